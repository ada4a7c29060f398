"""Provenance and exact replay on real processes: manifest, event log, resume with custom code, replay, diff.

One synchronous run (max_policy_age 0, 20 steps, batch 16) is shared by the module: a custom
reward is added after step 5 and a custom loss with kwargs swapped in after step 10, both live.
Its replay runs on the same processes (the test worker's `engine_pool` re-initialises them, so no live change
may linger there; the run itself takes an idle set an earlier module left, if any) and must reproduce every
learning metric exactly; its step-20 checkpoint is resumed (in a fresh Run on the pool's processes, re-initialised
again: the trainer starts from its config's loss "grpo" and no custom reward, so only the checkpoint can bring
them back) and must train with that loss, those kwargs and that reward. The first tests are pure functions (no
processes).
"""
import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

# functions defined here travel by value (as a notebook cell's would), not as an import of this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def short_reward(prompt, completion, target, **info):
    """1.0 for completions of at most 4 characters."""
    return 1.0 if len(completion.strip()) <= 4 else 0.0


def scaled_grpo(logprobs_B_T, *, scale=1.0, **kwargs):
    """GRPO with its loss multiplied by `scale` (reported as a metric, so its use is visible)."""
    from forgelab.algos import LOSSES

    loss, metrics = LOSSES["grpo"](logprobs_B_T, **kwargs)
    return loss * scale, {**metrics, "loss_scale": float(scale)}


# ---------------------------------------------------------------- pure functions
def test_hash_dir_cache_reuses_digest_until_a_file_changes(tmp_path, monkeypatch):
    import os

    from forgelab.controller import provenance

    monkeypatch.setenv("FORGELAB_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_bytes(b'{"a": 1}')
    (model / "sub" / "w.bin").write_bytes(bytes(range(256)) * 10)

    def independent(root: Path) -> str:  # the definition, computed here without forgelab
        h = hashlib.sha256()
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    first = provenance.hash_dir(model)
    assert first == independent(model) == provenance.hash_dir(model, cache=False)
    assert (tmp_path / "cache" / "hash_dir.json").exists()
    reads = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: (model in self.parents and reads.append(self.name)) or real_open(self, *a, **k))
    assert provenance.hash_dir(model) == first and reads == []  # served from the cache: no file read
    # same size, old mtime put back: ctime still moves, so the cache misses and the new bytes count
    w = model / "sub" / "w.bin"
    st = w.stat()
    w.write_bytes(bytes(reversed(range(256))) * 10)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = provenance.hash_dir(model)
    assert "w.bin" in reads and changed == independent(model) != first
    (model / "extra.txt").write_text("x")  # a new file misses too
    assert provenance.hash_dir(model) == independent(model) != changed
    (tmp_path / "cache" / "hash_dir.json").write_text("{not json")  # a corrupt cache is only a miss
    assert provenance.hash_dir(model) == independent(model)


def test_event_log_memory_and_file_agree(tmp_path):
    from forgelab.controller.events import EventLog

    log = EventLog()
    log.emit("early", step=0, value=(1, 2))  # before the file exists
    log.attach(tmp_path)
    log.emit("loss_swapped", step=3, kwargs={"scale": 0.5}, obj=object())
    assert EventLog.read(tmp_path) == list(log)
    assert [e["kind"] for e in log] == ["early", "loss_swapped"] and log[0]["value"] == [1, 2]
    resumed = EventLog()
    resumed.emit("spawned", step=0)
    resumed.attach(tmp_path / "events.jsonl", append=True)  # a resumed run keeps the history
    assert [e["kind"] for e in resumed] == ["early", "loss_swapped", "spawned"]
    assert EventLog.read(tmp_path) == list(resumed)


