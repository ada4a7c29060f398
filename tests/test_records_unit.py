"""Records that hold (issue #25, items 1 and 8) against in-process fakes: no process starts.

Code from a run directory runs only when the caller says the directory is trusted, and a payload whose bytes
differ from the SHA-256 recorded when it was written is refused even then; a replay checks the package
versions and the built-in code it is about to run against the manifest before anything spawns; a fork is
replayed from its fork point; an environment run in deterministic mode either replays exactly or its
manifest says it is not deterministic; a run that cannot seed its samples fails instead of running unseeded.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sys

import cloudpickle
import pytest

from forgelab.config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
from forgelab.run import Run
from forgelab.testing.fakes import fake_spawn

# functions defined here travel by value (as a notebook cell's would), not as an import of this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def short_reward(prompt, completion, target, **info):
    """1.0 for completions of at most 3 characters."""
    return 1.0 if len(completion.strip()) <= 3 else 0.0


def always_one(prompt, completion, target, **info):
    return 1.0


def config(tmp_path, name="rec", steps=6, max_policy_age=0, **rollout) -> RunConfig:
    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2, concurrency=2, max_tokens=6,
                              reward_timeout_s=5.0, **rollout),
        train=TrainConfig(steps=steps, batch_size=8, warmup_steps=1, max_policy_age=max_policy_age, seed=11),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False),
        placement=PlacementConfig(),
    )


class CountingSpawn:
    """`fake_spawn` that counts its calls: a refused replay must refuse before anything spawns."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, cfg):
        self.calls += 1
        return await fake_spawn(cfg)


def recorded_run(tmp_path, name="rec", **kw) -> Run:
    """A finished synchronous fake run with a custom reward added live after step 2 (pickled into events.jsonl)."""
    run = Run(config(tmp_path, name=name, **kw), spawn=fake_spawn)

    def on_row(row):
        if row.get("step") == 2:
            run.add_reward("short", short_reward, 0.5)

    run.add_listener(on_row)

    async def go():
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished", run.message
    return run


def _edit_events(run_dir, edit):
    path = run_dir / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(e)) + "\n" for e in events))


# ---------------------------------------------------------------- function_code: trust and the pickle's hash
def test_pickle_hash_recorded_and_restore_needs_trust():
    from forgelab.controller.function_code import FunctionRestoreError, UntrustedCodeError, fn_record, restore_fn
    from forgelab.rewards import REWARDS

    rec = json.loads(json.dumps(fn_record(short_reward, REWARDS)))  # as read back from a file
    payload = base64.b64decode(rec["pickle"])
    assert rec["pickle_sha256"] == hashlib.sha256(payload).hexdigest()
    with pytest.raises(UntrustedCodeError, match="trusted=True") as err:
        restore_fn(rec, REWARDS, what="reward 'short'")
    assert isinstance(err.value, FunctionRestoreError) and "reward 'short'" in str(err.value)
    back = restore_fn(rec, REWARDS, trusted=True)
    assert back is not short_reward and back("", "12", "12") == 1.0 and back("", "12345", "1") == 0.0
    # a built-in is restored by name from this process's registry: no code from the record runs, no trust needed
    builtin = fn_record(REWARDS["exact_answer"], REWARDS)
    assert builtin["pickle"] is None and restore_fn(builtin, REWARDS) is REWARDS["exact_answer"]


