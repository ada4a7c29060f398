"""The watchdog: a deadline on every wait, tied to liveness and progress, not to how long a call usually takes.

    wd = Watchdog(run_config.watchdog, out_dir=run_dir, emit=bus.emit)
    answer = await wd.watch(call, pids=[1234], part="generator replica 0", call="generate")
    dump = wd.stacks()            # StackDump: every forgelab process's Python stacks, also written to a file

A call (a service's routed call, a weight push) runs while the watchdog reads its processes' heartbeat files
(`forgelab.runtime.liveness`, written by each process without being asked). It is declared stuck when

- a process **stopped answering**: its heartbeat thread has not beaten for ``unresponsive_s`` (SIGSTOPped, host
  gone, GIL held forever), or its event loop has not beaten for ``unresponsive_s`` while its progress counters
  stood still and the loop's thread used no CPU (an endpoint blocking the loop: a deadlock; a long forward pass
  holding the loop uses CPU);
- or **no progress**: none of the call's processes moved a progress counter (engine steps, tokens, weight bytes,
  train steps) for ``no_progress_s``.

A slow call is never stuck: a long turn in a busy engine moves its step counter every step. Then the watchdog
records the Python stacks of every forgelab process of this controller (py-spy, ``--nonblocking`` for a stopped
process; where py-spy is missing or ptrace is denied, the `faulthandler` dump each process writes on
`liveness.DUMP_SIGNAL`) into ``<out_dir>/stacks/``, emits a ``stuck`` event and raises `StuckError` naming the
part, the call, how long it waited and the dump file.

A process on another host (an ssh or Slurm job's worker) also sends each heartbeat record to the controller's
UDP sink (`forgelab.runtime.beat_sink`), so it is judged by the same rules; its stacks come from its own
heartbeat thread's `faulthandler` dump, sent to the sink when asked.
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from forgelab.runtime.beat_sink import running_sink
from forgelab.runtime.liveness import DUMP_SIGNAL, liveness_dir, read_beats
from forgelab.runtime.errors import ReplicaFailedError

__all__ = ["Deadlines", "ProcessStack", "StackDump", "StuckError", "Watchdog", "WatchdogSettings", "liveness_dir"]

T = TypeVar("T")


class WatchdogSettings(Protocol):
    """What the watchdog reads of its config (`forgelab.config.run_config.WatchdogConfig`, the ``watchdog:``
    section, documents each field and its default)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def unresponsive_s(self) -> float: ...
    @property
    def no_progress_s(self) -> float: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def py_spy(self) -> str | None: ...


class Emit(Protocol):
    """``emit(kind, **fields)``: records an event in the run's log (`forgelab.controller.events.EventBus.emit`)."""

    def __call__(self, kind: str, /, **fields: object) -> object: ...


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """The defaults of `forgelab.config.run_config.WatchdogConfig`, for services outside a run."""

    enabled: bool = True
    unresponsive_s: float = 120.0
    no_progress_s: float = 600.0
    heartbeat_s: float = 1.0
    py_spy: str | None = None


class StuckError(ReplicaFailedError):
    """A call or weight push whose process stopped answering or made no progress (see `forgelab.runtime.watchdog`).

    Attributes: ``part`` (e.g. "generator replica 0"), ``call`` (the endpoint or "weight push v3"), ``waited_s``,
    ``reason``, ``pids`` (the stuck processes) and ``dump`` (the stack dump file, None if it could not be
    written)."""

    def __init__(self, part: str, call: str, waited_s: float, reason: str, pids: Sequence[int], dump: Path | None):
        self.part, self.call, self.waited_s, self.reason, self.pids, self.dump = part, call, waited_s, reason, list(pids), dump
        where = f"stacks of every process in {dump}" if dump else "the stack dump could not be written"
        super().__init__(f"{part} is stuck in {call}: waited {waited_s:.1f} s; {reason}. {where}; raise "
                         "watchdog.unresponsive_s / watchdog.no_progress_s if this work is just that slow.")


@dataclass(frozen=True)
class ProcessStack:
    """One process's Python stacks: ``how`` is "py-spy", "faulthandler", "controller" or "none" (``text`` then
    says why)."""

    pid: int
    label: str
    how: str
    text: str


