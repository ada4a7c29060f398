"""The rollout generator: a vLLM engine inside a Monarch actor, token-in/token-out.

    gen = await Generator.options(procs=1).as_actor(GeneratorConfig(model_dir=...))
    groups_P_G = await gen.generate.call_one(GenerateRequest(prompts_P=prompts, n=8))   # list[list[Completion]]
    await gen.update_weights.call_one(WeightUpdate(version=1, weights=hf_state_dict))
    gens = await Generator.options(num_replicas=2).as_service(config)   # typed methods: GeneratorService

The endpoints take and answer the typed objects of `forgelab.generation` (`GenerateRequest`, `WeightUpdate`,
`EngineStats`, `EngineStatus`); the positional forms they took before (``generate(prompts, n, sampling, seeds)``,
``update_weights(version, weights)``) are still accepted for one release.

What it really is: one in-process vLLM v1 engine (`vllm.LLM`, no engine
subprocess) driven by an asyncio loop in the actor. Every `generate` call adds
its requests to the engine and awaits them; the loop runs `engine.step()` while
anything is unfinished, so concurrent calls share the same continuous batch
instead of queueing one `LLM.generate` after another. `generate` and
`update_weights` answer through an explicit response port: Monarch delivers one
endpoint call at a time per actor, and an endpoint that awaited its completions
would block every other caller until it returned.

Logprobs: `Completion.logprobs[i]` is log softmax of the raw model logits at
the step that produced `completion_ids[i]` (vLLM `logprobs_mode="raw_logprobs"`):
log pi(token) of the policy at temperature 1, before temperature, top-k and
top-p. That equals the trainer's recomputation at temperature 1 whatever
sampling settings were used; it is the *sampling* probability only when
temperature=1, top_k=0, top_p=1 (set `logprobs_mode="processed_logprobs"` to get
the log-probability under the temperature/top-k/top-p-processed distribution).

Weight updates (`update_weights`; `update_weights_shared` for a same-host shm handle) are checked and loaded
in place by `forgelab.weights.receiver`: `update_mode="drain"` (default) stops intake and lets the running
requests finish on the old weights first; `"inflight"` loads them between two engine steps while requests run
on. `Completion.policy_version` is the version its first token came from (the oldest);
`Completion.token_versions` says where later versions took over (run-length ``(version, first token)`` pairs).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import itertools
import operator
import os
import time
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence, cast

from monarch.actor import Port, endpoint

from forgelab.config.components import LOGPROBS_MODES, GeneratorConfig, SamplingConfig, vllm_lora_rank  # noqa: F401 -- re-exported
from forgelab.engines.generator_service import GeneratorService
from forgelab.generation import (CompletionGroups, EngineStats, EngineStatus, GenerateRequest, Prompt, SamplingSettings,
                                 WeightUpdate)
from forgelab.runtime import liveness
from forgelab.runtime.component import Component, answer_in_task
from forgelab.runtime.gc_timer import freeze_startup_objects, gc_stats
from forgelab.types import Completion
from forgelab.weights.receiver import WeightUpdateExtension, check_weights, checkpoint_shapes, receive, receive_shared, serve_base  # noqa: F401

if TYPE_CHECKING:
    import torch
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import RequestOutput

    from forgelab.weights.shm import SharedWeightsReader


class _KVCacheManager(Protocol):
    @property
    def usage(self) -> float: ...


class _Preempt(Protocol):
    def __call__(self, *args: object, **kwargs: object) -> object: ...


class _Scheduler(Protocol):
    """What the engine reads and patches on vLLM v1's scheduler (`_scheduler_of`)."""

    @property
    def kv_cache_manager(self) -> _KVCacheManager: ...

    # and ``_preempt_request`` (a `_Preempt`), read and replaced by name


class RequestAborted(RuntimeError):
    """A generate call whose samples were aborted (`VLLMEngine.abort`) before they finished."""


