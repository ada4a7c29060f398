"""A run's view of shared engines: the trainer and the generator service, seen through its LoRA slot.

    parts = SlotParts(generators=SlotGenerators(service, "b"), trainer=SlotTrainerHandle(trainer, "b"), ...)
    await parts.trainer.call("train_step", batch)      # = trainer.in_slot("b", "train_step", (batch,))
    await parts.generators.generate(request)           # = service.generate(replace(request, lora_slot="b"))
    await parts.shutdown()                             # detaches the run: its slot is freed, processes stay

(Formerly `forgelab.engines.slot_parts`, still importable with a DeprecationWarning for one release.)

A `Run` uses these exactly as its own parts (`forgelab.engines.spawn.Parts`): the controller code does not
know it shares processes. What a run cannot share is refused where it is attached
(`forgelab.experiments.variants.SharedEngines`).
"""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable, Mapping, Protocol, Sequence, cast

from forgelab.engines.generator_service import GeneratorService, ReplicaActor
from forgelab.engines.spawn import Parts, TrainerPart
from forgelab.generation import CompletionGroups, EngineStats, GenerateRequest
from forgelab.runtime.replicas import ReplicaStatus, ServiceEvent

__all__ = ["SlotTrainerHandle", "SlotGenerators", "SlotParts"]


class SlotTrainerHandle:
    """The shared trainer actor as one run sees it: every ``call`` runs in the run's slot (`Trainer.in_slot`)."""

    def __init__(self, handle: TrainerPart, slot: str):
        self.handle, self.slot = handle, slot

    async def call(self, name: str, /, *args: object, **kwargs: object) -> list[object]:
        return await self.handle.call("in_slot", self.slot, name, args, kwargs)

    async def pids(self) -> list[int]:
        return await self.handle.pids()

    async def shutdown(self) -> None:
        await self.handle.shutdown()

    def __getattr__(self, name: str) -> object:  # alive, failed, ...: the process itself
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.handle, name)

    def __repr__(self) -> str:
        return f"<slot {self.slot} of {self.handle!r}>"


class SlotGenerators:
    """The shared generator service as one run sees it: its generate calls carry its slot; its pushes reach
    only its slot; the served version per replica is the run's own (`set_replica_info`). Satisfies
    `forgelab.engines.generator_service.Generators`."""

    def __init__(self, service: GeneratorService, slot: str):
        self.service, self.slot = service, slot
        self.versions: dict[int, int] = {}
        self.on_respawn: Callable[[ReplicaActor], Awaitable[None]] | None = None
        """The run's hook for a respawned replica (its WeightSync.catch_up); the engines call it."""
        self.listeners: list[Callable[[ServiceEvent], None]] = []

    async def generate(self, request: GenerateRequest) -> CompletionGroups:
        """`request` served with this run's slot (its adapter; completions carry the slot's version)."""
        return await self.service.generate(dataclasses.replace(request, lora_slot=self.slot))

    async def engine_stats(self) -> list[EngineStats]:
        """The shared engines' counters (every run's requests together)."""
        return await self.service.engine_stats()

    async def abort(self, abort_key: str) -> list[int]:
        """Abort this run's samples sent with ``abort_key`` (keys are the caller's: the door makes them unique)."""
        return await self.service.abort(abort_key)

    async def route(self, endpoint: str, *args: object, **kwargs: object) -> object:
        """The string form (deprecated: `generate`): a ``generate`` is served in this run's slot."""
        if endpoint == "generate":
            return await self.service.route("generate_slot", self.slot, *args, **kwargs)
        return await self.service.route(endpoint, *args, **kwargs)

    def handles(self) -> Sequence[ReplicaActor | None]:
        return self.service.handles()

    def set_replica_info(self, index: int, **fields: object) -> None:
        if "version" in fields:
            self.versions[index] = int(cast(int, fields["version"]))

    def status(self) -> list[ReplicaStatus]:
        """The shared replicas' status, each with this run's served version and its slot in ``info``."""
        return [dataclasses.replace(st, info={**st.info, "version": self.versions.get(st.index, 0), "slot": self.slot})
                for st in self.service.status()]

    def add_listener(self, fn: Callable[[ServiceEvent], None]) -> None:
        self.listeners.append(fn)
        self.service.add_listener(fn)

    def remove_listener(self, fn: Callable[[ServiceEvent], None]) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)
        self.service.remove_listener(fn)

    def detach(self) -> None:
        """Stop hearing the service's events (the run detached)."""
        for fn in list(self.listeners):
            self.remove_listener(fn)
        self.on_respawn = None

    async def shutdown(self) -> None:
        await self.service.shutdown()

    def __getattr__(self, name: str) -> object:  # fanout(), ...: the shared service
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.service, name)

    def __repr__(self) -> str:
        return f"<slot {self.slot} of {self.service!r}>"


class SlotLender(Protocol):
    """The shared engines that lent a run its slot (`forgelab.experiments.variants.SharedEngines`)."""

    async def detach(self, target: SlotParts) -> None: ...

    def provenance(self, slot: str) -> Mapping[str, object]: ...


@dataclasses.dataclass
class SlotParts(Parts[SlotGenerators, SlotTrainerHandle]):
    """`Parts` lent by shared engines to one run: `shutdown()` detaches it (its slot is freed)."""

    pool: SlotLender | None = None
    """The `forgelab.experiments.variants.SharedEngines` (a fork of the run attaches to them: `forgelab.experiments.fork`)."""
    slot: str = ""

    async def shutdown(self) -> None:
        if self.pool is not None:
            await self.pool.detach(self)