def test_edited_pickle_is_refused_even_when_trusted():
    from forgelab.controller.function_code import FunctionRestoreError, fn_record, restore_fn
    from forgelab.rewards import REWARDS

    rec = fn_record(short_reward, REWARDS)
    # a valid pickle of another function in place of the recorded one (hashes left as written)
    edited = {**rec, "pickle": base64.b64encode(cloudpickle.dumps(always_one)).decode("ascii")}
    with pytest.raises(FunctionRestoreError, match="sha256"):
        restore_fn(edited, REWARDS, trusted=True)
    # one flipped byte
    raw = bytearray(base64.b64decode(rec["pickle"]))
    raw[len(raw) // 2] ^= 0x01
    with pytest.raises(FunctionRestoreError, match="sha256"):
        restore_fn({**rec, "pickle": base64.b64encode(bytes(raw)).decode("ascii")}, REWARDS, trusted=True)
    # a record whose hash was removed is no better than an edited one
    with pytest.raises(FunctionRestoreError, match="sha256"):
        restore_fn({k: v for k, v in rec.items() if k != "pickle_sha256"}, REWARDS, trusted=True)


# ---------------------------------------------------------------- replay: trust, versions and code checks
def test_replay_of_untrusted_dir_refuses_its_pickled_code_before_spawning(tmp_path):
    from forgelab.controller.function_code import UntrustedCodeError
    from forgelab.run import replay

    run = recorded_run(tmp_path / "runs")
    assert any(e["kind"] == "reward_added" and e["code"]["pickle"] for e in run.events)
    spawn = CountingSpawn()
    with pytest.raises(UntrustedCodeError, match="trusted=True"):
        asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn))
    assert spawn.calls == 0 and not (tmp_path / "replays").exists()
    report = asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True))
    assert spawn.calls == 1 and report.steps == 6 and len(report.changes_applied) == 1
    assert report.ok, str(report)


def test_replay_refuses_an_edited_pickle_even_when_trusted(tmp_path):
    from forgelab.controller.function_code import FunctionRestoreError
    from forgelab.run import replay

    run = recorded_run(tmp_path / "runs")
    other = base64.b64encode(cloudpickle.dumps(always_one)).decode("ascii")
    _edit_events(run.out_dir, lambda e: {**e, "code": {**e["code"], "pickle": other}} if e["kind"] == "reward_added" else e)
    spawn = CountingSpawn()
    with pytest.raises(FunctionRestoreError, match="sha256"):
        asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True))
    assert spawn.calls == 0


def test_replay_checks_package_versions_and_builtin_code_against_the_manifest(tmp_path):
    from forgelab.controller.provenance import MANIFEST_FILE
    from forgelab.experiments.replay import ReplayRefused
    from forgelab.run import replay

    run = recorded_run(tmp_path / "runs")
    path = run.out_dir / MANIFEST_FILE
    original = json.loads(path.read_text())
    assert original["code"]["loss"]["sha256"] and set(original["code"]["rewards"]) == {"exact_answer", "answer_format"}
    m = json.loads(json.dumps(original))
    m["versions"]["torch"] = "0.0.1"
    path.write_text(json.dumps(m))
    spawn = CountingSpawn()
    with pytest.raises(ReplayRefused, match="torch") as err:
        asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True))
    assert "0.0.1" in str(err.value) and "allow_mismatch=True" in str(err.value) and spawn.calls == 0
    # the built-in loss's code as recorded differs from this forgelab's
    m = json.loads(json.dumps(original))
    m["code"]["loss"]["code_sha256"] = "0" * 64
    path.write_text(json.dumps(m))
    with pytest.raises(ReplayRefused, match="loss 'grpo'"):
        asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True))
    assert spawn.calls == 0
    # the explicit override runs it and says what it overrode
    report = asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True,
                                allow_mismatch=True))
    assert spawn.calls == 1 and any("loss 'grpo'" in n for n in report.notes), report.notes


