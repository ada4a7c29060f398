"""Small components for the runtime tests (child processes import this module)."""
from __future__ import annotations

import asyncio
import os

import torch
from monarch.actor import endpoint

from forgelab.runtime import Component


class Echo(Component):
    """Records its pid; `pid` and `ping` are safe to retry, `slow` is not."""

    IDEMPOTENT = frozenset({"pid", "ping", "hold", "hold_until"})

    def __init__(self, tag: str = "echo"):
        self.tag = tag
        self.calls = 0

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def ping(self) -> int:
        return 1

    @endpoint
    async def hold(self, seconds: float) -> int:
        """Answer after `seconds`: keeps a call in flight (idempotent)."""
        await asyncio.sleep(seconds)
        return os.getpid()

    @endpoint
    async def hold_until(self, path: str, timeout_s: float = 300.0) -> int:
        """Answer once `path` exists: a call stays in flight until the test says so (idempotent)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not os.path.exists(path):
            if loop.time() > deadline:
                raise TimeoutError(f"hold_until: {path} did not appear within {timeout_s} s")
            await asyncio.sleep(0.01)
        return os.getpid()

    @endpoint
    async def slow(self, seconds: float) -> int:
        """Like `hold` but not idempotent (counts calls)."""
        self.calls += 1
        await asyncio.sleep(seconds)
        return os.getpid()

    @endpoint
    async def boom(self, message: str) -> None:
        raise ValueError(f"boom: {message}")

    @endpoint
    async def status(self) -> dict:
        return {"tag": self.tag, "calls": self.calls}


class StateSink(Component):
    """Receives a state dict from another actor and reports its size."""

    @endpoint
    async def receive(self, state: dict) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())


class StateSource(Component):
    """Holds a state dict and pushes it to a sink actor (actor to actor)."""

    def __init__(self, mib: int = 10):
        n = mib * 1024 * 1024 // 4
        self.state = {"w0": torch.randn(n // 2), "w1": torch.randn(n - n // 2)}

    @endpoint
    async def push(self, sink) -> int:
        return await sink.receive.call_one(self.state)


class ExitMarks(Component):
    """Writes ``<dir>/released`` from `release_for_exit` and ``<dir>/finalised`` from an exit handler registered
    at setup: a fast exit leaves the first and never runs the second."""

    def __init__(self, marks_dir: str):
        self.marks_dir = marks_dir

    @endpoint
    async def setup(self) -> None:
        import atexit

        atexit.register(lambda: open(os.path.join(self.marks_dir, "finalised"), "w").close())

    def release_for_exit(self) -> None:
        open(os.path.join(self.marks_dir, "released"), "w").close()
