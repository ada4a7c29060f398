"""A deadline on every wait: stuck calls and weight pushes end in a named error with every process's stacks.

One module-scoped run on the shipped tiny model (2 generator replicas, a trainer, no reference), spawned but not
training, with a watchdog on small configured deadlines (`WATCH`). One after another:

- `run.stacks()` returns a stack per process (py-spy);
- a generate call slowed by a test hook but stepping is not flagged, though it outlasts ``no_progress_s``;
- a weight push whose receive never completes (test hook "hang": the loop runs, no weight byte moves) raises
  `StuckError` after ``no_progress_s``;
- a SIGSTOPped generator raises `StuckError` after ``unresponsive_s``, its stacks read by py-spy --nonblocking; the
  dump is shown by the dashboard's services panel and the run's event log;
- a deadlocked endpoint (test hook "deadlock": the process's event loop blocks on a lock) raises `StuckError`, its
  stacks read from the faulthandler dump: py-spy is made unavailable (``watchdog.py_spy`` set to a missing path),
  what a cluster that denies ptrace leaves.

The watchdog's rules themselves are also checked without processes (`test_rule_*`, fast tier): heartbeat records
written by the test for a plain `sleep` process. Waits wait on conditions; the deadlines under test are the
configured ones. Stopped processes get SIGCONT in
teardown (the watchdog kills a stuck replica's processes itself, so normally none is left).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from forgelab.config.run_config import (EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig,
                                        TrainConfig, WatchdogConfig)

WATCH = dict(unresponsive_s=3.0, no_progress_s=4.0, heartbeat_s=0.25)
#: How late past its deadline a stuck call may be declared: one poll (a heartbeat) for the first reading, one for
#: the last, and the controller's loop running late on a loaded 2-core machine (vLLM respawns beside it; up to 4 s
#: seen nowhere, allowed here so that the bound fails only for a watchdog that misses its deadline).
LATE_S = 2 * WATCH["heartbeat_s"] + 4.0

stopped: list[int] = []


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def run(loop, tmp_path_factory):
    from forgelab.run import Run

    cfg = RunConfig(
        name="hangs",
        rollout=RolloutConfig(task="addition", group_size=2, prompts_per_rollout=2, concurrency=1, max_tokens=6),
        train=TrainConfig(steps=2, batch_size=4, warmup_steps=1),
        eval=EvalConfig(every=0, n=4),
        tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("hangs")), wandb=False),
        placement=PlacementConfig(generator_replicas=2, reference=False),
        watchdog=WatchdogConfig(**WATCH),
    )
    r = Run(cfg)
    loop.run_until_complete(r.spawn())
    yield r
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
    loop.run_until_complete(r.shutdown())


def request(tokens: int):
    from forgelab.config.components import SamplingConfig
    from forgelab.generation import GenerateRequest

    return GenerateRequest(prompts_P=[[1, 2, 3, 4]], n=1,
                           sampling=SamplingConfig(max_tokens=tokens, min_tokens=tokens, temperature=1.0))


async def arm(run, index: int, point: str, action: str, seconds: float = 0.0) -> None:
    """The test hook (`forgelab.runtime.liveness.arm`) on generator replica `index`."""
    handle = run.generators.handles()[index]
    await handle.actor._forgelab_arm.call_one(point, action, seconds)


def section(dump_text: str, pid: int) -> str:
    """The part of a dump file about process `pid`."""
    m = re.search(rf"===== pid {pid} \((.*?)\) via (\S+) =====\n(.*?)(?=\n===== pid |\Z)", dump_text, re.S)
    assert m, f"no section for pid {pid} in the dump:\n{dump_text[:2000]}"
    return f"via {m.group(2)}\n{m.group(3)}"


@pytest.mark.integration
def test_stacks_returns_every_process(run):
    dump = run.stacks()
    gens = [pid for st in run.generators.status() for pid in st.pids]
    trainer = run.trainer.handle.pids_list
    assert len(gens) == 2 and len(trainer) == 1
    for pid in gens + trainer:
        p = dump.processes[pid]
        assert p.how == "py-spy", p
        assert "liveness.py" in p.text, p.text  # this very process's heartbeat thread, as py-spy read it
    assert dump.processes[os.getpid()].how == "controller"
    assert dump.path is not None and dump.path.parent == run.out_dir / "stacks"
    text = dump.path.read_text()
    for pid in gens + trainer:
        assert "liveness.py" in section(text, pid)


@pytest.mark.integration
def test_slow_but_live_call_is_not_flagged(run, loop):
    n = len(run.watchdog.stuck)
    for i in range(2):
        loop.run_until_complete(arm(run, i, "engine_step", "slow", 0.4))
    try:
        t0 = time.monotonic()
        groups = loop.run_until_complete(run.generators.generate(request(16)))
        took = time.monotonic() - t0
    finally:
        for i in range(2):
            loop.run_until_complete(arm(run, i, "engine_step", "off"))
    assert len(groups[0][0].completion_ids) == 16
    # 16 tokens at >= 0.4 s a step: longer than the no-progress deadline, but every step moved the counters
    assert took > WATCH["no_progress_s"], took
    assert len(run.watchdog.stuck) == n and not [e for e in run.events if e["kind"] == "stuck"]


@pytest.mark.integration
def test_weight_push_that_never_completes(run, loop):
    from forgelab.runtime.watchdog import StuckError

    for i in range(2):
        loop.run_until_complete(arm(run, i, "weights_receive", "hang"))
    try:
        with pytest.raises(StuckError) as info:
            loop.run_until_complete(run.weights.push(1))
    finally:
        for i in range(2):  # the hung receives go on (and the trainer's push ends)
            loop.run_until_complete(arm(run, i, "weights_receive", "off"))
    err = info.value
    assert err.call == "weight push v1" and "weight push to generator replicas [0, 1]" in err.part
    assert "made progress" in err.reason
    assert WATCH["no_progress_s"] <= err.waited_s <= WATCH["no_progress_s"] + LATE_S, err
    assert f"waited {err.waited_s:.1f} s" in str(err)
    text = err.dump.read_text()
    for pid in [p for st in run.generators.status() for p in st.pids] + run.trainer.handle.pids_list:
        assert "liveness.py" in section(text, pid)


@pytest.mark.integration
def test_sigstopped_generator(run, loop):
    from forgelab.lab.controls_panel import ServicesPanel
    from forgelab.lab.summary import services_lines
    from forgelab.runtime.watchdog import StuckError

    s = run.generators.session("stopped")
    loop.run_until_complete(s.route("generate", request(2)))  # pins the session to a replica
    index = s.replica
    pid = run.generators.status()[index].pids[0]
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)
    with pytest.raises(StuckError) as info:
        loop.run_until_complete(s.route("generate", request(2)))
    err = info.value
    assert err.part == f"service 'generator' replica {index}" and err.call == "generate()" and err.pids == [pid]
    assert "stopped answering" in err.reason
    assert WATCH["unresponsive_s"] <= err.waited_s <= WATCH["unresponsive_s"] + LATE_S, err
    body = section(err.dump.read_text(), pid)
    assert body.startswith("via py-spy") and "liveness.py" in body, body  # read with --nonblocking
    ev = [e for e in run.events if e["kind"] == "stuck"][-1]
    assert ev["path"] == str(err.dump) and ev["pids"] == [pid]
    assert any(str(err.dump) in line for line in services_lines(run))
    panel = ServicesPanel(run)
    panel.widget
    panel.refresh()
    assert str(err.dump) in panel.table.value
    assert not run.generators.status()[index].healthy  # killed and respawning, like a dead replica


@pytest.mark.integration
def test_deadlocked_endpoint_dumped_by_faulthandler_without_py_spy(run, loop):
    from forgelab.runtime.watchdog import StuckError

    s = run.generators.session("deadlocked")
    loop.run_until_complete(s.route("generate", request(2)))  # pins a healthy replica
    index = s.replica
    pid = run.generators.status()[index].pids[0]
    loop.run_until_complete(arm(run, index, "engine_step", "deadlock"))
    run.config.watchdog.py_spy = "/nonexistent/py-spy"  # no py-spy: what ptrace denied leaves
    try:
        with pytest.raises(StuckError) as info:
            loop.run_until_complete(s.route("generate", request(2)))
    finally:
        run.config.watchdog.py_spy = None
    err = info.value
    assert err.part == f"service 'generator' replica {index}" and err.pids == [pid]
    assert "event loop has not run" in err.reason
    assert WATCH["unresponsive_s"] <= err.waited_s <= WATCH["unresponsive_s"] + LATE_S, err
    body = section(err.dump.read_text(), pid)
    assert body.startswith("via faulthandler") and "_deadlocked_by_test_hook" in body, body


# ------------------------------------------------------------------------------- slow but live, at scale


#: Deadlines for the loaded run: far shorter than its steps and its episodes (asserted), longer than one unit of
#: counted work (a 32-row backward pass) with the machine's cores shared by this run, a burner and whatever else
#: runs (on the 2-core machine, with other suites beside it, one took over 4 s).
BUSY_WATCH = dict(unresponsive_s=3.0, no_progress_s=8.0, heartbeat_s=0.25)


@pytest.fixture(scope="module")
def busy(loop, tmp_path_factory):
    """A second run under tight deadlines (`BUSY_WATCH`): about 1,000 episodes in flight whose turns take long
    (an environment that thinks 4.5 s per step, turns queued behind a thousand others in one small generator), and a
    large batch (512 episodes a step), on a machine made busy by a process burning a core beside this suite from
    the moment training starts (the processes are spawned first, without it: the spawn is not what is watched).
    It trains a step; then its trainer is SIGSTOPped, in the same configuration (the burner still on), and the run
    must end in `StuckError`: the watchdog can still fire here, so its silence before means something."""
    import subprocess
    import sys

    from forgelab.run import Run

    tmp = tmp_path_factory.mktemp("busy")
    cfg = RunConfig.from_dict({
        "name": "busy",
        "rollout": {"task": "addition", "env": "echo", "env_kwargs": {"turns": 2, "think_s": 4.5, "reply_chars": 24},
                    "max_turns": 2, "group_size": 8, "prompts_per_rollout": 32, "concurrency": 4, "max_tokens": 4,
                    "env_step_timeout_s": 60.0},
        # admission lets (served version + max_policy_age + 1) * batch_size = 1,024 episodes be live at the start
        "train": {"steps": 4, "batch_size": 512, "warmup_steps": 1, "max_policy_age": 1,
                  "loss_kwargs": {"kl_coef": 0.0}},
        # a step's 512 rows in micro-batches of 32: each moves the trainer's counters (forward, backward)
        "trainer": {"micro_batch_size": 32},
        "placement": {"reference": False, "env_replicas": 1},
        "eval": {"every": 0, "n": 8},
        "watchdog": BUSY_WATCH,
        "tracking": {"wandb": False, "out_dir": str(tmp / "runs")},
    })
    run = Run(cfg)
    burners: list[subprocess.Popen] = []
    out: dict = {}

    async def go():
        await run.spawn()
        burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))  # the machine's other tenant
        t0 = time.monotonic()
        await run.start()
        deadline = time.monotonic() + 600
        while run.buffer.reserved < 1000:  # the condition itself, checked until it holds
            assert time.monotonic() < deadline and run.state == "running", (run.state, run.message)
            await asyncio.sleep(0.05)
        out["in_flight"] = run.buffer.reserved
        await run.until(step=1, timeout=600)
        out["live_s"] = time.monotonic() - t0
        out["stuck_while_live"] = list(run.watchdog.stuck)
        out["events_while_live"] = [e for e in run.events if e["kind"] in ("stuck", "replica_failed")]
        out["trainer_pid"] = pid = run.parts.trainer.handle.pids_list[0]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        with pytest.raises(Exception) as info:  # the run fails: the stopped trainer is stuck
            await run.wait()
        out["error"] = info.value

    def stop_burner():
        for b in burners:
            b.kill()
            b.wait()
        burners.clear()

    try:
        loop.run_until_complete(go())
        stop_burner()  # its work is done: the run has failed on the stopped trainer
        yield run, out
    finally:
        stop_burner()
        if "trainer_pid" in out:
            try:
                os.kill(out["trainer_pid"], signal.SIGCONT)
            except OSError:
                pass
        loop.run_until_complete(run.shutdown())


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


@pytest.mark.integration
def test_slow_but_live_at_scale_is_not_flagged(busy):
    """Claim: ~1,000 episodes in flight with turns and env calls far longer than the deadlines, and 512-episode
    steps on a machine with a core taken, are not flagged; a trainer stopped in the same configuration is."""
    from forgelab.runtime.watchdog import StuckError

    run, out = busy
    assert out["in_flight"] >= 1000
    assert out["stuck_while_live"] == [] and out["events_while_live"] == [], out
    # the work really was slow: each episode (2 turns, 4.5 s of thinking after each, its turns queued behind ~1,000
    # others) took longer than the no-progress deadline, so a watchdog that judged by duration would have fired;
    # a think (4.5 s) is shorter than it: while every episode of the run thinks at once, nothing moves
    trained = [ep for ep in run.rollout.recent if run.buffer.status(ep.id) == "trained"]
    latencies = sorted(ep.info["latency_s"] for ep in trained)
    assert len(latencies) >= 512, len(latencies)
    print(f"in flight {out['in_flight']}, episode latency p50 {latencies[len(latencies) // 2]:.1f} s "
          f"p99 {latencies[int(len(latencies) * 0.99)]:.1f} s, train_time_s {list(run.metrics['train_time_s'])}, "
          f"live for {out['live_s']:.1f} s; {err_text(out['error'])}")
    assert latencies[len(latencies) // 2] > BUSY_WATCH["no_progress_s"], latencies[len(latencies) // 2]
    # and the 512-episode step, the trainer holding its event loop, outlasted the unresponsive deadline
    assert run.metrics["train_time_s"].max() > BUSY_WATCH["unresponsive_s"], list(run.metrics["train_time_s"])
    # and the same configuration still catches a hang: the SIGSTOPped trainer's call ends in StuckError
    err = out["error"]
    while not isinstance(err, StuckError) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, StuckError), repr(out["error"])
    assert out["trainer_pid"] in err.pids and "stopped answering" in err.reason, err
    assert err.waited_s >= BUSY_WATCH["unresponsive_s"], err
    assert [e for e in run.events if e["kind"] == "stuck"], "no stuck event for the stopped trainer"


# ------------------------------------------------------------------------------------------------ the rules, fast


class FakeBeats:
    """Writes heartbeat records, as `forgelab.runtime.liveness` does, for a plain `sleep` process: the test decides
    what moves (``beat``, ``loop_beat``, ``counters``)."""

    def __init__(self):
        import subprocess

        from forgelab.runtime.liveness import liveness_dir

        self.proc = subprocess.Popen(["sleep", "300"])
        self.pid = self.proc.pid
        self.path = liveness_dir() / f"{self.pid}.json"
        self.beat = self.loop_beat = 0
        self.loop_cpu = 0.0
        self.counters: dict[str, int] = {}
        self.moving = {"beat", "loop_beat"}
        self.writes = 0

    async def run(self):
        import json

        while True:
            self.beat += "beat" in self.moving
            self.loop_beat += "loop_beat" in self.moving
            self.loop_cpu += 0.01 * ("loop_cpu" in self.moving)
            if "counters" in self.moving:
                self.counters["engine_steps"] = self.counters.get("engine_steps", 0) + 1
            # written whole, then renamed, as liveness writes them: a reader never sees a half-written record
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": self.pid, "label": "fake", "beat": self.beat,
                                       "loop_beat": self.loop_beat, "counters": dict(self.counters),
                                       "loop_cpu": self.loop_cpu}))
            os.replace(tmp, self.path)
            self.writes += 1
            await asyncio.sleep(0.02)

    def close(self):
        self.path.unlink(missing_ok=True)
        self.proc.kill()
        self.proc.wait()


RULES = dict(unresponsive_s=0.5, no_progress_s=0.8, heartbeat_s=0.05)


async def _watched(fake: FakeBeats, tmp_path, finish_after: float | None = None, rules: dict = RULES):
    """Watch a call that ends after `finish_after` s (None: never) on `fake`'s process; the call's result."""
    from forgelab.runtime.watchdog import Deadlines, Watchdog

    writer = asyncio.ensure_future(fake.run())
    done = asyncio.Event()
    events: list[tuple[str, dict]] = []
    wd = Watchdog(Deadlines(**rules, py_spy="/nonexistent/py-spy"), out_dir=tmp_path,
                  emit=lambda kind, **f: events.append((kind, f)))

    async def call():
        if finish_after is None:
            await done.wait()
        else:
            await asyncio.sleep(finish_after)
        return "answered"

    try:
        return await wd.watch(call(), pids=[fake.pid], part="fake part", what="fake()"), events
    finally:
        writer.cancel()


@pytest.mark.parametrize("moving, reason", [
    (set(), "stopped answering"),                          # SIGSTOP: nothing moves
    ({"beat"}, "event loop has not run"),                  # a deadlocked endpoint: only the thread beats
    ({"beat", "loop_beat"}, "made progress"),              # alive, waiting on nothing that comes
])
def test_rule_stuck(tmp_path, moving, reason):
    from forgelab.runtime.watchdog import StuckError

    fake = FakeBeats()
    fake.moving = moving
    try:
        with pytest.raises(StuckError) as info:
            asyncio.run(_watched(fake, tmp_path))
    finally:
        fake.close()
    err = info.value
    assert reason in err.reason and err.part == "fake part" and err.call == "fake()" and err.pids == [fake.pid]
    deadline = RULES["no_progress_s"] if reason == "made progress" else RULES["unresponsive_s"]
    assert err.waited_s >= deadline, err
    text = err.dump.read_text()
    assert f"===== pid {fake.pid} (fake) via none =====" in text and "py-spy not found" in text
    assert "via controller" in text


def test_rule_slow_call_with_progress_is_not_stuck(tmp_path):
    fake = FakeBeats()
    fake.moving = {"beat", "loop_beat", "counters"}
    try:
        answer, events = asyncio.run(_watched(fake, tmp_path, finish_after=3 * RULES["no_progress_s"]))
    finally:
        fake.close()
    assert answer == "answered" and events == []


def test_rule_progress_alone_keeps_a_busy_loop_alive(tmp_path):
    """Synchronous work holding the loop (no loop beat) that moves counters is busy, not deadlocked."""
    fake = FakeBeats()
    fake.moving = {"beat", "counters"}
    try:
        answer, events = asyncio.run(_watched(fake, tmp_path, finish_after=3 * RULES["unresponsive_s"]))
    finally:
        fake.close()
    assert answer == "answered" and events == []


def test_rule_a_loop_held_by_computation_is_not_deadlocked(tmp_path):
    """One long synchronous piece of work (a forward pass of a large batch) holds the loop and moves no counter
    for longer than ``unresponsive_s``, but its thread burns CPU: busy, not deadlocked (only ``no_progress_s``
    bounds it)."""
    rules = dict(RULES, unresponsive_s=0.3, no_progress_s=3.0)
    fake = FakeBeats()
    fake.moving = {"beat", "loop_cpu"}
    try:  # 4 x unresponsive_s of a held loop, well inside no_progress_s
        answer, events = asyncio.run(_watched(fake, tmp_path, finish_after=1.2, rules=rules))
    finally:
        fake.close()
    assert answer == "answered" and events == []


# ------------------------------------------------- a process on another host: heartbeats over the network


REMOTE_CHILD = """
import asyncio, json, sys
from forgelab.runtime import liveness

