"""Faults and bad input on real meshes: the run keeps going and nothing is lost.

Two runs carry the faults, one module-scoped each (spawning costs ~30 s):

- run A (2 generator replicas, a reference model, two misbehaving rewards in
  its composer) takes, one test after another: a SIGKILLed generator replica,
  a SIGKILLed reference model, rewards that raise / return NaN / hang, and
  losses that return the wrong shape and NaN until the run pauses;
- run B (a 2-process trainer) is started by a subprocess controller that is
  SIGKILLed after its first checkpoint, then resumed in this process.

Every test checks its own promise; the last numbers land in
artifacts/faults_summary.json (docs/reliability.md quotes them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import psutil
import pytest

from forgelab.config.run_config import ConfigError, EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SUMMARY: dict = {}


def tiny_config(out_dir, name: str, steps: int, *, checkpoint_every: int = 0, **placement) -> RunConfig:
    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=4, concurrency=2, max_tokens=6,
                              reward_timeout_s=3.0),
        train=TrainConfig(steps=steps, batch_size=16, warmup_steps=1, max_policy_age=1),
        eval=EvalConfig(every=0, n=16),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False, checkpoint_every=checkpoint_every),
        placement=PlacementConfig(**placement),
    )


# ---------------------------------------------------------------------------- helpers


def drive(loop, run, until, what: str, limit_s: float = 400.0) -> None:
    """Run the event loop until `until()` holds; a safety bound, not a speed assertion."""

    async def go():
        deadline = loop.time() + limit_s
        while not until():
            if run._main is not None and run._main.done():
                run._main.result()  # re-raises a failure
                if not until():
                    raise AssertionError(f"run ended ({run.state}: {run.message}) before: {what}")
            if loop.time() > deadline:
                raise AssertionError(f"gave up waiting for: {what} ({run!r}, events {run.events[-5:]})")
            await asyncio.sleep(0.2)

    loop.run_until_complete(go())


def tree_pids(root: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def non_loopback_listeners(pids: list[int]) -> list[str]:
    """Every TCP listener / bound UDP socket of `pids` whose address is not loopback."""
    bad = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # SOCK_DGRAM
            if not listening:
                continue
            ip = ipaddress.ip_address(c.laddr.ip)
            if getattr(ip, "ipv4_mapped", None):
                ip = ip.ipv4_mapped
            if not ip.is_loopback:
                bad.append(f"pid {pid} ({psutil.Process(pid).name()}) listens on {c.laddr.ip}:{c.laddr.port}")
    return bad


def accounting(run) -> dict:
    c = run.buffer.check_accounting()
    return {k: c[k] for k in ("generated", "trained", "evicted", "dropped", "buffered", "in_flight", "dropped_reasons")}


class FaultyRewards:
    """Two rewards that misbehave on purpose and keep their own record of what they did.

    `sleepy` hangs (until released) on its first `hangs` calls: more than the
    old 4-thread reward pool had, so a pool-based scorer would starve. `flaky`
    raises on 1/16 of inputs and returns NaN on another 1/16 (by a hash of the
    input, so a repeated input fails again).
    """

    def __init__(self, hangs: int = 6):
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.hangs_left = hangs
        self.hung: list[tuple[str, str]] = []
        self.raised: list[tuple[str, str]] = []
        self.nan: list[tuple[str, str]] = []

    def sleepy(self, prompt, completion, target, **info):
        with self.lock:
            hang = self.hangs_left > 0
            self.hangs_left -= hang
            if hang:
                self.hung.append((prompt, completion))
        if hang:
            self.release.wait(900)
        return 0.0

    def flaky(self, prompt, completion, target, **info):
        if self.release.is_set():  # teardown: hung calls finishing late are not counted
            return 0.0
        bucket = zlib.crc32(f"{prompt}|{completion}".encode()) % 16
        with self.lock:
            if bucket == 0:
                self.raised.append((prompt, completion))
            elif bucket == 1:
                self.nan.append((prompt, completion))
        if bucket == 0:
            raise ValueError(f"flaky reward cannot parse {completion!r}")
        return float("nan") if bucket == 1 else 0.0


def bad_loss(kind: str):
    """A loss that returns a wrong-shaped or a NaN loss (a closure: shipped to the trainer by value)."""

    def loss(logprobs_B_T, *, mask_B_T, **_):
        per_row = (logprobs_B_T * mask_B_T.float()).sum(-1)
        if kind == "shape":
            return per_row, {}
        return per_row.sum() * float("nan"), {}

    loss.__name__ = f"{kind}_loss"
    return loss


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()
    SUMMARY["totals"] = totals(SUMMARY)
    out = ROOT / "artifacts" / "faults_summary.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(SUMMARY, indent=2, sort_keys=True, default=str) + "\n")


def totals(summary: dict) -> dict:
    """Faults injected, runs that reached their last step, episodes unaccounted for (the README numbers)."""
    rf = summary.get("reward_faults", {})
    faults = {
        "generator_replica_sigkill": int("generator_kill" in summary),
        "reference_sigkill": int("reference_kill" in summary),
        "controller_sigkill": int("controller_kill" in summary),
        "reward_raised": rf.get("raised", 0), "reward_nan": rf.get("nan", 0), "reward_hung": rf.get("hung", 0),
        "bad_loss_steps": summary.get("bad_loss", {}).get("skipped_steps", 0),
        "rewards_refused": summary.get("rewards_refused", 0), "bad_configs": summary.get("bad_configs", 0),
    }
    runs = [summary[k] for k in ("run_a", "resume") if k in summary]
    return {"faults_injected": faults, "faults_total": sum(faults.values()),
            "runs_finished": sum(r.get("finished", False) for r in runs), "runs": len(runs),
            "episodes_lost": sum(r.get("episodes_lost", 0) for r in runs),
            "orphan_processes": summary.get("controller_kill", {}).get("orphans")}


class Faulty:
    def __init__(self, run, rewards: FaultyRewards):
        self.run = run
        self.rewards = rewards
        self.respawns: list[dict] = []  # what the respawned generator served right after on_respawn


@pytest.fixture(scope="module")
def faulty(loop, tmp_path_factory):
    from forgelab.run import Run

    # Long enough that the run is still training when the later fault tests inject their faults. The run only
    # advances while a test drives the loop, and each fault test drives it to a condition then pauses or
    # returns, so the step they reach does not depend on the machine's speed: the generator kill lands at
    # step 1, the reference kill at step 3, the bad loss pauses at step 5 and one more step follows (every
    # recorded artifacts/faults_summary.json); 16 steps leave that twice over, and the reward test waits for
    # the end. (40 steps before: the last 34 trained only toward the end.)
    cfg = tiny_config(tmp_path_factory.mktemp("faulty"), "faulty", 16, generator_replicas=2, reference=True)
    run = Run(cfg)
    rewards = FaultyRewards()
    run.rewards.add("sleepy", rewards.sleepy, 0.0)  # weight 0: still evaluated, still fails the episode
    run.rewards.add("flaky", rewards.flaky, 0.0)
    f = Faulty(run, rewards)
    loop.run_until_complete(run.start())
    hook = run.generators.on_respawn

    async def watched(handle):
        await hook(handle)
        run_version = run.version  # read before any await: what the replica must serve now
        served = await handle.actor.version.call_one()
        f.respawns.append({"replica": handle.replica_index, "served": served, "run_version": run_version})

    run.generators.on_respawn = watched
    yield f
    rewards.release.set()
    loop.run_until_complete(run.shutdown())


# ---------------------------------------------------------------------------- bad configuration


@pytest.mark.parametrize("section, change, field", [
    ("train", {"loss": "no_such_loss"}, "train.loss"),
    ("model", {"path": "/nonexistent/model"}, "model.path"),
    ("placement", {"with_gpus": True, "generator_replicas": 64}, "placement"),
    ("train", {"batch_size": -16}, "train.batch_size"),
    ("rollout", {"group_size": -4}, "rollout.group_size"),
])
def test_bad_config_raises_before_any_process(tmp_path, section, change, field):
    from forgelab.run import Run

    good = tiny_config(tmp_path, "bad", 2)
    bad = dataclasses.replace(good, **{section: dataclasses.replace(getattr(good, section), **change)})
    before = set(tree_pids(os.getpid()))
    with pytest.raises(ConfigError) as err:
        Run(bad)
    assert field in str(err.value).split(":")[0], str(err.value)
    assert set(tree_pids(os.getpid())) - before == set(), "Run(bad config) spawned a process"
    SUMMARY["bad_configs"] = SUMMARY.get("bad_configs", 0) + 1


# ---------------------------------------------------------------------------- run A


def test_reward_that_fails_everything_is_refused(loop, faulty):
    from forgelab.run import RewardChangeRefused

    run = faulty.run
    drive(loop, run, lambda: len(run.rollout.recent) >= 16, "first rollout scored")
    for name, fn in [("always_raises", lambda p, c, t, **i: 1 / 0), ("always_nan", lambda p, c, t, **i: float("nan"))]:
        with pytest.raises(RewardChangeRefused, match=name):
            run.add_reward(name, fn, 1.0)
        assert name not in run.rewards.names
        SUMMARY["rewards_refused"] = SUMMARY.get("rewards_refused", 0) + 1
    run.add_reward("short", lambda p, c, t, **i: float(len(c) <= 6), 0.0)  # a sound one goes in
    assert "short" in run.rewards.names


def test_generator_replica_killed(loop, faulty):
    """Claim: a generator replica SIGKILLed with a call in flight is noticed, training goes on with the other
    replica, the service respawns it, and it serves the run's current weights before its first request.
    Structural: one kill after step 1 reaches every branch (its time is vLLM's respawn)."""
    run = faulty.run
    drive(loop, run, lambda: run.step >= 1 and run.generators.status()[1].in_flight > 0,
          "a generate call in flight on replica 1 after step 1")
    victim = run.generators.status()[1]
    version_at_kill, step_at_kill = run.version, run.step
    os.kill(victim.pid, signal.SIGKILL)
    drive(loop, run, lambda: not run.generators.status()[1].healthy, "replica 1's death noticed")
    drive(loop, run, lambda: run.step >= step_at_kill + 1, "a step with one generator replica")
    # Steps take ~1 s and a vLLM respawn tens of seconds: hold training so the run does not end first.
    run.pause()
    drive(loop, run, lambda: run.generators.status()[1].restarts >= 1 and run.generators.status()[1].healthy,
          "generator replica 1 respawned")
    run.resume()
    back = run.generators.status()[1]
    assert back.pid != victim.pid and not alive(victim.pid)
    assert [e for e in run.events if e["kind"] == "replica_failed" and e["replica"] == 1]
    # it caught up with the weights before serving
    assert len(faulty.respawns) == 1, faulty.respawns
    r = faulty.respawns[0]
    assert r["served"] == r["run_version"] >= max(1, version_at_kill), r
    drive(loop, run, lambda: run.step >= step_at_kill + 2, "two more steps after the kill")
    SUMMARY["generator_kill"] = {"step": step_at_kill, "respawned_with_version": r, "restarts": back.restarts}


def test_reference_killed(loop, faulty):
    run = faulty.run
    victim = run.reference.status()[0]
    step_at_kill = run.step
    os.kill(victim.pid, signal.SIGKILL)
    # no pause needed: rollouts wait for the reference, so at most the buffered episodes get trained meanwhile
    drive(loop, run, lambda: run.reference.status()[0].restarts >= 1 and run.reference.status()[0].healthy,
          "reference respawned")
    assert not alive(victim.pid)
    drive(loop, run, lambda: run.step >= step_at_kill + 2, "two more steps after the reference kill")
    # Hold training until the next test has set its bad loss: on an idle machine the remaining steps would
    # otherwise all run (and the run end) before it gets there.
    run.pause()
    SUMMARY["reference_kill"] = {"step": step_at_kill, "restarts": run.reference.status()[0].restarts}


def test_bad_loss_skips_steps_then_pauses(loop, faulty):
    from forgelab.engines.trainer import pack_loss

    run = faulty.run
    skips = lambda: [e for e in run.events if e["kind"] == "step_skipped"]  # noqa: E731
    n0 = len(skips())

    async def set_raw(kind):  # straight to the trainer: no dry run to stop it
        await run.trainer.call("set_loss", pack_loss(bad_loss(kind)), {})
        return await run.trainer.call("fingerprint")

    # Each bad loss runs until the run pauses itself (K skips in a row); the next is set while it is paused,
    # so no step can slip through between them however fast steps are.
    k = run.config.train.max_consecutive_failures
    before = loop.run_until_complete(set_raw("shape"))
    run.resume()  # paused by the previous test (a no-op when this test runs alone)
    drive(loop, run, lambda: run.state == "paused" and len(skips()) >= n0 + k, "the run pauses on the shape loss")
    loop.run_until_complete(set_raw("nan"))
    run.resume()
    drive(loop, run, lambda: run.state == "paused" and len(skips()) >= n0 + 2 * k, "the run pauses on the nan loss")
    reasons = [e["reason"] for e in skips()[n0:]]
    assert len(reasons) == 2 * k, reasons
    assert all("shape_loss" in r for r in reasons[:k]) and all("nan_loss" in r for r in reasons[k:]), reasons
    assert f"paused after {k} skipped steps" in run.message and "run.resume()" in run.message, run.message
    after = loop.run_until_complete(run.trainer.call("fingerprint"))
    assert after == before, "a skipped step changed parameters or optimizer state"
    assert run.buffer.counts()["dropped_reasons"].get("step_skipped", 0) >= 2 * k * run.config.train.batch_size

    step = run.step
    loop.run_until_complete(run.set_loss("grpo"))
    run.resume()
    drive(loop, run, lambda: run.step > step, "a step after resume")
    assert loop.run_until_complete(run.trainer.call("fingerprint")) != before
    SUMMARY["bad_loss"] = {"skipped_steps": len(reasons), "reasons": reasons, "paused_at_step": step}


def test_nothing_listens_beyond_loopback_run_a(faulty):
    pids = [os.getpid(), *tree_pids(os.getpid())]
    assert len(pids) >= 5  # controller, 2 generators, trainer, reference
    assert non_loopback_listeners(pids) == []


def test_reward_faults_drop_episodes_and_are_recorded(loop, faulty):
    run, fr = faulty.run, faulty.rewards
    drive(loop, run, lambda: run.state == "finished", "run A finishes")
    c = run.buffer.counts()["dropped_reasons"]
    assert fr.hung and fr.raised and fr.nan, "the faulty rewards never fired; the test proves nothing"
    assert c.get("reward_timeout", 0) == len(fr.hung)
    # An episode the flaky reward failed on is dropped as reward_error:flaky, unless the same episode also hit
    # the hanging reward (then its whole score timed out: reward_timeout) or the run ended while it was being
    # scored (rollout_cancelled). Either way it is dropped with a reason, never trained.
    flaky_calls = len(fr.raised) + len(fr.nan)
    assert 0 < c.get("reward_error:flaky", 0) <= flaky_calls
    assert flaky_calls - c["reward_error:flaky"] <= c.get("reward_timeout", 0) + c.get("rollout_cancelled", 0)
    # each failure is recorded with the input that caused it
    failures = list(run.reward_failures)
    flaky_inputs = {(f.prompt, f.completion) for f in failures if f.name == "flaky"}
    assert flaky_inputs and flaky_inputs <= set(fr.raised) | set(fr.nan)
    assert any("ValueError: flaky reward cannot parse" in f.error_text for f in failures)
    assert any("returned nan" in f.error_text for f in failures)
    # run.reward_failures keeps the latest 200; the events keep them all (with the offending input)
    hung = {(e["prompt"], e["completion"]) for e in run.events
            if e["kind"] == "reward_error" and e.get("reason") == "reward_timeout"}
    assert hung == set(fr.hung)
    events = [e for e in run.events if e["kind"] == "reward_error"]
    assert {e["reason"] for e in events} == {"reward_timeout", "reward_error:flaky"}
    assert all(e["completion"] is not None and e["prompt"] for e in events)
    # the hung calls are still blocked, yet the run trained to its last step: they starved nothing
    assert all(t.is_alive() for t in run.reward_runner.hung) and len(run.reward_runner.hung) == len(fr.hung)
    # no step trained on a corrupt value
    ro = run.rollouts
    trained = ro[ro["status"] == "trained"]
    assert len(trained) == run.buffer.counts()["trained"]
    assert trained["reward"].map(math.isfinite).all() and trained["advantage"].map(math.isfinite).all()
    assert trained["reward/flaky"].notna().all() and trained["reward/sleepy"].notna().all()
    bad_inputs = set(fr.raised) | set(fr.nan)  # flaky fails by input; sleepy hung by call order, not input
    assert not any((p, c) in bad_inputs for p, c in zip(trained["prompt"], trained["completion"]))
    SUMMARY["reward_faults"] = {"raised": len(fr.raised), "nan": len(fr.nan), "hung": len(fr.hung),
                                "abandoned_threads_alive_at_end": len(run.reward_runner.hung)}


def test_run_a_survived_with_every_episode_accounted_for(loop, faulty):
    run = faulty.run
    drive(loop, run, lambda: run.state == "finished", "run A finishes")
    assert run.step == run.config.train.steps and len(run.metrics) == run.config.train.steps
    acc = accounting(run)
    assert acc["trained"] == run.step * run.config.train.batch_size  # no episode trained twice, none missing
    # every episode the controller ever made is in the ledger: none vanished in a failed rollout
    assert acc["generated"] + run.rollout.ids_unused == run.rollout.next_episode_id
    for reason in acc["dropped_reasons"]:
        assert reason.split(":")[0] in {"reward_timeout", "reward_error", "group_too_small", "step_skipped",
                                         "rollout_error", "zero_variance_group", "buffer_full", "rollout_cancelled"}
    SUMMARY["run_a"] = {"finished": run.state == "finished", "steps": run.step, "episodes": acc,
                        "episodes_lost": acc["generated"] - (acc["trained"] + acc["evicted"] + acc["dropped"]
                                                             + acc["buffered"] + acc["in_flight"]),
                        "episodes_never_accounted": run.rollout.next_episode_id - run.rollout.ids_unused - acc["generated"],
                        "rollout_errors": [e["message"][:200] for e in run.events if e["kind"] == "rollout_error"],
                        "service_events": [(e["kind"], e.get("replica")) for e in run.events
                                           if e["kind"] in ("replica_failed", "replica_restarted")]}


# ---------------------------------------------------------------------------- run B: the controller dies

CONTROLLER = """
import asyncio, json, sys
from forgelab.config.run_config import RunConfig
from forgelab.run import Run

async def main():
    await Run(RunConfig.from_dict(json.load(open(sys.argv[1])))).start()
    await asyncio.Event().wait()  # train in the background until killed

asyncio.run(main())
"""


def test_controller_killed_then_resumed(loop, tmp_path):
    """Claim: a controller SIGKILLed after its first checkpoint leaves no orphan process, and a run resumed from
    that checkpoint starts at its step, version, data stream and trainer fingerprint, listens on loopback only,
    and finishes with a gapless learning curve and every episode accounted for. Structural: 6 steps with a
    checkpoint every 2 is the smallest run with a checkpoint before the kill and steps after the resume; its
    time is two cold starts (the killed controller's and the resumed run's), which this test must keep."""
    from forgelab.run import Run

    cfg = tiny_config(tmp_path, "resume", 6, checkpoint_every=2, reference=False, trainer_procs=2)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "controller.py").write_text(CONTROLLER)
    ckpts = tmp_path / "resume" / "checkpoints"
    log = (tmp_path / "controller.log").open("w")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "controller.py"), str(tmp_path / "cfg.json")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while not (ckpts / "LATEST").is_file():
            assert proc.poll() is None, (tmp_path / "controller.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        children = tree_pids(proc.pid)
        assert len(children) >= 3  # generator + 2 trainer ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    # Monarch spawns its procs with PR_SET_PDEATHSIG: they die with the controller
    t0 = time.monotonic()
    while any(alive(p) for p in children) and time.monotonic() - t0 < 120:
        time.sleep(0.2)
    orphans = [p for p in children if alive(p)]
    assert orphans == [], f"processes outlived their killed controller: {orphans}"
    SUMMARY["controller_kill"] = {"children": len(children), "orphans": len(orphans),
                                  "seconds_until_children_gone": round(time.monotonic() - t0, 1)}

    saved_dir = ckpts / (ckpts / "LATEST").read_text().strip()
    saved = json.loads((saved_dir / "controller.json").read_text())
    run = Run(cfg, resume_from=ckpts)

    async def start():
        await run.start()
        position = (run.step, run.version, run.stream.state_dict())  # before any rollout ran
        return position, await run.trainer.call("fingerprint")

    try:
        (step, version, stream), fingerprint = loop.run_until_complete(start())
        assert (step, version, stream) == (saved["step"], saved["version"], saved["stream"])
        assert step >= 2 and version == step
        assert fingerprint == saved["trainer_fingerprint"], "parameters/optimizer differ from the checkpoint"
        assert len(fingerprint) == 2 and fingerprint[0]["optim_entries"] > 0
        resumed = [e for e in run.events if e["kind"] == "resumed_from_checkpoint"]
        assert resumed and resumed[0]["fingerprint_match"] is True

        # a 2-rank trainer has a TCP rendezvous (TCPStore + gloo): it must stay on loopback
        assert non_loopback_listeners([os.getpid(), *tree_pids(os.getpid())]) == []

        drive(loop, run, lambda: run.state == "finished", "the resumed run finishes")
        df = run.metrics
        assert list(df["step"]) == list(range(1, cfg.train.steps + 1)), "the learning curve has a gap"
        assert df["reward_mean"].notna().all()
        lines = (run.out_dir / "metrics.csv").read_text().splitlines()
        assert len(lines) == cfg.train.steps + 1
        acc = accounting(run)
        assert acc["trained"] == cfg.train.steps * cfg.train.batch_size
        lost = acc["generated"] - (acc["trained"] + acc["evicted"] + acc["dropped"] + acc["buffered"] + acc["in_flight"])
        SUMMARY["resume"] = {"finished": run.state == "finished", "resumed_at_step": step, "final_step": run.step,
                             "episodes": acc, "episodes_lost": lost}
    finally:
        loop.run_until_complete(run.shutdown())