@dataclass(frozen=True)
class StackDump:
    """Every process's stacks, and the file they were written to."""

    path: Path | None
    processes: dict[int, ProcessStack] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join(_section(p) for p in self.processes.values())


def _state(pid: int) -> str:
    """The process's state letter from /proc ("T": stopped; "?" unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _local(rec: dict[str, object]) -> bool:
    """Whether a heartbeat record comes from a process of this host (its pid means something in /proc here)."""
    return rec.get("via") != "sink" or rec.get("host") == socket.gethostname()


def _section(p: ProcessStack) -> str:
    return f"===== pid {p.pid} ({p.label}) via {p.how} =====\n{p.text.rstrip()}\n"


class Watchdog:
    """Watches calls against `WatchdogConfig` and dumps stacks; one per run (or per controller)."""

    def __init__(self, config: WatchdogSettings | None = None, *, out_dir: Path | None = None,
                 emit: Emit | None = None):
        self.config: WatchdogSettings = config or Deadlines()
        self.out_dir = out_dir
        self.emit = emit
        self.dumps: list[Path] = []
        """Stack dump files written so far (newest last)."""
        self.stuck: list[StuckError] = []
        """Every stuck call declared so far (the dashboard's services panel lists them)."""

    # ------------------------------------------------------------------------------------------- watching
    async def watch(self, call: Awaitable[T], *, pids: Sequence[int], part: str, what: str,
                    progress: Sequence[str] | None = None, progress_pids: Sequence[int] = (),
                    on_stuck: Callable[[StuckError], None] | None = None) -> T:
        """Await `call`; raise `StuckError` (after dumping stacks) if `pids` stop answering or progressing.
        `progress`: the counters that count as this call's progress (None: any counter of its processes; a
        weight push counts only weight bytes, since the generators' engines step for other calls meanwhile).
        `progress_pids`: other processes the call waits on, whose counters count as its progress but whose
        liveness is judged by their own calls (an environment's rollout waits on the generators' engine steps).
        `on_stuck` runs before the error is raised (a service marks the replica failed there)."""
        task = asyncio.ensure_future(call)
        if not self.config.enabled or not pids:
            return await task
        cfg = self.config
        t0 = time.monotonic()
        seen: dict[int, tuple[object, object, object, object]] = {}
        beat_at: dict[int, float] = {}
        loop_at: dict[int, float] = {}
        cpu_at: dict[int, float] = {}  # when the loop's thread last used CPU (busy computing, not deadlocked)
        progress_at = t0
        helpers = [p for p in progress_pids if p not in pids]
        helper_seen: dict[int, object] = {}
        poll = min(cfg.heartbeat_s, cfg.unresponsive_s / 4)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll)
                if done:
                    return task.result()
                now = time.monotonic()
                verdict: tuple[str, list[int]] | None = None
                for pid in pids:
                    rec = self.beats(pid)
                    if rec is None:
                        continue  # no heartbeat heard yet (it is starting): judged by the others
                    if _local(rec) and _state(pid) in ("?", "Z", "X"):
                        continue  # it died: Monarch's supervision reports that (and a service retries the call)
                    beat, loop_beat, counters = rec.get("beat"), rec.get("loop_beat"), rec.get("counters")
                    cpu = rec.get("loop_cpu")
                    if progress is not None and isinstance(counters, dict):
                        counters = {k: v for k, v in counters.items() if k in progress}
                    old = seen.get(pid)
                    if old is None or old[0] != beat:
                        beat_at[pid] = now
                    if old is None or old[1] != loop_beat:
                        loop_at[pid] = now
                    if old is not None and old[2] != counters:
                        progress_at = now
                    if old is None or (cpu is not None and old[3] != cpu):  # unknown (not Linux): no evidence
                        cpu_at[pid] = now
                    seen[pid] = (beat, loop_beat, counters, cpu)
                    label = str(rec.get("label", "?"))
                    if now - beat_at[pid] > cfg.unresponsive_s:
                        verdict = (f"process {pid} ({label}) stopped answering: no heartbeat for "
                                   f"{now - beat_at[pid]:.1f} s (stopped, frozen, or its host is gone)", [pid])
                    elif min(now - loop_at[pid], now - progress_at, now - cpu_at[pid]) > cfg.unresponsive_s:
                        verdict = (f"process {pid} ({label}) is alive but its event loop has not run for "
                                   f"{now - loop_at[pid]:.1f} s, its thread used no CPU and it made no progress "
                                   "(an endpoint blocks it: a deadlock?)", [pid])
                    if verdict:
                        break
                for pid in helpers if verdict is None else ():
                    rec = self.beats(pid)
                    if rec is not None:
                        counters = rec.get("counters")
                        if progress is not None and isinstance(counters, dict):
                            counters = {k: v for k, v in counters.items() if k in progress}
                        if pid in helper_seen and helper_seen[pid] != counters:
                            progress_at = now
                        helper_seen[pid] = counters
                if verdict is None and seen and now - progress_at > cfg.no_progress_s:
                    verdict = (f"none of its processes {sorted(seen)} made progress (engine steps, tokens, weight "
                               f"bytes, train steps) for {now - progress_at:.1f} s", sorted(seen))
                if verdict is not None:
                    task.cancel()
                    err = await self.declare(part, what, now - t0, verdict[0], verdict[1])
                    if on_stuck is not None:
                        on_stuck(err)
                    raise err
        finally:
            if not task.done():
                task.cancel()

    async def declare(self, part: str, what: str, waited_s: float, reason: str, pids: Sequence[int]) -> StuckError:
        """Dump every process's stacks, emit a ``stuck`` event, and return the `StuckError` to raise."""
        try:
            dump: Path | None = (await asyncio.to_thread(self.stacks, f"stuck {part} {what}", list(pids))).path
        except Exception as e:  # noqa: BLE001 -- the error must still be raised; say why the dump is missing
            dump = None
            reason += f" (stack dump failed: {type(e).__name__}: {e})"
        err = StuckError(part, what, waited_s, reason, pids, dump)
        self.stuck.append(err)
        if self.emit is not None:
            self.emit("stuck", part=part, call=what, waited_s=round(waited_s, 1), reason=reason,
                      pids=list(pids), path=str(dump) if dump else None)
        return err

    def beats(self, pid: int) -> dict[str, object] | None:
        """Process `pid`'s newest heartbeat record: its file in this controller's heartbeat directory, else what
        it sent to the heartbeat sink (a process on another host; the record then has ``via`` "sink")."""
        rec = read_beats(liveness_dir(), pid)
        if rec is not None:
            return rec
        sink = running_sink()
        heard = sink.record(pid) if sink is not None else None
        if heard is not None:
            heard["via"] = "sink"
        return heard

    # -------------------------------------------------------------------------------------------- stacks
    def processes(self) -> dict[int, str]:
        """Every live forgelab process of this controller (pid -> its label), from the heartbeat files and the
        heartbeat sink (processes on other hosts heard from in the last 2 x ``unresponsive_s`` + 10 s)."""
        out: dict[int, str] = {}
        for f in sorted(liveness_dir().glob("*.json")):
            rec = read_beats(liveness_dir(), int(f.stem)) if f.stem.isdigit() else None
            if rec is not None and _state(int(f.stem)) not in ("?", "Z", "X"):
                out[int(f.stem)] = str(rec.get("label", "?"))
        sink = running_sink()
        if sink is not None:
            recent = time.monotonic() - 2 * self.config.unresponsive_s - 10
            for pid, rec in list(sink.records.items()):
                if pid not in out and sink.heard_at.get(pid, 0.0) > recent and (
                        not _local(rec) or _state(pid) not in ("?", "Z", "X")):
                    out[pid] = f"{rec.get('label', '?')} on {rec.get('host', '?')}"
        return out

    def stacks(self, reason: str = "on demand", first: Sequence[int] = ()) -> StackDump:
        """Every forgelab process's Python stacks (the processes in `first` first, then the others, then this
        controller), written to ``<out_dir>/stacks/<time>-<reason>.txt`` when there is an out_dir."""
        procs = self.processes()
        order = [p for p in first if p in procs] + [p for p in procs if p not in first]
        found = {pid: self._stack(pid, procs[pid]) for pid in order}
        me = os.getpid()
        found[me] = ProcessStack(me, "controller", "controller", "".join(
            f"Thread {tid}:\n" + "".join(traceback.format_stack(frame)) for tid, frame in sys._current_frames().items()))
        path = None
        if self.out_dir is not None:
            folder = Path(self.out_dir) / "stacks"
            folder.mkdir(parents=True, exist_ok=True)
            slug = re.sub(r"[^A-Za-z0-9]+", "-", reason).strip("-")[:60]
            path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{len(self.dumps)}-{slug}.txt"
            path.write_text(f"# forgelab stack dump: {reason}\n# {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n\n"
                            + "\n".join(_section(p) for p in found.values()))
            self.dumps.append(path)
        return StackDump(path, found)

    def _stack(self, pid: int, label: str) -> ProcessStack:
        rec = None if (liveness_dir() / f"{pid}.json").exists() else self.beats(pid)
        if rec is not None and not _local(rec):
            return self._remote_stack(pid, label)
        stopped = _state(pid) == "T"
        spy = self._py_spy()
        why = "py-spy not found"
        if spy is not None:
            cmd = [spy, "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                if out.returncode == 0 and out.stdout.strip():
                    return ProcessStack(pid, label, "py-spy", out.stdout)
                why = f"py-spy failed ({out.returncode}): {(out.stderr or out.stdout).strip().splitlines()[:1]}"
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"py-spy failed: {type(e).__name__}: {e}"
        if stopped:
            return ProcessStack(pid, label, "none", f"process is stopped (SIGSTOP): a faulthandler dump is written "
                                                    f"only once it runs again; {why}")
        return self._faulthandler(pid, label, why)

    def _remote_stack(self, pid: int, label: str) -> ProcessStack:
        """A process on another host: py-spy and signals cannot reach it from here; its heartbeat thread sends
        its `faulthandler` dump to the sink when asked (a stopped process cannot)."""
        sink = running_sink()
        wait_s = 2 * self.config.heartbeat_s + 2.0
        text = sink.stacks(pid, wait_s) if sink is not None else None
        if not text:
            return ProcessStack(pid, label, "none", f"process on another host sent no faulthandler dump within "
                                                    f"{wait_s:.1f} s: it is stopped (SIGSTOP) or frozen, or its "
                                                    "host is gone; a stopped process can dump only once it runs "
                                                    "again (py-spy cannot reach another host from here)")
        return ProcessStack(pid, label, "faulthandler", "(another host: sent by its heartbeat thread)\n" + text)

    def _faulthandler(self, pid: int, label: str, why: str) -> ProcessStack:
        """Ask the process for its faulthandler dump (`liveness.DUMP_SIGNAL`) and read what it appended."""
        path = liveness_dir() / f"{pid}.stacks"
        try:
            before = path.stat().st_size
            os.kill(pid, DUMP_SIGNAL)
        except OSError as e:
            return ProcessStack(pid, label, "none", f"{why}; no faulthandler dump either: {type(e).__name__}: {e}")
        deadline = time.monotonic() + 10
        size = before
        while time.monotonic() < deadline:  # the dump is written by a C signal handler: wait for it to settle
            time.sleep(0.05)
            now = path.stat().st_size
            if now > before and now == size:
                break
            size = now
        with open(path) as f:
            f.seek(before)
            text = f.read()
        if not text.strip():
            return ProcessStack(pid, label, "none", f"{why}; the process wrote no faulthandler dump within 10 s")
        return ProcessStack(pid, label, "faulthandler", f"({why})\n{text}")

    def _py_spy(self) -> str | None:
        if self.config.py_spy is not None:
            return self.config.py_spy if os.access(self.config.py_spy, os.X_OK) else None
        beside = Path(sys.executable).parent / "py-spy"
        return str(beside) if beside.exists() else shutil.which("py-spy")


_default: list[Watchdog] = []


def default_watchdog() -> Watchdog:
    """The controller's watchdog for services outside a run (defaults; dumps go to the heartbeat directory)."""
    if not _default:
        _default.append(Watchdog(out_dir=liveness_dir()))
    return _default[0]
