"""Experiments on real processes: a warm pool, fork, rescore, loss A/B.

One pool (the test worker's `engine_pool`: the parent takes an idle set an earlier module left, if any) and one
synchronous parent run (max_policy_age 0, seed 5, batch 16, 5 steps) are shared by the module. The parent is forked
at step ~2 twice: once with no overrides (pausing the parent, on new processes) and once with loss "dapo" (on the
first child's processes, warm; the parent resumes alongside it). Then a fresh run with the parent's config starts
on the idle warm pool. The pool's counts are checked as changes from the module's start.
"""
import asyncio
import json
import statistics
import sys

import cloudpickle
import pytest

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.integration

STEPS = 5


def short_reward(prompt, completion, target, **info):
    """1.0 for completions of at most 3 characters."""
    return 1.0 if len(completion.strip()) <= 3 else 0.0


def _config(out_dir, name, steps=STEPS):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=steps, batch_size=16, lr=1e-4, warmup_steps=2, max_policy_age=0, seed=5),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(out_dir), wandb=False),
        placement=PlacementConfig(reference=False),
    )


def _learning(df, after):
    from forgelab.experiments.replay import learning_columns

    rows = df[df["step"] > after].reset_index(drop=True)
    return rows[[c for c in learning_columns(rows.columns) if c != "heldout_accuracy"]]


@pytest.fixture(scope="module")
def world(loop, tmp_path_factory, engine_pool):
    from forgelab.engines.pool import engine_key
    from forgelab.run import Run

    out = tmp_path_factory.mktemp("exp")
    pool = engine_pool
    # the shared pool's counts when the module starts, and whether the parent finds an idle set of its key there
    warm = any(p.key == engine_key(_config(out, "exp-parent")) for p in pool.idle)
    w = {"pool": pool, "out": out, "spawned0": pool.spawned, "reused0": pool.reused, "parent_spawns": 0 if warm else 1}
    parent = Run(_config(out, "exp-parent"), spawn=pool)
    w["parent"] = parent
    run = loop.run_until_complete
    try:
        run(parent.start())
        w["parent_pids"] = run(pool.pids(parent.parts))
        run(parent.until(step=2))
        same = run(parent.fork(pause_parent=True, name="exp-same"))
        w["fork_step"] = same.step
        w["same_pids"] = run(pool.pids(same.parts))
        assert parent.state == "paused" and pool.spawned - w["spawned0"] == w["parent_spawns"] + 1
        run(same.wait())
        w["same"] = {"metrics": same.metrics, "accounting": same.buffer.check_accounting(), "dir": same.out_dir,
                     "events": list(same.events), "state": same.state, "message": same.message}
        run(same.shutdown())  # its processes go back to the pool, idle
        dapo = run(parent.fork(loss="dapo", name="exp-dapo"))  # the parent stays paused: resumed by hand
        w["dapo_pids"] = run(pool.pids(dapo.parts))
        w["dapo_fork_step"] = dapo.step
        parent.resume()

        async def both():
            await asyncio.gather(parent.wait(), dapo.wait())

        run(both())
        w["dapo"] = {"metrics": dapo.metrics, "accounting": dapo.buffer.check_accounting(), "state": dapo.state,
                     "message": dapo.message}
        run(dapo.shutdown())
        yield w
    finally:
        run(parent.shutdown())  # back to the worker's pool (it keeps one idle set; the session's end stops it)


def test_fork_without_overrides_reproduces_parent_exactly(world):
    p, c = world["parent"], world["same"]
    k = world["fork_step"]
    assert p.state == "finished" and c["state"] == "finished", (p.message, c["message"])
    assert 1 <= k < STEPS
    a, b = _learning(p.metrics, k), _learning(c["metrics"], k)
    assert list(a["step"]) == list(range(k + 1, STEPS + 1)) and list(b["step"]) == list(a["step"])
    for col in ("loss", "reward_mean", "entropy", "grad_norm"):
        assert col in a.columns
    from forgelab.experiments.replay import compare_metrics

    diffs = compare_metrics(a, b)
    assert diffs == [], diffs[:5]
    # the child's curve continues the parent's (rows up to the fork restored from the parent's metrics)
    assert list(c["metrics"]["step"]) == list(range(1, STEPS + 1))


