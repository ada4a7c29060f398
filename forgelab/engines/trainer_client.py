"""Typed calls into the trainer and the reference, on forgelab's own routing.

    trainer = TrainerClient(handle)        # an ActorHandle, a SlotTrainerHandle (one run's LoRA slot), ...
    metrics = await trainer.train_step(batch)              # TrainBatch -> StepMetrics
    await trainer.forward_backward(batch, "grpo", {"kl_coef": 0.05})   # -> LossReport; gradients accumulate
    await trainer.optim_step(AdamParams(lr=1e-5))          # -> OptimReport
    ref = ReferenceClient(service)                          # the reference (or teacher) service
    ref_logprobs_B_T = await ref.logprobs(batch.tokens_B_L)

`TrainerAPI` is what the controller depends on: `TrainerClient` implements it over any handle whose
``call(endpoint, *args)`` answers one value per rank (`forgelab.runtime.mesh.ActorHandle`, which keeps
replica choice, retry and health; `forgelab.engines.slot_parts.SlotTrainerHandle`), and the test fakes
(`forgelab.testing.fakes.FakeTrainer`) implement it in process. A call with a wrong argument type is a type
error, not a failure inside a process. Every trainer endpoint runs on all ranks (collectives); the answers
are identical on every rank, so the client returns rank 0's, except `fingerprint` (one per rank: each hashes
its shard).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, cast, runtime_checkable

import torch

from forgelab.engines.contracts import (
    AdamParams, DryRunReport, LossReport, OptimReport, SlotStep, StepMetrics, TokenValues, TrainBatch, WeightPush,
)
from forgelab.engines.loss_specs import LossSpec

if TYPE_CHECKING:
    from forgelab.runtime.watchdog import Watchdog

__all__ = ["TrainerAPI", "TrainerClient", "ExportsSteps", "ReferenceAPI", "ReferenceClient", "EndpointHandle", "RoutedService",
           "TrainerInfo", "Fingerprint", "SlotList", "LossComparison", "as_trainer"]


class TrainerInfo(TypedDict, total=False):
    """`Trainer.info` (and `load`): this rank's view of the trainer."""

    rank: int
    world: int
    device: str
    step: int
    policy_version: int
    loss: str
    loss_kwargs: dict[str, object]
    family: str
    params: int
    trainable_params: int
    lora: bool


class Fingerprint(TypedDict, total=False):
    """`Trainer.fingerprint` of one rank: SHA-256 of its parameter and optimizer shards, the schedule, the step."""

    params: str
    optim: str
    optim_entries: int
    scheduler: str
    step: int
    lr: float


class SlotList(TypedDict):
    """The answer of a slot operation: the slot it concerned and every slot now in the table."""

    slot: str
    slots: list[str]


class LossComparison(TypedDict):
    """`Trainer.compare_losses`: one row per loss (name, ok, reason, loss, grad_norm, metrics, kwargs) and the
    pairwise gradient cosines (`forgelab.engines.loss_compare.compare_on_state`)."""

    losses: list[dict[str, object]]
    cosine: list[list[float]]


def _mapping(answer: object) -> dict[str, object]:
    """An endpoint's dict answer (info, fingerprint, slot lists), checked at run time."""
    if not isinstance(answer, dict):
        raise TypeError(f"the trainer answered {type(answer).__name__}, expected a dict")
    return answer


class EndpointHandle(Protocol):
    """A spawned component as the client sees it: ``call(endpoint, *args)`` answers one value per rank."""

    async def call(self, endpoint_name: str, /, *args: object, **kwargs: object) -> list[object]: ...


class TrainerAPI(Protocol):
    """The trainer's endpoints, typed: what the controller calls (`TrainerClient`, `FakeTrainer`)."""

    async def train_step(self, batch: TrainBatch) -> StepMetrics:
        """Fused: `forward_backward` with the current loss, then `optim_step(None)` (bit-identical to the pair)."""
        ...

    async def forward_backward(self, batch: TrainBatch, loss: LossSpec | None = None,
                               loss_kwargs: Mapping[str, object] | None = None) -> LossReport:
        """Add ``loss``'s gradient on ``batch`` to the accumulated gradients (None: the current loss)."""
        ...

    async def optim_step(self, adam: AdamParams | None = None) -> OptimReport:
        """AdamW on the accumulated gradients (``adam``'s hyperparameters, or None: the schedule's); zeroes them."""
        ...

    async def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's float32 ``logprobs_B_T`` on ``batch``'s trained positions (0 elsewhere)."""
        ...

    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor: ...

    async def token_values(self) -> TokenValues | None: ...

    async def set_loss(self, loss: LossSpec, loss_kwargs: Mapping[str, object] | None = None) -> str: ...

    async def dry_run_loss(self, loss: LossSpec, batch: TrainBatch,
                           loss_kwargs: Mapping[str, object] | None = None) -> DryRunReport: ...

    async def push_weights(self, version: int, generators: Sequence[object],
                           transport: str | None = None) -> WeightPush: ...

    async def save(self, path: str) -> str: ...

    async def load(self, path: str) -> TrainerInfo: ...

    async def info(self) -> TrainerInfo: ...

    async def fingerprint(self) -> list[Fingerprint]: ...

    async def set_lr(self, lr: float) -> float:
        """Make ``lr`` the peak learning rate from now on, keeping the schedule's position; the current lr."""
        ...

    async def compare_losses(self, specs: Sequence[object], batch: TrainBatch) -> LossComparison:
        """Each loss spec on ``batch`` from the current state, nothing changed (`forgelab.engines.loss_compare`)."""
        ...