def test_fork_replays_from_its_fork_point(tmp_path):
    """The fork's manifest names the checkpoint it was forked from; its replay restores it (the parent's state,
    not step 0), applies the fork's changes again and reproduces the child's learning metrics."""
    from forgelab.run import replay

    parent = Run(config(tmp_path / "runs", name="par", steps=6), spawn=fake_spawn)
    held = {}

    async def go():
        await parent.start()
        await parent.until(step=2)
        held["child"] = child = await parent.fork(name="par-fork", pool=fake_spawn, pause_parent=True,
                                                  reward_weights={"answer_format": 0.0},
                                                  rewards={"short": (short_reward, 0.5)})
        await asyncio.wait_for(child.wait(), 60)
        await child.shutdown()
        parent.resume()
        await asyncio.wait_for(parent.wait(), 60)
        await parent.shutdown()

    asyncio.run(go())
    child = held["child"]
    assert child.state == "finished", child.message
    k = [e for e in child.events if e["kind"] == "forked_from"][0]["step"]
    assert 2 <= k < 6
    m = json.loads((child.out_dir / "manifest.json").read_text())
    ckpt = m["resume_from"]
    assert ckpt and "forks" in ckpt
    spawn = CountingSpawn()
    report = asyncio.run(replay(child.out_dir, out_dir=tmp_path / "replays", spawn=spawn, trusted=True))
    assert spawn.calls == 1 and report.ok, str(report)
    from forgelab.controller.events import EventLog

    resumed = [e for e in EventLog.read(report.replay_dir) if e["kind"] == "resumed_from_checkpoint"]
    assert [e["path"] for e in resumed] == [ckpt]
    import pandas as pd

    again = pd.read_csv(report.replay_dir / "metrics.csv")
    assert list(again["step"]) == list(range(1, 7))
    assert "reward/short" in again.columns and again[again["step"] <= k]["reward/short"].isna().all()
    assert again[again["step"] == 6]["reward/short"].notna().all()  # the fork's reward re-applied, from its episodes
    # the fork's code is pickled: replaying it needs trust
    from forgelab.controller.function_code import UntrustedCodeError

    with pytest.raises(UntrustedCodeError, match="trusted=True"):
        asyncio.run(replay(child.out_dir, out_dir=tmp_path / "replays2", spawn=spawn))
    assert spawn.calls == 1


# ---------------------------------------------------------------- determinism: seeds and environments
def test_one_episode_seed_owned_by_the_rollout_part():
    import importlib

    rollout = importlib.import_module("forgelab.controller.rollout")
    replay = importlib.import_module("forgelab.experiments.replay")
    assert replay.episode_seed is rollout.episode_seed
    # the definition, computed here: the first 4 bytes of sha256("seed:episode"), little-endian, 31 bits
    for seed, ep in ((0, 0), (3, 17), (11, 123456)):
        digest = hashlib.sha256(f"{seed}:{ep}".encode()).digest()
        assert rollout.episode_seed(seed, ep) == int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def test_failure_to_seed_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """Deterministic mode needs the generator's seeded `generate`; if it cannot be checked the run fails."""

    def start(run):
        async def go():
            try:
                await run.start()
                await asyncio.wait_for(run.wait(), 60)
            finally:
                await run.shutdown()
        asyncio.run(go())

    monkeypatch.setitem(sys.modules, "forgelab.engines.generator", None)  # its import now raises ImportError
    with pytest.raises(RuntimeError, match="seeds every sample.*importing forgelab.engines.generator failed"):
        start(Run(config(tmp_path, steps=2), spawn=fake_spawn))
    monkeypatch.undo()
    from forgelab.engines.generator import VLLMEngine

    async def unseeded(self, prompts, n=1, sampling=None):
        raise AssertionError("never called")

    monkeypatch.setattr(VLLMEngine, "generate", unseeded)
    with pytest.raises(RuntimeError, match="takes no `seeds`"):
        start(Run(config(tmp_path, name="sync2", steps=2), spawn=fake_spawn))
    # an asynchronous run is not seeded: nothing to check, it trains
    run = Run(config(tmp_path, name="async", steps=2, max_policy_age=1), spawn=fake_spawn)
    start(run)
    assert run.state == "finished", run.message