def test_function_records_restore_and_name_what_cannot():
    import threading

    from forgelab.controller.function_code import FunctionRestoreError, fn_record, restore_fn
    from forgelab.rewards.library import REWARDS

    rec = fn_record(short_reward, REWARDS)
    assert rec["sha256"] == hashlib.sha256(rec["source"].encode()).hexdigest() and "def short_reward" in rec["source"]
    back = restore_fn(json.loads(json.dumps(rec)), REWARDS, trusted=True)  # written here: trusted
    assert back is not short_reward and back("", "12", "12") == 1.0 and back("", "12345", "1") == 0.0
    builtin = fn_record(REWARDS["exact_answer"], REWARDS)
    assert builtin["builtin"] == "exact_answer" and restore_fn(builtin, REWARDS) is REWARDS["exact_answer"]
    lock = threading.Lock()
    bad = fn_record(lambda p, c, t, **i: float(lock.locked()), REWARDS)  # a lock cannot be pickled
    with pytest.raises(FunctionRestoreError, match="cannot be restored"):
        restore_fn(bad, REWARDS, what="reward 'locked'")


def test_episode_seeds_differ_per_episode_and_repeat():
    from forgelab.experiments.replay import episode_seed

    seeds = [episode_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and seeds == [episode_seed(7, i) for i in range(1000)]
    assert all(0 <= s < 2**31 for s in seeds) and episode_seed(8, 0) != episode_seed(7, 0)


def test_compare_metrics_names_first_differing_step_and_metric():
    import pandas as pd

    from forgelab.experiments.replay import compare_metrics

    a = pd.DataFrame({"step": [1, 2, 3], "loss": [0.5, 0.25, 0.125], "kl_behaviour": [0.0, 0.1, 0.2],
                      "step_time_s": [1.0, 2.0, 3.0], "tokens_per_s": [9.0, 9.0, 9.0]})
    b = a.copy()
    b["step_time_s"] = [5.0, 5.0, 5.0]  # timings are not compared
    assert compare_metrics(a, b) == []
    b.loc[2, "kl_behaviour"] = 0.2000001
    b.loc[1, "loss"] = 0.25000000000000006
    assert compare_metrics(a, b)[0] == (2, "loss", 0.25, 0.25000000000000006)
    assert compare_metrics(a, b, until=1) == []


def test_an_unrecorded_final_eval_is_a_note_and_a_recorded_one_is_compared():
    """Runs recorded before the final held-out evaluation reached metrics.csv have NaN there; their replays write
    it: a note, not a difference. A final value the original did record is compared like any other, and so is a
    missing value on any other step."""
    import pandas as pd

    from forgelab.experiments.replay import compare_metrics, unrecorded_final_eval

    old = pd.DataFrame({"step": [1, 2, 3], "loss": [0.5, 0.25, 0.125], "heldout_accuracy": [0.2, float("nan"), float("nan")]})
    new = old.copy()
    new.loc[2, "heldout_accuracy"] = 0.5
    assert compare_metrics(old, new) == [] and "step 3" in (unrecorded_final_eval(old, new) or "")
    recorded = new.copy()
    recorded.loc[2, "heldout_accuracy"] = 0.75
    assert unrecorded_final_eval(recorded, new) is None
    assert compare_metrics(recorded, new) == [(3, "heldout_accuracy", 0.75, 0.5)]
    earlier = new.copy()
    earlier.loc[1, "heldout_accuracy"] = 0.3
    assert [m[:2] for m in compare_metrics(old, earlier)] == [(2, "heldout_accuracy")]


# ---------------------------------------------------------------- real processes
def _config(out_dir, name="prov", steps=20):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=steps, batch_size=16, lr=1e-4, warmup_steps=2, max_policy_age=0, seed=3),
        eval=EvalConfig(every=0, n=16),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False),
        placement=PlacementConfig(reference=False),
    )


