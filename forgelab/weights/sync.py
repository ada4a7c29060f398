"""Weight sync, controller side: trainer -> every healthy generator replica, with a typed report.

    report = await WeightSync(trainer, generators, emit).push(version)   # PushReport
    generators.on_respawn = sync.catch_up                                 # a respawned replica gets the weights
    report = await sync.deliver_adapter(slot_step)     # a LoRA slot's adapter the trainer exported (SlotStep)

The trainer's `push_weights(version, meshes)` endpoint gathers the HF state dict
and sends it through a transport from `forgelab.weights.sender` (shared
memory on the same host, messages otherwise); the generator's
`update_weights` / `update_weights_shared` endpoints load it. This module is the
controller's view of that: which replicas got which version, what failed, how
long each part took.

A run in a slot of shared engines (`forgelab.experiments.variants.SharedEngines`) steps and exports its
adapter in one trainer call (`forgelab.engines.trainer_slots`, a `SlotStep`); `deliver_adapter` then sends
that adapter to each generator replica's ``update_adapter_slot`` from here, so the trainer goes on with the
other slots' steps while the generators load it (between their own engine steps).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from forgelab.types import SlotStep, WeightPush

if TYPE_CHECKING:
    from forgelab.runtime.watchdog import Watchdog

PUSH_PROGRESS = ("weight_pushes_gathered", "weight_sends_done", "weight_bytes_received", "weight_drain_steps")
"""The progress counters of a weight push (`forgelab.runtime.liveness`): gathered on the trainer, sent, received
and drained on a generator."""

__all__ = ["PushReport", "WeightSync", "PushesWeights"]


class PushesWeights(Protocol):
    """The part of the trainer a weight sync uses (`forgelab.engines.trainer_client.TrainerAPI` has it)."""

    async def push_weights(self, version: int, generators: Sequence[object],
                           transport: str | None = None) -> WeightPush: ...


@dataclass(frozen=True)
class PushReport:
    """What one weight push did. Times in milliseconds; `failed` maps a replica index to its error."""

    version: int
    gather_ms: float = 0.0
    write_ms: float = 0.0
    send_ms: float = 0.0
    bytes: int = 0
    sent: int = 0
    transport: str = "none"
    """"shm", "message", "mixed" or "none"."""
    failed: dict[int, str] = field(default_factory=dict)
    replicas: tuple[int, ...] = ()
    """The generator replica indices the push was sent to."""

    @property
    def sync_ms(self) -> float:
        """Controller-visible cost of the push (gather + shared-memory write + send)."""
        return self.gather_ms + self.write_ms + self.send_ms

    @classmethod
    def from_trainer(cls, raw: "WeightPush | Mapping[str, Any] | None", version: int,
                     replicas: tuple[int, ...] = ()) -> "PushReport":
        """From the trainer's `push_weights` answer (a `WeightPush`; failed keys are positions in the list it
        was sent)."""
        push = WeightPush(version=version) if raw is None else WeightPush.of(raw, version)
        failed = {replicas[int(k)] if int(k) < len(replicas) else int(k): str(v) for k, v in push.failed.items()}
        return cls(version=int(push.version), gather_ms=float(push.gather_ms), write_ms=float(push.write_ms),
                   send_ms=float(push.send_ms), bytes=int(push.bytes), sent=int(push.sent),
                   transport=str(push.transport), failed=failed, replicas=tuple(replicas))


class WeightSync:
    """Pushes the trainer's weights to the generator replicas and keeps their served version.

    Args:
        trainer: the trainer (`forgelab.engines.trainer_client.TrainerAPI`: ``push_weights(version, meshes)``).
        generators: the generator service (`handles()`, `set_replica_info(i, version=...)`).
        emit: ``emit(kind, **fields)`` records an event in the run's log.
        current_version: returns the run's policy version now (a respawn catches up to it).
    """

    def __init__(self, trainer: PushesWeights | None, generators: Any, emit: Callable[..., None],
                 current_version: Callable[[], int], watchdog: Watchdog | None = None):
        self.trainer, self.generators, self.emit, self.current_version = trainer, generators, emit, current_version
        self.watchdog = watchdog
        """Declares a push stuck when no weight byte moves for `WatchdogConfig.no_progress_s` or a process stops
        answering (`forgelab.runtime.watchdog`); None: unwatched."""

    async def _push(self, version: int, meshes: list[Any], replicas: Sequence[int]) -> Any:
        """The trainer's `push_weights`, watched: its processes and the receiving generators' must keep moving
        weight counters (`PUSH_PROGRESS`) or answering."""
        assert self.trainer is not None
        call = self.trainer.push_weights(version, [getattr(h, "actor", h) for h in meshes])  # the actor meshes travel
        if self.watchdog is None:
            return await call
        trainer_pids = list(getattr(getattr(self.trainer, "handle", None), "pids_list", None) or [])
        gen_pids = [pid for h in meshes for pid in (getattr(h, "pids_list", None) or [])]
        return await self.watchdog.watch(call, pids=trainer_pids + gen_pids, progress=PUSH_PROGRESS,
                                         part=f"weight push to generator replicas {list(replicas)}", what=f"weight push v{version}")

    async def push(self, version: int) -> PushReport:
        """Send `version` to every healthy replica; a replica that fails is respawned and caught up later."""
        if self.trainer is None:
            raise RuntimeError("WeightSync.push: no trainer (the run's parts were shut down)")
        live = [(i, h) for i, h in enumerate(self.generators.handles()) if h is not None]
        raw = await self._push(version, [h for _, h in live], [i for i, _ in live])
        report = PushReport.from_trainer(raw, version, tuple(i for i, _ in live))
        for i, _ in live:
            if i in report.failed:
                self.emit("weight_push_failed", replica=i, version=version, error=report.failed[i][:300])
            else:
                self.generators.set_replica_info(i, version=version)
        return report

    @property
    def adapter_slot(self) -> str | None:
        """The LoRA slot the generators serve this run in (a `forgelab.engines.shared_parts.SlotGenerators`), or
        None: the run has its own generators and pushes through the trainer (`push`)."""
        slot = getattr(self.generators, "slot", None)
        return slot if isinstance(slot, str) and slot else None

    async def deliver_adapter(self, step: SlotStep) -> PushReport:
        """Send the adapter ``step`` exported to every healthy replica as this run's slot's ``step.version``
        (``update_adapter_slot``; the replica loads it between two engine steps); a replica that fails is
        respawned and caught up later, as with `push`."""
        from forgelab.generation import AdapterUpdate

        slot = self.adapter_slot
        if slot is None or step.adapter is None:
            raise RuntimeError(f"WeightSync.deliver_adapter: {'no slot' if slot is None else 'no adapter'} "
                               f"(version {step.version}); a run on its own generators pushes through push()")
        version = int(step.version)
        update = AdapterUpdate(slot=slot, version=version, tensors=step.adapter)
        live = [(i, h) for i, h in enumerate(self.generators.handles()) if h is not None]
        t0 = time.perf_counter()
        sends = asyncio.gather(*(getattr(h, "actor", h).update_adapter_slot.call(update) for _, h in live),
                               return_exceptions=True)
        if self.watchdog is None:
            results = await sends
        else:
            pids = [pid for _, h in live for pid in (getattr(h, "pids_list", None) or [])]
            results = await self.watchdog.watch(sends, pids=pids, progress=PUSH_PROGRESS,
                                                part=f"adapter of slot {slot} to generator replicas "
                                                     f"{[i for i, _ in live]}", what=f"adapter push v{version}")
        send_ms = (time.perf_counter() - t0) * 1e3
        failed = {i: f"{type(r).__name__}: {str(r)[-800:]}" for (i, _), r in zip(live, results)
                  if isinstance(r, BaseException)}
        for i, _ in live:
            if i in failed:
                self.emit("weight_push_failed", replica=i, version=version, error=failed[i][:300])
            else:
                self.generators.set_replica_info(i, version=version)
        sent = len(live) - len(failed)
        return PushReport(version=version, gather_ms=step.export_ms, send_ms=send_ms,
                          bytes=sum(v.numel() * v.element_size() for v in step.adapter.values()), sent=sent,
                          transport="message" if sent else "none", failed=failed,
                          replicas=tuple(i for i, _ in live))

    async def catch_up(self, handle: Any) -> None:
        """`on_respawn` hook: a fresh replica starts from the checkpoint on disk; give it the current weights
        before it serves. A step may land while we push (steps push only to healthy replicas): push again."""
        pushed = 0
        while self.trainer is not None and self.current_version() > pushed:
            version = self.current_version()
            report = PushReport.from_trainer(await self._push(version, [handle], [getattr(handle, "replica_index", -1)]),
                                             version)
            if report.failed:
                # raising fails this respawn attempt: the service tears the replica down and tries again
                raise RuntimeError(f"weights v{version} could not be pushed to the respawned generator: "
                                   f"{next(iter(report.failed.values()))}")
            pushed = version
        index = getattr(handle, "replica_index", None)
        if index is not None:
            self.generators.set_replica_info(index, version=pushed)