@runtime_checkable
class ExportsSteps(Protocol):
    """A trainer whose step can export the adapter in the same call (a LoRA slot of a
    `forgelab.engines.trainer_slots.SlotTrainer`); the controller then hands the adapter to the generator."""

    async def train_export(self, batch: TrainBatch, version: int) -> SlotStep:
        """`train_step`, the batch's token values and (not skipped) the adapter as ``version``, in one call."""
        ...


class TrainerClient(TrainerAPI):
    """`TrainerAPI` over a trainer handle (`EndpointHandle`); anything else (``pids()``, ``alive``,
    ``shutdown()``) reaches the handle. ``call(name, *args)`` is kept for one release (callers that name an
    endpoint by string); typed methods go through it, so a wrapper that records calls sees them all."""

    def __init__(self, handle: EndpointHandle):
        self.handle = handle
        self.watchdog: Watchdog | None = None
        """Declares a trainer call stuck (`forgelab.runtime.watchdog`; a run sets it); None: unwatched. A weight
        push is watched by `forgelab.weights.sync.WeightSync` instead, with the generators' processes."""

    async def call(self, endpoint_name: str, *args: object, **kwargs: object) -> list[object]:
        call = self.handle.call(endpoint_name, *args, **kwargs)
        pids: list[int] = list(getattr(self.handle, "pids_list", None) or [])
        if self.watchdog is None or endpoint_name == "push_weights" or not pids:
            return await call
        return await self.watchdog.watch(call, pids=pids, part="trainer", what=f"{endpoint_name}()")

    async def _one(self, endpoint_name: str, *args: object) -> object:
        return (await self.call(endpoint_name, *args))[0]

    # -- the step --------------------------------------------------------------------------------

    async def train_step(self, batch: TrainBatch) -> StepMetrics:
        out = await self._one("train_step", batch)
        assert isinstance(out, StepMetrics), type(out)
        return out

    async def train_export(self, batch: TrainBatch, version: int) -> SlotStep:
        """A LoRA slot's step in one call (`ExportsSteps`); only a `SlotTrainer`'s slot answers it."""
        out = await self._one("train_export", batch, int(version))
        assert isinstance(out, SlotStep), type(out)
        return out

    async def forward_backward(self, batch: TrainBatch, loss: LossSpec | None = None,
                               loss_kwargs: Mapping[str, object] | None = None) -> LossReport:
        out = await self._one("forward_backward", batch, loss, None if loss_kwargs is None else dict(loss_kwargs))
        assert isinstance(out, LossReport), type(out)
        return out

    async def optim_step(self, adam: AdamParams | None = None) -> OptimReport:
        out = await self._one("optim_step", adam)
        assert isinstance(out, OptimReport), type(out)
        return out

    async def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        out = await self._one("forward_logprobs", batch)
        assert isinstance(out, torch.Tensor), type(out)
        return out

    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        out = await self._one("logprobs", tokens_B_L, spans_B_2)
        assert isinstance(out, torch.Tensor), type(out)
        return out

    async def base_logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        """LoRA: the base model's ``logprobs_B_T`` (adapters off)."""
        out = await self._one("base_logprobs", tokens_B_L, spans_B_2)
        assert isinstance(out, torch.Tensor), type(out)
        return out

    async def token_values(self) -> TokenValues | None:
        out = await self._one("token_values")
        assert out is None or isinstance(out, TokenValues), type(out)
        return out

    # -- the loss ----------------------------------------------------------------------------------

    async def set_loss(self, loss: LossSpec, loss_kwargs: Mapping[str, object] | None = None) -> str:
        return str(await self._one("set_loss", loss, None if loss_kwargs is None else dict(loss_kwargs)))

    async def dry_run_loss(self, loss: LossSpec, batch: TrainBatch,
                           loss_kwargs: Mapping[str, object] | None = None) -> DryRunReport:
        out = await self._one("dry_run_loss", loss, batch, None if loss_kwargs is None else dict(loss_kwargs))
        assert isinstance(out, DryRunReport), type(out)
        return out

    async def compare_losses(self, specs: Sequence[object], batch: TrainBatch) -> LossComparison:
        out = await self._one("compare_losses", list(specs), batch)
        assert isinstance(out, dict), type(out)
        return LossComparison(losses=list(out["losses"]), cosine=list(out["cosine"]))

    async def set_lr(self, lr: float) -> float:
        return float(await self._one("set_lr", float(lr)))  # type: ignore[arg-type]  # the endpoint answers a float

    # -- weights and checkpoints ---------------------------------------------------------------

    async def push_weights(self, version: int, generators: Sequence[object],
                           transport: str | None = None) -> WeightPush:
        args: tuple[object, ...] = (int(version), list(generators)) + (() if transport is None else (transport,))
        out = await self._one("push_weights", *args)
        return WeightPush.of(out)  # type: ignore[arg-type]  # a WeightPush, or the dict of an older trainer

    async def export_hf(self, path: str) -> str:
        return str(await self._one("export_hf", str(path)))

    async def export_adapter(self, path: str) -> str:
        return str(await self._one("export_adapter", str(path)))

    async def save(self, path: str) -> str:
        return str(await self._one("save", str(path)))

    async def load(self, path: str, with_optimizer: bool = True) -> TrainerInfo:
        args: tuple[object, ...] = (str(path),) if with_optimizer else (str(path), False)
        return cast(TrainerInfo, _mapping(await self._one("load", *args)))

    async def info(self) -> TrainerInfo:
        return cast(TrainerInfo, _mapping(await self._one("info")))

    async def fingerprint(self) -> list[Fingerprint]:
        return [cast(Fingerprint, _mapping(fp)) for fp in await self.call("fingerprint")]

    # -- LoRA slots (a `forgelab.engines.trainer_slots.SlotTrainer`) ------------------------------

    async def slot_new(self, slot: str, config: object) -> SlotList:
        """A new slot from the fresh adapters with ``config``'s (a `TrainerConfig`) loss, lr and schedule."""
        return cast(SlotList, _mapping(await self._one("slot_new", slot, config)))

    async def slot_copy(self, src: str, dst: str) -> SlotList:
        return cast(SlotList, _mapping(await self._one("slot_copy", src, dst)))

    async def slot_free(self, slot: str) -> SlotList:
        return cast(SlotList, _mapping(await self._one("slot_free", slot)))

    async def slot_stats(self) -> dict[str, object]:
        out = await self._one("slot_stats")
        assert isinstance(out, dict), type(out)
        return out

    def __getattr__(self, name: str) -> object:  # pids(), alive, failed, shutdown(), ...: the handle itself
        if name.startswith("__") or name == "handle":
            raise AttributeError(name)
        return getattr(self.handle, name)

    def __repr__(self) -> str:
        return f"<TrainerClient {self.handle!r}>"


