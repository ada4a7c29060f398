"""The controller: one `Run` object drives asynchronous GRPO from a notebook, a script or the CLI.

    run = Run(RunConfig(train=TrainConfig(steps=50)))
    await run.start()            # spawns generator / trainer / reference, returns at once
    run.metrics                  # pandas DataFrame, one row per step
    run.set_reward_weights({"answer_format": 0.0})
    await run.set_loss("dapo")   # dry-run on the last batch, applies at the next step boundary
    await run.wait(); await run.shutdown()

    asyncio.run(Run(cfg).run())  # the same thing from a script

Inside, everything is asyncio tasks on the caller's event loop (the kernel's
loop in Jupyter, so other cells stay usable):

- N rollout tasks: problems -> generator service (`generate`, n = group size)
  -> rewards (in threads, with a timeout) -> reference logprobs -> group
  advantages -> replay buffer;
- one training task: buffer.sample -> trainer.train_step -> trainer.push_weights
  to every healthy generator replica (version + 1) -> metrics row.

`train.max_policy_age` bounds staleness: 0 is synchronous on-policy training
(rollouts wait for the new weights), k lets generation run up to k versions
ahead. Every episode ends trained, evicted (stale) or dropped with a reason;
`run.episodes` holds the counters.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from forgelab.algos import ADVANTAGES, LOSSES
from forgelab.algos.batching import collate
from forgelab.buffer import ReplayBuffer
from forgelab.config import ConfigError, RunConfig
from forgelab.data import ProblemStream, load_problems
from forgelab.rewards import REWARDS, RewardComposer, RewardFailure, validate
from forgelab.tasks import TASKS, get_task
from forgelab.tracking import Tracker, plot_learning_curve
from forgelab.types import Episode

log = logging.getLogger("forgelab.run")


class LossSwapRefused(ValueError):
    """A loss failed its dry run on the last batch; the old loss keeps training."""


class RewardChangeRefused(ValueError):
    """A reward failed validation on recent rollouts; the old rewards stay."""


def _as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    if isinstance(config, RunConfig):
        return config.validate()
    if isinstance(config, dict):
        return RunConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return RunConfig.from_yaml(config)
    raise ConfigError(f"Run(config): expected a RunConfig, a dict or a YAML path, got {type(config).__name__}")


class Run:
    """One training run: its processes, its background tasks, its metrics and its controls."""

    def __init__(self, config: RunConfig | dict | str | Path, *, resume_from: str | Path | None = None):
        self.config = _as_config(config)  # raises ConfigError before anything spawns
        cfg = self.config
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.out_dir = Path(cfg.tracking.out_dir) / cfg.name
        self.rewards = RewardComposer({name: (REWARDS[name], w) for name, w in cfg.rollout.rewards.items()})
        self.loss_name: str = cfg.train.loss
        self.buffer = ReplayBuffer(cfg.train.batch_size, cfg.train.max_policy_age, cfg.train.max_buffer)
        train = load_problems(cfg.rollout.task, "train", 4000, cfg.train.seed)
        self.stream = ProblemStream(train, seed=cfg.train.seed)
        self.heldout = load_problems(cfg.rollout.task, "test", cfg.eval.n, cfg.train.seed)
        self._task_reward = get_task(cfg.rollout.task).reward if cfg.rollout.task in TASKS else REWARDS["exact_answer"]
        self.resume_from = Path(resume_from) if resume_from else None

        self.step = 0
        self.version = 0
        self.state = "created"
        self.message = ""
        self.events: list[dict[str, Any]] = []
        self.reward_failures: deque[RewardFailure] = deque(maxlen=200)
        self._recent: deque[Episode] = deque(maxlen=2000)
        self._episode_status: dict[int, str] = {}
        self._next_episode_id = 0
        self._next_group_id = 0
        self._last_batch: dict | None = None
        self._tokens_since = 0
        self._t_last = time.time()
        self._consecutive_failures = 0
        self._pending_reward_weights: dict | None = None
        self._listeners: list[Callable[[dict], None]] = []
        self.tracker: Tracker | None = None
        self.generators = self.trainer = self.reference = None
        self._tasks: list[asyncio.Task] = []
        self._main: asyncio.Task | None = None
        self._unpaused: asyncio.Event | None = None
        self._buffer_changed: asyncio.Condition | None = None
        self._stopping = False
        self._reward_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="forgelab-reward")
        self._inflight_rollout = 0
        self._admitted = 0  # episodes whose generation was started
        self._pushed_version = 0  # version the generators serve (last completed push)
        self._training_in_flight = False
        self.accuracy_history: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "Run":
        """Spawn the processes (if not yet) and start training in the background. Returns at once."""
        if self._main is not None and not self._main.done():
            return self
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._buffer_changed = asyncio.Condition()
        self._stopping = False
        if self.generators is None:
            self.state = "starting"
            await self._spawn()
        self.state = "running"
        self._main = asyncio.ensure_future(self._run_main())
        return self

    async def run(self) -> "Run":
        """Start, train to the end, shut down: the whole run for scripts (`asyncio.run(run.run())`)."""
        await self.start()
        try:
            await self.wait()
        finally:
            await self.shutdown()
        return self

    async def wait(self) -> None:
        """Until the training task ends (steps done, stopped or failed); re-raises a failure."""
        if self._main is not None:
            await asyncio.shield(self._main)

    def pause(self) -> None:
        """Finish the current step, then hold rollouts and training."""
        if self._unpaused is not None and self.state == "running":
            self._unpaused.clear()
            self.state = "paused"
            self._event("paused", message=self.message)

    def resume(self) -> None:
        if self._unpaused is not None and self.state == "paused":
            self.message = ""
            self._consecutive_failures = 0
            self.state = "running"
            self._unpaused.set()
            self._event("resumed")

    async def stop(self) -> None:
        """Stop after the current step; processes stay up until `shutdown()`."""
        self._stopping = True
        if self._unpaused is not None:
            self._unpaused.set()
        if self._main is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._main), timeout=300)
            except Exception:
                pass
        if self.state not in ("failed", "finished", "stopped", "created"):
            self.state = "stopped"
            self._event("stopped")

    async def shutdown(self) -> None:
        """Stop training and free every process."""
        await self.stop()
        for svc in (self.generators, self.reference):
            if svc is not None:
                await svc.shutdown()
        if self.trainer is not None:
            await self.trainer.shutdown()
        self.generators = self.trainer = self.reference = None
        if self.tracker is not None:
            self.tracker.finish()
        self._reward_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ spawning
    async def _spawn(self) -> None:
        from forgelab.generator import Generator, GeneratorConfig, SamplingConfig
        from forgelab.trainer import ReferenceConfig, ReferenceModel, Trainer, TrainerConfig

        cfg = self.config
        p = cfg.placement
        gcfg = GeneratorConfig(
            model_dir=cfg.model.path, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
            kv_cache_gib=p.kv_cache_gib,
            sampling=SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_tokens),
        )
        tcfg = TrainerConfig(
            model_dir=cfg.model.path, lr=cfg.train.lr, warmup_steps=cfg.train.warmup_steps,
            total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio, weight_decay=cfg.train.weight_decay,
            max_grad_norm=cfg.train.max_grad_norm, loss=cfg.train.loss, loss_kwargs=dict(cfg.train.loss_kwargs),
            is_cap=cfg.train.is_cap, seed=cfg.train.seed,
        )
        common = dict(threads=p.threads, with_gpus=p.with_gpus)
        jobs = [
            Generator.options(num_replicas=p.generator_replicas, **common).as_service(gcfg),
            Trainer.options(procs=p.trainer_procs, **common).as_actor(tcfg),
        ]
        if p.reference:
            jobs.append(ReferenceModel.options(num_replicas=p.reference_replicas, **common).as_service(ReferenceConfig(model_dir=cfg.model.path)))
        t0 = time.time()
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if not isinstance(r, BaseException):
                    await r.shutdown()
            raise failed[0]
        self.generators, self.trainer = results[0], results[1]
        self.reference = results[2] if p.reference else None
        self.generators.on_respawn = self._on_generator_respawn
        for svc in (self.generators, self.reference):
            if svc is not None and hasattr(svc, "add_listener"):
                svc.add_listener(self._on_service_event)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tracker = Tracker(self.out_dir, use_wandb=cfg.tracking.wandb, run_name=cfg.name, config=cfg.to_dict())
        self._event("spawned", seconds=round(time.time() - t0, 1))
        if self.resume_from is not None:
            await self._restore(self.resume_from)

    async def _on_generator_respawn(self, handle) -> None:
        # A fresh replica starts from the checkpoint on disk: give it the current weights before it serves.
        if self.trainer is not None and self.version > 0:
            await self.trainer.call("push_weights", self.version, [handle.actor])

    def _on_service_event(self, event: Any) -> None:
        # ServiceEvent(kind="replica_failed"|"replica_restarted", replica, time, detail)
        self._event(str(getattr(event, "kind", "service")), replica=getattr(event, "replica", None),
                    detail=str(getattr(event, "detail", event)))

    # ------------------------------------------------------------------ main loop
    async def _run_main(self) -> None:
        cfg = self.config
        try:
            if self.step == 0 and not self.accuracy_history:
                acc = await self.evaluate()
                self._event("eval", accuracy=acc)
            self._tasks = [asyncio.ensure_future(self._rollout_worker(i)) for i in range(cfg.rollout.concurrency)]
            await self._train_loop()
            if self.state != "failed":
                if not self.accuracy_history or self.accuracy_history[-1][0] != self.step:
                    acc = await self.evaluate()
                    if self.tracker and self.tracker.rows:
                        self.tracker.rows[-1]["heldout_accuracy"] = acc
                self.state = "stopped" if self._stopping else "finished"
                self._event(self.state, message=self.message)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as e:
            self.state = "failed"
            self.message = f"{type(e).__name__}: {e}"
            self._event("failed", message=self.message)
            log.exception("forgelab: run failed")
            raise
        finally:
            self._stopping = True
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks = []
            # in-flight rollout groups that never reached the buffer are counted as dropped
            self._finish_tracking()

    def _finish_tracking(self) -> None:
        if self.tracker is None or not self.tracker.rows:
            return
        try:
            plot_learning_curve(self.tracker.dataframe(), self.out_dir / "learning_curve.png", self.events)
        except Exception as e:
            log.warning("forgelab: plot failed (%s)", e)

    async def _wait_unpaused(self) -> bool:
        await self._unpaused.wait()
        return not self._stopping

    def _may_admit(self, n: int) -> bool:
        """Staleness control at the source: admit n more episodes only if they can be trained in time.

        Episodes started while the generators serve version v can be used up to
        step v + max_policy_age, so at most (v + max_policy_age + 1) * batch_size
        episodes may ever have been started (minus those that left without being
        trained: evicted or dropped, whose slots are given back). With
        max_policy_age = 0 this is synchronous on-policy RL.
        """
        t = self.config.train
        c = self.buffer.counts()
        live = self._admitted - c["evicted"] - c["dropped"]
        return live + n <= (self._pushed_version + t.max_policy_age + 1) * t.batch_size

    async def _rollout_worker(self, wid: int) -> None:
        r = self.config.rollout
        per_call = r.prompts_per_rollout * r.group_size
        while not self._stopping:
            if not await self._wait_unpaused():
                return
            async with self._buffer_changed:
                # Back-pressure: generate no more than the trainer can use before the episodes go stale.
                await self._buffer_changed.wait_for(lambda: self._stopping or self._may_admit(per_call))
                if self._stopping:
                    return
                self._inflight_rollout += per_call
                self._admitted += per_call
            try:
                await self._one_rollout()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # nothing of this rollout reached the buffer: give its slots back
                self._admitted -= per_call
                self._event("rollout_error", message=f"{type(e).__name__}: {e}")
                log.warning("forgelab: rollout failed: %s", e)
                await asyncio.sleep(0.5)
            finally:
                async with self._buffer_changed:
                    self._inflight_rollout -= per_call
                    self._buffer_changed.notify_all()

    def _prompt_ids(self, prompt: str) -> list[int]:
        from forgelab.evaluate import format_prompt

        return self.tokenizer.encode(format_prompt(self.tokenizer, prompt), add_special_tokens=False)

    async def _one_rollout(self) -> None:
        r = self.config.rollout
        problems = self.stream.next(r.prompts_per_rollout)
        prompt_ids = [self._prompt_ids(p.prompt) for p in problems]
        groups = await self.generators.route("generate", prompt_ids, n=r.group_size)
        episodes_by_group: list[list[Episode]] = []
        for prob, comps in zip(problems, groups):
            gid = self._next_group_id
            self._next_group_id += 1
            eps = []
            for c in comps:
                ep = Episode(
                    id=self._next_episode_id, group_id=gid, prompt_ids=list(c.prompt_ids),
                    completion_ids=list(c.completion_ids), generator_logprobs=list(c.logprobs),
                    policy_version=c.policy_version, prompt=prob.prompt, completion=c.text,
                    target=prob.target, task=prob.task, info=dict(prob.info), finish_reason=c.finish_reason,
                )
                self._next_episode_id += 1
                self._tokens_since += len(c.completion_ids)
                eps.append(ep)
            episodes_by_group.append(eps)

        # rewards, in threads with a timeout (a reward is user code: it may hang)
        loop = asyncio.get_running_loop()
        flat = [ep for g in episodes_by_group for ep in g]
        futs = [
            asyncio.wait_for(
                loop.run_in_executor(self._reward_pool, lambda ep=ep: self.rewards.score(ep.prompt, ep.completion, ep.target, **ep.info)),
                timeout=r.reward_timeout_s,
            )
            for ep in flat
        ]
        results = await asyncio.gather(*futs, return_exceptions=True)
        failed: dict[int, str] = {}
        for ep, res in zip(flat, results):
            if isinstance(res, asyncio.TimeoutError):
                fail = RewardFailure("timeout", ep.prompt, ep.completion, ep.target, f"reward took longer than rollout.reward_timeout_s={r.reward_timeout_s}s")
                self._reward_failed(ep, fail, "reward_timeout")
                failed[ep.id] = "reward_timeout"
            elif isinstance(res, BaseException):
                fail = RewardFailure("composer", ep.prompt, ep.completion, ep.target, f"{type(res).__name__}: {res}")
                self._reward_failed(ep, fail, fail.drop_reason)
                failed[ep.id] = fail.drop_reason
            elif res.failed:
                for f in res.errors:
                    self.reward_failures.append(f)
                self._reward_failed(ep, res.errors[0], res.drop_reason)
                failed[ep.id] = res.drop_reason
            else:
                ep.reward = res.total
                ep.reward_parts = dict(res.parts)

        keep: list[list[Episode]] = []
        for g in episodes_by_group:
            ok = [ep for ep in g if ep.id not in failed]
            bad = [ep for ep in g if ep.id in failed]
            for ep in bad:
                self.buffer.drop([ep], failed[ep.id])
                self._note(ep, "dropped:" + failed[ep.id])
            if len(ok) < 2:
                if ok:
                    self.buffer.drop(ok, "group_too_small")
                    for ep in ok:
                        self._note(ep, "dropped:group_too_small")
                continue
            rewards = torch.tensor([[ep.reward for ep in ok]], dtype=torch.float64)
            if r.drop_zero_variance_groups and float(rewards.std()) == 0.0:
                self.buffer.drop(ok, "zero_variance_group")
                for ep in ok:
                    self._note(ep, "dropped:zero_variance_group")
                continue
            adv = ADVANTAGES[r.advantage](rewards)[0].tolist()
            for ep, a in zip(ok, adv):
                ep.advantage = float(a)
            keep.append(ok)

        kept = [ep for g in keep for ep in g]
        if kept and self.reference is not None:
            await self._add_ref_logprobs(kept)
        if kept:
            async with self._buffer_changed:
                overflow = self.buffer.add(kept)
                for ep in kept:
                    self._note(ep, "buffered")
                for ep in overflow:
                    self._note(ep, "dropped:buffer_full")
                self._buffer_changed.notify_all()

    async def _add_ref_logprobs(self, eps: list[Episode]) -> None:
        rows = [ep.prompt_ids + ep.completion_ids for ep in eps]
        L = max(len(x) for x in rows)
        tokens = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        for i, x in enumerate(rows):
            tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        lp = await self.reference.route("logprobs", tokens)
        lp = torch.as_tensor(lp)
        for i, ep in enumerate(eps):
            p, c = len(ep.prompt_ids), len(ep.completion_ids)
            ep.ref_logprobs = lp[i, p - 1 : p - 1 + c].tolist()

    def _reward_failed(self, ep: Episode, failure: RewardFailure, reason: str) -> None:
        self.reward_failures.append(failure)
        self._event("reward_error", reason=reason, prompt=ep.prompt, completion=ep.completion, target=ep.target,
                    error=failure.error_text[-500:])

    def _note(self, ep: Episode, status: str) -> None:
        self._episode_status[ep.id] = status
        if status in ("buffered",) or status.startswith("dropped"):
            if status == "buffered" or ep not in self._recent:
                self._recent.append(ep)

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> None:
        cfg = self.config
        while self.step < cfg.train.steps and not self._stopping:
            if not await self._wait_unpaused():
                break
            async with self._buffer_changed:
                await self._buffer_changed.wait_for(
                    lambda: self._stopping or not self._unpaused.is_set() or self._sample_ready()
                )
                if self._stopping:
                    break
                if not self._unpaused.is_set():
                    continue
                batch_eps = self.buffer.sample(self.version)
                self._buffer_changed.notify_all()
            if batch_eps is None:
                continue
            await self._train_on(batch_eps)
        async with self._buffer_changed:
            self._buffer_changed.notify_all()

    def _sample_ready(self) -> bool:
        self.buffer.evict_stale(self.version)
        return len(self.buffer) >= self.config.train.batch_size

    async def _train_on(self, batch_eps: list[Episode]) -> None:
        cfg = self.config
        t0 = time.time()
        batch = collate(batch_eps, self.pad_id)
        self._last_batch = batch
        self._training_in_flight = True
        try:
            results = await self.trainer.call("train_step", batch)
        finally:
            self._training_in_flight = False
        m = dict(results[0])
        if m.get("skipped"):
            reason = str(m.get("skip_reason", "skipped"))
            self.buffer.mark_dropped(batch_eps, "step_skipped")
            for ep in batch_eps:
                self._note(ep, "dropped:step_skipped")
            self._consecutive_failures += 1
            self._event("step_skipped", reason=reason)
            if self._consecutive_failures >= cfg.train.max_consecutive_failures:
                self.message = (
                    f"paused after {self._consecutive_failures} skipped steps in a row; last reason: {reason}. "
                    "Fix the loss (run.set_loss(...)) or the data, then run.resume()"
                )
                log.warning("forgelab: %s", self.message)
                self.pause()
            return
        self._consecutive_failures = 0
        self.buffer.mark_trained(batch_eps)
        for ep in batch_eps:
            self._episode_status[ep.id] = "trained"
        self.step += 1
        self.version += 1
        t_train = time.time() - t0
        sync = await self.push_weights()
        row = self._metrics_row(batch_eps, m, t_train, sync, time.time() - t0)
        if cfg.eval.every and self.step % cfg.eval.every == 0:
            row["heldout_accuracy"] = await self.evaluate()
        if cfg.tracking.checkpoint_every and self.step % cfg.tracking.checkpoint_every == 0:
            await self.save_checkpoint()
        self.tracker.log(row)
        for fn in list(self._listeners):
            try:
                fn(row)
            except Exception:
                log.exception("forgelab: metrics listener failed")

    async def push_weights(self) -> dict:
        """Trainer -> every healthy generator replica, as version `self.version`."""
        live = [(i, h) for i, h in enumerate(self.generators.handles()) if h is not None]
        timing = (await self.trainer.call("push_weights", self.version, [h.actor for _, h in live]))[0]
        for i, _ in live:
            self.generators.set_replica_info(i, version=self.version)
        async with self._buffer_changed:
            self._pushed_version = self.version
            self._buffer_changed.notify_all()
        return timing or {}

    def _metrics_row(self, eps: list[Episode], m: dict, t_train: float, sync: dict, t_step: float) -> dict:
        now = time.time()
        dt, self._t_last = now - self._t_last, now
        tokens, self._tokens_since = self._tokens_since, 0
        counts = self.buffer.counts()
        row: dict[str, Any] = {
            "step": self.step, "time": now, "version": self.version,
            "reward_mean": sum(ep.reward for ep in eps) / len(eps),
        }
        for name in self.rewards.names:
            vals = [ep.reward_parts[name] for ep in eps if name in ep.reward_parts]
            if vals:
                row[f"reward/{name}"] = sum(vals) / len(vals)
        ages = [self.version - 1 - ep.policy_version for ep in eps]
        row["policy_age_mean"] = sum(ages) / len(ages)
        row["policy_age_max"] = max(ages)
        row["completion_len"] = sum(len(ep.completion_ids) for ep in eps) / len(eps)
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k if k not in row else f"train/{k}"] = float(v)
        # the loss the trainer actually used for this step (a swap applies at a step boundary)
        row["loss_name"] = str(m.get("loss_name") or self.loss_name)
        row["tokens_per_s"] = tokens / dt if dt > 0 else float("nan")
        row["step_time_s"] = t_step
        row["train_time_s"] = t_train
        row["weight_sync_ms"] = float(sync.get("gather_ms", 0.0)) + float(sync.get("send_ms", 0.0))
        for k in ("generated", "trained", "evicted", "dropped", "buffered"):
            row[f"episodes_{k}"] = counts[k]
        return row

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, n: int | None = None) -> float:
        """Held-out greedy accuracy (exact answer) with the generator's current weights."""
        probs = self.heldout[: n or len(self.heldout)]
        ids = [self._prompt_ids(p.prompt) for p in probs]
        from forgelab.generator import SamplingConfig

        greedy = SamplingConfig(temperature=0.0, max_tokens=self.config.rollout.max_tokens)
        groups = await self.generators.route("generate", ids, n=1, sampling=greedy)
        correct = 0
        for p, g in zip(probs, groups):
            try:
                correct += float(self._task_reward(p.prompt, g[0].text, p.target, **p.info)) > 0.5
            except Exception:
                pass
        acc = correct / max(1, len(probs))
        self.accuracy_history.append((self.step, acc))
        return acc

    # ------------------------------------------------------------------ live controls
    def set_reward_weights(self, weights: dict[str, float]) -> None:
        """Change reward weights; applies from the next scored rollout. Unknown names raise KeyError."""
        old = self.rewards.weights
        self.rewards.set_weights(weights)
        self._event("reward_weights", old=old, new=self.rewards.weights)

    def add_reward(self, name: str, fn: Callable[..., float], weight: float = 1.0, *, replace: bool = False) -> None:
        """Register a reward function from a cell; validated on recent rollouts first."""
        samples = [(ep.prompt, ep.completion, ep.target, ep.info) for ep in list(self._recent)[-64:]]
        if samples:
            report = validate(fn, samples, name=name)
            if not report.ok:
                raise RewardChangeRefused(f"reward {name!r} refused, the old rewards stay:\n{report}")
        self.rewards.add(name, fn, weight, replace=replace)
        self._event("reward_added", name=name, weight=weight)

    async def set_loss(self, loss: str | Callable, **loss_kwargs: Any) -> dict:
        """Hot-swap the loss: dry-run it on the last batch, then apply at the next step boundary."""
        if isinstance(loss, str) and loss not in LOSSES:
            raise LossSwapRefused(f"unknown loss {loss!r}; known: {', '.join(sorted(LOSSES))}; or pass your own function")
        if not isinstance(loss, str) and not callable(loss):
            raise LossSwapRefused(f"set_loss expects a loss name or a function, got {loss!r}")
        from forgelab.trainer import pack_loss

        packed = loss if isinstance(loss, str) else pack_loss(loss)
        if self._last_batch is not None:
            report = (await self.trainer.call("dry_run_loss", packed, self._last_batch, loss_kwargs))[0]
            if not report.get("ok"):
                name = loss if isinstance(loss, str) else getattr(loss, "__name__", "loss")
                self._event("loss_refused", loss=name, reason=report.get("reason"))
                raise LossSwapRefused(f"loss {name!r} refused on the last batch: {report.get('reason')}; the old loss keeps training")
        # A train_step already running finishes with the old loss (the trainer swaps between steps).
        applies_at = self.step + (2 if self._training_in_flight else 1)
        await self.trainer.call("set_loss", packed, loss_kwargs)
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
        self.loss_name = name
        self._event("loss_swapped", loss=name, kwargs=loss_kwargs, applies_at_step=applies_at)
        return {"loss": name, "applies_at_step": applies_at}

    async def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Trainer state (DCP) + controller state (step, version, data position, counters, rewards)."""
        path = Path(path) if path else self.out_dir / "checkpoints" / f"step_{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        await self.trainer.call("save", str(path / "trainer"))
        state = {
            "step": self.step, "version": self.version, "stream": self.stream.state_dict(),
            "buffer": self.buffer.state_dict(), "reward_weights": self.rewards.weights,
            "loss": self.loss_name if isinstance(self.loss_name, str) else None,
            "next_episode_id": self._next_episode_id, "next_group_id": self._next_group_id,
            "accuracy_history": self.accuracy_history,
        }
        (path / "controller.json").write_text(json.dumps(state))
        (path.parent / "LATEST").write_text(path.name)
        self._event("checkpoint", path=str(path))
        return path

    async def _restore(self, path: Path) -> None:
        if (path / "LATEST").is_file():
            path = path / (path / "LATEST").read_text().strip()
        state = json.loads((path / "controller.json").read_text())
        await self.trainer.call("load", str(path / "trainer"))
        self.step, self.version = state["step"], state["version"]
        self.stream.load_state_dict(state["stream"])
        self.buffer.load_state_dict(state["buffer"])
        self.rewards.set_weights({k: v for k, v in state["reward_weights"].items() if k in self.rewards.weights})
        self._next_episode_id, self._next_group_id = state["next_episode_id"], state["next_group_id"]
        self.accuracy_history = [tuple(x) for x in state.get("accuracy_history", [])]
        if state.get("loss") and state["loss"] != self.loss_name:
            await self.trainer.call("set_loss", state["loss"], {})
            self.loss_name = state["loss"]
        if self.version > 0:
            await self.push_weights()
        self._event("resumed_from_checkpoint", path=str(path), step=self.step)

    # ------------------------------------------------------------------ views
    def _event(self, kind: str, **fields: Any) -> None:
        ev = {"kind": kind, "step": self.step, "time": time.time(), **fields}
        self.events.append(ev)
        for fn in list(self._listeners):
            try:
                fn({"event": ev})
            except Exception:
                pass

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """fn(row) after every step and fn({"event": ev}) on every event (widgets use this)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    @property
    def metrics(self):
        """Per-step metrics as a pandas DataFrame."""
        import pandas as pd

        return self.tracker.dataframe() if self.tracker else pd.DataFrame()

    @property
    def rollouts(self):
        """Recent episodes (newest last) with token ids, logprobs, rewards, advantages and status."""
        import pandas as pd

        rows = []
        for ep in list(self._recent):
            row = {
                "id": ep.id, "group_id": ep.group_id, "task": ep.task, "prompt": ep.prompt,
                "completion": ep.completion, "target": ep.target, "reward": ep.reward, "advantage": ep.advantage,
                "policy_version": ep.policy_version, "finish_reason": ep.finish_reason,
                "status": self._episode_status.get(ep.id, ""), "prompt_ids": ep.prompt_ids,
                "completion_ids": ep.completion_ids, "generator_logprobs": ep.generator_logprobs,
                "ref_logprobs": ep.ref_logprobs, "loss_mask": ep.loss_mask,
            }
            for k, v in ep.reward_parts.items():
                row[f"reward/{k}"] = v
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def episodes(self) -> dict:
        """Episode accounting: generated = trained + evicted + dropped + buffered + in_flight."""
        return self.buffer.counts()

    def status(self) -> dict:
        return {
            "state": self.state, "step": self.step, "steps": self.config.train.steps, "version": self.version,
            "loss": self.loss_name, "reward_weights": self.rewards.weights, "message": self.message,
            "episodes": self.episodes,
            "services": {
                "generator": self.generators.status() if self.generators else [],
                "reference": self.reference.status() if self.reference else [],
            },
        }

    def dashboard(self):
        """The live lab: metrics, rollout inspector, reward and loss panels, controls."""
        from forgelab.lab import dashboard

        return dashboard(self)

    def __repr__(self) -> str:
        return f"<Run {self.config.name} {self.state} step {self.step}/{self.config.train.steps} version {self.version}>"
