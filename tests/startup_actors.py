"""Small components for tests/test_startup_cpus.py (child processes import this module)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from monarch.actor import endpoint

from forgelab.runtime import Component


def thread_affinities() -> dict[int, list[int]]:
    """{thread id: its allowed cores} for every thread of this process, read from the kernel."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended in between
            pass
    return out


class AffinityProbe(Component):
    """Records every thread's CPU affinity during `setup`, then writes `ready_file` (its pid)."""

    def __init__(self, ready_file: str):
        self.ready_file = ready_file
        self.during: dict[int, list[int]] = {}

    @endpoint
    async def setup(self) -> None:
        self.during = thread_affinities()
        Path(self.ready_file).write_text(str(os.getpid()))

    @endpoint
    async def during_setup(self) -> dict[int, list[int]]:
        return self.during

    @endpoint
    async def now(self) -> dict[int, list[int]]:
        return thread_affinities()


class Gate(AffinityProbe):
    """The critical part of a test start: its `setup` records its affinity, then waits until every file of
    `wait_for` exists (the other parts have run their setup), then fails if `fail`."""

    def __init__(self, ready_file: str, wait_for: list[str], fail: bool = False):
        super().__init__(ready_file)
        self.wait_for, self.fail = wait_for, fail

    @endpoint
    async def setup(self) -> None:
        self.during = thread_affinities()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while not all(os.path.exists(p) for p in self.wait_for):
            if loop.time() > deadline:
                raise TimeoutError(f"Gate: {self.wait_for} did not all appear within 120 s")
            await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("Gate: failing on purpose after the others started")
