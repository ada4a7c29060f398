"""The critical path first at start-up: the generator gets cores to itself while everything else starts.

A run's start-up is bounded by its generator's: importing vLLM and building the engine (about 12.8 CPU-s of the
tiny model's start on 2 cores, 9 of them ``import vllm``) run in one thread, while the trainer, the reference, the
env replicas and the controller's own start-up (tokenizer, manifest hashes, git calls) together need less and can
wait. Started all at once at equal priority, four runnable processes shared two cores and the generator got about
half of one. `forgelab.engines.spawn.start_all` opens a `StartWindow` around a start:

- the critical part (the generator) is launched first; the other parts are launched once its processes exist;
- every other part launched inside the window starts restricted to the other cores: its bootstrap command sets the
  process's CPU affinity before anything else runs (`pinned_command`), so every thread it makes inherits it; the
  controller's own threads are restricted the same way (the critical part's bootstrap sets all the original cores:
  Monarch forks every process from the controller's threads, so it would inherit the restriction), and the controller's start-up work (`ShadowWork`: the
  tokenizer, the manifest's hashes and git calls) starts in a thread once the critical part is launched;
- when the critical part's start ends (ready or failed), and again when the whole start ends (whatever happened),
  every thread that still has the restricted affinity gets the controller's original one back. Affinity, unlike a
  raised nice value, can be widened again by a user who is not root.

The critical part keeps the controller's original affinity (all cores): nothing else of the run can run on its
cores, and it may still use the others. Processes are found for restoring by the window's mark in their
environment (``FORGELAB_START_WINDOW``, read from ``/proc/PID/environ``), so a grandchild (a compile worker) is
restored too, and a part still starting when the generator is ready is widened at once.

Nothing is restricted (one log line says why) with fewer than 2 usable cores, without `os.sched_setaffinity`
(not Linux), or for parts placed on a `monarch.job`'s hosts (another machine's cores).
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

if TYPE_CHECKING:
    from monarch.actor import BootstrapCommand

log = logging.getLogger("forgelab.runtime.startup_cpus")

CPUS_ENV = "FORGELAB_START_CPUS"
"""The cores a pinned process starts on (``"0,2"``), read by its bootstrap (`pinned_command`)."""
MARK_ENV = "FORGELAB_START_WINDOW"
"""The window's file: a pinned process pins itself only while it exists; the window finds its processes by it."""

T = TypeVar("T")
Cmd = TypeVar("Cmd")


def split_cores(allowed: Collection[int], critical: int = 1) -> tuple[frozenset[int], frozenset[int]] | None:
    """(cores kept for the critical part, cores for everything else) out of the controller's `allowed` cores, or
    None when there is nothing to split (fewer than 2 cores). The critical part gets the `critical`
    highest-numbered cores, but at least one core always goes to the rest.

    >>> split_cores({0, 1})
    (frozenset({1}), frozenset({0}))
    >>> split_cores(range(4), critical=2)
    (frozenset({2, 3}), frozenset({0, 1}))
    >>> split_cores({0, 1}, critical=3)  # never all of them
    (frozenset({1}), frozenset({0}))
    >>> split_cores({5}) is None
    True
    """
    cores = sorted(set(allowed))
    if len(cores) < 2:
        return None
    keep = max(1, min(critical, len(cores) - 1))
    return frozenset(cores[-keep:]), frozenset(cores[:-keep])


def cpu_list(cpus: Collection[int]) -> str:
    """``"0,2,3"``: a core set as the bootstrap reads it.

    >>> cpu_list({3, 0, 2})
    '0,2,3'
    """
    return ",".join(str(c) for c in sorted(cpus))