def test_fork_records_origin_in_both_event_logs(world):
    from forgelab.controller.events import EventLog

    p, c = world["parent"], world["same"]
    forked = [e for e in EventLog.read(p.out_dir) if e["kind"] == "forked"]
    assert [e["child"] for e in forked] == ["exp-same", "exp-dapo"] and forked[1]["overrides"] == {"loss": "dapo"}
    mine = [e for e in c["events"] if e["kind"] == "forked_from"]
    assert len(mine) == 1 and mine[0]["parent"] == "exp-parent" and mine[0]["step"] == world["fork_step"]
    origin = json.loads((c["dir"] / "origin.json").read_text())
    assert origin["parent_dir"] == str(p.out_dir) and origin["checkpoint"] == forked[0]["checkpoint"]


def test_fork_with_other_loss_trains_it_from_first_step_parent_keeps_its_own(world):
    p, d = world["parent"], world["dapo"]
    k = world["dapo_fork_step"]
    assert d["state"] == "finished", d["message"]
    after = d["metrics"][d["metrics"]["step"] > k]
    assert list(after["step"]) == list(range(k + 1, STEPS + 1)) and set(after["loss_name"]) == {"dapo"}
    assert set(p.metrics["loss_name"]) == {"grpo"}
    # same data, other loss: the first step's rewards agree (same rollouts); the loss values differ, unless
    # every group of that batch scored alike (all advantages 0: every ratio loss is then exactly 0)
    first_p = p.metrics[p.metrics["step"] == k + 1].iloc[0]
    first_d = after.iloc[0]
    assert first_p["reward_mean"] == first_d["reward_mean"]
    if first_p["loss"] == 0.0:
        assert first_d["loss"] == 0.0 and first_p["grad_norm"] == first_d["grad_norm"] == 0.0
    else:
        assert first_p["loss"] != first_d["loss"]


def test_second_run_on_idle_warm_pool_reuses_processes_and_reinitialises(world, loop):
    from forgelab.run import Run

    pool = world["pool"]
    # the dapo fork ran on the processes the first fork left idle
    assert world["dapo_pids"] == world["same_pids"] and world["same_pids"] != world["parent_pids"]
    assert pool.spawned - world["spawned0"] == world["parent_spawns"] + 1 and pool.reused > world["reused0"]
    assert len(pool.idle) == 1
    idle_pids = loop.run_until_complete(pool.pids(pool.idle[0]))
    fresh = Run(_config(world["out"], "exp-warm"), spawn=pool)
    try:
        loop.run_until_complete(fresh.start())
        assert loop.run_until_complete(pool.pids(fresh.parts)) == idle_pids
        assert pool.spawned - world["spawned0"] == world["parent_spawns"] + 1
        loop.run_until_complete(fresh.wait())
        assert fresh.state == "finished", fresh.message
        # re-initialised from its config: weights, optimizer, schedule and seeds as at the parent's start
        from forgelab.experiments.replay import compare_metrics

        assert compare_metrics(_learning(world["parent"].metrics, 0), _learning(fresh.metrics, 0)) == []
        assert "pool:" in "\n".join(__import__("forgelab.lab.summary", fromlist=["x"]).services_lines(fresh))
    finally:
        loop.run_until_complete(fresh.shutdown())
    assert len(pool.idle) == 1


def test_accounting_holds_in_parent_and_children(world):
    p = world["parent"].buffer.check_accounting()
    for c in (p, world["same"]["accounting"], world["dapo"]["accounting"]):
        assert c["trained"] == 16 * STEPS
        assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]


def test_compare_losses_leaves_trainer_untouched(world, loop):
    parent = world["parent"]
    before = loop.run_until_complete(parent.trainer.call("fingerprint"))
    report = loop.run_until_complete(parent.compare_losses(["grpo", "grpo", ("dapo", {"eps_high": 0.28})]))
    assert report.unchanged and loop.run_until_complete(parent.trainer.call("fingerprint")) == before
    t, cos = report.table, report.cosine
    # the run's current loss first (the baseline), then the losses asked for
    assert list(t.index) == ["current: grpo", "grpo", "grpo#2", "dapo(eps_high=0.28)"] and t["ok"].all()
    # the same loss three times: the same value and gradient (cosine 1); another loss: a different value
    assert t["loss"].iloc[0] == t["loss"].iloc[1] == t["loss"].iloc[2] and abs(cos.iloc[1, 2] - 1.0) < 1e-9
    assert abs(cos.iloc[0, 1] - 1.0) < 1e-9
    assert all(abs(cos.iloc[i, i] - 1.0) < 1e-9 for i in range(4)) and -1.0 <= cos.iloc[1, 3] <= 1.0
    assert t["grad_norm"].gt(0).all() and "clip_frac" in t.columns