async def main(directory, mode, sink):
    liveness.start(directory, "remote-worker", 0.1, tuple(json.loads(sink)))
    while True:
        liveness.bump("engine_steps")
        await asyncio.sleep(0.02)
        if mode == "deadlock" and liveness.COUNTERS["engine_steps"] > 10:
            liveness._deadlocked_by_test_hook()   # the loop's thread waits on itself; the heartbeat thread beats on

asyncio.run(main(*sys.argv[1:]))
"""


class RemoteChild:
    """A forgelab process as on another host: its own host name (a UTS namespace), its heartbeat files on a
    directory this controller does not read, its records sent to this controller's heartbeat sink over UDP."""

    def __init__(self, tmp_path, mode: str):
        import json
        import shutil
        import subprocess
        import sys

        from forgelab.runtime.beat_sink import beat_sink

        unshare = shutil.which("unshare")
        ok = unshare and subprocess.run([unshare, "--uts", "true"], capture_output=True).returncode == 0
        if not ok:
            reason = "no `unshare --uts` here (needs root): cannot give a process another host name"
            if os.environ.get("CI"):
                pytest.fail(f"CI is set and the remote heartbeat test cannot run: {reason}", pytrace=False)
            pytest.skip(reason)
        self.sink = beat_sink()
        own_disk = tmp_path / "other-host"
        script = f"hostname forgelab-other-host && exec {sys.executable} -c {shlex_quote(REMOTE_CHILD)} " \
                 f"{own_disk} {mode} {shlex_quote(json.dumps(list(self.sink.address)))}"
        self.proc = subprocess.Popen([unshare, "--uts", "sh", "-c", script],
                                     env={**os.environ, "PYTHONPATH": os.getcwd()})
        self.pid = self.proc.pid  # sh exec'd python: the same process
        deadline = time.monotonic() + 60
        while self.sink.record(self.pid) is None:  # its first heartbeat, the condition itself
            assert self.proc.poll() is None and time.monotonic() < deadline, "the remote child sent no heartbeat"
            time.sleep(0.02)

    def close(self):
        self.proc.kill()
        self.proc.wait()


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


