"""Tinker's training primitives on shared engines: the loop is the notebook's own code, one LoRA slot per client.

    prims = Primitives(engines, root="ckpts")                    # engines: a SharedEngines (LoRA)
    tc = await prims.create_lora_training_client("sft")          # a free slot: fresh adapter and AdamW
    out = await tc.forward_backward(data, "cross_entropy")       # gradients accumulate ...
    await tc.optim_step(AdamParams(learning_rate=1e-3))          # ... until the optimizer step
    sampler = await tc.save_weights_for_sampler("v1")            # a frozen copy of the adapter, served by vLLM
    res = await sampler.sample(prompt_ids, 4, SamplingParams(max_tokens=16, stop=["\\n"]))
    path = await tc.save_state("s1"); await tc.load_state(path)  # adapter, AdamW, step: an exact resume
    await tc.close()                                             # the slot is free again

What it really is: each `TrainingClient` is a slot of `forgelab.experiments.variants.SharedEngines` (the
trainer holds its adapter, AdamW state and accumulated gradients; `forgelab.engines.trainer_slots`), driven
through the trainer's typed pieces (`forgelab.engines.trainer_client.TrainerClient`: ``forward_backward``,
``optim_step``, ``forward_logprobs``, ``save``/``load``, ``export_adapter``). Several clients (and `Run`s) share
the engines; the trainer runs one call at a time, and each client's own calls run in the order they were made
(a per-client lock, first come first served), so ``forward_backward`` then ``optim_step`` fired without awaiting
still step in that order. Data are `forgelab.experiments.primitive_types` (Tinker's types, mirrored).

Losses by name: Tinker's (`forgelab.algos.primitive_losses`: ``cross_entropy``, ``importance_sampling``, ``ppo``,
``cispo``, sums over target tokens), then forgelab's registry (`forgelab.algos.losses.LOSSES`: ``grpo``,
``dapo``, ... which take the datum's ``logprobs`` as the generator's and ``advantages``, over the positions
where ``weights`` (else ``advantages``) is not 0). A sampler (`SamplingClient`) serves a snapshot: the adapter
as it was at `save_weights_for_sampler`, in its own adapter slot of the generator, so later steps do not move it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from forgelab.algos.losses import LOSSES
from forgelab.algos.primitive_losses import PRIMITIVE_LOSSES
from forgelab.engines.contracts import OptimReport, TrainBatch
from forgelab.engines.loss_specs import LossSpec, PackedLoss, pack_loss
from forgelab.engines.trainer_client import TrainerClient
from forgelab.experiments.primitive_records import ClientRecords
from forgelab.experiments.primitive_types import (
    AdamParams, Datum, ForwardBackwardOutput, ModelInput, OptimStepResponse, SampledSequence, SampleResponse,
    SamplingParams, VLLMSampling,
)
from forgelab.generation import AdapterUpdate, GenerateRequest
from forgelab.types import AdamParams as TrainerAdamParams

if TYPE_CHECKING:
    from forgelab.engines.generator_service import GeneratorService
    from forgelab.engines.shared_parts import SlotParts
    from forgelab.experiments.variants import SharedEngines

__all__ = ["Primitives", "TrainingClient", "SamplingClient", "CustomLoss", "datum_batch"]

CustomLoss = Callable[[Sequence[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(data, logprobs)`` for `TrainingClient.forward_backward_custom`: ``logprobs[i]`` is datum ``i``'s
float32 ``[N]`` target logprobs (a leaf with grad); returns ``(scalar loss, metrics)``."""

_COUNT_METRICS = frozenset({"n_tokens", "n_seqs", "n_target_tokens", "weight_sum"})
_sampler_ids = itertools.count(1)


# --- data -> the trainer's batch ---------------------------------------------------------------