def affinity_supported() -> bool:
    """Whether this platform lets a process set its threads' CPU affinity (Linux with /proc)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity") and os.path.isdir("/proc/self/task")


def threads_of(pid: int) -> list[int]:
    """The thread ids of process `pid` ([] once it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def affinity(tid: int) -> frozenset[int] | None:
    """The CPU affinity of thread (or process) `tid`; None when it is gone or not ours."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:
        return None


def _set_affinity(tid: int, cpus: Collection[int]) -> bool:
    try:
        os.sched_setaffinity(tid, cpus)
        return True
    except OSError:  # the thread ended in between, or is not ours
        return False


def marked_processes(mark: str, cpus: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``FORGELAB_START_WINDOW=<mark>`` and
    ``FORGELAB_START_CPUS=<cpus>`` (the other parts of one window, not its critical part)."""
    needles = {f"{MARK_ENV}={mark}".encode(), f"{CPUS_ENV}={cpus}".encode()}
    out: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # another user's process, or gone
            continue
        if needles <= set(env.split(b"\0")):
            out.append(int(name))
    return out


_SHIM = """import os, runpy
w = os.environ.get({mark!r}, '')
if w and os.path.exists(w):
    try:
        os.sched_setaffinity(0, {{int(c) for c in os.environ[{cpus!r}].split(',')}})
    except (OSError, ValueError, KeyError):
        pass
runpy.run_module({module!r}, run_name='__main__', alter_sys=True)
"""


class _Controller:
    """The controller's own threads, restricted while any window is open (windows may overlap: two runs starting
    at once in one kernel); the first window in records the original affinity, the last one out restores it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.base: frozenset[int] = frozenset()
        self.pinned: frozenset[int] = frozenset()

    def original(self) -> frozenset[int]:
        """The controller's affinity before any open window restricted it."""
        with self.lock:
            return self.base if self.open else affinity(0) or frozenset()

    def enter(self, base: frozenset[int], others: frozenset[int]) -> None:
        with self.lock:
            self.open += 1
            if self.open > 1:
                return
            self.base, self.pinned = base, others
            for tid in threads_of(os.getpid()):
                if affinity(tid) == base:  # a thread someone pinned on purpose keeps its own
                    _set_affinity(tid, others)

    def leave(self) -> None:
        with self.lock:
            self.open -= 1
            if self.open > 0:
                return
            for tid in threads_of(os.getpid()):  # threads made meanwhile inherited the restriction: widened too
                if affinity(tid) == self.pinned:
                    _set_affinity(tid, self.base)


_CONTROLLER = _Controller()


def original_affinity() -> frozenset[int]:
    """The controller's CPU affinity as it was before any open start window restricted it."""
    return _CONTROLLER.original()


@dataclass
class StartRecord:
    """What a `StartWindow` did, for the log and for tests that read the real processes."""

    note: str = ""
    """Why nothing was restricted ("" when it was)."""
    base: frozenset[int] = frozenset()
    """The controller's affinity before the start (what every restricted thread gets back)."""
    critical: frozenset[int] = frozenset()
    """The cores kept for the critical part."""
    others: frozenset[int] = frozenset()
    """The cores the other parts and the controller started on."""
    launches: list[tuple[str, str]] = field(default_factory=list)
    """(role, component class name) in launch order; role "critical" or "other"."""
    pinned: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)
    """pid -> {thread id: its affinity} of every marked process, read just before it was widened again (the threads
    it had when first found)."""
    controller_during: frozenset[int] | None = None
    """The controller's main-thread affinity while the window was open."""
    restored: bool = False
    """Every restricted thread got `base` back (set by `StartWindow.close`)."""


class StartWindow:
    """One start with its critical part first (see the module docstring); `start_all` drives it.

        window = StartWindow(critical_cores=1)
        window.open()
        crit = asyncio.ensure_future(window.critical(generator_start))
        await window.critical_launched(crit)        # the generator's processes exist
        rest = [asyncio.ensure_future(window.other(job)) for job in other_starts]
        ...
        window.close()                              # in a finally: affinity restored whatever happened
    """

    def __init__(self, critical_cores: int = 1, *, enabled: bool = True, why_not: str = "") -> None:
        self.critical_cores = critical_cores
        self.enabled = enabled
        self.why_not = why_not
        self.record = StartRecord()
        self.active = False
        self._file: str | None = None
        self._launched: asyncio.Event | None = None

    # ------------------------------------------------------------------ open / release / close
    def open(self) -> StartRecord:
        """Restrict the controller and arm the bootstrap of other parts; records (and logs) why not when it cannot."""
        self._launched = asyncio.Event()
        if not self.enabled:
            return self._skip(self.why_not or "disabled by the caller")
        if not affinity_supported():
            return self._skip("this platform has no os.sched_setaffinity (not Linux): parts start unrestricted")
        base = _CONTROLLER.original()
        split = split_cores(base, self.critical_cores)
        if split is None:
            return self._skip(f"the controller may use {len(base)} core(s): nothing to keep for the generator")
        crit, others = split
        fd, self._file = tempfile.mkstemp(prefix="forgelab-start-", suffix=".cpus")
        with os.fdopen(fd, "w") as f:
            f.write(cpu_list(others) + "\n")
        self.record.base, self.record.critical, self.record.others = base, crit, others
        _CONTROLLER.enter(base, others)
        self.active = True
        self.record.controller_during = affinity(0)
        log.info("forgelab: start-up: the generator has core(s) %s to itself; other parts and the controller start "
                 "on %s until it is ready", cpu_list(crit), cpu_list(others))
        return self.record

    def _skip(self, why: str) -> StartRecord:
        self.record.note = why
        log.info("forgelab: start-up: no CPU affinity set: %s", why)
        return self.record

    def release(self) -> None:
        """The critical part is ready (or failed): widen every restricted thread again. Safe to call twice; later
        calls only look for processes that appeared since."""
        if self._file is None:
            return
        first = self.active  # a later pass records only processes it finds for the first time
        if self.active:
            self.active = False
            try:
                os.unlink(self._file)  # from now on a bootstrap that starts does not pin itself
            except OSError:
                pass
            _CONTROLLER.leave()
        base, others = self.record.base, self.record.others
        for pid in marked_processes(self._file, cpu_list(others)):
            record = first or pid not in self.record.pinned  # threads made since the first pass inherit `base`
            seen = self.record.pinned.setdefault(pid, {})
            for tid in threads_of(pid):
                now = affinity(tid)
                if now is None:
                    continue
                if record:
                    seen.setdefault(tid, now)
                if now == others:  # what the bootstrap set, or inherited from it; a thread's own choice stays
                    _set_affinity(tid, base)

    def close(self) -> None:
        """The whole start ended: release, and once more for processes launched late. Idempotent."""
        self.release()
        if self._file is not None:
            self.record.restored = True
        if self._launched is not None:
            self._launched.set()

    # ------------------------------------------------------------------ the parts' starts
    async def critical(self, job: Awaitable[T]) -> T:
        """Await the critical part's start (its spawns are recorded as critical); release when it ends."""
        _ROLE.set((self, "critical"))
        try:
            return await job
        finally:
            self.release()
            if self._launched is not None:
                self._launched.set()  # a start that failed before launching must not hold the others back

    async def other(self, job: Awaitable[T]) -> T:
        """Await another part's start: its processes are launched on the other cores while the window is open."""
        _ROLE.set((self, "other"))
        return await job

    async def critical_launched(self) -> None:
        """Until the critical part's first process is launched (or its start ended)."""
        if self._launched is not None:
            await self._launched.wait()

    def launched(self, role: str, component: str) -> None:
        self.record.launches.append((role, component))
        if role == "critical" and self._launched is not None:
            self._launched.set()

    def bootstrap(self, cmd: BootstrapCommand, role: str = "other") -> BootstrapCommand:
        """`cmd` for a part's process, started on its cores while the window is open: another part's on the other
        cores; the critical part's on all the controller's original cores (Monarch forks the processes from the
        controller's threads, restricted by then: without this the generator would inherit the restriction).
        Unchanged when `cmd` is not Monarch's ``python -m <module>`` form."""
        args = list(cmd.args)
        if not self.active or self._file is None or len(args) != 2 or args[0] != "-m":
            return cmd
        code = _SHIM.format(mark=MARK_ENV, cpus=CPUS_ENV, module=args[1])
        cpus = self.record.others if role == "other" else self.record.base
        env = {**dict(cmd.env), CPUS_ENV: cpu_list(cpus), MARK_ENV: self._file}
        return type(cmd)(cmd.program, cmd.arg0, ["-c", code], env)  # Monarch's BootstrapCommand


