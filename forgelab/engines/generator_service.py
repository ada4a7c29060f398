"""The generator replicas behind one handle, called through typed methods.

    gens = await Generator.options(num_replicas=2).as_service(GeneratorConfig(...))   # a GeneratorService
    completions_P_G = await gens.generate(GenerateRequest(prompts_P=prompt_ids, n=8))
    versions = await gens.update_weights(WeightUpdate(version=1, weights=hf_state_dict))
    stats = await gens.engine_stats()                      # list[EngineStats], one per healthy replica

`GeneratorService` is a `forgelab.runtime.service.Service` (least-loaded replica, one retry of an idempotent
call on another replica, respawns, sticky sessions) whose methods name the generator's endpoints and type
their requests and answers (`forgelab.generation`). `Generators` is the protocol the controller depends on;
(defined in `forgelab.generation`, re-exported here); the in-process fakes (`forgelab.testing.fakes.FakeGenerators`) and a run's view of a shared generator
(`forgelab.engines.shared_parts.SlotGenerators`) satisfy it too.
"""
from __future__ import annotations

from typing import Mapping

from forgelab.generation import (AdapterUpdate, CompletionGroups, EngineStats, EngineStatus, GenerateRequest,
                                 Generators, ReplicaActor, WeightUpdate)
from forgelab.runtime.component import Component
from forgelab.runtime.service import Endpoint, Service

__all__ = ["ABORT", "ADAPTER_UPDATE", "DROP_SLOT", "ENGINE_STATS", "ENGINE_STATUS", "GENERATE", "GeneratorService",
           "Generators", "RESET_VERSION", "ReplicaActor", "SLOT_STATUS", "VERSION", "WEIGHT_UPDATE"]

GENERATE: Endpoint[GenerateRequest, CompletionGroups] = Endpoint("generate")
WEIGHT_UPDATE: Endpoint[WeightUpdate, int] = Endpoint("update_weights")
ADAPTER_UPDATE: Endpoint[AdapterUpdate, int] = Endpoint("update_adapter_slot")
VERSION: Endpoint[None, int] = Endpoint("version")
RESET_VERSION: Endpoint[int, int] = Endpoint("reset_version")
ENGINE_STATS: Endpoint[None, EngineStats] = Endpoint("stats")
ENGINE_STATUS: Endpoint[None, EngineStatus] = Endpoint("status")
DROP_SLOT: Endpoint[str, bool] = Endpoint("drop_slot")
SLOT_STATUS: Endpoint[None, Mapping[str, object]] = Endpoint("slot_status")
ABORT: Endpoint[str, int] = Endpoint("abort")


class GeneratorService(Service[Component]):
    """`Service` over `Generator` (or `SlotGenerator`) replicas with the generator's endpoints as typed methods.

    Typed over `Component` (the `Component.SERVICE` of both generator classes); the endpoints' requests and
    answers are typed by the `Endpoint` constants above."""

    async def generate(self, request: GenerateRequest) -> CompletionGroups:
        """`request` on the least-loaded healthy replica (retried once elsewhere if that replica dies)."""
        return await self.call(GENERATE, request)

    async def update_weights(self, update: WeightUpdate) -> list[int]:
        """Load `update` on every healthy replica; the served version of each."""
        return await self.call_each(WEIGHT_UPDATE, update)

    async def update_adapter(self, update: AdapterUpdate) -> list[int]:
        """Serve `update` as its slot's adapter on every healthy replica (a `SlotGenerator` engine)."""
        return await self.call_each(ADAPTER_UPDATE, update)

    async def versions(self) -> list[int]:
        """The weights version each healthy replica serves."""
        return await self.call_each(VERSION, None)

    async def reset_version(self, version: int = -1) -> list[int]:
        """Every healthy replica forgets its served version (a warm pool's next run); with LoRA the base is
        served again."""
        return await self.call_each(RESET_VERSION, version)

    async def engine_stats(self) -> list[EngineStats]:
        return await self.call_each(ENGINE_STATS, None)

    async def abort(self, abort_key: str) -> list[int]:
        """Abort the unfinished samples sent with ``abort_key`` on every healthy replica (whichever took them); how
        many each aborted."""
        return await self.call_each(ABORT, abort_key)

    async def engine_status(self) -> list[EngineStatus]:
        """What each healthy replica serves now (version, requests in flight, counters)."""
        return await self.call_each(ENGINE_STATUS, None)

    async def drop_slot(self, slot: str) -> list[bool]:
        """Free `slot`'s adapter on every healthy replica (a `SlotGenerator` engine); whether each held it."""
        return await self.call_each(DROP_SLOT, slot)

    async def slot_status(self) -> list[Mapping[str, object]]:
        """Each healthy replica's LoRA slots (`forgelab.weights.adapter_slots.AdapterSlots.status`)."""
        return await self.call_each(SLOT_STATUS, None)