def datum_batch(data: Sequence[Datum], *, primitive: bool) -> TrainBatch:
    """The trainer's `TrainBatch` of ``data``: row ``i`` is datum ``i``'s inputs then its last target token.

    A datum's targets must be its inputs shifted by one (``target_tokens[:-1] == inputs[1:]``): the trainer scores
    each next token of a sequence. ``primitive``: Tinker's losses, which sum over every input position (mask 1 on
    all of them; ``weights`` and ``advantages`` select); else forgelab's, whose mask is where ``weights`` (else
    ``advantages``) is not 0.
    """
    if not data:
        raise ValueError("no data: give at least one Datum")
    rows: list[list[int]] = []
    for i, d in enumerate(data):
        inputs = d.model_input.to_ints()
        if not inputs:
            raise ValueError(f"datum {i} has no input tokens")
        targets = d.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise ValueError(f"datum {i} lacks loss_fn_inputs['target_tokens'] (it has {sorted(d.loss_fn_inputs)})")
        tl = [int(t) for t in targets.tolist()]
        if tl[:-1] != inputs[1:]:
            at = next(j for j, (a, b) in enumerate(zip(tl[:-1], inputs[1:])) if a != b)
            raise ValueError(f"datum {i}: target_tokens[{at}] = {tl[at]} but the next input token is "
                             f"{inputs[at + 1]}; forgelab scores each sequence's next tokens, so target_tokens must "
                             "be the inputs shifted by one (inputs = tokens[:-1], targets = tokens[1:])")
        rows.append(inputs + tl[-1:])
    B, L = len(rows), max(len(r) for r in rows)
    T = L - 1
    tokens_B_L = torch.zeros(B, L, dtype=torch.int64)
    mask_B_T = torch.zeros(B, T)
    per_token = {k: torch.zeros(B, T) for k in ("logprobs", "advantages", "weights")}
    present = {k: False for k in per_token}
    for i, (row, d) in enumerate(zip(rows, data)):
        n = len(row) - 1
        tokens_B_L[i, :len(row)] = torch.tensor(row)
        mask_B_T[i, :n] = 1.0
        for k in per_token:
            if k in d.loss_fn_inputs:
                per_token[k][i, :n] = d.loss_fn_inputs[k].float()
                present[k] = True
    extra: dict[str, torch.Tensor] = {}
    if primitive:
        if present["weights"]:
            extra["weights_B_T"] = torch.where(mask_B_T != 0, per_token["weights"], 0.0)
    else:
        select = per_token["weights"] if present["weights"] else per_token["advantages"]
        mask_B_T = mask_B_T * (select != 0)
    return TrainBatch(tokens_B_L=tokens_B_L, mask_B_T=mask_B_T, generator_logprobs_B_T=per_token["logprobs"] * mask_B_T,
                      advantages_B=per_token["advantages"] * mask_B_T, loss_inputs_B_T=extra,
                      # Tinker's losses read no reference: zeros spare the trainer its base-model pass
                      ref_logprobs_B_T=torch.zeros(B, T) if primitive else None)


def _metrics(loss: float, metrics: dict[str, float]) -> dict[str, float]:
    """``name:reduction`` keys (Tinker's): ``loss:sum``, counts summed, the rest means over the batch."""
    out = {"loss:sum": float(loss)}
    for k, v in metrics.items():
        out[f"{k}:{'sum' if k in _COUNT_METRICS else 'mean'}"] = float(v)
    return out


# --- the clients --------------------------------------------------------------------------------