def test_env_run_in_sync_mode_replays_exactly_or_is_marked_not_deterministic(tmp_path):
    from forgelab.run import replay

    cfg = config(tmp_path / "runs", name="env", steps=4, env="arithmetic_tutor", max_turns=2, rewards=None)
    run = Run(cfg, spawn=fake_spawn)

    async def go():
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished", run.message
    m = json.loads((run.out_dir / "manifest.json").read_text())
    report = asyncio.run(replay(run.out_dir, out_dir=tmp_path / "replays", spawn=fake_spawn))
    if m["deterministic"]:
        assert report.ok, str(report)
    else:
        assert "env" in m["nondeterministic_reason"] and not report.deterministic
        assert m["nondeterministic_reason"] in str(report) or report.ok
    # a single-turn run in the same mode is deterministic, and says so
    plain = json.loads((recorded_run(tmp_path / "plain").out_dir / "manifest.json").read_text())
    assert plain["deterministic"] is True and plain.get("nondeterministic_reason") is None


# ---------------------------------------------------------------- wandb: several runs alive in one process
@pytest.mark.slow  # wandb's service process and reader: ~20-50 s on 2 busy cores
def test_two_trackers_alive_in_one_process_each_keep_a_complete_wandb_history(tmp_path):
    """A parent's tracker keeps logging after a fork's tracker starts (wandb on, offline); both histories are
    complete when read back with wandb's own reader (with reinit="finish_previous" the parent's would stop)."""
    import shutil
    import subprocess
    from pathlib import Path

    import wandb

    from forgelab.controller.tracking import Tracker

    def history(out_dir: Path) -> dict[int, dict]:
        runs = sorted((out_dir / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        cli = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
        out = subprocess.run([cli, "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True,
                             timeout=300, check=True).stdout
        items = [json.loads(x)["history"]["item"] for x in out.splitlines()
                 if x.startswith("{") and json.loads(x).get("type") == "history"]
        return {int(h["_step"]): h for h in items if "loss" in h}

    try:
        parent = Tracker(tmp_path / "parent", use_wandb=True, run_name="parent")
        for s in (1, 2):
            parent.log({"step": s, "loss": 1.0 / s})
        child = Tracker(tmp_path / "child", use_wandb=True, run_name="child")
        assert parent.wandb_dir and child.wandb_dir and parent.wandb_dir != child.wandb_dir
        for s in (3, 4, 5):
            parent.log({"step": s, "loss": 1.0 / s})
            child.log({"step": s, "loss": 2.0 / s})
        parent.finish()
        child.finish()
        p, c = history(tmp_path / "parent"), history(tmp_path / "child")
    finally:
        wandb.teardown()
    assert sorted(p) == [1, 2, 3, 4, 5] and all(p[s]["loss"] == 1.0 / s for s in p)
    assert sorted(c) == [3, 4, 5] and all(c[s]["loss"] == 2.0 / s for s in c)


def test_restored_function_keeps_its_recorded_source_when_its_file_is_gone(tmp_path):
    """A function restored from a record reports the record's source (what `fn_record` writes again in a replay),
    even when the file it was defined in no longer exists (a run directory made on another machine)."""
    import importlib.util

    from forgelab.controller.function_code import fn_record, restore_fn, source_of

    path = tmp_path / "gone_module.py"
    path.write_text("def gone_reward(prompt, completion, target, **info):\n    return 0.25\n")
    spec = importlib.util.spec_from_file_location("gone_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rec = fn_record(module.gone_reward)
    rec["pickle"] = base64.b64encode(cloudpickle.dumps(module.gone_reward, protocol=5)).decode()  # by value
    rec["pickle_sha256"] = hashlib.sha256(base64.b64decode(rec["pickle"])).hexdigest()
    assert "return 0.25" in rec["source"]
    path.unlink()
    import linecache

    linecache.clearcache()
    back = restore_fn(rec, trusted=True)
    assert back("", "", "") == 0.25
    assert source_of(back) == rec["source"] and fn_record(back)["source"] == rec["source"]
