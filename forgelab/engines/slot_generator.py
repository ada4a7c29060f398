"""The generator of shared engines: one vLLM engine serving several LoRA runs, each with its adapter and version.

    gen = await SlotGenerator.options(procs=1).as_actor(GeneratorConfig(..., lora=..., max_loras=8))
    await gen.update_adapter_slot.call_one("b", 3, adapter_tensors)     # only slot b changes; nothing pauses
    groups_P_G = await gen.generate_slot.call_one("b", prompts, n=8)     # served with b's adapter, version 3

What it really is: a `Generator` whose engine reads the adapter and version of each `generate` call from the
calling task (a context variable pinned by `generate_slot`), so concurrent calls of different runs share one
continuous batch (vLLM multi-LoRA: ``max_loras`` distinct adapters per batch) while each completion carries
its own run's version. Slots and pushes: `forgelab.weights.adapter_slots.AdapterSlots`.
"""
from __future__ import annotations

import contextvars
import os
from typing import Any, Sequence

from monarch.actor import Port, endpoint

from forgelab.engines.generator import Generator, VLLMEngine
from forgelab.runtime.component import answer_in_task
from forgelab.weights.adapter_slots import AdapterSlots

__all__ = ["SlotGenerator", "SlotVLLMEngine"]

_PINNED: contextvars.ContextVar[tuple[int, Any] | None] = contextvars.ContextVar("forgelab_lora_slot", default=None)


class SlotVLLMEngine(VLLMEngine):
    """A `VLLMEngine` whose ``version`` and ``lora_request``, read inside `generate_in_slot`, are the slot's."""

    def __init__(self, config: Any):
        self.own = {"version": 0, "lora_request": None}  # the engine-wide values (outside any slot call)
        super().__init__(config)
        self.slots = AdapterSlots(self)

    version = property(lambda self: self.own["version"] if _PINNED.get() is None else _PINNED.get()[0],
                       lambda self, v: self.own.__setitem__("version", v))
    lora_request = property(lambda self: self.own["lora_request"] if _PINNED.get() is None else _PINNED.get()[1],
                            lambda self, v: self.own.__setitem__("lora_request", v))

    async def generate_in_slot(self, slot: str, prompts: Sequence[Any], n: int = 1, sampling: Any = None,
                               seeds: Sequence[Sequence[int]] | None = None) -> Any:
        """`generate` with ``slot``'s adapter and version (pinned for this call: a push meanwhile does not move it)."""
        pinned = self.slots.hold(slot)
        token = _PINNED.set(pinned)
        try:
            return await self.generate(prompts, n, sampling, seeds)
        finally:
            _PINNED.reset(token)
            self.slots.release(pinned[1])


class SlotGenerator(Generator):
    """`Generator` with LoRA slots. Endpoints besides Generator's: generate_slot, update_adapter_slot, drop_slot,
    slot_status."""

    IDEMPOTENT = frozenset({"generate", "generate_slot"})

    @endpoint
    async def setup(self) -> None:
        import torch

        torch.set_num_threads(int(os.environ.get("FORGELAB_THREADS", "1")))
        self.engine = SlotVLLMEngine(self.config)

    @endpoint(explicit_response_port=True)
    async def generate_slot(self, port: Port, slot: str, prompts: Sequence[Any], n: int = 1, sampling: Any = None,
                            seeds: Sequence[Sequence[int]] | None = None) -> None:
        """`generate` served with ``slot``'s adapter; completions carry the slot's version."""
        answer_in_task(port, lambda: self._engine().generate_in_slot(slot, prompts, n, sampling, seeds), "SlotGenerator.generate_slot")

    @endpoint(explicit_response_port=True)
    async def update_adapter_slot(self, port: Port, slot: str, version: int, tensors: dict) -> None:
        """Serve the adapter ``tensors`` (PEFT names) as ``slot``'s ``version``; answers the version."""
        answer_in_task(port, lambda: self._engine().slots.receive(slot, version, tensors), "SlotGenerator.update_adapter_slot")

    @endpoint
    async def drop_slot(self, slot: str) -> bool:
        return self._engine().slots.drop(slot)

    @endpoint
    async def slot_status(self) -> dict[str, Any]:
        return self._engine().slots.status()
