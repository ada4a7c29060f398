"""The generator of shared engines: one vLLM engine serving several LoRA runs, each with its adapter and version.

    gen = await SlotGenerator.options(procs=1).as_actor(GeneratorConfig(..., lora=..., max_loras=8))
    await gen.update_adapter_slot.call_one(AdapterUpdate(slot="b", version=3, tensors=adapter_tensors))
    groups_P_G = await gen.generate.call_one(GenerateRequest(prompts_P=prompts, n=8, lora_slot="b"))  # b's version 3

(Formerly `forgelab.engines.slot_generator`, still importable with a DeprecationWarning for one release.)

What it really is: a `Generator` whose engine reads the adapter and version of each `generate` call from the
calling task (a context variable pinned by `SlotVLLMEngine.generate_in_slot`), so concurrent calls of different runs share one
continuous batch (vLLM multi-LoRA: ``max_loras`` distinct adapters per batch) while each completion carries
its own run's version. Slots and pushes: `forgelab.weights.adapter_slots.AdapterSlots`.
"""
from __future__ import annotations

import contextvars
import dataclasses
import os
from typing import TYPE_CHECKING, Mapping, Sequence

from monarch.actor import Port, endpoint

from forgelab.config.components import GeneratorConfig
from forgelab.engines.generator import Generator, VLLMEngine
from forgelab.generation import AdapterUpdate, CompletionGroups, GenerateRequest, Prompt, SamplingSettings
from forgelab.runtime.component import answer_in_task
from forgelab.weights.adapter_slots import AdapterSlots

if TYPE_CHECKING:
    import torch
    from vllm.lora.request import LoRARequest

__all__ = ["SlotGenerator", "SlotVLLMEngine"]

_PINNED: contextvars.ContextVar[tuple[int, LoRARequest | None] | None] = contextvars.ContextVar("forgelab_lora_slot", default=None)


class SlotVLLMEngine(VLLMEngine):
    """A `VLLMEngine` whose ``version`` and ``lora_request``, read inside `generate_in_slot`, are the slot's."""

    def __init__(self, config: GeneratorConfig):
        # the engine-wide values (outside any slot call)
        self.own_version = 0
        self.own_lora_request: LoRARequest | None = None
        super().__init__(config)
        self.slots = AdapterSlots(self)

    @property  # VLLMEngine's plain attribute, read per calling task here
    def version(self) -> int:
        pinned = _PINNED.get()
        return self.own_version if pinned is None else pinned[0]

    @version.setter
    def version(self, v: int) -> None:
        self.own_version = v

    @property  # VLLMEngine's plain attribute, read per calling task here
    def lora_request(self) -> LoRARequest | None:
        pinned = _PINNED.get()
        return self.own_lora_request if pinned is None else pinned[1]

    @lora_request.setter
    def lora_request(self, v: LoRARequest | None) -> None:
        self.own_lora_request = v

    async def generate_in_slot(self, slot: str, prompts: Sequence[Prompt], n: int = 1,
                               sampling: SamplingSettings | None = None,
                               seeds: Sequence[Sequence[int]] | None = None,
                               abort_key: str | None = None) -> CompletionGroups:
        """`generate` with ``slot``'s adapter and version (pinned for this call: a push meanwhile does not move it)."""
        pinned = self.slots.hold(slot)
        token = _PINNED.set(pinned)
        try:
            return await self.generate(prompts, n, sampling, seeds, abort_key)
        finally:
            _PINNED.reset(token)
            self.slots.release(pinned[1])


class SlotGenerator(Generator):
    """`Generator` with LoRA slots: a `GenerateRequest` with ``lora_slot`` is served with that slot's adapter.
    Endpoints besides Generator's: update_adapter_slot, drop_slot, slot_status (and generate_slot, the positional
    form of a slot's generate, deprecated)."""

    IDEMPOTENT = frozenset({"generate", "generate_slot"})

    @endpoint
    async def setup(self) -> None:
        import torch

        torch.set_num_threads(int(os.environ.get("FORGELAB_THREADS", "1")))
        self.engine = SlotVLLMEngine(self.config)

    def _slot_engine(self) -> SlotVLLMEngine:
        engine = self._engine()
        assert isinstance(engine, SlotVLLMEngine)
        return engine

    async def _serve(self, req: GenerateRequest) -> CompletionGroups:
        if req.lora_slot is None:
            return await self._engine().generate(req.prompts_P, req.n, req.sampling, req.seeds_P_G, req.abort_key)
        return await self._slot_engine().generate_in_slot(req.lora_slot, req.prompts_P, req.n, req.sampling,
                                                          req.seeds_P_G, req.abort_key)

    @endpoint(explicit_response_port=True)
    async def generate_slot(self, port: Port[CompletionGroups], slot: str, request: GenerateRequest | Sequence[Prompt], n: int = 1,
                            sampling: SamplingSettings | None = None,
                            seeds: Sequence[Sequence[int]] | None = None) -> None:
        """`generate` served with ``slot``'s adapter; completions carry the slot's version. Deprecated: send
        ``GenerateRequest(lora_slot=slot)`` to `generate`."""
        req = dataclasses.replace(GenerateRequest.coerce(request, n, sampling, seeds), lora_slot=slot)
        answer_in_task(port, lambda: self._serve(req), "SlotGenerator.generate_slot")

    @endpoint(explicit_response_port=True)
    async def update_adapter_slot(self, port: Port[int], update: AdapterUpdate | str, version: int | None = None,
                                  tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Serve ``update.tensors`` (PEFT names) as ``update.slot``'s ``update.version``; answers the version.
        ``update_adapter_slot(slot, version, tensors)``: the positional form, still accepted (the trainer's push)."""
        if not isinstance(update, AdapterUpdate):
            if version is None or tensors is None:
                raise TypeError("update_adapter_slot: pass an AdapterUpdate (or slot, version, tensors)")
            update = AdapterUpdate(slot=update, version=version, tensors=tensors)
        up = update
        answer_in_task(port, lambda: self._slot_engine().slots.receive(up.slot, up.version, dict(up.tensors)),
                       "SlotGenerator.update_adapter_slot")

    @endpoint
    async def drop_slot(self, slot: str) -> bool:
        """Free ``slot``'s adapter; whether this engine held it."""
        return self._slot_engine().slots.drop(slot)

    @endpoint
    async def slot_status(self) -> dict[str, object]:
        return self._slot_engine().slots.status()
