"""LoRA slots on the generator: each run attached to shared engines serves its own adapter and version.

    slots = AdapterSlots(engine)                        # engine: a VLLMEngine with LoRA (vLLM enable_lora)
    await slots.receive("b", version=3, tensors)        # only slot b's adapter changes; nothing pauses
    version, request = slots.hold("b"); ...; slots.release(request)   # around one generate call
    slots.drop("b")                                     # the run detached

What it really is: a map slot -> ``(version, LoRARequest)``. A push writes the adapter (PEFT directory) and
loads it under a new name and id (vLLM keys its prefix cache on both, so no block cached under an older
adapter is reused), then points the slot at it. Unlike a full-weight push (`forgelab.weights.receiver`),
intake does not stop and no request waits: requests already running keep the adapter they started with,
which is unloaded (and its directory deleted) when the last of them returns. A slot that never received an
adapter is served by the base at version 0 (a fresh adapter's B is zero: the same policy).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections import Counter
from typing import Any

from forgelab.weights.adapter import check_adapter, peft_config, write_adapter

__all__ = ["AdapterSlots"]


class AdapterSlots:
    """The adapters a LoRA generator serves per slot. Args: engine: the `VLLMEngine` (``lora`` set)."""

    def __init__(self, engine: Any):
        if getattr(engine, "lora", None) is None:
            raise ValueError("LoRA slots need a generator with LoRA (lora.enabled; vLLM enable_lora)")
        self.engine = engine
        self.serving: dict[str, tuple[int, Any]] = {}
        self.users: Counter = Counter()  # lora_int_id -> generate calls using it now
        self.retired: dict[int, Any] = {}  # replaced or dropped adapters still used by running calls
        self.root = tempfile.mkdtemp(prefix="forgelab-lora-slots-")
        self.ids = itertools.count(1 << 20)  # apart from the ids `forgelab.weights.receiver` gives
        self.pushes = 0
        self.push_ms = 0.0

    def hold(self, slot: str) -> tuple[int, Any]:
        """``(version, LoRARequest or None)`` a generate call for ``slot`` uses; call `release` after it."""
        version, request = self.serving.get(slot, (0, None))
        if request is not None:
            self.users[request.lora_int_id] += 1
        return version, request

    def release(self, request: Any) -> None:
        if request is None:
            return
        lid = request.lora_int_id
        self.users[lid] -= 1
        if self.users[lid] <= 0:
            del self.users[lid]
            if lid in self.retired:
                self._unload(self.retired.pop(lid))

    def _unload(self, request: Any) -> None:
        try:
            self.engine.engine.remove_lora(request.lora_int_id)
        finally:
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _retire(self, request: Any) -> None:
        if request is None:
            return
        if self.users.get(request.lora_int_id, 0) > 0:
            self.retired[request.lora_int_id] = request
        else:
            self._unload(request)

    async def receive(self, slot: str, version: int, tensors: Any) -> int:
        """Serve ``tensors`` (an adapter, PEFT names) as ``slot``'s ``version`` (greater than its current one)."""
        from vllm.lora.request import LoRARequest

        eng, lo = self.engine, self.engine.lora
        current = self.serving.get(slot)
        if not isinstance(version, int) or (current is not None and version <= current[0]):
            raise ValueError(f"update_adapter_slot({slot!r}): version must be an int greater than the slot's "
                             f"{current[0] if current else 'none yet'}, got {version!r}; the slot keeps its adapter")
        problems = check_adapter(tensors, eng.adapter_shapes)
        if problems:
            raise ValueError(f"update_adapter_slot({slot!r}, version={version}) refused: " + "; ".join(problems[:6])
                             + ". Nothing was loaded: the slot keeps its adapter.")
        t0 = time.perf_counter()
        lid = next(self.ids)
        path = write_adapter(os.path.join(self.root, f"{lid}-v{version}"), dict(tensors),
                             peft_config(rank=lo.rank, alpha=lo.alpha, targets=lo.targets, dropout=lo.dropout,
                                         base_model=eng.config.model_dir))
        request = LoRARequest(f"forgelab-{slot}-{lid}-v{version}", lid, path)
        eng.engine.add_lora(request)  # loaded now, not by the first request
        self.serving[slot] = (version, request)
        if current is not None:
            self._retire(current[1])
        self.pushes += 1
        self.push_ms += (time.perf_counter() - t0) * 1e3
        return version

    def drop(self, slot: str) -> bool:
        """Forget ``slot`` (its run detached); its adapter is unloaded once no running call uses it."""
        current = self.serving.pop(slot, None)
        if current is not None:
            self._retire(current[1])
        return current is not None

    def status(self) -> dict[str, Any]:
        return {"slots": {s: v for s, (v, _) in sorted(self.serving.items())}, "retired": len(self.retired),
                "pushes": self.pushes, "push_ms": self.push_ms}
