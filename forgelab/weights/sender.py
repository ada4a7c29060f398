"""Weight sync, trainer side: gather once, send to every generator mesh through a transport.

    sender = WeightSender(shm_dir=None)
    report = await sender.push(state_dict_fn, is_rank0, version, generator_meshes, "auto")   # a plain dict

Transports (`TRANSPORTS`, a dict: adding one is adding an entry):

- ``"auto"``: rank 0 writes the state dict once into a shared-memory safetensors
  file (`forgelab.weights.shm`; overwritten in place on later pushes once no
  generator can still be reading it) and each generator gets only a handle
  (`update_weights_shared`); a generator that cannot see the file (another host,
  no /dev/shm) answers why and gets the tensors as a message instead.
- ``"message"``: every generator gets the tensors in a Monarch message
  (`update_weights`), which pickles the whole state dict once per generator.

The answer (`push`) is the dict `forgelab.weights.sync.PushReport.from_trainer` reads:
``{"version", "gather_ms", "write_ms", "send_ms", "bytes", "sent", "failed": {index: error},
"transport": "shm" | "message" | "mixed" | "none", "transports": [per generator], "fallback": {index: why}}``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import torch

from forgelab.runtime import liveness
from forgelab.weights.shm import SharedWeights, SharedWeightsWriter, default_shm_root

__all__ = ["TRANSPORTS", "WeightSender", "send_message", "send_shared"]


async def send_message(mesh: Any, version: int, sd: dict, handle: SharedWeights | None,
                       why_not: str | None) -> tuple[str, str | None]:
    """The tensors in a message: ``("message", why not shm)``."""
    await mesh.update_weights.call(version, sd)
    return "message", why_not


async def send_shared(mesh: Any, version: int, sd: dict, handle: SharedWeights | None,
                      why_not: str | None) -> tuple[str, str | None]:
    """A shared-memory handle if there is one and the mesh can map its file, else a message."""
    if handle is not None:
        if not hasattr(mesh, "update_weights_shared"):
            why_not = "the generator has no update_weights_shared endpoint"
        else:
            answers = [v for _, v in (await mesh.update_weights_shared.call(handle)).items()]
            reasons = [a for a in answers if isinstance(a, str)]
            if not reasons:
                return "shm", None
            if len(reasons) < len(answers):
                raise RuntimeError(f"only some ranks of the generator mesh could map the weights file: {reasons[0]}")
            why_not = reasons[0]
    return await send_message(mesh, version, sd, None, why_not)


Send = Callable[[Any, int, dict, "SharedWeights | None", "str | None"], Awaitable[tuple[str, "str | None"]]]
TRANSPORTS: dict[str, tuple[bool, Send]] = {"auto": (True, send_shared), "message": (False, send_message)}
"""name -> (writes the shared-memory file first, how one generator mesh is sent to)."""


class WeightSender:
    """Rank 0's side of a push: the shared-memory file (made on first use) and the sends."""

    def __init__(self, shm_dir: str | None = None):
        self.shm_dir = shm_dir
        self._writer: SharedWeightsWriter | None = None
        self._reusable = False  # True when no generator can still be reading the file

    async def push(self, state_dict: Callable[[], dict[str, torch.Tensor]], rank0: bool, version: int,
                   generators: list[Any], transport: str) -> dict[str, Any]:
        """Gather (every rank: collectives), then on rank 0 send `version` to each mesh in `generators`."""
        if transport not in TRANSPORTS:
            raise ValueError(f"push_weights: transport={transport!r} must be one of {tuple(TRANSPORTS)}")
        t0 = time.perf_counter()
        sd = state_dict()
        liveness.bump("weight_pushes_gathered")  # progress the watchdog sees for a push (forgelab.runtime.watchdog)
        out: dict[str, Any] = {"version": int(version), "gather_ms": (time.perf_counter() - t0) * 1e3, "write_ms": 0.0,
                               "send_ms": 0.0, "bytes": sum(v.numel() * v.element_size() for v in sd.values()),
                               "sent": 0, "failed": {}, "transport": "none", "transports": [], "fallback": {}}
        if not (rank0 and generators):
            return out
        meshes = [getattr(g, "actor", g) for g in generators]
        writes_shm, send = TRANSPORTS[transport]
        handle, why_not = None, None
        if writes_shm:
            t1 = time.perf_counter()
            handle, why_not = self._write_shared(int(version), sd)
            out["write_ms"] = (time.perf_counter() - t1) * 1e3
        t1 = time.perf_counter()
        async def sent(m: Any) -> tuple[str, str | None]:
            try:
                return await send(m, int(version), sd, handle, why_not)
            finally:
                liveness.bump("weight_sends_done")

        results = await asyncio.gather(*(sent(m) for m in meshes), return_exceptions=True)
        out["send_ms"] = (time.perf_counter() - t1) * 1e3
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                text = str(r)  # a remote error's own message comes last, after its traceback
                out["failed"][i] = f"{type(r).__name__}: {text if len(text) <= 800 else '...' + text[-800:]}"
                out["transports"].append(None)
            else:
                out["sent"] += 1
                out["transports"].append(r[0])
                if r[1] is not None and writes_shm:
                    out["fallback"][i] = r[1]
        used = {t for t in out["transports"] if t is not None}
        out["transport"] = used.pop() if len(used) == 1 else ("mixed" if used else "none")
        if handle is not None:
            # Overwrite the file in place next time only if every generator answered (none still reads it).
            self._reusable = not out["failed"]
        return out

    def close(self) -> None:
        """Remove the shared-memory file now (a fast process exit skips the writer's finalizer)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write_shared(self, version: int, sd: dict[str, torch.Tensor]) -> tuple[SharedWeights | None, str | None]:
        """Write ``sd`` to the shared-memory file: ``(handle, None)``, or ``(None, why not)``."""
        root = self.shm_dir or default_shm_root()
        if root is None:
            return None, "the trainer's host has no writable /dev/shm"
        reuse, self._reusable = self._reusable, False  # not while this handle is out (or half written)
        try:
            if self._writer is None:
                self._writer = SharedWeightsWriter(root)
            return self._writer.write(version, sd, reuse=reuse), None
        except Exception as e:  # e.g. a full tmpfs: this push goes by message
            return None, f"could not write the shared-memory weights file in {root}: {type(e).__name__}: {e}"
