"""Liveness and progress, process side: a heartbeat a stuck process cannot fake, and counters of work done.

Every forgelab process (`forgelab.runtime.mesh.spawn` starts it after ``setup()``) keeps two beats and writes them,
with its progress counters, to a small JSON file ``<dir>/<pid>.json`` that the controller's watchdog reads
(`forgelab.runtime.watchdog`); no message to the process is needed to read it:

- ``beat``: bumped by a daemon thread every ``interval_s``. A SIGSTOPped process, a host gone from the network
  (the file stops changing) or C code holding the GIL forever stop it.
- ``loop_beat``: bumped by a task on the process's asyncio loop, where every endpoint runs. An endpoint that
  blocks that loop (a deadlock on a lock, a blocking wait) stops it while the thread's beat goes on.
- ``loop_cpu``: the CPU seconds the loop's thread has used. Synchronous work holding the loop (one long forward
  or backward pass) moves it; a thread deadlocked on a lock does not.
- ``counters``: work done, bumped where it happens (`bump`): ``engine_steps``, ``tokens``, ``requests`` (the
  generator), ``weight_bytes_received`` / ``weights_loaded`` (a weight push), ``train_steps`` (the trainer).
  A busy process moves them; one waiting forever (an awaited event nobody sets) does not.

A process on another host (given the controller's heartbeat sink, `forgelab.runtime.beat_sink`) also sends each
record there as a signed UDP datagram, and its heartbeat thread answers the sink's request for a stack dump.

The process also registers `faulthandler` on `DUMP_SIGNAL` (SIGUSR2), writing every thread's Python stack to
``<dir>/<pid>.stacks``: the stack dump where py-spy cannot attach (ptrace denied, as on many clusters).

Test hooks (`arm`, `checkpoint`): the watchdog's tests make a process hang, deadlock or crawl at a named point
(``engine_step``, ``weights_receive``) through ``Component._forgelab_arm``; unarmed, a checkpoint costs one dict
lookup.
"""
from __future__ import annotations

import asyncio
import atexit
import faulthandler
import json
import os
import shutil
import signal
import socket
import threading
import tempfile
import time
from pathlib import Path
from typing import IO, Callable

__all__ = ["COUNTERS", "DUMP_SIGNAL", "arm", "bump", "checkpoint", "liveness_dir", "read_beats", "start"]

DUMP_SIGNAL = signal.SIGUSR2
"""The signal on which a forgelab process writes its Python stacks (`faulthandler`) to ``<dir>/<pid>.stacks``."""

COUNTERS: dict[str, int] = {}
"""This process's progress counters (name -> count); written to the heartbeat file with each beat."""

HEARTBEAT_S = [1.0]
"""The heartbeat interval processes spawned from now on get (s); `forgelab.runtime.watchdog.WatchdogConfig.heartbeat_s`
sets it for a run."""

_started: dict[str, object] = {}
_hooks: dict[str, tuple[str, float]] = {}
_hung: dict[str, asyncio.Event] = {}  # points where a call hangs now -> what releases it
_keep: list[object] = []  # the stacks file and the loop task: alive as long as the process


_dir: list[Path] = []


def liveness_dir() -> Path:
    """This controller's heartbeat directory (made on first use, removed when the controller exits); the
    processes it spawns write their files there."""
    if not _dir:
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        path = Path(tempfile.mkdtemp(prefix=f"forgelab-live-{os.getpid()}-", dir=root))
        _dir.append(path)
        atexit.register(shutil.rmtree, path, True)
    return _dir[0]


def bump(name: str, n: int = 1) -> None:
    """Add `n` to progress counter `name` (any thread; a dict update under the GIL)."""
    COUNTERS[name] = COUNTERS.get(name, 0) + n


def start(directory: str, label: str, interval_s: float = 1.0,
          sink: tuple[list[str], int, str] | None = None) -> None:
    """Start the heartbeat thread and the loop's beat task, and register the faulthandler dump; called on the
    process's asyncio loop (an endpoint), once per process (a second call is a no-op). `sink`: (addresses, port,
    key in hex) of the controller's `forgelab.runtime.beat_sink.BeatSink`, given to a process on another host:
    each record also goes there, and the sink's request for a stack dump is answered from this thread."""
    if _started:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    stacks: IO[str] = open(path / f"{pid}.stacks", "a")
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    state = {"loop_beat": 0}
    _started.update(pid=pid, label=label, state=state)

    async def loop_beats() -> None:
        while True:
            state["loop_beat"] += 1
            await asyncio.sleep(interval_s)

    task = asyncio.get_running_loop().create_task(loop_beats())
    _keep.extend([stacks, task])
    loop_stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat")  # this call runs on the loop's thread
    target, tmp = path / f"{pid}.json", path / f".{pid}.json.tmp"
    send = _sender(sink, path / f"{pid}.stacks") if sink is not None else None
    host = socket.gethostname()

    def beats() -> None:
        beat = 0
        while True:
            beat += 1
            record = {"pid": pid, "label": label, "beat": beat, "loop_beat": state["loop_beat"],
                      "counters": dict(COUNTERS), "time": time.time(), "interval_s": interval_s, "host": host,
                      "loop_cpu": _cpu_s(loop_stat)}
            if send is not None:
                send(record)
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, target)
            except OSError:  # the controller removed the directory (it is shutting down)
                if send is None:
                    return
            time.sleep(interval_s)

    threading.Thread(target=beats, name="forgelab-heartbeat", daemon=True).start()


