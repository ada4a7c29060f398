"""Trainer and reference model: torchtitan models in Monarch actors, FSDP2 across the trainer's processes.

    trainer = TrainerClient(await Trainer.options(procs=2).as_actor(TrainerConfig(model_dir=..., lr=1e-5)))
    metrics = await trainer.train_step(batch)                 # StepMetrics; every rank gets the global TrainBatch
    await trainer.forward_backward(batch); await trainer.optim_step(AdamParams(lr=1e-5))   # the same, in pieces
    await trainer.set_loss(my_loss, {"eps_high": 0.28})       # live from the next step
    await trainer.push_weights(version, [gen.actor for gen in healthy])
    ref = ReferenceClient(await ReferenceModel.options(procs=1).as_actor(ReferenceConfig(model_dir=...)))
    ref_logprobs_B_T = await ref.logprobs(batch.tokens_B_L)

The typed objects are in `forgelab.engines.contracts`, the typed clients in `forgelab.engines.trainer_client`.

**One global loss, whatever its normalisation.** Every rank receives the
whole batch (``forgelab.algos.batching.collate``) and runs the model on its
contiguous block of rows. The ranks then all-gather the (detached) token
logprobs and *every rank evaluates the loss on the global batch*, on a leaf
tensor ``lp_B_T`` standing in for the logprobs. Backward through the loss alone
gives ``dL/dlp_B_T``; each rank back-propagates its own rows' slice of that
gradient through its model forward, and FSDP2 *sums* (not averages) the
parameter gradients over ranks. By the chain rule the summed gradient is
exactly ``dL/dtheta`` of the global-batch loss. So token-level means
(dapo, cispo), per-sequence means (grpo), constant normalisers (dr_grpo),
sequence ratios (gspo) and any user loss get the same value and gradient on 1
or N processes, without the loss knowing about ranks; no "average of per-rank
averages" bias. The cost is one all-gather of ``B x T`` floats. Gradient
accumulation (``micro_batch_size``) reuses the decomposition: a no-grad forward
pass for the logprobs, the loss, then forward+backward per micro-batch with
its slice of ``dL/dlp`` (one extra forward pass per step).

**Fault rule.** A loss that raises, is not a finite scalar, or yields
non-finite gradients skips the step: gradients are zeroed, the optimizer and
the LR schedule do not step, and the metrics are
``{"skipped": 1, "skip_reason": ...}``. The ranks all-reduce the decision, so
they stay in lock step and FSDP never waits on a rank that bailed out.

**The step in pieces.** ``forward_backward`` (gradients accumulate across calls), ``optim_step`` (per-call
AdamW hyperparameters or the schedule) and ``forward_logprobs``; ``train_step`` is the two first in
sequence in one call, bit for bit (`forgelab.engines.trainer_state`). A skipped ``forward_backward``
discards the whole accumulation window; an ``optim_step`` with nothing accumulated is skipped.

**Loss hot swap.** ``set_loss`` stores the new loss; ``train_step`` (or the first ``forward_backward``
after an optimizer step) picks it up at its start, so a step never mixes two losses. Monarch pickles arguments
with cloudpickle, which sends functions defined in ``__main__`` (a notebook
cell, a script) by value: passing the function itself works. ``pack_loss`` is
there for callers that want the bytes explicitly (e.g. to store them).

**Weight push.** ``push_weights`` gathers the HF state dict on rank 0. By
default (``weight_transport="auto"``) rank 0 writes it once into a
shared-memory safetensors file (``forgelab.weights.sender`` / ``.shm``; the same file
is overwritten in place on later pushes) and each generator on this host gets
only a handle, maps the file and reloads from it; generators that cannot see the
file get the tensors in a Monarch message, which pickles the whole state dict
once per generator (``weight_transport="message"`` does that for all).

The state and the step itself (no actors) live in ``forgelab.engines.trainer_state``.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Unpack

import torch
from monarch.actor import endpoint

from forgelab.config.components import WEIGHT_TRANSPORTS, ReferenceConfig, TrainerConfig  # noqa: F401 -- re-exported
from forgelab.runtime import liveness
from forgelab.runtime.component import ActorHandle, Component, Configured, Placement, PlacementOptions
from forgelab.weights.sender import WeightSender
from forgelab.engines.contracts import (
    AdamParams, DryRunReport, LossReport, OptimReport, StepMetrics, TokenValues, TrainBatch, WeightPush, check_spans,
    check_tokens,
)
from forgelab.engines.loss_specs import LossSpec, PackedLoss, pack_loss, resolve_loss
from forgelab.engines.trainer_dist import resolve_device
from forgelab.engines.trainer_optim import WarmupCosine, set_schedule_peak
from forgelab.engines.trainer_state import TrainerState

__all__ = [
    "TrainerConfig",
    "Trainer",
    "WEIGHT_TRANSPORTS",
    "ReferenceConfig",
    "ReferenceModel",
    "PackedLoss",
    "pack_loss",
    "WarmupCosine",
    "free_port",
    "resolve_loss",
    "TrainBatch",
    "StepMetrics",
    "AdamParams",
]

# --- configuration ------------------------------------------------------------

def free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mesh_rank_world() -> tuple[int, int]:
    from monarch.actor import current_rank, current_size

    world = 1
    for n in current_size().values():
        world *= n
    return current_rank().rank, world


def _with_port(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
    def fill(v: object) -> object:
        if not isinstance(v, TrainerConfig):
            return v
        v.validate()  # fail here, before spawning processes
        return replace(v, master_port=free_port()) if v.master_port is None else v

    return tuple(fill(a) for a in args), {k: fill(v) for k, v in kwargs.items()}


class _TrainerConfigured(Configured["Trainer"]):
    """`Configured` that gives each spawned trainer mesh its own free rendezvous port."""

    def options(self, **kwargs: Unpack[PlacementOptions]) -> "_TrainerConfigured":
        return _TrainerConfigured(self.cls, replace(self.placement, **kwargs))

    async def as_actor(self, *args: object, **kwargs: object) -> ActorHandle[Trainer]:
        args, kwargs = _with_port(args, kwargs)
        return await super().as_actor(*args, **kwargs)


# --- the actors -------------------------------------------------------------------


class Trainer(Component):
    """Policy trainer: torchtitan model, FSDP2 over the mesh's processes, AdamW, swappable loss.

    Call every endpoint on all ranks (``handle.call(...)``): they run collectives.
    Results are identical on every rank except where noted (rank 0 carries tensors).
    """

    state: TrainerState
    """Model, optimizer, schedule and loss (`setup`; rebuilt by `reinit`)."""

    def __init__(self, config: TrainerConfig) -> None:
        config.validate()
        self.config = config
        self._sender = WeightSender(config.shm_dir)  # rank 0's sends and shared-memory file (forgelab.weights.sender)

    @classmethod
    def options(cls, **kwargs: Unpack[PlacementOptions]) -> _TrainerConfigured:
        return _TrainerConfigured(cls, Placement(**kwargs))

    @classmethod
    async def as_actor(cls, *args: object, **kwargs: object) -> ActorHandle[Trainer]:
        return await cls.options().as_actor(*args, **kwargs)

    # -- lifecycle -------------------------------------------------------------

    @endpoint
    async def setup(self) -> None:
        self.state = TrainerState.create(self.config, *_mesh_rank_world())

    def release_for_exit(self) -> None:
        self._sender.close()  # the shared-memory weights file

    @endpoint
    async def reinit(self, config: TrainerConfig) -> dict[str, object]:
        """Start over from ``config`` in this process (a warm pool's next run): model, optimizer, schedule, loss."""
        config.validate()
        self.config = config
        if hasattr(self, "state"):
            del self.state  # the old model and optimizer go before the next are built
        self.state = TrainerState.create(config, *_mesh_rank_world())  # the process group is kept
        return self.state.info()

    @endpoint
    async def set_lr(self, lr: float) -> float:
        """Make ``lr`` the peak learning rate from now on, keeping the schedule's position; returns the current lr."""
        s = self.state
        self.config = s.config = replace(s.config, lr=float(lr))
        return set_schedule_peak(s.optimizer, s.scheduler, lr)

    @endpoint
    async def info(self) -> dict[str, object]:
        """Rank, world size, device, step, policy version, current loss name, parameter count."""
        return self.state.info()

    # -- training --------------------------------------------------------------

    @endpoint
    async def train_step(self, batch: TrainBatch) -> StepMetrics:
        """One optimizer step on the global ``batch`` (this rank trains its block of rows): `forward_backward`
        with the current loss, then `optim_step` with the schedule, in one call."""
        return self.state.train_step(batch)

    @endpoint
    async def forward_backward(self, batch: TrainBatch, loss: LossSpec | None = None,
                               loss_kwargs: dict[str, object] | None = None) -> LossReport:
        """Add ``loss``'s gradient on ``batch`` to the accumulated gradients (None: the current loss); see
        `TrainerState.forward_backward`."""
        return self.state.forward_backward(batch, loss, loss_kwargs)

    @endpoint
    async def optim_step(self, adam: AdamParams | None = None) -> OptimReport:
        """AdamW step on the accumulated gradients with ``adam``'s hyperparameters (None: the schedule's)."""
        return self.state.optim_step(adam)

    @endpoint
    async def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's ``logprobs_B_T`` on ``batch``'s trained positions (float32, CPU, no grad)."""
        return self.state.forward_logprobs(batch)

    @endpoint
    async def set_loss(self, fn_or_name: LossSpec, loss_kwargs: dict[str, object] | None = None) -> str:
        """Make ``fn_or_name`` (with ``loss_kwargs``, default none) the loss from the next ``train_step``; returns its name."""
        return self.state.set_loss(fn_or_name, loss_kwargs)

    @endpoint
    async def dry_run_loss(self, fn_or_name: LossSpec, batch: TrainBatch,
                           loss_kwargs: dict[str, object] | None = None) -> DryRunReport:
        """Forward + loss + backward on ``batch`` with nothing changed after."""
        return self.state.dry_run_loss(fn_or_name, batch, loss_kwargs)

    @endpoint
    async def compare_losses(self, specs: Sequence[object], batch: TrainBatch | Mapping[str, object]
                             ) -> dict[str, object]:
        """Each loss's value, grad norm and metrics on ``batch`` and the pairwise gradient cosines; nothing changes
        (see `forgelab.engines.loss_compare.compare_on_state`)."""
        from forgelab.engines.loss_compare import compare_on_state

        return compare_on_state(self.state, specs, batch)

    @endpoint
    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        """Current policy's ``logprobs_B_T`` (fp32, no grad), the full batch on every rank.

        With ``spans_B_2`` (each row's ``(prompt length, length)``) only the completion positions are
        computed (0 elsewhere), and rows sharing a prompt run it once (`TrainerConfig.share_prompts`).
        """
        return self.state.logprobs(tokens_B_L, spans_B_2)

    # -- weights ---------------------------------------------------------------

    @endpoint
    async def get_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights (CPU) on rank 0; other ranks return ``{}`` after taking part in the gather."""
        sd = self.state.hf_state_dict()
        return sd if self.state.rank == 0 else {}

    @endpoint
    async def push_weights(self, version: int, generators: Sequence[object], transport: str | None = None
                           ) -> WeightPush:
        """Gather the HF weights (with LoRA: the adapter only, PEFT names) and load them into each generator mesh
        as ``version``.

        ``generators`` are Monarch actor meshes (``ActorHandle.actor``) of healthy
        generator replicas; rank 0 sends to all of them concurrently. ``transport``
        (default ``TrainerConfig.weight_transport``): ``"auto"`` writes the weights
        once to shared memory and calls each generator's
        ``update_weights_shared(handle)``; a generator that cannot see the file (or
        has no such endpoint) gets ``update_weights(version, weights)`` instead, as
        every generator does with ``"message"``. Returns a `WeightPush` (times, bytes, per-generator transports,
        failures by position in ``generators``).
        """
        out = await self._sender.push(self.state.push_state_dict, self.state.rank == 0, int(version), list(generators),
                                      transport or self.config.weight_transport)
        self.state.policy_version = int(version)
        return WeightPush.of(out)

    @endpoint
    async def export_hf(self, path: str) -> str:
        """Write the current weights as a HF directory (rank 0 writes; every rank gathers). With LoRA: merged."""
        return self.state.export_hf(path)

    @endpoint
    async def export_adapter(self, path: str) -> str:
        """LoRA: write the adapter as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``)."""
        return self.state.export_adapter(path)

    @endpoint
    async def base_logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        """LoRA: the base model's ``logprobs_B_T`` (adapters off, fp32, no grad), the full batch on every rank."""
        return self.state.base_logprobs(tokens_B_L, spans_B_2)

    # -- checkpoints -----------------------------------------------------------

    @endpoint
    async def save(self, path: str) -> str:
        """DCP checkpoint of model + optimizer, plus schedule, step, policy version, loss and RNG states."""
        return self.state.save(path)

    @endpoint
    async def load(self, path: str, with_optimizer: bool = True) -> dict[str, object]:
        """Restore a `save` checkpoint (any world size for model/optimizer); returns ``info()``. ``with_optimizer``
        False: the AdamW moments start fresh."""
        return self.state.load(path, with_optimizer)

    @endpoint
    async def fingerprint(self) -> dict[str, object]:
        """SHA-256 of this rank's parameters and optimizer state, and the schedule/step: for bit-exact checks."""
        return self.state.fingerprint()

    @endpoint
    async def token_values(self) -> TokenValues | None:
        """The last trained batch's per-token values (`forgelab.engines.contracts.token_values_of`: trainer
        logprobs before the update, entropy, IS weights, clipped, mask; CPU ``[B, T]``); None before any step."""
        return self.state.token_values


class ReferenceModel(Component):
    """Frozen policy for reference logprobs: eval mode, no grad, float32; each process holds the whole model."""

    IDEMPOTENT = frozenset({"logprobs"})

    def __init__(self, config: ReferenceConfig):
        config.validate()
        self.config = config

    @endpoint
    async def setup(self) -> None:
        from forgelab.engines.titan import build_from_hf

        from forgelab.engines.precision import compute_dtype

        self.device = resolve_device(self.config.device)
        dtype = compute_dtype(self.config.dtype, self.device.type)
        model, self.ckpt = build_from_hf(self.config.model_dir, device=self.device, dtype=dtype)
        self.model = model.eval().requires_grad_(False)

    @endpoint
    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        """``logprobs_B_T`` (fp32, CPU) of each next token of ``tokens_B_L`` under the frozen weights.

        With ``spans_B_2`` (each row's ``(prompt length, length)``) only the completion positions are
        computed (0 elsewhere), and rows sharing a prompt run it once (`ReferenceConfig.share_prompts`).
        """
        from forgelab.engines.titan_forward import model_logprobs_entropy

        tokens_B_L = check_tokens(tokens_B_L)
        spans_B_2 = check_spans(spans_B_2, tokens_B_L)
        rows = self.config.micro_batch_size or tokens_B_L.shape[0]
        parts = []
        with torch.no_grad():
            for s in range(0, tokens_B_L.shape[0], rows):
                parts.append(model_logprobs_entropy(
                    self.model, tokens_B_L[s:s + rows].to(self.device),
                    spans_B_2=None if spans_B_2 is None else spans_B_2[s:s + rows],
                    share_prompts=self.config.share_prompts, max_pack_len=self.config.max_pack_len)[0])
                # progress the watchdog sees while this synchronous loop holds the event loop (forgelab.runtime.watchdog)
                liveness.bump("reference_rows", min(rows, tokens_B_L.shape[0] - s))
        return torch.cat(parts).float().cpu()