@pytest.fixture(scope="module")
def recorded(loop, tmp_path_factory, engine_pool):
    """The 20-step synchronous run with two live changes, finished, checkpointed and shut down (its processes
    idle in ``pool``, the worker's `engine_pool`, for the replay)."""
    from forgelab.run import Run

    head_before = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip()
    pool = engine_pool
    run = Run(_config(tmp_path_factory.mktemp("prov")), spawn=pool)
    swaps = []

    def on_row(row):
        if "step" not in row:
            return
        if row["step"] == 5:
            run.add_reward("short", short_reward, 0.5)
        if row["step"] == 10:
            swaps.append(asyncio.ensure_future(run.set_loss(scaled_grpo, scale=0.5)))

    run.add_listener(on_row)
    try:
        loop.run_until_complete(run.start())
        loop.run_until_complete(run.wait())
        loop.run_until_complete(asyncio.gather(*swaps))
        ckpt = loop.run_until_complete(run.save_checkpoint())
        events = list(run.events)
    finally:
        loop.run_until_complete(run.shutdown())  # back to the worker's pool (stopped if a process failed)
    assert run.state == "finished", run.message
    yield {"head_before": head_before, "dir": run.out_dir, "ckpt": ckpt, "events": events, "metrics": run.metrics,
           "config": run.config, "pool": pool}


@pytest.mark.integration
def test_manifest_holds_hashes_and_versions(recorded):
    import platform

    import torch
    import transformers

    from forgelab.data.datasets import load_problems

    m = json.loads((recorded["dir"] / "manifest.json").read_text())
    assert m["config"] == json.loads(json.dumps(recorded["config"].to_dict()))
    v = m["versions"]
    assert v["python"] == platform.python_version() and v["torch"] == torch.__version__
    assert v["transformers"] == transformers.__version__ and v["vllm"] and v["monarch"] and v["torchtitan"]
    # the model hash, recomputed here over the checkpoint's files
    model = Path(m["model"]["path"])
    h = hashlib.sha256()
    for p in sorted(x for x in model.rglob("*") if x.is_file()):
        h.update(str(p.relative_to(model)).encode() + b"\0" + p.read_bytes())
    assert m["model"]["sha256"] == h.hexdigest()
    train = load_problems("addition", "train", 4000, 3)
    h = hashlib.sha256()
    for p in train:
        h.update(json.dumps([p.prompt, p.target, dict(p.info)], sort_keys=True, default=repr).encode() + b"\n")
    assert m["data"]["train_sha256"] == h.hexdigest() and m["data"]["train_n"] == len(train)
    # the commit checked out when the run started: others may commit meanwhile, so it lies between the
    # HEAD seen before the run and the HEAD now
    commit = m["forgelab"]["git"]["commit"]

    def ancestor(a, b):
        return subprocess.run(["git", "merge-base", "--is-ancestor", a, b], cwd=Path(__file__).parent).returncode == 0

    assert ancestor(recorded["head_before"], commit) and ancestor(commit, "HEAD"), (recorded["head_before"], commit)
    assert len(m["forgelab"]["git"]["uncommitted_sha256"]) == 64
    assert m["hardware"]["cores_usable"] >= 1 and m["seeds"]["train.seed"] == 3 and m["deterministic"] is True


@pytest.mark.integration
def test_event_log_records_each_live_change_with_source(recorded):
    from forgelab.controller.events import EventLog

    events = recorded["events"]
    assert EventLog.read(recorded["dir"]) == events  # the file and run.events agree
    added = [e for e in events if e["kind"] == "reward_added"]
    assert len(added) == 1 and added[0]["name"] == "short" and "def short_reward" in added[0]["code"]["source"]
    assert added[0]["code"]["sha256"] == hashlib.sha256(added[0]["code"]["source"].encode()).hexdigest()
    assert added[0]["code"]["pickle"] and added[0]["step"] == 5
    effective = [e for e in events if e["kind"] == "reward_effective"]
    assert effective and effective[0]["rev"] == added[0]["rev"] and effective[0]["rewards"]["short"] == 0.5
    swaps = [e for e in events if e["kind"] == "loss_swapped"]
    assert len(swaps) == 1 and swaps[0]["kwargs"] == {"scale": 0.5} and "def scaled_grpo" in swaps[0]["code"]["source"]
    # where it took effect: the first step the trainer ran it (its metric shows the kwarg)
    df = recorded["metrics"]
    first = int(df[df["loss_name"] == "scaled_grpo"]["step"].min())
    assert swaps[0]["applies_at_step"] == first and (df[df["step"] >= first]["loss_scale"] == 0.5).all()
    # the first episode scored with the new reward is the first with a reward/short part
    assert df[df["step"] < effective[0]["step"]]["reward/short"].isna().all()
    assert [e for e in events if e["kind"] == "checkpoint"][-1]["loss_kwargs"] == {"scale": 0.5}


