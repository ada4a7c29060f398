"""Cores busy: how much of the machine a run keeps working, from its processes' CPU time.

    meter = CpuMeter(lambda: {"controller": [os.getpid()], "generator": [...], ...}, episodes=lambda: n_trained)
    meter.sample()                 # at each step's end (the run's rows do it)
    meter.use()                    # CpuUse over the steady state: cores_busy, cpu_s_per_episode, per part

``cores_busy`` is the CPU seconds every process of the run spent (user + system, each process and its live
child processes that are not parts of their own, per `/proc/PID/stat`) over the wall seconds times the machine's usable cores: 1.0 means every
core worked the whole time. ``cpu_s_per_episode`` is the same CPU seconds over the episodes trained meanwhile:
busy without more work done is not progress, so the two are read together. The steady state runs from the first
sample (the end of the first trained step: start-up, the step-0 evaluation and the first step's compile left out)
to the last.

The controller's share is its whole process (a notebook kernel running two runs counts both; processes shared by
several runs, a pool's LoRA engines, count in full for each). Linux only (/proc); elsewhere `use` is None.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds of each process at one moment, with the wall clock and the episodes trained so far."""

    wall_s: float
    """`time.monotonic()` when taken."""
    cpu_s: Mapping[int, tuple[str, float]]
    """pid -> (part, CPU seconds of the process and its live children)."""
    episodes: int


@dataclass(frozen=True)
class CpuUse:
    """The steady state between two samples (`cpu_use_between`)."""

    cores_busy: float
    """CPU seconds of all the run's processes / (wall seconds x usable cores), 0..1."""
    cpu_s_per_episode: float | None
    """CPU seconds per episode trained in between (None: none was)."""
    wall_s: float
    cores: int
    episodes: int
    cpu_s: float
    per_part: dict[str, float] = field(default_factory=dict)
    """Each part's share of the machine (its CPU seconds / (wall x cores)); they add up to `cores_busy`."""

    def as_dict(self, ndigits: int = 3) -> dict[str, object]:
        """The JSON keys the benchmarks, the demo and the services panel show."""
        return {"cores_busy": round(self.cores_busy, ndigits),
                "cpu_s_per_episode": None if self.cpu_s_per_episode is None else round(self.cpu_s_per_episode, 4),
                "cores": self.cores, "steady_wall_s": round(self.wall_s, 2), "steady_episodes": self.episodes,
                "cores_busy_by_part": {k: round(v, ndigits) for k, v in self.per_part.items()}}


def cpu_use_between(a: CpuSample, b: CpuSample, cores: int) -> CpuUse | None:
    """What the processes did between samples `a` and `b` on `cores` cores (None: no wall time between them).

    A process in both samples counts its difference; a process only in `b` started in between and counts all
    its CPU time; one only in `a` ended in between and counts nothing (its last seconds are lost: respawns are
    rare). Pure: the samples are plain numbers.

    >>> a = CpuSample(10.0, {1: ("controller", 2.0), 2: ("generator", 5.0)}, episodes=64)
    >>> b = CpuSample(14.0, {1: ("controller", 2.5), 2: ("generator", 8.5), 3: ("trainer", 2.0)}, episodes=192)
    >>> u = cpu_use_between(a, b, cores=2)
    >>> u.cores_busy, u.cpu_s_per_episode, u.per_part
    (0.75, 0.046875, {'controller': 0.0625, 'generator': 0.4375, 'trainer': 0.25})
    """
    wall = b.wall_s - a.wall_s
    if wall <= 0 or cores < 1:
        return None
    by_part: dict[str, float] = {}
    for pid, (part, now) in b.cpu_s.items():
        before = a.cpu_s.get(pid)
        spent = now - before[1] if before is not None and before[0] == part else now
        by_part[part] = by_part.get(part, 0.0) + max(0.0, spent)  # a reused pid number is a new process
    total = sum(by_part.values())
    episodes = b.episodes - a.episodes
    return CpuUse(cores_busy=total / (wall * cores), cpu_s_per_episode=total / episodes if episodes > 0 else None,
                  wall_s=wall, cores=cores, episodes=episodes, cpu_s=total,
                  per_part={k: v / (wall * cores) for k, v in by_part.items()})


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def process_cpu_s(pid: int, *, children: bool = True, skip: Collection[int] = ()) -> float | None:
    """User + system CPU seconds of process `pid` (with `children`: and of its live descendants, except those in
    `skip` and theirs: processes counted on their own); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": fields from the 3rd on
    own = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (the 14th and 15th fields)
    if not children:
        return own
    return own + sum(process_cpu_s(c, skip=skip) or 0.0 for c in _children(pid) if c not in skip)


def usable_cores() -> int:
    """The cores this controller may use (its affinity before any start restricted it), else `os.cpu_count()`."""
    from forgelab.runtime.startup_cpus import affinity_supported, original_affinity

    if affinity_supported():
        return max(1, len(original_affinity()))
    return max(1, os.cpu_count() or 1)


class CpuMeter:
    """Samples the CPU time of a run's processes (`pids()`: part -> pids, read at each sample) and the episodes
    trained (`episodes()`); `use()` is the steady state from the first sample to the last."""

    def __init__(self, pids: Callable[[], Mapping[str, list[int]]], episodes: Callable[[], int],
                 cores: int | None = None) -> None:
        self.pids, self.episodes = pids, episodes
        self.cores = cores or usable_cores()
        self.first: CpuSample | None = None
        self.last: CpuSample | None = None
        self.available = os.path.isdir("/proc/self")

    def sample(self) -> CpuSample | None:
        if not self.available:
            return None
        cpu: dict[int, tuple[str, float]] = {}
        by_part = self.pids()
        listed = {pid for pids in by_part.values() for pid in pids}
        for part, pids in by_part.items():
            for pid in pids:
                # the parts' processes are the controller's children (Monarch forks them): each counts once, as itself
                spent = process_cpu_s(pid, skip=listed)
                if spent is not None:
                    cpu[pid] = (part, spent)
        s = CpuSample(time.monotonic(), cpu, int(self.episodes()))
        if self.first is None:
            self.first = s
        self.last = s
        return s

    def on_step(self) -> dict[str, float]:
        """A metrics-row source (`TrainingLoop.add_row_source`): samples at each step's end and adds no column."""
        self.sample()
        return {}

    def use(self) -> CpuUse | None:
        """The steady state so far (None before two samples, or without /proc)."""
        if self.first is None or self.last is None or self.last is self.first:
            return None
        return cpu_use_between(self.first, self.last, self.cores)