def _by_hand(df):
    """New reward (short_reward) and GRPO advantage per episode, computed here without forgelab."""
    new = {int(r.id): short_reward(r.prompt, r.completion, r.target) for r in df.itertuples()}
    adv = {}
    for _, g in df.groupby("group_id"):
        rs = [new[int(i)] for i in g["id"]]
        mean, std = statistics.fmean(rs), statistics.pstdev(rs)
        for i, r in zip(g["id"], rs):
            adv[int(i)] = (r - mean) / (std + 1e-6)
    return new, adv


def _check_rescore(out, recorded):
    new, adv = _by_hand(recorded[recorded["reward_parts"].map(bool)])
    assert len(out) == len(new) and out.attrs["n_episodes"] == len(new)
    for r in out.itertuples():
        assert r.new_reward == new[r.id] and abs(r.new_advantage - adv[r.id]) < 1e-5
        assert r.flipped == (r.old_advantage * adv[r.id] < 0 and abs(adv[r.id]) > 1e-12)
    flips = sorted({int(g) for g in out[out["flipped"]]["group_id"]})
    assert out.attrs["flipped_groups"] == flips


def test_rescore_agrees_with_hand_computation_live_and_from_dir(world):
    import forgelab
    from forgelab.controller.rollout_log import read_rollouts

    parent = world["parent"]
    recorded = read_rollouts(parent.out_dir)
    # every trained episode was recorded, with its tokens, logprobs, reward parts and version
    assert len(recorded) >= 16 * STEPS and set(recorded["policy_version"]) >= set(range(STEPS))
    assert all(len(a) == len(b) for a, b in zip(recorded["completion_ids"], recorded["generator_logprobs"]))
    # the run's recorded rollouts and its recent ones in memory (restricted to the recorded: the last
    # rollouts generated after the final step are only in memory)
    live = parent.rescore(short_reward, episodes=list(recorded["id"]))
    _check_rescore(live, recorded)
    from_dir = forgelab.rescore(parent.out_dir, short_reward)
    _check_rescore(from_dir, recorded)
    # weights over the recorded parts: exact_answer alone gives the old reward minus the format term
    w = forgelab.rescore(parent.out_dir, {"exact_answer": 1.0})
    parts = recorded.set_index("id")["reward_parts"]
    assert all(r.new_reward == parts[r.id]["exact_answer"] for r in w.itertuples())


def test_compare_view_over_live_run_and_finished_dir(world, tmp_path):
    import forgelab

    view = forgelab.lab.compare([world["parent"], world["same"]["dir"]])
    t = view.table()
    assert list(t.index) == ["exp-parent", "exp-same"] and list(t["steps"]) == [STEPS, STEPS]
    assert t.loc["exp-parent", "reward_mean final"] == float(world["parent"].metrics["reward_mean"].iloc[-1])
    # (read back from metrics.csv: pandas' fast float parser may differ in the last bit)
    assert abs(t.loc["exp-same", "reward_mean best"] - float(world["same"]["metrics"]["reward_mean"].max())) < 1e-12
    assert ("exp-same", world["fork_step"], "forked_from") in view.marks()
    assert view.save(tmp_path / "c.png").stat().st_size > 1000
    assert view.widget is not None and len(view.image.value) > 1000  # headless: the widget's PNG and table
    assert "exp-same" in view.table_html.value and "forked_from" in repr(view)
    view.close()


def test_fork_from_a_saved_checkpoint_reproduces_the_live_fork(world, loop):
    """`Run.fork_from(checkpoint)` (config from the parent's manifest) continues exactly as the live fork
    taken at that checkpoint did, on the pool's idle processes."""
    from forgelab.controller.events import EventLog
    from forgelab.experiments.replay import compare_metrics
    from forgelab.run import Run

    pool, k = world["pool"], world["fork_step"]
    ckpt = [e for e in EventLog.read(world["parent"].out_dir) if e["kind"] == "forked"][0]["checkpoint"]
    idle_pids = loop.run_until_complete(pool.pids(pool.idle[0]))
    child = loop.run_until_complete(Run.fork_from(ckpt, pool=pool, name="exp-from"))
    try:
        assert child.step == k and loop.run_until_complete(pool.pids(child.parts)) == idle_pids
        loop.run_until_complete(child.wait())
        assert child.state == "finished", child.message
        assert compare_metrics(_learning(world["same"]["metrics"], k), _learning(child.metrics, k)) == []
        assert [e["parent"] for e in child.events if e["kind"] == "forked_from"] == ["exp-parent"]
        acc = child.buffer.check_accounting()
        assert acc["generated"] == acc["trained"] + acc["evicted"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    finally:
        loop.run_until_complete(child.shutdown())