class TrainingClient:
    """One LoRA slot of shared engines, driven by Tinker's primitives (see the module). Make it with
    `Primitives.create_lora_training_client`."""

    def __init__(self, primitives: "Primitives", parts: "SlotParts", name: str):
        self.primitives, self.parts, self.name = primitives, parts, name
        self.slot: str = parts.slot
        if parts.trainer is None:
            raise RuntimeError(f"slot {parts.slot!r} of the shared engines has no trainer (was it detached?)")
        self.trainer = TrainerClient(parts.trainer)
        self._lock = asyncio.Lock()  # FIFO: this client's calls run in the order they were made
        self._packed: dict[str, PackedLoss] = {}
        self.samplers: list[SamplingClient] = []
        self.records = ClientRecords(Path(primitives.path(name)), name, primitives.engines.config.model.path,
                                     primitives.engines.config.to_dict())
        """Its run directory (`forgelab.experiments.primitive_records`): ``forgelab.lab.open(client.out_dir)``."""

    @property
    def out_dir(self) -> Path:
        """``<root>/<name>``: its metrics, rollouts and events (a run directory the lab opens), and checkpoints."""
        return self.records.out_dir

    # -- losses -----------------------------------------------------------------------------------
    def _loss(self, loss_fn: str) -> tuple[LossSpec, bool]:
        """``(what the trainer gets, is it Tinker's)`` for a loss name."""
        if loss_fn in PRIMITIVE_LOSSES:
            if loss_fn not in self._packed:  # by reference: the trainer imports forgelab.algos.primitive_losses
                self._packed[loss_fn] = dataclasses.replace(pack_loss(PRIMITIVE_LOSSES[loss_fn]), name=loss_fn)
            return self._packed[loss_fn], True
        if loss_fn in LOSSES:
            from forgelab.engines.loss_specs import shipped_loss

            return shipped_loss(loss_fn), False
        raise ValueError(f"unknown loss_fn {loss_fn!r}: Tinker's {sorted(PRIMITIVE_LOSSES)} or forgelab's "
                         f"{sorted(LOSSES)} (or forward_backward_custom for your own)")

    # -- the primitives ----------------------------------------------------------------------------
    async def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                               loss_fn_config: dict[str, float] | None = None) -> ForwardBackwardOutput:
        """Add ``loss_fn``'s gradient on ``data`` to the slot's accumulated gradients (kept until `optim_step`);
        the target tokens' logprobs (before any update) and ``loss:sum``. A loss that raises or is not finite
        raises here, and discards the gradients accumulated since the last `optim_step`."""
        async with self._lock:
            spec, primitive = self._loss(loss_fn)
            batch = datum_batch(data, primitive=primitive)
            report = await self.trainer.forward_backward(batch, spec, dict(loss_fn_config or {}))
            if report.skipped:
                raise RuntimeError(f"forward_backward({loss_fn!r}) on {self.name}: {report.skip_reason}; the "
                                   "gradients accumulated since the last optim_step were discarded")
            values = await self.trainer.token_values()
            assert values is not None, "the trainer keeps the token values of the batch it just trained"
            out = ForwardBackwardOutput(loss_fn_outputs=_per_datum(values.trainer_logprobs_B_T, data),
                                        metrics=_metrics(report.loss, report.metrics))
            self._record(data, out, loss_fn)
            return out

    def _record(self, data: Sequence[Datum], out: ForwardBackwardOutput, loss_name: str) -> None:
        self.records.trained([d.loss_fn_inputs for d in data], [d.model_input.to_ints() for d in data],
                             [o["logprobs"] for o in out.loss_fn_outputs], loss_name, out.metrics)

    async def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                      loss_fn_config: dict[str, float] | None = None) -> ForwardBackwardOutput:
        """The target tokens' logprobs under the current adapter, and ``loss_fn``'s value on them (Tinker's
        losses only); nothing changes (accumulated gradients included)."""
        async with self._lock:
            return await self._forward(data, loss_fn, loss_fn_config)

    async def _forward(self, data: Sequence[Datum], loss_fn: str,
                       loss_fn_config: dict[str, float] | None) -> ForwardBackwardOutput:
        batch = datum_batch(data, primitive=True)
        lp_B_T = await self.trainer.forward_logprobs(batch)
        metrics: dict[str, float] = {}
        if loss_fn in PRIMITIVE_LOSSES:
            loss, m = PRIMITIVE_LOSSES[loss_fn](lp_B_T, generator_logprobs_B_T=batch.generator_logprobs_B_T,
                                                advantages_B=batch.advantages_B, mask_B_T=batch.mask_B_T,
                                                **batch.loss_inputs_B_T, **dict(loss_fn_config or {}))
            metrics = _metrics(float(loss), m)
        return ForwardBackwardOutput(loss_fn_outputs=_per_datum(lp_B_T, data), metrics=metrics)

    async def forward_backward_custom(self, data: Sequence[Datum], loss_fn: CustomLoss) -> ForwardBackwardOutput:
        """Your own loss over the logprobs, as Tinker's SDK does it: a forward, ``loss_fn(data, logprobs)`` and
        its gradient ``dC/dlogp`` here, then a ``cross_entropy`` forward-backward with weights ``-dC/dlogp``
        (whose gradient is then exactly ``dC/dtheta``). ``loss:sum`` is your loss's value."""
        async with self._lock:
            fwd = await self._forward(data, "", None)
            leaves = [o["logprobs"].clone().requires_grad_(True) for o in fwd.loss_fn_outputs]
            loss, metrics = loss_fn(data, leaves)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
            weighted = [Datum(model_input=d.model_input, loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": -(lp.grad if lp.grad is not None else torch.zeros_like(lp))}) for d, lp in zip(data, leaves)]
            spec, _ = self._loss("cross_entropy")
            report = await self.trainer.forward_backward(datum_batch(weighted, primitive=True), spec, {})
            if report.skipped:
                raise RuntimeError(f"forward_backward_custom on {self.name}: {report.skip_reason}")
            out = ForwardBackwardOutput(loss_fn_outputs=fwd.loss_fn_outputs,
                                        metrics={**_metrics(float(loss.detach()), metrics)})
            self._record(data, out, "custom")
            return out

    async def optim_step(self, adam_params: AdamParams | TrainerAdamParams) -> OptimStepResponse:
        """AdamW on the gradients accumulated since the last step, with ``adam_params`` (per call), then zeroes
        them. Raises when nothing was accumulated."""
        adam = adam_params.to_trainer() if isinstance(adam_params, AdamParams) else adam_params
        async with self._lock:
            report: OptimReport = await self.trainer.optim_step(adam)
        if report.skipped:
            raise RuntimeError(f"optim_step on {self.name}: {report.skip_reason}")
        self.records.stepped(report.step, report.lr, report.grad_norm)
        return OptimStepResponse(step=report.step, metrics={"grad_norm:mean": report.grad_norm,
                                                            "learning_rate:mean": report.lr})

    # -- checkpoints -------------------------------------------------------------------------------
    async def save_state(self, name: str) -> str:
        """Adapter, AdamW state, step and RNG under ``<root>/<client>/state/<name>``; the path."""
        async with self._lock:
            path = await self.trainer.save(self.primitives.path(self.name, "state", name))
        self.records.event("checkpoint_saved", path=path)
        return path

    async def load_state(self, path: str, with_optimizer: bool = True) -> None:
        """Restore a `save_state` checkpoint (of any client of the same model and adapter shape) into this slot;
        ``with_optimizer`` False: the weights only, AdamW starts fresh. Accumulated gradients are discarded."""
        async with self._lock:
            await self.trainer.load(path, with_optimizer)
        self.records.event("checkpoint_loaded", path=path, with_optimizer=with_optimizer)

    async def save_weights_for_sampler(self, name: str) -> "SamplingClient":
        """The adapter as it is now, written as a PEFT directory (``<root>/<client>/sampler/<name>``) and served
        by the generator in an adapter slot of its own: a `SamplingClient` whose weights later steps do not move."""
        async with self._lock:
            path = await self.trainer.export_adapter(self.primitives.path(self.name, "sampler", name))
        sampler = await self.primitives.create_sampling_client(path)
        sampler.records = self.records
        self.samplers.append(sampler)
        self.records.event("sampler_saved", path=path, sampler=name)
        return sampler

    async def fingerprint(self) -> dict[str, object]:
        """SHA-256 of the slot's adapter and AdamW state, its step (`Trainer.fingerprint`, rank 0)."""
        async with self._lock:
            return dict((await self.trainer.fingerprint())[0])

    async def close(self) -> None:
        """Free the slot (and the samplers' adapters in the generator)."""
        async with self._lock:
            for s in self.samplers:
                await s.close()
            await self.primitives.engines.detach(self.parts)
        self.records.flush()
        self.records.event("finished")

    def __repr__(self) -> str:
        return f"<TrainingClient {self.name} in {self.slot} of {self.primitives.engines.name}>"


def _per_datum(lp_B_T: torch.Tensor, data: Sequence[Datum]) -> list[dict[str, torch.Tensor]]:
    return [{"logprobs": lp_B_T[i, :d.model_input.length].float().clone()} for i, d in enumerate(data)]


class SamplingClient:
    """Samples from the shared generator with fixed weights: the base model (``adapter_slot`` None) or an adapter
    snapshot in its own adapter slot."""

    def __init__(self, primitives: "Primitives", adapter_slot: str | None, path: str | None = None):
        self.primitives, self.adapter_slot, self.path = primitives, adapter_slot, path
        self.records: ClientRecords | None = None
        """Where its samples are recorded (the training client's, for a `save_weights_for_sampler` snapshot)."""

    async def sample(self, prompt: ModelInput | Sequence[int], num_samples: int = 1,
                     sampling_params: SamplingParams | None = None,
                     include_prompt_logprobs: bool = False) -> SampleResponse:
        """``num_samples`` continuations of ``prompt``: tokens, each token's logprob, why each ended."""
        params = sampling_params or SamplingParams()
        ids = prompt.to_ints() if isinstance(prompt, ModelInput) else [int(t) for t in prompt]
        sampling = VLLMSampling.of(params, prompt_logprobs=include_prompt_logprobs)
        seeds = None if params.seed is None else [[params.seed + g for g in range(num_samples)]]
        request = GenerateRequest(prompts_P=[ids], n=num_samples, sampling=sampling, seeds_P_G=seeds,
                                  lora_slot=self.adapter_slot)
        groups = await self.primitives.generators().generate(request)
        completions = groups[0]
        if self.records is not None:
            self.records.sampled(ids, [(list(c.completion_ids), list(c.logprobs), c.finish_reason)
                                       for c in completions], os.path.basename(self.path or "base"))
        return SampleResponse(
            sequences=[SampledSequence(tokens=list(c.completion_ids), logprobs=list(c.logprobs),
                                       stop_reason="length" if c.finish_reason == "length" else "stop")
                       for c in completions],
            prompt_logprobs=completions[0].prompt_logprobs if include_prompt_logprobs else None)

    async def close(self) -> None:
        if self.adapter_slot is not None:
            await self.primitives.generators().drop_slot(self.adapter_slot)

    def __repr__(self) -> str:
        return f"<SamplingClient {self.adapter_slot or 'base'}{f' from {self.path}' if self.path else ''}>"


class Primitives:
    """Tinker's service client over shared engines: training clients (one slot each) and sampling clients.

    Args:
        engines: the `SharedEngines` (LoRA) whose slots the training clients take.
        root: where ``save_state`` and ``save_weights_for_sampler`` write.
    """

    def __init__(self, engines: "SharedEngines", root: str | os.PathLike[str]):
        self.engines = engines
        self.root = os.path.abspath(os.fspath(root))
        self._names = itertools.count(1)

    def generators(self) -> "GeneratorService":
        """The shared engines' generator service (every slot's sampler)."""
        parts = self.engines.parts
        if parts is None or parts.generators is None:
            raise RuntimeError(f"{self.engines.name} is not started (or was shut down): await engines.start()")
        return parts.generators

    def path(self, *names: str) -> str:
        for n in names:
            if not n or os.sep in n or n in (".", ".."):
                raise ValueError(f"a checkpoint name must be a plain name (no {os.sep!r}, not '.' or '..'), got {n!r}")
        return os.path.join(self.root, *names)

    async def create_lora_training_client(self, name: str | None = None) -> TrainingClient:
        """A client in a free slot of the engines: the fresh adapter (the base model's outputs) and fresh AdamW."""
        name = name or f"client{next(self._names)}"
        self.path(name)
        await self.engines.start()
        cfg = dataclasses.replace(self.engines.config, name=name)
        parts = await self.engines.attach(cfg)
        return TrainingClient(self, parts, name)

    async def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """A sampler of the base model (``model_path`` None) or of an adapter directory written by
        `TrainingClient.save_weights_for_sampler`, loaded into an adapter slot of its own."""
        from forgelab.weights.adapter import read_adapter

        await self.engines.start()
        if model_path is None:
            return SamplingClient(self, None)
        tensors, _ = read_adapter(model_path)
        slot = f"sampler{next(_sampler_ids)}"
        await self.generators().update_adapter(AdapterUpdate(slot=slot, version=1, tensors=tensors))
        return SamplingClient(self, slot, model_path)