def as_trainer(trainer: "TrainerAPI | EndpointHandle") -> TrainerAPI:
    """``trainer`` itself when it speaks `TrainerAPI` by declaration (a `TrainerClient`, a fake that subclasses
    the Protocol), else a `TrainerClient` over it (an actor handle)."""
    if TrainerAPI in type(trainer).__mro__:
        return cast(TrainerAPI, trainer)
    return TrainerClient(cast(EndpointHandle, trainer))  # not a TrainerAPI by declaration: a handle


# --- the reference --------------------------------------------------------------------------------


class RoutedService(Protocol):
    """A replicated service (`forgelab.runtime.replicas`): ``route`` picks a healthy replica and retries."""

    async def route(self, endpoint: str, *args: object, **kwargs: object) -> object: ...


class ReferenceAPI(Protocol):
    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``logprobs_B_T`` of each next token under the frozen weights (0 off ``spans_B_2``)."""
        ...


class ReferenceClient(ReferenceAPI):
    """`ReferenceAPI` over the reference (or teacher) service: `forgelab.engines.trainer.ReferenceModel.logprobs`."""

    def __init__(self, service: RoutedService):
        self.service = service

    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        out = await self.service.route("logprobs", tokens_B_L, spans_B_2)
        assert isinstance(out, torch.Tensor), type(out)
        return out