class VLLMEngine:
    """A `vllm.LLM` driven by an asyncio loop: concurrent `generate` calls share one batch.

    Not an actor: the `Generator` actor wraps it, and benchmarks use it in-process.
    Everything runs on the event-loop thread that created it (vLLM is not thread-safe).
    """

    def __init__(self, config: GeneratorConfig):
        config.validate()
        self.config = config
        self.device = config.resolved_device()
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("GeneratorConfig.device='cuda' but this process sees no GPU; "
                                 "spawn it with Generator.options(with_gpus=True) or use device='auto'")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.device == "cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{config.kv_cache_gib:g}"
        import vllm  # noqa: F401  (after the environment is set)

        if self.device == "cpu":
            _eager_token_ranks()
        # vLLM runs gc.collect() 6 times while it builds the engine; with the imported modules' objects frozen
        # first, each scans only what the build makes (1.55 s -> 0.1 s on the shipped model, 2-core AMD EPYC)
        gc.freeze()

        kwargs: dict[str, object] = dict(
            model=config.model_dir,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_seqs=config.max_num_seqs,
            logprobs_mode=config.logprobs_mode,
            worker_extension_cls="forgelab.weights.receiver.WeightUpdateExtension",
            use_tqdm_on_load=False,  # a progress bar per replica start is noise in a notebook cell
        )
        block_size = config.block_size or (32 if self.device == "cpu" else None)
        if block_size is not None:
            kwargs["block_size"] = block_size
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.lora.enabled:  # adapters on the unchanged base; a weight push brings a new adapter
            kwargs.update(enable_lora=True, max_loras=config.max_loras, max_lora_rank=vllm_lora_rank(config.lora.rank))
        # the keywords are vLLM's EngineArgs, assembled above per device and LoRA setting: not typed one by one
        self.llm: LLM = vllm.LLM(**kwargs)  # type: ignore[arg-type]  # vllm.LLM's keywords, built as a dict
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        freeze_startup_objects()  # the engine/tokenizer's objects: never scanned by later collections
        gc_stats()  # start timing garbage-collection pauses
        self.expected_shapes = checkpoint_shapes(config.model_dir)
        self.version = 0
        self.lora = config.lora if config.lora.enabled else None
        self.lora_request: LoRARequest | None = None
        """The adapter every request is served with (a `vllm.lora.request.LoRARequest`); None: the base, which
        is also the policy before the first push (a fresh adapter's B is zero). Set by forgelab.weights.receiver."""
        if self.lora is not None:
            from forgelab.weights.adapter import adapter_shapes

            self.adapter_shapes = adapter_shapes(self.expected_shapes, self.lora.targets, self.lora.rank)
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self.idle_event = asyncio.Event()
        self.idle_event.set()
        self.admitting = asyncio.Event()  # cleared while weights are swapped
        # vLLM-cpu's LoRA logits op (vllm/lora/ops/torch_ops) holds one adapter index per request but a row per
        # prompt token: a step where a request asking prompt logprobs meets any other request fails, and the
        # failed step fails every request in it. On such engines those requests run alone (`_generate_alone`).
        self._alone = asyncio.Lock()
        self._alone_free = asyncio.Event()  # cleared while a request runs alone: other calls wait to add theirs
        self._alone_free.set()
        self.admitting.set()
        self.update_lock = asyncio.Lock()
        self.shared_reader: SharedWeightsReader | None = None  # forgelab.weights.shm.SharedWeightsReader, made on first use
        self._loop_task: asyncio.Task[None] | None = None
        self._last_add = 0.0
        self._idle_since: float | None = None  # when the engine loop last ran out of requests
        self.logprob_shift: tuple[int, float] | None = None  # (token index, delta): Generator.corrupt_next_logprob
        self._token_versions: dict[str, list[tuple[int, int]]] = {}  # inflight mode: request id -> version runs
        self.prefix_reset_pending = False  # inflight mode: reset the prefix cache when the engine is next idle
        self._stale_rids: set[str] = set()  # inflight mode: requests added while that reset was pending
        self._keyed: dict[str, list[str]] = {}  # abort key -> its request ids (`abort`)
        self._aborted_early: collections.deque[str] = collections.deque(maxlen=4096)  # aborted before they arrived
        self.counters: dict[str, float] = dict(
            busy_time_s=0.0, intake_time_s=0.0, idle_time_s=0.0, idle_periods=0, admission_wait_s=0.0, steps=0, requests=0,
            aborted_requests=0,
            tokens_generated=0, prompt_tokens=0, cached_prompt_tokens=0, max_concurrent_requests=0,
            sum_concurrent_requests=0, weight_updates=0, last_update_ms=0.0, inflight_updates=0,
            requests_spanning_versions=0, prefix_cache_resets=0, prefix_cache_resets_deferred=0,
            cached_tokens_possibly_stale=0, drain_wait_s=0.0,
            kv_cache_usage_sum=0.0, kv_cache_usage_max=0.0, kv_cache_usage=0.0, preemptions=0,
        )
        self._scheduler = _scheduler_of(self.engine)
        if self._scheduler is not None:  # count vLLM's preemptions (KV cache full: a request's blocks freed)
            # vLLM's private method, patched by name (`_scheduler_of` checked that it exists)
            preempt: _Preempt = getattr(self._scheduler, "_preempt_request")

            def counted(*args: object, **kwargs: object) -> object:
                self.counters["preemptions"] += 1
                return preempt(*args, **kwargs)

            setattr(self._scheduler, "_preempt_request", counted)

    # -- requests -------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            # Text is already chat-templated (forgelab.controller.evaluate.format_prompt): no extra specials.
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        try:
            if len(prompt) > 0:
                return [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d int tensors
        except TypeError:
            pass
        raise ValueError(
            f"generate: each prompt must be a str or a non-empty list of token ids, got {str(prompt)[:80]!r}"
        )

    def _render(self, prompt_ids: list[int]) -> TokensPrompt:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        # Pre-rendering avoids vLLM 0.32's "Passing raw prompts to InputProcessor is deprecated".
        preprocess: Callable[[list[TokensPrompt]], list[TokensPrompt]] | None = getattr(self.llm, "_preprocess_cmpl", None)
        return preprocess([prompt])[0] if preprocess is not None else prompt

    async def generate(
        self, prompts: Sequence[Prompt], n: int = 1, sampling: SamplingSettings | None = None,
        seeds: Sequence[Sequence[int]] | None = None, abort_key: str | None = None,
    ) -> CompletionGroups:
        """`n` completions of each prompt (text or token ids), in prompt order.

        `seeds` (seeds_P_G, optional): one vLLM seed per sample, for reproducible sampling
        (deterministic runs derive them from the run seed and the episode id).
        `abort_key`: `abort(abort_key)` cancels this call's unfinished samples (the call raises `RequestAborted`).
        """
        sampling = sampling or self.config.sampling
        sampling.validate("generate(sampling=...)")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"generate: n must be a positive integer, got {n!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("generate: prompts must be a list of strings or of token-id lists")
        if seeds is not None and (len(seeds) != len(prompts) or any(len(s) != n for s in seeds)):
            raise ValueError(f"generate: seeds must be one list of n={n} ints per prompt ({len(prompts)} prompts)")
        texts = [p if isinstance(p, str) else "" for p in prompts]
        ids_P = [self._prompt_ids(p) for p in prompts]
        for ids in ids_P:
            if len(ids) + sampling.max_tokens > self.config.max_model_len:
                raise ValueError(
                    f"generate: prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} exceeds "
                    f"max_model_len={self.config.max_model_len}; shorten it or raise GeneratorConfig.max_model_len"
                )
        params = sampling.to_vllm()
        if params.prompt_logprobs is not None and self.config.lora.enabled and self.device == "cpu":
            return await self._generate_alone(ids_P, texts, n, sampling, seeds, abort_key)
        while not (self.admitting.is_set() and self._alone_free.is_set()):
            await (self._alone_free if self.admitting.is_set() else self.admitting).wait()
        if abort_key is not None and abort_key in self._aborted_early:  # aborted while it waited for intake
            raise RequestAborted(f"generate: aborted ({abort_key!r}) before it started")
        # No await between here and the last add_request: a weight update cannot slip in.
        version, lora_request = self.version, self.lora_request
        loop = asyncio.get_running_loop()
        futures_P_G: list[list[asyncio.Future[RequestOutput]]] = []
        added: list[str] = []
        self._end_idle()  # taking in requests is work: an idle period ends here
        t_add = time.perf_counter()
        try:
            for p, ids in enumerate(ids_P):
                # One request per sample (not vLLM's n-way parent request): each sample keeps its
                # own prefix-cache count. The prompt is rendered once per group.
                rendered = self._render(ids)
                row: list[asyncio.Future[RequestOutput]] = []
                for g in range(n):
                    rid = f"fg{next(self._ids)}"
                    self.engine.add_request(rid, rendered, params if seeds is None else sampling.to_vllm(int(seeds[p][g])),
                                            lora_request=lora_request)  # vLLM copies prompt and params
                    added.append(rid)
                    if self.config.update_mode == "inflight":
                        self._token_versions[rid] = [(version, 0)]
                        if self.prefix_reset_pending:  # its prefix hits may be blocks of older weights
                            self._stale_rids.add(rid)
                    row.append(self._pending.setdefault(rid, loop.create_future()))
                futures_P_G.append(row)
        except Exception:  # e.g. a token id outside the vocabulary: drop this call's requests
            self.engine.abort_request(added)
            for rid in added:
                self._pending.pop(rid, None)
                self._token_versions.pop(rid, None)
            raise
        self._last_add = time.perf_counter()
        self.counters["intake_time_s"] += self._last_add - t_add  # vLLM's input processing of the requests
        self._ensure_loop()
        if abort_key is not None:
            self._keyed.setdefault(abort_key, []).extend(added)
        try:
            outs_P_G = [await asyncio.gather(*row) for row in futures_P_G]
        finally:
            if abort_key is not None:
                self._keyed.pop(abort_key, None)
        top = int(getattr(params, "logprobs", 0) or 0)  # top-k alternatives asked for (the agent door's top_logprobs)
        return [
            [self._completion(o, ids, text, version, self._token_versions.pop(o.request_id, None), top) for o in outs]
            for outs, ids, text in zip(outs_P_G, ids_P, texts)
        ]

    async def _generate_alone(self, ids_P: list[list[int]], texts: list[str], n: int, sampling: SamplingSettings,
                              seeds: Sequence[Sequence[int]] | None, abort_key: str | None) -> CompletionGroups:
        """`generate` for requests asking prompt logprobs on a LoRA engine on CPU: each sample runs alone in the
        engine (see ``_alone``), one after another; other calls' requests wait until it is done. Each completion
        records the version it was generated at, as any other."""
        out_P_G: CompletionGroups = []
        async with self._alone:
            self._alone_free.clear()
            try:
                for p, ids in enumerate(ids_P):
                    row: list[Completion] = []
                    for g in range(n):
                        while not self.admitting.is_set() or self.engine.has_unfinished_requests():
                            if not self.admitting.is_set():  # a weight update: wait for it
                                await self.admitting.wait()
                            else:  # requests added before this call: the loop sets idle_event once they are done
                                self._ensure_loop()
                                await self.idle_event.wait()
                        if abort_key is not None and abort_key in self._aborted_early:
                            raise RequestAborted(f"generate: aborted ({abort_key!r}) before it started")
                        version, lora_request = self.version, self.lora_request
                        params = sampling.to_vllm() if seeds is None else sampling.to_vllm(int(seeds[p][g]))
                        rid = f"fg{next(self._ids)}"
                        self._end_idle()
                        self.engine.add_request(rid, self._render(ids), params, lora_request=lora_request)
                        fut = self._pending.setdefault(rid, asyncio.get_running_loop().create_future())
                        if abort_key is not None:  # `abort` finds it while it runs
                            self._keyed[abort_key] = [rid]
                        if self.config.update_mode == "inflight":
                            self._token_versions[rid] = [(version, 0)]
                        self._last_add = time.perf_counter()
                        self._ensure_loop()
                        out = await fut
                        top = int(getattr(params, "logprobs", 0) or 0)
                        row.append(self._completion(out, ids, texts[p], version,
                                                    self._token_versions.pop(rid, None), top))
                    out_P_G.append(row)
            finally:
                self._alone_free.set()
                if abort_key is not None:
                    self._keyed.pop(abort_key, None)
        return out_P_G

    def _completion(self, out: RequestOutput, prompt_ids: list[int], text: str, version: int,
                    runs: list[tuple[int, int]] | None = None, top: int = 0) -> Completion:
        c = out.outputs[0]
        ids = list(c.token_ids)
        runs = [(v, start) for v, start in (runs or [(version, 0)]) if start < max(1, len(ids))]
        # vLLM gives each sampled token its logprobs dict when logprobs were asked for (every request here)
        logprobs = [lp[t].logprob for t, lp in zip(ids, c.logprobs)] if c.logprobs is not None else []  # type: ignore[index]  # vLLM types each entry dict | None
        if self.logprob_shift is not None and len(logprobs) > self.logprob_shift[0]:  # a test hook, used once
            (i, delta), self.logprob_shift = self.logprob_shift, None
            import numpy as np

            logprobs[i] = float(np.float32(logprobs[i] + delta))  # a float32 value, as vLLM's are
        return Completion(
            prompt_ids=list(prompt_ids),
            completion_ids=ids,
            logprobs=[float(x) for x in logprobs],
            text=c.text,
            finish_reason=str(c.finish_reason),
            policy_version=version,
            prompt=text,
            num_cached_tokens=int(out.num_cached_tokens or 0),
            token_versions=runs,
            prompt_logprobs=_prompt_logprobs(prompt_ids, out.prompt_logprobs),
            prompt_top_logprobs=_prompt_top_logprobs(out.prompt_logprobs, top),
            # vLLM's entry holds the sampled token and the top `top` (by rank); keep the top ones
            top_logprobs=[{int(t): float(lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= top}
                          for d in c.logprobs] if top > 0 and c.logprobs is not None else None,
        )

    def mark_new_version(self, version: int) -> None:
        """Inflight mode, called between two engine steps right after `version` was loaded: every running
        request's next token comes from `version` (its tokens so far came from the older ones)."""
        if not self._token_versions:
            return
        produced = {st.external_req_id: st.detokenizer.num_output_tokens()  # type: ignore[union-attr]  # vLLM makes a detokenizer for every generate request (None: pooling only)
                    for st in self.engine.output_processor.request_states.values()}
        for rid, runs in self._token_versions.items():
            if rid not in self._pending:
                continue  # finished in the last step: all its tokens are older
            start = produced.get(rid, 0)
            if start == runs[-1][1]:
                runs[-1] = (version, start)  # no token came from the previous version
            else:
                if len(runs) == 1:
                    self.counters["requests_spanning_versions"] += 1
                runs.append((version, start))

    # -- engine loop ----------------------------------------------------------
    def _ensure_loop(self) -> None:
        self.idle_event.clear()
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        s = self.counters
        while True:
            if not self.engine.has_unfinished_requests():
                if self.prefix_reset_pending and self.llm.reset_prefix_cache():  # no block in use now
                    self.prefix_reset_pending = False
                    s["prefix_cache_resets"] += 1
                self.idle_event.set()
                self._wake.clear()
                self._idle_since = time.perf_counter()
                s["idle_periods"] += 1
                await self._wake.wait()
                self._end_idle()
                continue
            await liveness.checkpoint("engine_step")  # a test hook (slow / hang / deadlock); nothing unarmed
            t_admit = time.perf_counter()
            await self._admit_arrivals()
            s["admission_wait_s"] += time.perf_counter() - t_admit
            concurrent = self.engine.get_num_unfinished_requests()
            t0 = time.perf_counter()
            try:
                # a generate-only engine: vLLM's step answers PoolingRequestOutput only for pooling models
                outputs = cast("list[RequestOutput]", self.engine.step())
            except Exception as e:  # fail the waiting calls, keep the loop alive
                self._fail_all(e)
                continue
            s["busy_time_s"] += time.perf_counter() - t0
            s["steps"] += 1
            liveness.bump("engine_steps")  # progress the watchdog sees (forgelab.runtime.watchdog)
            if not self.admitting.is_set():  # a weight push drains these requests: progress of the push too
                liveness.bump("weight_drain_steps")
            if self._scheduler is not None:
                usage = float(self._scheduler.kv_cache_manager.usage)
                s["kv_cache_usage"] = usage
                s["kv_cache_usage_sum"] += usage
                s["kv_cache_usage_max"] = max(s["kv_cache_usage_max"], usage)
            s["max_concurrent_requests"] = max(s["max_concurrent_requests"], concurrent)
            s["sum_concurrent_requests"] += concurrent
            for out in outputs:
                if not out.finished:
                    continue
                s["requests"] += 1
                s["tokens_generated"] += len(out.outputs[0].token_ids)
                liveness.bump("tokens", len(out.outputs[0].token_ids))
                s["prompt_tokens"] += len(out.prompt_token_ids or ())
                s["cached_prompt_tokens"] += int(out.num_cached_tokens or 0)
                if self._stale_rids and out.request_id in self._stale_rids:
                    self._stale_rids.discard(out.request_id)
                    s["cached_tokens_possibly_stale"] += int(out.num_cached_tokens or 0)
                fut = self._pending.pop(out.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(out)
            # Let Monarch deliver new calls (their requests join the next step).
            await asyncio.sleep(0)

    def _end_idle(self) -> None:
        if self._idle_since is not None:
            self.counters["idle_time_s"] += time.perf_counter() - self._idle_since
            self._idle_since = None

    async def _admit_arrivals(self) -> None:
        """Let calls that are still arriving join this step (see `admission_window_ms`).

        Not when the running batch is already full: a newcomer would only wait in
        vLLM's queue, and the engine would idle for the window."""
        if self.engine.get_num_unfinished_requests() >= self.config.max_num_seqs:
            return
        window = self.config.admission_window_ms / 1e3
        deadline = time.perf_counter() + 4 * window
        while (now := time.perf_counter()) < deadline and now - self._last_add < window:
            await asyncio.sleep(window - (now - self._last_add))

    def abort(self, abort_key: str) -> int:
        """Abort the unfinished samples of the calls made with ``abort_key``: vLLM frees their sequences, and the
        calls raise `RequestAborted`. How many samples were still running."""
        if abort_key not in self._keyed:  # not taken in yet (a weight update holds intake): refuse it on arrival
            self._aborted_early.append(abort_key)
            return 0
        live = [rid for rid in self._keyed.pop(abort_key) if rid in self._pending]
        if not live:
            return 0
        self.engine.abort_request(live)
        for rid in live:
            self._token_versions.pop(rid, None)
            self._stale_rids.discard(rid)
            fut = self._pending.pop(rid)
            if not fut.done():
                fut.set_exception(RequestAborted(f"generate: aborted ({abort_key!r})"))
        self.counters["aborted_requests"] += len(live)
        return len(live)

    def _fail_all(self, error: Exception) -> None:
        ids = list(self._pending)
        try:
            self.engine.abort_request(ids)
        except Exception:
            pass
        self._stale_rids.clear()
        for rid in ids:
            self._token_versions.pop(rid, None)
            fut = self._pending.pop(rid)
            if not fut.done():
                fut.set_exception(RuntimeError(f"vLLM engine step failed: {error!r}"))

    # weights: forgelab.weights.receiver.receive(engine, version, weights) / receive_shared(engine, handle)

    # -- introspection --------------------------------------------------------
    def stats(self) -> dict[str, float]:
        s = dict(self.counters)
        if self._idle_since is not None:  # idle now: the period so far counts (deltas between reads add up)
            s["idle_time_s"] += time.perf_counter() - self._idle_since
        s["mean_concurrent_requests"] = s["sum_concurrent_requests"] / max(1, s["steps"])
        s["cpu_time_s"] = time.process_time()  # this process, all threads
        s["clock_s"] = time.perf_counter()  # when these counters were read (fractions over the engine's own clock)
        s.update(gc_stats())
        s["prefix_cache_hit_rate"] = s["cached_prompt_tokens"] / max(1, s["prompt_tokens"])
        s["kv_cache_usage_mean"] = s["kv_cache_usage_sum"] / max(1, s["steps"])
        return s

    def status(self) -> EngineStatus:
        return EngineStatus(version=self.version, in_flight_requests=len(self._pending),
                            update_mode=self.config.update_mode, admitting=self.admitting.is_set(), device=self.device,
                            stats=EngineStats.from_counters(self.stats()))


def _prompt_logprobs(prompt_ids: Sequence[int],
                     given: "FlatLogprobs | list[dict[int, Logprob] | None] | None") -> list[float | None] | None:
    """Each prompt token's logprob under the model (None for the first, which has no context), or None when the
    request asked for none."""
    if given is None:
        return None
    return [None if d is None else float(d[t].logprob) for t, d in zip(prompt_ids, given)]


def _prompt_top_logprobs(given: "FlatLogprobs | list[dict[int, Logprob] | None] | None",
                         top: int) -> list[dict[int, float] | None] | None:
    """With prompt logprobs and k > 0 top logprobs asked for: each prompt token's k most likely tokens and their
    logprobs (None for the first); None otherwise."""
    if given is None or top <= 0:
        return None
    return [None if d is None else {int(t): float(lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= top}
            for d in given]


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` [B, V], how many entries are >= that row's value in `values` [B, 1] (a token's rank)."""
    return (x >= values).sum(-1)


def _eager_token_ranks() -> None:
    """On CPU, compute the sampled token's rank eagerly instead of with vLLM's ``torch.compile``d
    ``batched_count_greater_than`` (same expression, same integer counts).

    vLLM compiles it to avoid a [B, V] boolean temporary on GPUs; on a CPU host the compile (dynamo + inductor,
    hashing torch's sources first) cost every generator process 1.7-2.2 s at its first request, the step-0
    evaluation (measured on a 2-core AMD EPYC, shipped model: first 200-prompt greedy batch 2.18 s, later ones
    0.35-0.40 s), while the temporary is 200 x 105 bytes here (39 MB at Qwen3's vocabulary and 256 rows).
    """
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = _count_at_least  # type: ignore[attr-defined]  # vLLM imports it there without re-exporting; this replaces that module global


def _scheduler_of(llm_engine: object) -> _Scheduler | None:
    """The vLLM v1 scheduler of an in-process engine (KV-cache usage, preemptions), or None elsewhere."""
    core: object = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
    sched: object = getattr(core, "scheduler", None)
    return cast(_Scheduler, sched) if hasattr(sched, "kv_cache_manager") and hasattr(sched, "_preempt_request") else None


class Generator(Component):
    """vLLM rollout generator. Endpoints: generate, update_weights, update_weights_shared, version, reset_version,
    status, stats (typed methods of its service: `GeneratorService`)."""

    IDEMPOTENT = frozenset({"generate"})
    SERVICE = GeneratorService

    def __init__(self, config: GeneratorConfig):
        config.validate()
        self.config = config
        self.engine: VLLMEngine | None = None

    @endpoint
    async def setup(self) -> None:
        import torch

        # vLLM's CPU worker turns later torch.set_num_threads calls into no-ops.
        torch.set_num_threads(int(os.environ.get("FORGELAB_THREADS", "1")))
        self.engine = VLLMEngine(self.config)

    def _engine(self) -> VLLMEngine:
        if self.engine is None:
            raise RuntimeError("Generator.setup() has not run; spawn it with Generator.options(...).as_actor(config)")
        return self.engine

    @endpoint(explicit_response_port=True)
    async def generate(
        self, port: Port[CompletionGroups], request: GenerateRequest | Sequence[Prompt], n: int = 1,
        sampling: SamplingSettings | None = None, seeds: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """`CompletionGroups` (list[list[Completion]]): ``request.n`` completions per prompt, in prompt order.

        ``n``, ``sampling``, ``seeds``: the positional form (``request`` then is the prompts), deprecated."""
        req = GenerateRequest.coerce(request, n, sampling, seeds)
        answer_in_task(port, lambda: self._serve(req), "Generator.generate")

    async def _serve(self, req: GenerateRequest) -> CompletionGroups:
        if req.lora_slot is not None:
            raise ValueError(f"generate: lora_slot={req.lora_slot!r} but this generator has no LoRA slots "
                             "(SlotGenerator serves them: forgelab.engines.generator_slots)")
        return await self._engine().generate(req.prompts_P, req.n, req.sampling, req.seeds_P_G, req.abort_key)

    @endpoint
    async def abort(self, abort_key: str) -> int:
        """Abort the unfinished samples of the requests sent with ``abort_key`` (`VLLMEngine.abort`); how many."""
        return self._engine().abort(abort_key)

    @endpoint(explicit_response_port=True)
    async def update_weights(self, port: Port[int], update: WeightUpdate | int,
                             weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Load `update.weights` (HF names) as `update.version` (strictly increasing); answers the new version.
        ``update_weights(version, weights)``: the positional form, still accepted (the trainer's weight sender)."""
        if isinstance(update, WeightUpdate):
            version, weights = update.version, dict(update.weights)
        else:
            version = update
        answer_in_task(port, lambda: receive(self._engine(), version, weights), "Generator.update_weights")

    @endpoint(explicit_response_port=True)
    async def update_weights_shared(self, port: Port[int | str], handle: object) -> None:
        """Load the weights a trainer on this host wrote to shared memory: the new version (an int), or a str
        saying why the file cannot be reached from here (the trainer then sends the tensors)."""
        answer_in_task(port, lambda: receive_shared(self._engine(), handle), "Generator.update_weights_shared")

    @endpoint
    async def version(self) -> int:
        return self._engine().version

    @endpoint
    async def reset_version(self, version: int = -1) -> int:
        """Forget the served version (a warm pool's next run): the next weight push may carry any later one.
        With LoRA the base is served again (a new run's adapter starts at B = 0); an armed test hook
        (`corrupt_next_logprob`) is disarmed."""
        self._engine().version = int(version)
        self._engine().logprob_shift = None
        serve_base(self._engine())
        return self._engine().version

    @endpoint
    async def status(self) -> EngineStatus:
        return self._engine().status()

    @endpoint
    async def corrupt_next_logprob(self, index: int, delta: float) -> None:
        """A test hook: the next completion long enough has its token `index`'s recorded logprob shifted by
        `delta` (what a lost chat-template token or a kernel bug would do); token-truth tests find it."""
        self._engine().logprob_shift = (int(index), float(delta))

    @endpoint
    async def stats(self) -> EngineStats:
        return EngineStats.from_counters(self._engine().stats())

    @endpoint
    async def set_update_mode(self, mode: str) -> str:
        """Load later weight pushes as `mode` (`GeneratorConfig.update_mode`: "drain" or "inflight"), a warm
        pool's next run's choice: nothing in the engine depends on it, only how `receive` loads a push."""
        engine = self._engine()
        dataclasses.replace(engine.config, update_mode=mode).validate()  # a bad mode, or inflight with LoRA
        engine.config.update_mode = self.config.update_mode = mode
        return mode


__all__ = ["Generator", "GeneratorConfig", "RequestAborted", "GeneratorService", "SamplingConfig", "VLLMEngine", "WeightUpdateExtension", "check_weights",
           "checkpoint_shapes"]