def _cpu_s(stat: Path) -> float | None:
    """CPU seconds a thread has used (its /proc stat's utime + stime; None off Linux). The loop's thread burns
    CPU while it computes (a long forward pass holds the loop) and none while deadlocked on a lock."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _sender(sink: tuple[list[str], int, str], stacks: Path) -> Callable[[dict[str, object]], None]:
    """Sends a record to the controller's sink (`forgelab.runtime.beat_sink`) and answers its request for a
    stack dump: this thread writes the `faulthandler` dump of every thread (it runs while the event loop's thread
    is deadlocked on a lock) and sends it back."""
    from forgelab.runtime.beat_sink import MAX_DATAGRAM, pack, unpack

    addresses, port, key_hex = sink
    key = bytes.fromhex(key_hex)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if all(a.startswith("127.") for a in addresses):  # the controller is on this machine: answer on loopback only
        sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    _keep.append(sock)

    def send(record: dict[str, object]) -> None:
        datagram = pack(key, {"kind": "beat", **record})
        for address in addresses:  # every address the controller may be reached at; a repeat overwrites the same record
            try:
                sock.sendto(datagram, (address, port))
            except OSError:
                pass
        while True:
            try:
                reply, origin = sock.recvfrom(65536)
            except OSError:  # nothing more waiting
                return
            body = unpack(key, reply)
            if body is None or body.get("kind") != "dump":
                continue
            with open(stacks, "a+") as f:
                start = f.seek(0, os.SEEK_END)
                faulthandler.dump_traceback(f, all_threads=True)
                f.flush()
                f.seek(start)
                text = f.read()
            answer = {"kind": "stacks", "pid": record["pid"], "nonce": body.get("nonce"), "text": text}
            while len(json.dumps(answer)) > MAX_DATAGRAM - 64:  # keep the end: the innermost frames are last
                answer["text"] = "...(cut)\n" + str(answer["text"])[len(str(answer["text"])) // 4:]
            try:
                sock.sendto(pack(key, answer), origin)
            except OSError:
                pass

    return send


def read_beats(directory: str | Path, pid: int) -> dict[str, object] | None:
    """The last record process `pid` wrote in `directory` (None: none yet, or unreadable)."""
    try:
        data = json.loads((Path(directory) / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------------------- test hooks
def arm(point: str, action: str, seconds: float = 0.0) -> None:
    """Make the next checkpoints at `point` misbehave (a test hook): ``"slow"`` sleeps `seconds` there (the loop
    keeps running), ``"hang"`` waits on the loop until disarmed (alive, no progress), ``"deadlock"`` blocks the
    loop's thread forever, ``"off"`` disarms (and lets a call hung at `point` go on)."""
    if action not in ("slow", "hang", "deadlock", "off"):
        raise ValueError(f"liveness.arm: action must be slow, hang, deadlock or off, got {action!r}")
    if action == "off":
        _hooks.pop(point, None)
        release = _hung.pop(point, None)
        if release is not None:  # a call hung there goes on
            release.set()
    else:
        _hooks[point] = (action, float(seconds))


async def checkpoint(point: str) -> None:
    """A place a test hook can make slow, hang or deadlock (see `arm`); nothing when unarmed."""
    hook = _hooks.get(point)
    if hook is None:
        return
    action, seconds = hook
    if action == "slow":
        await asyncio.sleep(seconds)
    elif action == "hang":
        _hooks.pop(point, None)
        await _hung_by_test_hook(_hung.setdefault(point, asyncio.Event()))
    elif action == "deadlock":
        _hooks.pop(point, None)
        _deadlocked_by_test_hook()


async def _hung_by_test_hook(release: asyncio.Event) -> None:
    await release.wait()  # set only by arm(point, "off"): the loop runs on, this call makes no progress


def _deadlocked_by_test_hook() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # the loop's thread waits on itself: every endpoint of this process stops