_ROLE: contextvars.ContextVar[tuple[StartWindow, str] | None] = contextvars.ContextVar("forgelab_start_role",
                                                                                          default=None)
"""The window and role of the start running in this task (set by `StartWindow.critical` / `.other`)."""


def pinned_command(cmd: Cmd, local: bool) -> Cmd:
    """The bootstrap command `forgelab.runtime.mesh.spawn` uses (a `BootstrapCommand`, or a function of the mesh
    point giving one): with its cores set (`StartWindow.bootstrap`) when this task starts a part inside an open
    window on this host (`local`), else `cmd` itself."""
    role = _ROLE.get()
    if role is None or not local or not role[0].active:
        return cmd
    window, which = role
    if hasattr(cmd, "args"):
        return cast(Cmd, window.bootstrap(cast("BootstrapCommand", cmd), which))
    per_point = cast("Callable[[object], BootstrapCommand]", cmd)
    return cast(Cmd, lambda point: window.bootstrap(per_point(point), which))


def note_launch(component: str) -> None:
    """`spawn` launched `component`'s processes: recorded in the window of this task's start, if any."""
    role = _ROLE.get()
    if role is not None and (role[0].active or role[1] == "critical"):
        role[0].launched(role[1], component)


class ShadowWork(Generic[T]):
    """The controller's own start-up work (`fn`, run in a thread), started by whoever knows when it should run:
    a start with a critical part once that part is launched (`start_shadow_work`), else its caller after the
    start. ``await work.wait()`` gives `fn`'s value or raises its error."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.future: asyncio.Future[T] | None = None

    def start(self) -> asyncio.Future[T]:
        if self.future is None:
            self.future = asyncio.ensure_future(asyncio.to_thread(self.fn))
        return self.future

    async def wait(self) -> T:
        return await self.start()


SHADOW: contextvars.ContextVar[ShadowWork[object] | None] = contextvars.ContextVar("forgelab_shadow_work",
                                                                                     default=None)
"""The controller's start-up work waiting for the critical part's launch (set by `forgelab.run.Run.spawn`)."""


def start_shadow_work() -> None:
    """Start the controller's start-up work of this task's start, if it has some and it has not started."""
    work = SHADOW.get()
    if work is not None:
        work.start()


def close_unstarted(jobs: Collection[Awaitable[object]]) -> None:
    """Close coroutines that will never be awaited (their start was called off), without a warning."""
    for job in jobs:
        if inspect.iscoroutine(job):
            job.close()