#: Real processes on a loaded 2-core machine get the CPU late: deadlines of seconds, not RULES' fractions.
REMOTE_RULES = dict(unresponsive_s=2.0, no_progress_s=3.0, heartbeat_s=0.1)


async def _watch_remote(child: RemoteChild, tmp_path, finish_after: float | None, rules: dict = REMOTE_RULES):
    from forgelab.runtime.watchdog import Deadlines, Watchdog

    wd = Watchdog(Deadlines(**rules, py_spy="/nonexistent/py-spy"), out_dir=tmp_path)

    async def call():
        await asyncio.sleep(1e9 if finish_after is None else finish_after)
        return "answered"

    return await wd.watch(call(), pids=[child.pid], part="remote part", what="remote()")


def test_remote_heartbeats_keep_a_live_process_unflagged(tmp_path):
    child = RemoteChild(tmp_path, "live")
    try:
        rec = child.sink.record(child.pid)
        assert rec["host"] == "forgelab-other-host"
        from forgelab.runtime.liveness import liveness_dir

        assert not (liveness_dir() / f"{child.pid}.json").exists()  # only the network carries its heartbeat
        assert asyncio.run(_watch_remote(child, tmp_path, 2 * REMOTE_RULES["no_progress_s"])) == "answered"
    finally:
        child.close()