@pytest.mark.integration
def test_replay_reproduces_learning_metrics_exactly(recorded, loop, tmp_path_factory):
    from forgelab.run import Run

    pool = recorded["pool"]
    reused = pool.reused
    # the run's custom reward and loss are pickled in its event log: this test wrote them, so it trusts them
    report = loop.run_until_complete(Run.replay(recorded["dir"], out_dir=tmp_path_factory.mktemp("replay"), spawn=pool,
                                                trusted=True))
    print(report)
    assert pool.reused == reused + 1, pool.last_note  # the recorded run's processes, re-initialised
    assert report.steps == 20 and len(report.changes_applied) == 2
    assert report.ok, str(report)
    # the replay's own log records the same changes at the same points
    from forgelab.controller.events import EventLog

    again = EventLog.read(report.replay_dir)
    for kind, key in (("loss_swapped", "applies_at_step"), ("reward_effective", "first_episode")):
        assert [e[key] for e in again if e["kind"] == kind] == [e[key] for e in recorded["events"] if e["kind"] == kind]


@pytest.mark.integration
def test_resume_restores_custom_loss_kwargs_and_reward(recorded, loop, tmp_path_factory):
    from forgelab.run import Run

    cfg = _config(tmp_path_factory.mktemp("resumed"), name="prov-resumed", steps=24)
    # the pool re-initialises the processes (loss "grpo", no custom reward): only the checkpoint brings them back
    run = Run(cfg, resume_from=recorded["ckpt"], spawn=recorded["pool"])
    rows = []

    def on_row(row):
        if "step" in row:
            rows.append(row)
            if row["step"] == 22:
                rows.append(asyncio.ensure_future(run.set_loss("dapo")))

    run.add_listener(on_row)
    try:
        loop.run_until_complete(run.start())
        assert run.step == 20 and run.rewards.weights == {"exact_answer": 1.0, "answer_format": 0.1, "short": 0.5}
        fn = run.rewards._terms["short"][0]
        assert fn is not short_reward and fn("", "12", "") == 1.0  # rebuilt from the checkpoint, not shared
        loop.run_until_complete(run.wait())
        loop.run_until_complete(asyncio.gather(*[r for r in rows if isinstance(r, asyncio.Future)]))
        steps = [r for r in rows if isinstance(r, dict)]
        assert [r["step"] for r in steps] == [21, 22, 23, 24], run.message
        # trained with the custom loss and its kwargs, and scored with the custom reward, after the resume
        assert [r["loss_name"] for r in steps[:2]] == ["scaled_grpo", "scaled_grpo"]
        assert all(r["loss_scale"] == 0.5 for r in steps[:2]) and all("reward/short" in r for r in steps)
        assert steps[-1]["loss_name"] == "dapo"
        resumed = [e for e in run.events if e["kind"] == "resumed_from_checkpoint"][0]
        assert resumed["loss"] == "scaled_grpo" and resumed["loss_kwargs"] == {"scale": 0.5}
        assert resumed["fingerprint_match"] is True
    finally:
        loop.run_until_complete(run.shutdown())
    # forgelab diff names the changed loss (the resumed run went on to dapo)
    out = subprocess.run([sys.executable, "-m", "forgelab.cli", "diff", str(recorded["dir"]), str(run.out_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "[loss] differs" in out.stdout and "dapo" in out.stdout and "train.steps: 20 -> 24" in out.stdout
    assert "[reward:short]" not in out.stdout  # the same reward code in both


@pytest.mark.integration
def test_show_prints_timeline_with_code(recorded):
    out = subprocess.run([sys.executable, "-m", "forgelab.cli", "show", str(recorded["dir"])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert "prov: task addition" in lines[0] and "max_policy_age 0" in lines[0]
    assert any("reward short added, weight 0.5" in ln for ln in lines)
    assert any("loss grpo -> scaled_grpo {'scale': 0.5}" in ln for ln in lines)
    assert any(ln.strip().startswith("+def scaled_grpo") for ln in lines)  # the code diff between versions
    from forgelab.lab import timeline

    view = timeline(recorded["dir"])  # the notebook view of the same entries
    page = view._repr_html_()
    assert "scaled_grpo" in page and "<details><summary>code diff" in page and "def short_reward" in page
    assert [e["kind"] for e in view.entries if e["category"] in ("loss", "reward")] == [
        "reward_added", "reward_effective", "loss_swapped"]


@pytest.mark.integration
def test_a_checkpoint_waits_for_the_rollouts_being_played(loop, tmp_path_factory, engine_pool, monkeypatch):
    """A periodic checkpoint holds every rollout whose prompts and ids it counts: one still being played while the
    trainer saves (as on a loaded machine) lands in the buffer before the checkpoint is written, so a resume from
    it trains exactly what the run trained. (Written before the fix, the step-4 checkpoint of this run counted
    group 9 in its ids but did not hold it, and the resumed steps 5-6 differed in the last bits.)"""
    import json

    import pandas as pd

    from forgelab.controller import rollout
    from forgelab.experiments.replay import compare_metrics
    from forgelab.run import Run

    slow_group = 9  # the second group of step 5's rollouts (2 prompts per rollout: groups 8 and 9)
    delayed = {"on": True, "seen": 0}
    original = rollout.Rollouts._advantages_and_buffer

    async def late(self, groups, failed, coef=1.0):
        if delayed["on"] and any(ep.group_id == slow_group for g in groups for ep in g):
            delayed["seen"] += 1
            while not any(e["kind"] == "checkpoint" for e in run.events) and run.state == "running":
                await asyncio.sleep(0.05)  # this group lands only after the checkpoint has started (a condition)
        return await original(self, groups, failed, coef)

    monkeypatch.setattr(rollout.Rollouts, "_advantages_and_buffer", late)
    out = tmp_path_factory.mktemp("ckpt-race")
    cfg = _config(out, name="race", steps=6)
    cfg.tracking.checkpoint_every = 4
    run = Run(cfg, spawn=engine_pool)
    try:
        loop.run_until_complete(run.start())
        loop.run_until_complete(run.wait())
    finally:
        loop.run_until_complete(run.shutdown())
    assert run.state == "finished" and delayed["seen"] == 1, (run.state, run.message, delayed)
    state = json.loads((run.out_dir / "checkpoints" / "step_000004" / "controller.json").read_text())
    held = sorted({e["group_id"] for e in state["buffer"]["episodes"]})
    assert all(g in held for g in range(8, state["next_group_id"])), (state["next_group_id"], held)
    delayed["on"] = False
    resumed = Run(_config(out, name="race-resumed", steps=6), resume_from=str(run.out_dir / "checkpoints"),
                  spawn=engine_pool)
    try:
        loop.run_until_complete(resumed.start())
        loop.run_until_complete(resumed.wait())
    finally:
        loop.run_until_complete(resumed.shutdown())
    a, b = pd.read_csv(run.out_dir / "metrics.csv"), pd.read_csv(resumed.out_dir / "metrics.csv")
    assert list(b["step"][b["step"] > 4]) == [5, 6]  # the rows before the resume are the checkpoint's
    assert compare_metrics(a[a["step"] > 4], b[b["step"] > 4]) == []
