"""Records that hold on real processes (issue #25, items 1, 3, 4 and 8): a fork's replay, loss A/B, wandb.

One synchronous parent (max_policy_age 0, seed 7, batch 16, loss dr_grpo with loss_kwargs, wandb on, offline)
is forked while running at step ~2 with a lower lr, another reward weight and a custom reward; parent and
fork train on to the end side by side in this process (two wandb runs alive at once). Then:
- both have complete wandb histories, read back with wandb's own reader;
- `compare_losses` of the parent's current loss on its last batch equals the loss its train step computes on
  that batch from the same weights;
- `forgelab replay` (the CLI, a fresh interpreter and fresh processes) refuses the fork's pickled code unless
  `--trust` is given, and with it reproduces the fork's learning metrics exactly, from the fork point.
"""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.integration

STEPS = 5
LOSS_KWARGS = {"eps_high": 0.28}


def short_reward(prompt, completion, target, **info):
    """1.0 for completions of at most 3 characters."""
    return 1.0 if len(completion.strip()) <= 3 else 0.0


def _config(out_dir, name):
    from forgelab.config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=STEPS, batch_size=16, lr=1e-4, warmup_steps=2, max_policy_age=0, seed=7,
                          loss="dr_grpo", loss_kwargs=dict(LOSS_KWARGS)),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=True),
        placement=PlacementConfig(reference=False),
    )


@pytest.fixture(scope="module")
def world(loop, engine_pool, tmp_path_factory):
    from forgelab.run import Run

    out = tmp_path_factory.mktemp("records")
    w = {"out": out}
    parent = Run(_config(out / "runs", "rec-parent"), spawn=engine_pool)
    child = None
    run = loop.run_until_complete
    try:
        run(parent.start())
        run(parent.until(step=2))
        child = run(parent.fork(name="rec-fork", lr=5e-5, reward_weights={"answer_format": 0.0},
                                rewards={"short": (short_reward, 0.5)}))
        w["fork_step"] = child.step

        async def both():
            import asyncio

            await asyncio.gather(parent.wait(), child.wait())

        run(both())
        assert parent.state == "finished" and child.state == "finished", (parent.message, child.message)
        # loss A/B on the last trained batch, then the train step itself on that batch, from the same weights
        batch = parent.last_batch
        w["ab"] = run(parent.compare_losses(["dr_grpo", ("dr_grpo", {"eps_high": 0.2})], batch=batch))
        w["step_metrics"] = run(parent.trainer.call("train_step", batch))[0]
        w["parent"], w["child"] = parent, child
        run(child.shutdown())
        run(parent.shutdown())  # finishes the wandb runs: their logs are complete only then
        yield w
    finally:
        if child is not None:
            run(child.shutdown())
        run(parent.shutdown())
        import wandb

        wandb.teardown()  # wandb keeps its service process (wandb-core) for the interpreter's life otherwise


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history records of an offline wandb run, read by wandb's own reader (wandb-core's `leet inspect`)."""
    wandb_cli = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def _check_wandb_complete(out_dir: Path, metrics):
    runs = sorted((out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    history = _wandb_history(runs[0])
    by_step = {int(h["_step"]): h for h in history if "loss" in h}
    assert sorted(by_step) == list(range(1, STEPS + 1)) == [int(s) for s in metrics["step"]]
    for _, row in metrics.iterrows():
        h = by_step[int(row["step"])]
        for key in ("loss", "reward_mean", "grad_norm"):
            # wandb stores float64 as given; metrics.csv round-trips floats with repr: equal up to 1 ulp of float64
            assert h[key] == pytest.approx(float(row[key]), rel=1e-15, abs=0.0), (row["step"], key)


def test_parent_and_fork_each_have_a_complete_wandb_history(world):
    import pandas as pd

    for r in (world["parent"], world["child"]):
        _check_wandb_complete(r.out_dir, pd.read_csv(r.out_dir / "metrics.csv"))


def test_compare_losses_current_loss_equals_the_train_step_on_the_same_batch(world):
    t = world["ab"].table
    m = world["step_metrics"]
    assert not m.get("skipped"), m
    assert list(t.index) == ["current: dr_grpo", "dr_grpo", "dr_grpo(eps_high=0.2)"] and t["ok"].all()
    # the same function, keywords (the run's eps_high and the completion budget max_tokens = rollout.max_tokens),
    # weights and batch: the same float computation, so bit-for-bit equal
    assert t.loc["current: dr_grpo", "loss"] == m["loss"]
    assert t.loc["current: dr_grpo", "grad_norm"] == m["grad_norm"]
    # a spec naming the run's loss resolves as set_loss would: the run's loss_kwargs, the completion budget
    assert t.loc["dr_grpo", "loss"] == m["loss"]
    kw = world["ab"].losses
    assert kw[0]["kwargs"] == {**LOSS_KWARGS, "max_tokens": 8} == kw[1]["kwargs"]
    assert kw[2]["kwargs"] == {"eps_high": 0.2, "max_tokens": 8}


def _replay_cli(child_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "forgelab.cli", "replay", str(child_dir), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=900, env=env)


def test_replay_of_an_untrusted_fork_refuses_its_code(world):
    out = world["out"] / "replays-untrusted"
    res = _replay_cli(world["child"].out_dir, out)
    assert res.returncode != 0 and "--trust" in res.stderr, (res.stdout, res.stderr[-3000:])
    assert not out.exists() or not any(out.iterdir())  # refused before anything ran


def test_fork_replayed_by_the_cli_on_fresh_processes_reproduces_its_learning_metrics(world):
    import pandas as pd

    from forgelab.experiments.replay import learning_columns

    child = world["child"]
    out = world["out"] / "replays"
    res = _replay_cli(child.out_dir, out, "--trust")
    print(res.stdout, res.stderr[-3000:])
    assert res.returncode == 0, res.stderr[-3000:]
    replay_dir = out / "rec-fork-replay"
    original = pd.read_csv(child.out_dir / "metrics.csv")
    again = pd.read_csv(replay_dir / "metrics.csv")
    k = world["fork_step"]
    assert list(again["step"]) == list(range(1, STEPS + 1)) == list(original["step"])
    cols = [c for c in learning_columns(original.columns) if c != "step"]
    assert {"loss", "reward_mean", "reward/short", "grad_norm", "entropy", "lr"} <= set(cols)
    # the fork's own steps: every learning metric equal (NaN where both are NaN)
    mine = original[original["step"] > k].reset_index(drop=True)
    theirs = again[again["step"] > k].reset_index(drop=True)
    diffs = [(int(a["step"]), c, a[c], b.get(c)) for (_, a), (_, b) in zip(mine.iterrows(), theirs.iterrows())
             for c in cols if not (a[c] == b.get(c) or (isinstance(a[c], float) and math.isnan(a[c])
                                                         and isinstance(b.get(c), float) and math.isnan(b.get(c))))]
    assert diffs == [], diffs[:5]
    # it was replayed from the fork point with the fork's changes: the lower lr (below the parent's at every
    # step after the fork) and the custom reward (on the fork's own episodes: its last step)
    parent = pd.read_csv(world["parent"].out_dir / "metrics.csv")
    assert (mine["lr"].to_numpy() < parent[parent["step"] > k]["lr"].to_numpy()).all()
    assert mine["reward/short"].notna().iloc[-1] and original[original["step"] <= k]["reward/short"].isna().all()
    # the replay has its own complete wandb run
    _check_wandb_complete(replay_dir, again)