def test_remote_sigstopped_process_is_flagged(tmp_path):
    from forgelab.runtime.watchdog import StuckError

    child = RemoteChild(tmp_path, "live")
    try:
        os.kill(child.pid, signal.SIGSTOP)
        with pytest.raises(StuckError) as info:
            asyncio.run(_watch_remote(child, tmp_path, None))
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.close()
    err = info.value
    assert "stopped answering" in err.reason and err.pids == [child.pid], err
    assert err.waited_s >= REMOTE_RULES["unresponsive_s"], err
    body = section(err.dump.read_text(), child.pid)
    # py-spy and signals cannot reach another host, and a stopped process cannot write its own stack
    assert body.startswith("via none") and "sent no faulthandler dump" in body, body


def test_remote_deadlocked_process_is_flagged_and_dumped_over_the_network(tmp_path):
    from forgelab.runtime.watchdog import StuckError

    child = RemoteChild(tmp_path, "deadlock")
    try:
        with pytest.raises(StuckError) as info:
            asyncio.run(_watch_remote(child, tmp_path, None))
    finally:
        child.close()
    err = info.value
    assert "event loop has not run" in err.reason and err.pids == [child.pid], err
    body = section(err.dump.read_text(), child.pid)
    assert body.startswith("via faulthandler") and "_deadlocked_by_test_hook" in body, body
    assert "sent by its heartbeat thread" in body


def test_the_sink_drops_a_forged_heartbeat():
    import socket

    from forgelab.runtime.beat_sink import BeatSink, pack

    sink = BeatSink()  # its own: the controller's sink (other tests in this process) keeps its dropped count at 0
    before = sink.dropped
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(pack(b"not the key" * 3, {"kind": "beat", "pid": 424242, "beat": 1}), ("127.0.0.1", sink.port))
    deadline = time.monotonic() + 10
    while sink.dropped == before:  # the condition: the sink read it and refused it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sink.record(424242) is None
