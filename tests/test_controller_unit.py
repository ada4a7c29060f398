"""The controller's loop against in-process fakes of the generator, trainer and reference (forgelab.testing.fakes).

Fast and exact: no process starts, so these pin the loop's logic (staleness, accounting, pause/resume, the loss
swap's step boundary, failing rewards, a replica death, `until`). The real actors keep their own integration tests.
"""
from __future__ import annotations

import asyncio

import pytest

from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
from forgelab.run import Run
from forgelab.testing.fakes import FakeParts, FakeTrainer, fake_generators, fake_spawn


def config(tmp_path, name="unit", steps=6, max_policy_age=1, **placement) -> RunConfig:
    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2, concurrency=2, max_tokens=6,
                              reward_timeout_s=5.0),
        train=TrainConfig(steps=steps, batch_size=8, warmup_steps=1, max_policy_age=max_policy_age),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False),
        placement=PlacementConfig(**placement),
    )


def run_to_end(run: Run) -> Run:
    async def go():
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await run.shutdown()
    asyncio.run(go())
    return run


def check_accounting(run: Run) -> dict:
    c = run.buffer.check_accounting()
    # every episode id handed out at admission either became an episode (generated) or was never generated
    assert c["generated"] + run.rollout.ids_unused == run.rollout.next_episode_id
    return c


def test_accounting_and_metrics_columns(tmp_path):
    held = {}

    async def spawn(cfg):
        held["parts"] = await fake_spawn(cfg)
        return held["parts"]

    run = run_to_end(Run(config(tmp_path, reference=True), spawn=spawn))
    assert run.state == "finished" and run.step == 6 and run.version == 6
    c = check_accounting(run)
    assert c["trained"] == 6 * 8 and c["in_flight"] == 0
    df = run.metrics
    assert list(df["step"]) == [1, 2, 3, 4, 5, 6]
    for col in ("reward_mean", "reward/exact_answer", "reward/answer_format", "policy_age_mean", "policy_age_max",
                "completion_len", "loss", "loss_name", "tokens_per_s", "step_time_s", "train_time_s",
                "weight_sync_ms", "episodes_generated", "episodes_trained", "episodes_dropped"):
        assert col in df.columns, col
    assert (df["weight_sync_ms"] == 3.5).all()  # the fake trainer's gather 1 + write 0.5 + send 2 ms
    kinds = [e["kind"] for e in run.events]
    assert kinds[:3] == ["spawned", "data", "eval"] and kinds[-1] == "finished"
    # the greedy fake answers every held-out problem right: evaluation scored the final answers
    assert run.accuracy_history == [(0, 1.0), (6, 1.0)]
    trained = run.rollouts[run.rollouts["status"] == "trained"]
    assert len(trained) > 0 and trained["ref_logprobs"].map(lambda x: x is not None and all(v == 0.0 for v in x)).all()
    # every generator replica got every version, in order
    gen = held["parts"].generators.replicas[0]
    assert gen.loaded == [1, 2, 3, 4, 5, 6]
    assert held["parts"].reference.calls > 0
    # one generate call per rollout (P prompts, n = G samples each: the group shares its prompt), plus one
    # greedy call per held-out evaluation (8 problems, n = 1)
    rollouts = run.rollout.next_group_id // 2
    assert sorted(gen.calls) == sorted([(2, 4)] * rollouts + [(8, 1)] * 2)


@pytest.mark.parametrize("age", [0, 1, 2])
def test_staleness_bound(tmp_path, age):
    parts = FakeParts(generators=None, trainer=FakeTrainer())
    seen = []

    async def spawn(cfg):
        parts.generators = fake_generators(cfg, 1)
        return parts

    run = Run(config(tmp_path, steps=8, max_policy_age=age), spawn=spawn)
    run.add_listener(lambda row: seen.append(row) if "step" in row else None)
    run_to_end(run)
    ages = [r["policy_age_max"] for r in seen]
    assert len(ages) == 8 and max(ages) <= age
    if age == 0:
        assert set(ages) == {0}
    # admission bound: episodes started under version v are at most (v + age + 1) * batch_size in all
    c = check_accounting(run)
    assert c["generated"] - c["evicted"] - c["dropped"] <= (run.version + age + 1) * 8


def test_pause_and_resume(tmp_path):
    run = Run(config(tmp_path, steps=8), spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(step=2, timeout=30)
        run.pause()
        assert run.state == "paused" and run.events[-1]["kind"] == "paused"
        at_pause = run.step
        for _ in range(500):  # give every task many turns of the loop: nothing may train while paused
            await asyncio.sleep(0)
        assert run.step <= at_pause + 1  # the step in flight when pausing may finish
        held = run.step
        for _ in range(500):
            await asyncio.sleep(0)
        assert run.step == held and run.state == "paused"
        run.resume()
        await run.until(predicate=lambda r: r.state == "finished", timeout=30)
        await run.shutdown()

    asyncio.run(go())
    assert run.step == 8 and [e["kind"] for e in run.events].count("resumed") == 1
    check_accounting(run)


def test_loss_swap_lands_at_a_step_boundary(tmp_path):
    trainer = FakeTrainer()
    run = Run(config(tmp_path, steps=6))

    async def go():
        await run.start()
        await run.until(step=2, timeout=30)
        trainer.hold()
        await asyncio.wait_for(trainer.in_step.wait(), 30)  # a step is in flight with the old loss
        swap = await run.set_loss("dapo")
        assert swap == {"loss": "dapo", "applies_at_step": run.step + 2}
        trainer.release()
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()
        return swap

    parts = FakeParts(trainer=trainer)

    async def spawn(cfg):
        parts.generators = fake_generators(cfg, 1)
        return parts

    run._spawn_parts = spawn
    swap = asyncio.run(go())
    names = dict(zip(run.metrics["step"], run.metrics["loss_name"]))
    at = swap["applies_at_step"]
    assert names[at - 1] == "grpo" and names[at] == "dapo" and names[6] == "dapo"
    assert [s["loss"] for s in trainer.steps] == ["grpo"] * (at - 1) + ["dapo"] * (6 - at + 1)
    ev = [e for e in run.events if e["kind"] == "loss_swapped"]
    assert len(ev) == 1 and ev[0]["applies_at_step"] == at


def test_loss_swap_refused_keeps_the_old_loss(tmp_path):
    from forgelab.run import LossSwapRefused

    run = Run(config(tmp_path, steps=3), spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(step=1, timeout=30)
        with pytest.raises(LossSwapRefused, match="no_such_loss"):
            await run.set_loss("no_such_loss")
        with pytest.raises(LossSwapRefused):
            await run.set_loss("grpo", not_a_keyword=1.0)
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()

    asyncio.run(go())
    assert set(run.metrics["loss_name"]) == {"grpo"}


def test_failing_reward_drops_its_episodes(tmp_path):
    run = Run(config(tmp_path, steps=5), spawn=fake_spawn)
    bad = set()

    def picky(prompt, completion, target, **info):
        if completion != target:  # the fake answers wrong half the time: those calls fail
            bad.add((prompt, completion))
            raise ValueError("picky reward cannot parse")
        return 1.0

    run.rewards.add("picky", picky, 0.5)  # before start: validation on recent rollouts would refuse it
    run_to_end(run)
    assert run.state == "finished"
    c = check_accounting(run)
    assert bad and c["dropped_reasons"].get("reward_error:picky", 0) > 0
    errors = [e for e in run.events if e["kind"] == "reward_error"]
    assert {e["reason"] for e in errors} == {"reward_error:picky"}
    assert {(e["prompt"], e["completion"]) for e in errors} <= bad
    ro = run.rollouts
    trained = ro[ro["status"] == "trained"]
    assert len(trained) > 0 and (trained["completion"] == trained["target"]).all()
    assert (trained["reward/picky"] == 1.0).all()
    assert any("picky reward cannot parse" in f.error_text for f in run.reward_failures)


def test_reward_refused_on_recent_rollouts_and_removed(tmp_path):
    from forgelab.run import RewardChangeRefused

    run = Run(config(tmp_path, steps=8), spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(predicate=lambda r: len(r.rollout.recent) >= 8, timeout=30)
        with pytest.raises(RewardChangeRefused, match="always_raises"):
            run.add_reward("always_raises", lambda p, c, t, **i: 1 / 0)
        assert "always_raises" not in run.snapshot().reward_names
        run.remove_reward("answer_format")
        with pytest.raises(KeyError):
            run.remove_reward("answer_format")
        await run.until(predicate=lambda r: any(e["kind"] == "reward_effective" for e in r.events), timeout=30)
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()

    asyncio.run(go())
    assert run.snapshot().reward_names == ["exact_answer"]
    kinds = [e["kind"] for e in run.events]
    assert "reward_removed" in kinds and kinds.index("reward_removed") < kinds.index("reward_effective")
    effective = next(e for e in run.events if e["kind"] == "reward_effective")
    assert effective["rewards"] == {"exact_answer": 1.0}
    # episodes scored from then on carry no answer_format part
    ro = run.rollouts
    assert not ro[ro["id"] >= effective["first_episode"]]["reward/answer_format"].notna().any()


def test_generator_replica_death(tmp_path):
    run = Run(config(tmp_path, steps=8, generator_replicas=2), spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(step=3, timeout=30)
        respawn = run.parts.generators.kill(1)
        await asyncio.wait_for(respawn, 30)
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished" and run.step == 8
    gens = run.parts is None  # shut down: parts released
    assert gens
    kinds = [e["kind"] for e in run.events]
    assert "replica_failed" in kinds and "replica_restarted" in kinds
    check_accounting(run)


def test_respawned_replica_is_caught_up_before_it_serves(tmp_path):
    gens: dict = {}

    async def spawn(cfg):
        parts = await fake_spawn(cfg)
        gens["g"] = parts.generators
        return parts

    run = Run(config(tmp_path, steps=8, generator_replicas=2), spawn=spawn)

    async def go():
        await run.start()
        await run.until(step=3, timeout=30)
        version = run.version
        await asyncio.wait_for(gens["g"].kill(0), 30)
        info = gens["g"].respawns[-1]
        assert info["served"] >= version and info["loaded"][-1] == info["served"]
        await asyncio.wait_for(run.wait(), 30)
        assert gens["g"].replicas[0].version == run.version  # and it kept receiving later pushes
        await run.shutdown()

    asyncio.run(go())


def test_until_raises_when_the_run_ends_first(tmp_path):
    run = Run(config(tmp_path, steps=2), spawn=fake_spawn)

    async def go():
        await run.start()
        with pytest.raises(RuntimeError, match="before the awaited condition"):
            await run.until(step=50, timeout=30)
        await run.shutdown()

    asyncio.run(go())
    assert run.state == "finished"


def test_skipped_steps_pause_the_run_with_a_message(tmp_path):
    trainer = FakeTrainer(skip_losses=("dapo",))
    parts = FakeParts(trainer=trainer)

    async def spawn(cfg):
        parts.generators = fake_generators(cfg, 1)
        return parts

    cfg = config(tmp_path, steps=6)
    run = Run(cfg, spawn=spawn)

    async def go():
        await run.start()
        await run.until(step=1, timeout=30)
        await run.set_loss("dapo")
        await run.until(predicate=lambda r: r.state == "paused", timeout=30)
        assert "run.set_loss" in run.message
        await run.set_loss("grpo")
        run.resume()
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()

    asyncio.run(go())
    c = check_accounting(run)
    assert c["dropped_reasons"]["step_skipped"] == cfg.train.max_consecutive_failures * 8
    assert run.step == 6 and run.state == "finished"


def test_hung_reward_message_points_at_public_commands():
    from forgelab.controller.reward_runner import MAX_HUNG_REWARD_CALLS, RewardRunner
    from forgelab.rewards.library import RewardComposer

    runner = RewardRunner(RewardComposer(), 1.0)

    class Alive:
        def is_alive(self):
            return True

    runner.hung = [Alive()] * MAX_HUNG_REWARD_CALLS
    msg = runner.hung_message()
    assert "run.remove_reward" in msg and "run.rewards" not in msg


def _episodes(n):
    from forgelab.types import Episode

    return [Episode(id=i, group_id=0, prompt_ids=[1], completion_ids=[2], generator_logprobs=[0.0],
                    policy_version=0, prompt="p", completion=str(i), target="t") for i in range(n)]


def test_reward_calls_run_at_once_on_reused_threads_and_a_hung_one_blocks_nobody():
    import threading
    import time

    from forgelab.controller.reward_runner import _WORKERS, RewardRunner
    from forgelab.rewards.library import RewardComposer

    n = 12
    barrier = threading.Barrier(n, timeout=60)  # every call must be running at the same time to pass it

    def together(prompt, completion, target, **info):
        barrier.wait()
        return 1.0

    def wait_idle(k):  # the pool's threads go back to waiting after settling their calls
        deadline = time.monotonic() + 60
        while _WORKERS._idle < k:
            assert time.monotonic() < deadline, f"only {_WORKERS._idle} idle reward threads"
            time.sleep(0.01)

    runner = RewardRunner(RewardComposer({"together": (together, 1.0)}), timeout_s=120)
    eps = _episodes(n)
    assert asyncio.run(runner.score(eps)) == {} and [e.reward for e in eps] == [1.0] * n
    wait_idle(n)
    started = next(_WORKERS._names)  # a counter: the next thread's number
    eps = _episodes(n)
    assert asyncio.run(runner.score(eps)) == {} and [e.reward for e in eps] == [1.0] * n
    assert next(_WORKERS._names) == started + 1  # no thread was started for the second batch

    release = threading.Event()

    def hangs_on_zero(prompt, completion, target, **info):
        if completion == "0":
            release.wait(120)
        return 0.5

    runner = RewardRunner(RewardComposer({"h": (hangs_on_zero, 1.0)}), timeout_s=5.0)
    eps = _episodes(4)
    failed = asyncio.run(runner.score(eps))
    assert failed == {0: "reward_timeout"} and [e.reward for e in eps[1:]] == [0.5] * 3
    assert len(runner.hung) == 1 and runner.hung[0].is_alive()
    release.set()
    deadline = time.monotonic() + 60
    while runner.hung[0].is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert runner.hung_message() is None and runner.hung == []


def test_parts_shutdown_stops_the_rest_and_kills_the_job_when_a_part_fails_to_stop(caplog):
    from forgelab.engines.spawn import Parts

    stopped, killed = [], []

    class Part:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        async def shutdown(self):
            stopped.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not stop")

    class Job:
        def kill(self):
            killed.append(True)

    parts = Parts(generators=Part("generators", fails=True), trainer=Part("trainer"),
                  reference=Part("reference"), job=Job())
    with caplog.at_level("WARNING", logger="forgelab.engines.spawn"):
        asyncio.run(parts.shutdown())
    assert stopped == ["generators", "reference", "trainer"] and killed == [True]
    assert "stopping the generators failed: RuntimeError: generators would not stop" in caplog.text
    assert parts.job is None and parts.generators is None and parts.trainer is None


def test_stop_then_start_again_continues_in_a_new_event_loop(tmp_path):
    run = Run(config(tmp_path, steps=6), spawn=fake_spawn)

    async def first():
        await run.start()
        await run.until(step=2, timeout=30)
        await run.stop()

    asyncio.run(first())
    assert run.state == "stopped" and 2 <= run.step < 6
    stopped_at = run.step

    async def second():
        await run.start()  # the parts stay up across stop(); only the loops restart
        await asyncio.wait_for(run.wait(), 30)
        await run.shutdown()

    asyncio.run(second())
    assert run.state == "finished" and run.step == 6 and list(run.metrics["step"]) == list(range(1, 7))
    assert [e["kind"] for e in run.events].count("stopped") == 1 and stopped_at < 6
    check_accounting(run)


@pytest.mark.parametrize("rewards", [None, {"answer_format": 0.5}])
def test_env_episode_reward_is_the_envs_plus_the_listed_rewards(tmp_path, rewards):
    import dataclasses

    cfg = config(tmp_path, steps=3)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, env="arithmetic_tutor", max_turns=2,
                                                               rewards=rewards)).validate()
    run = run_to_end(Run(cfg, spawn=fake_spawn))
    assert run.state == "finished" and run.step == 3
    check_accounting(run)
    ro = run.rollouts
    scored = ro[ro["status"].isin(["trained", "buffered", "in_flight"])]
    assert len(scored) > 0
    for _, ep in scored.iterrows():
        env_part = ep["reward/correct"] + ep["reward/hint_cost"]  # the environment's own reward parts
        if rewards is None:  # the default list adds nothing to an environment run
            assert ep["reward"] == pytest.approx(env_part)
            assert "reward/answer_format" not in ro.columns or ep["reward/answer_format"] != ep["reward/answer_format"]
        else:
            assert ep["reward"] == pytest.approx(env_part + 0.5 * ep["reward/answer_format"])
    if rewards is not None:
        assert "reward/answer_format" in run.metrics.columns and "reward/correct" in run.metrics.columns
    assert run.rewards.names == ([] if rewards is None else ["answer_format"])


def test_lab_panels_read_the_view_and_follow_remove_reward(tmp_path):
    run = Run(config(tmp_path, steps=3), spawn=fake_spawn)

    async def go():
        lab = run.dashboard()
        for panel in (lab.metrics, lab.rewards, lab.loss, lab.controls, lab.services, lab.inspector):
            panel.widget  # builds it: from here on it listens to the run
        await run.start()
        await asyncio.wait_for(run.wait(), 30)
        assert lab.metrics.refresh(force=True)
        lab.rewards.refresh()
        assert sorted(lab.rewards.sliders) == ["answer_format", "exact_answer"]
        run.remove_reward("answer_format")  # the public command; the panel follows the view
        lab.rewards.refresh()
        assert sorted(lab.rewards.sliders) == ["exact_answer"]
        lab.loss.refresh()
        assert "grpo" in lab.loss.current.value
        text = str(lab)
        assert "finished" in text and "rewards: exact_answer=1" in text
        lab.close()
        await run.shutdown()

    asyncio.run(go())


# ---------------------------------------------------------------------------- records that hold (issue #25: 2, 7)


def test_rollout_log_records_every_closed_episode_once_and_flushes_on_stop(tmp_path):
    """Stopped at a step that is no multiple of the log's flush period: every episode the buffer closed (trained,
    evicted, dropped) is in the log once, with the status and reason it closed with; held ones are not."""
    from forgelab.controller.rollout_log import FLUSH_EVERY, read_rollouts

    cfg = config(tmp_path, steps=100, max_policy_age=0)
    cfg.train.max_buffer = 8  # = batch_size: a second rollout arriving before a step overflows (buffer_full)
    parts = {}

    async def spawn(c):
        parts["p"] = await fake_spawn(c)
        return parts["p"]

    async def go():
        run = Run(cfg, spawn=spawn)
        await run.start()
        await run.until(step=FLUSH_EVERY + 1, timeout=60)
        await run.shutdown()
        return run

    run = asyncio.run(go())
    assert run.step % FLUSH_EVERY != 0
    c = check_accounting(run)
    log = read_rollouts(run.out_dir)
    assert log["id"].is_unique
    by_status = log["status"].value_counts().to_dict()
    # the fake trainer's own count of the episodes it stepped on, independent of the buffer and the log
    assert by_status.get("trained", 0) == c["trained"] == sum(s["episodes"] for s in parts["p"].trainer.steps)
    assert by_status.get("evicted", 0) == c["evicted"] and by_status.get("dropped", 0) == c["dropped"] > 0
    dropped = log[log["status"] == "dropped"]["reason"].value_counts().to_dict()
    assert dropped == c["dropped_reasons"]
    held = {ep.id for ep in run.buffer.buffered()}
    assert held.isdisjoint(log["id"]) and len(log) + len(held) == c["generated"]
    view = run.rollouts  # the in-memory view is capped, and says by how much
    assert view.attrs["shown"] == len(view) and view.attrs["shown"] + view.attrs["older"] == c["generated"]


def _block(first: int, n: int, version: int, group: int):
    from forgelab.types import Episode

    return [Episode(id=first + k, group_id=group, prompt_ids=[1], completion_ids=[2], generator_logprobs=[-1.0],
                    policy_version=version) for k in range(n)]


def _drive(buf, steps: int, start: int = 0):
    """A synchronous loop on the buffer alone: two blocks of 4 admitted per step, the second one half failed
    (2 episodes never generated), one whole block trained; what it sampled, per step."""
    sampled = []
    for step in range(start, start + steps):
        first = step * 8
        assert buf.admit(4, first_id=first) and buf.admit(4, first_id=first + 4)
        buf.add(_block(first, 4, step, 2 * step))
        buf.drop(_block(first + 4, 2, step, 2 * step + 1), "reward_error:f")  # the other 2 ids: never generated
        buf.release(4, first_id=first + 4)
        batch = buf.sample(step)
        sampled.append([e.id for e in batch])
        buf.mark_trained(batch)
        buf.release(4, first_id=first)
        buf.served_version = step + 1
    return sampled


def test_buffer_bookkeeping_is_bounded_by_a_watermark():
    from forgelab.controller.buffer import CLOSED, ReplayBuffer

    buf = ReplayBuffer(batch_size=4, max_policy_age=1, keep_statuses=10)
    _drive(buf, 500)
    c = buf.check_accounting()
    assert c["generated"] == 500 * 6 and c["trained"] == 2000 and c["dropped"] == 1000
    state = buf.state_dict()
    # every id below the watermark is closed or never generated: nothing above it is left to keep
    assert buf.watermark == 4000 and state["watermark"] == 4000 and state["closed"] == [] and state["episodes"] == []
    assert buf.status(3999) == CLOSED  # never generated (its rollout failed), below the watermark
    assert buf.status(3996) == "dropped" and buf.drop_reason(3996) == "reward_error:f"  # recent: kept for views
    assert buf.status(3995) == "trained" and buf.status(8) == CLOSED and buf.drop_reason(12) == ""
    with pytest.raises(ValueError, match="already seen"):
        buf.add(_block(8, 1, 0, 0))
    with pytest.raises(ValueError, match="watermark"):
        buf.admit(4, first_id=16)


def test_buffer_checkpoint_with_a_watermark_resumes_exactly():
    """Saved mid-run (a block admitted and buffered, statuses above the watermark), restored into a new buffer
    (as a resumed run's): the same operations then give the same batches, statuses and counters."""
    import json

    from forgelab.controller.buffer import ReplayBuffer

    a = ReplayBuffer(batch_size=4, max_policy_age=2, max_size=64)
    _drive(a, 50)
    assert a.admit(4, first_id=400)
    a.add(_block(400, 4, 50, 100))
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint stores it
    assert state["watermark"] == 400 and [e["id"] for e in state["episodes"]] == [400, 401, 402, 403]
    a.release(4, first_id=400)
    b = ReplayBuffer(batch_size=4, max_policy_age=2, max_size=64)
    b.load_state_dict(state)
    b.served_version = a.served_version  # a resumed run pushes its weights: the generators serve its version
    assert b.counts() == a.counts() and b.watermark == 400
    assert _drive(a, 30, start=51) == _drive(b, 30, start=51)
    assert a.counts() == b.counts() and a.state_dict() == b.state_dict()
    assert [a.status(i) for i in range(640, 700)] == [b.status(i) for i in range(640, 700)]


def test_run_checkpoints_stay_small_over_a_long_run(tmp_path):
    """A run's buffer state (what every checkpoint stores) holds the watermark and a few steps of statuses, not
    one entry per episode ever closed."""
    run = run_to_end(Run(config(tmp_path, steps=30), spawn=fake_spawn))
    state = run.buffer.state_dict()
    c = check_accounting(run)
    assert c["trained"] == 30 * 8 and c["generated"] >= 30 * 8
    assert state["watermark"] > 0 and len(state["closed"]) + len(state["episodes"]) <= 4 * 8


# ---------------------------------------------------------------------------- data limits (issue #25: 6)


def _rows_file(path, n):
    import json

    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "target": str(i)}) + "\n" for i in range(n)))
    return path


def test_a_10000_row_file_trains_on_all_of_its_training_rows(tmp_path):
    """No hidden cap: a 10,000-row file with the default held-out fraction (0.1, its last 1,000 rows) streams
    all 9,000 other rows in one epoch, and says so at start and in the manifest."""
    import json

    data = _rows_file(tmp_path / "big.jsonl", 10_000)
    cfg = config(tmp_path, steps=2)
    cfg.rollout.task = str(data)
    cfg.rollout.rewards = {"exact_answer": 1.0}
    run = Run(cfg, spawn=fake_spawn)
    epoch = run.stream.next(9_000)
    assert sorted(int(p.target) for p in epoch) == list(range(9_000))  # every training row once
    assert [int(p.target) for p in run.heldout] == list(range(9_000, 9_008))  # the first eval.n = 8 held-out rows
    run_to_end(run)
    manifest = json.loads((run.out_dir / "manifest.json").read_text())
    split = manifest["data_split"]
    assert (split["rows"], split["train"], split["heldout_rows"], split["evaluated"]) == (10_000, 9_000, 1_000, 8)
    assert str(split["heldout"]) == "0.1" and split["max_train_problems"] is None
    (ev,) = [e for e in run.events if e["kind"] == "data"]
    assert ev["message"].startswith("data: 9000 of 9000 training rows (rows 0-8999 of ") and "last 1000 rows" in ev["message"]


def test_data_limits_are_config_fields(tmp_path):
    from forgelab.config.run_config import ConfigError
    from forgelab.data import load_split

    data = _rows_file(tmp_path / "d.jsonl", 100)
    held = _rows_file(tmp_path / "h.jsonl", 30)
    s = load_split(str(data), heldout=25, max_train=50, eval_n=10)
    assert [int(p.target) for p in s.train] == list(range(50)) and [int(p.target) for p in s.heldout] == list(range(75, 85))
    assert "50 of 75 training rows" in s.description and "its last 25 rows" in s.description
    s = load_split(str(data), heldout=str(held), eval_n=100)
    assert len(s.train) == 100 and len(s.heldout) == 30 and "every row of" in s.description
    s = load_split("addition", heldout=str(held), max_train=7, eval_n=5)
    assert len(s.train) == 7 and [int(p.target) for p in s.heldout] == list(range(5))
    # 0.1 of 70 rows is 7 held out (exact decimal arithmetic, not int(70 * 0.1) by float)
    assert len(load_split(str(_rows_file(tmp_path / "s.jsonl", 70)), heldout=0.1).train) == 63
    with pytest.raises(ValueError, match="leaving none to train on"):
        load_split(str(data), heldout=100)
    for bad in (0, 1.5, -0.1, True, str(tmp_path / "missing.jsonl")):
        with pytest.raises(ConfigError, match="rollout.heldout"):
            RunConfig.from_dict({"rollout": {"heldout": bad}})
    with pytest.raises(ConfigError, match="rollout.max_train_problems"):
        RunConfig.from_dict({"rollout": {"max_train_problems": 0}})
    assert RunConfig.from_dict({"rollout": {"heldout": 200, "max_train_problems": 500}}).rollout.heldout == 200


# --- the parts' interfaces (issue #25): each part owns its state behind typed methods -----------------------


def test_reward_composer_snapshot_is_frozen_and_replace_all_keeps_the_object():
    from forgelab.rewards import RewardComposer, answer_format, exact_answer

    live = RewardComposer({"exact_answer": (exact_answer, 1.0)})
    frozen = live.snapshot()
    live.add("answer_format", answer_format, 0.5)
    live.set_weights({"exact_answer": 2.0})
    assert frozen.weights == {"exact_answer": 1.0}  # a rollout scored with the snapshot sees no later change
    assert live.weights == {"exact_answer": 2.0, "answer_format": 0.5}
    other = RewardComposer({"answer_format": (answer_format, 3.0)})
    same = live
    live.replace_all(other)
    assert live is same and live.weights == {"answer_format": 3.0}
    other.set_weights({"answer_format": 1.0})  # the two stay independent after the swap
    assert live.weights == {"answer_format": 3.0}
    assert set(live.terms) == {"answer_format"}


def test_reward_revisions_count_changes_and_mark_where_they_took_effect():
    from forgelab.controller.controls import RewardRevisions

    revs = RewardRevisions()
    assert not revs.unscored()
    assert revs.bump() == 1 and revs.bump() == 2 and revs.unscored()
    assert revs.mark_scored() == 2 and not revs.unscored()


def test_reward_changes_are_events_with_revisions_and_the_first_scored_rollout_marks_them(tmp_path):
    from forgelab.rewards import answer_format

    # enough steps that rollouts admitted after the changes are scored before the run can end (the changes are
    # made at step 1; at most (age + 1) batches were admitted before them)
    run = Run(config(tmp_path, steps=12), spawn=fake_spawn)

    async def go():
        await run.start()
        await run.until(step=1, timeout=30)
        run.set_reward_weights({"answer_format": 0.25})
        run.remove_reward("answer_format")
        run.add_reward("answer_format", answer_format, 0.5)
        await run.until(predicate=lambda r: any(e["kind"] == "reward_effective" for e in r.events), timeout=60)
        await run.shutdown()

    asyncio.run(go())
    kinds = [(e["kind"], e.get("rev")) for e in run.events if e["kind"].startswith("reward_")]
    assert kinds[:3] == [("reward_weights", 1), ("reward_removed", 2), ("reward_added", 3)]
    effective = [e for e in run.events if e["kind"] == "reward_effective"]
    assert effective and effective[0]["rev"] == 3 and effective[0]["rewards"] == {"exact_answer": 1.0,
                                                                                   "answer_format": 0.5}


def test_emit_records_the_event_and_tells_listeners_and_a_failing_listener_is_logged(tmp_path, caplog):
    run = Run(config(tmp_path), spawn=fake_spawn)
    seen = []

    def bad(msg):
        raise RuntimeError("listener bug")

    run.add_listener(bad)
    run.add_listener(seen.append)
    run.emit("note", detail="x")
    assert seen and seen[-1]["event"]["kind"] == "note" and seen[-1]["event"]["detail"] == "x"
    assert run.events[-1]["kind"] == "note" and run.events[-1]["step"] == 0
    assert "run listener failed" in caplog.text
    run.remove_listener(seen.append)
    run.notify({"step": 1})
    assert seen[-1]["event"]["kind"] == "note"  # removed: no longer told


def test_main_task_is_none_before_start_and_done_after_the_run(tmp_path):
    run = Run(config(tmp_path, steps=2), spawn=fake_spawn)
    assert run.main_task is None
    run_to_end(run)
    assert run.main_task is not None and run.main_task.done() and run.state == "finished"


def test_spawn_prepares_the_parts_without_training(tmp_path):
    run = Run(config(tmp_path, steps=2), spawn=fake_spawn)

    async def go():
        await run.spawn()
        assert run.parts is not None and run.rollout is not None and run.step == 0 and run.main_task is None
        assert (run.out_dir / "manifest.json").is_file()
        await run.start()  # start on spawned parts trains them
        await run.wait()
        await run.shutdown()

    asyncio.run(go())
    assert run.step == 2


def test_config_from_yaml_applies_overrides_and_names_a_bad_one(tmp_path):
    from forgelab.config import ConfigError

    p = tmp_path / "c.yaml"
    p.write_text("name: y\ntrain:\n  steps: 5\n")
    cfg = RunConfig.from_yaml(p, overrides=["train.steps=7", "rollout.group_size=2"])
    assert cfg.train.steps == 7 and cfg.rollout.group_size == 2 and cfg.name == "y"
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        RunConfig.from_yaml(p, overrides=["train.steps"])
    with pytest.raises(ConfigError, match="'name' is not a section"):
        RunConfig.from_yaml(p, overrides=["name.x=1"])


def test_one_episode_seed_owned_by_the_rollout_part():
    import hashlib

    from forgelab.controller import rollout
    from forgelab.experiments import replay

    assert replay.episode_seed is rollout.episode_seed
    # independent computation: the documented hash of "seed:episode" (31 bits)
    want = int.from_bytes(hashlib.sha256(b"3:17").digest()[:4], "little") & 0x7FFFFFFF
    assert rollout.episode_seed(3, 17) == want


def test_public_packages_resolve_their_lazy_names():
    import forgelab
    import forgelab.engines
    import forgelab.experiments

    assert forgelab.Run.__name__ == "Run" and forgelab.replay.__module__ == "forgelab.run"
    assert "Trainer" in dir(forgelab.engines) and forgelab.experiments.fork_from.__name__ == "fork_from"
    # a public name never shares its name with a submodule (importing the submodule would shadow it)
    import importlib
    import pkgutil

    for pkg in ("forgelab", "forgelab.engines", "forgelab.controller", "forgelab.experiments", "forgelab.recipes",
                "forgelab.config", "forgelab.data", "forgelab.rewards"):
        mod = importlib.import_module(pkg)
        subs = {m.name for m in pkgutil.iter_modules(mod.__path__)}
        assert not subs & set(mod.__all__), f"{pkg}: {sorted(subs & set(mod.__all__))} are both names and modules"
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        forgelab.engines.nope  # noqa: B018


# ---------------------------------------------------------------------------- custom losses, small traps (issue #25: 5, 9)


def halved_dapo(logprobs_B_T, **kwargs):
    """DAPO at half weight: a loss function given as code."""
    from forgelab.algos import LOSSES

    loss, metrics = LOSSES["dapo"](logprobs_B_T, **kwargs)
    return 0.5 * loss, metrics


def test_a_run_starts_on_a_loss_function_which_reaches_the_trainer_by_value(tmp_path):
    from forgelab.config import ConfigError
    from forgelab.engines.loss_specs import PackedLoss

    cfg = config(tmp_path, steps=2)
    cfg.train.loss = halved_dapo
    held = {}

    async def spawn(c):
        held["p"] = await fake_spawn(c)
        return held["p"]

    run = run_to_end(Run(cfg, spawn=spawn))
    assert run.state == "finished" and run.loss_name == "halved_dapo"
    got = held["p"].trainer.loss  # what the trainer process was given: the code itself, by value
    assert isinstance(got, PackedLoss) and got.name == "halved_dapo" and got.unpack().__doc__ == halved_dapo.__doc__
    assert set(run.metrics["loss_name"]) == {"halved_dapo"}
    assert "halved_dapo" in cfg.to_yaml()  # a config holding code still prints
    with pytest.raises(ConfigError, match="train.loss: unknown loss 3"):
        RunConfig.from_dict({"train": {"loss": 3}})


def test_a_losses_entry_only_the_notebook_has_is_shipped_not_lost(monkeypatch, tmp_path):
    """A name added to (or replaced in) LOSSES in this process passes validation and must reach the trainer as
    code: it travels packed under its name; the built-ins still travel by name."""
    from forgelab.algos import LOSSES
    from forgelab.controller.controls import prepare_loss
    from forgelab.engines.spawn import component_configs
    from forgelab.engines.loss_specs import PackedLoss

    monkeypatch.setitem(LOSSES, "halved", halved_dapo)
    cfg = config(tmp_path)
    cfg.train.loss = "halved"
    cfg.validate()
    shipped = component_configs(cfg)["trainer"].loss
    assert isinstance(shipped, PackedLoss) and shipped.name == "halved"
    assert shipped.unpack().__doc__ == halved_dapo.__doc__
    name, spec, _ = prepare_loss(cfg, "halved", {})  # run.set_loss("halved") ships it the same way
    assert name == "halved" and isinstance(spec, PackedLoss) and spec.name == "halved"
    assert prepare_loss(cfg, "dapo", {})[1] == "dapo"
    cfg.train.loss = "grpo"
    assert component_configs(cfg)["trainer"].loss == "grpo"
    monkeypatch.setitem(LOSSES, "grpo", halved_dapo)  # a built-in replaced in the notebook: its code travels
    assert isinstance(component_configs(cfg)["trainer"].loss, PackedLoss)


def test_grpo_default_kl_without_a_reference_is_set_to_zero_and_said(tmp_path, caplog):
    from forgelab.algos.loss_checks import reference_notes
    from forgelab.config import ConfigError
    from forgelab.controller.controls import LossSwapRefused
    from forgelab.engines.spawn import component_configs

    cfg = config(tmp_path, steps=2, reference=False)
    assert cfg.train.loss == "grpo"
    (note,) = reference_notes(cfg.train.loss, cfg.train.loss_kwargs, cfg.placement.reference)
    assert "kl_coef=0.04" in note and "placement.reference is false" in note
    assert component_configs(cfg)["trainer"].loss_kwargs == {"kl_coef": 0.0}  # what the trainer runs, visibly
    with pytest.raises(ConfigError, match=r"train.loss_kwargs.kl_coef: 0.04 needs the reference model"):
        RunConfig.from_dict({"train": {"loss_kwargs": {"kl_coef": 0.04}}, "placement": {"reference": False}})
    assert reference_notes("grpo", {"kl_coef": 0.0}, False) == [] == reference_notes("grpo", {}, True)

    async def go():
        run = Run(cfg, spawn=fake_spawn)
        await run.start()
        await run.until(step=1, timeout=60)
        with pytest.raises(LossSwapRefused, match="kl_coef: 0.1 needs the reference model"):
            await run.set_loss("dapo", kl_coef=0.1)  # the same rule for a live swap
        await run.wait()
        await run.shutdown()
        return run

    with caplog.at_level("WARNING"):
        run = asyncio.run(go())
    assert [e["message"] for e in run.events if e["kind"] == "config_note"] == [note]
    assert any(note in r.getMessage() for r in caplog.records)


def test_set_loss_without_await_still_swaps_and_a_failure_is_logged(tmp_path, caplog):
    """`run.set_loss(...)` forgotten without `await` (a notebook cell) used to do nothing and say nothing."""
    held = {}

    async def spawn(c):
        held["p"] = await fake_spawn(c)
        return held["p"]

    async def go():
        run = Run(config(tmp_path, steps=6), spawn=spawn)
        await run.start()
        await run.until(step=1, timeout=60)
        cmd = run.set_loss("dapo")  # not awaited
        await run.until(predicate=lambda r: r.loss_name == "dapo", timeout=60)
        assert "dapo" in repr(cmd) and "applies_at_step" in repr(cmd)
        bad = run.set_loss("dapo", eps_hgih=0.3)  # refused; nobody awaits it: the refusal is logged
        await run.until(predicate=lambda r: any("eps_hgih" in rec.getMessage() for rec in caplog.records), timeout=60)
        assert "failed" in repr(bad)
        assert (await run.set_loss("grpo"))["loss"] == "grpo"  # awaited, it returns the swap's report as before
        await run.wait()
        await run.shutdown()
        return run

    with caplog.at_level("WARNING"):
        run = asyncio.run(go())
    assert "dapo" in [s["loss"] for s in held["p"].trainer.steps]  # the trainer did train with it
    (msg,) = [r.getMessage() for r in caplog.records if "eps_hgih" in r.getMessage()]
    assert "run.set_loss('dapo') failed and nothing awaited it: LossSwapRefused" in msg


def test_rollout_inspector_before_any_rollout_and_after_the_run(tmp_path, caplog):
    """Built before the first rollout (a dashboard cell right after start) it refreshes without error; when
    the run ends it turns to the trained episodes, not the last rollout's cancelled ones; a status the user
    chose stays."""
    from forgelab.lab import RolloutInspector

    run = Run(config(tmp_path, steps=3), spawn=fake_spawn)
    insp, chosen = RolloutInspector(run, min_interval_s=0.0), RolloutInspector(run, min_interval_s=0.0)

    async def go():
        with caplog.at_level("ERROR", logger="forgelab.lab"):
            _ = insp.widget, chosen.widget  # first refresh: no rollout exists yet
        assert not [r for r in caplog.records if r.name.startswith("forgelab.lab")], caplog.text
        assert list(insp.select.options) == [] and insp.status.value == "all statuses"
        chosen.status.value = "dropped"  # by hand
        await run.start()
        await asyncio.wait_for(run.wait(), 60)
        await insp.throttle.settled()
        await chosen.throttle.settled()
        await run.shutdown()

    asyncio.run(go())
    newest = run.rollouts.sort_values("id").iloc[-1]
    assert newest["status"] != "trained"  # what the table used to open on
    assert insp.status.value == "trained" and set(insp.df["status"]) == {"trained"} and len(insp.df) > 0
    assert insp.episode()["status"] == "trained"
    assert chosen.status.value == "dropped" and all(s.startswith("dropped") for s in chosen.df["status"])
    late = RolloutInspector(run)  # opened after the run ended
    _ = late.widget
    assert late.status.value == "trained" and late.episode()["status"] == "trained"


def test_run_summary_closes_its_accounting(tmp_path):
    """`make demo`'s last JSON line (`follow_run`'s summary) shows every term of its accounting identity."""
    from forgelab.progress import follow_run

    summary = asyncio.run(follow_run(Run(config(tmp_path, steps=3), spawn=fake_spawn), started_at=0.0, start=True))
    e = summary["episodes"]
    assert e["generated"] == e["trained"] + e["evicted"] + e["dropped"] + e["buffered"] + e["in_flight"]
    assert e["trained"] == 3 * 8 and sum(e["dropped_reasons"].values()) == e["dropped"]


def test_subpackages_are_reachable_as_attributes_of_a_fresh_import():
    """`forgelab.lab.compare` right after `import forgelab` (it raised AttributeError unless forgelab.lab was
    imported first); a fresh interpreter, since this one has imported everything already."""
    import subprocess
    import sys

    code = ("import forgelab, sys; assert 'forgelab.lab' not in sys.modules; "
            "print(forgelab.lab.compare.__module__, forgelab.controller.buffer.ReplayBuffer.__name__, "
            "hasattr(forgelab, 'no_such_thing'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["forgelab.lab.compare", "ReplayBuffer", "False"]


def test_a_run_resumed_from_a_checkpoint_restores_the_bounded_buffer_exactly(tmp_path):
    """The checkpoint holds the buffer's watermark and the few statuses above it; the resumed run's buffer is
    the saved one (same state_dict), and it trains on to the end with its accounting closed."""
    import json

    cfg = config(tmp_path, name="ck", steps=12)
    cfg.tracking.checkpoint_every = 6
    first = run_to_end(Run(cfg, spawn=fake_spawn))
    ckpt = tmp_path / "ck" / "checkpoints" / "step_000006"
    saved = json.loads((ckpt / "controller.json").read_text())["buffer"]
    assert saved["format"] == 2 and saved["watermark"] > 0  # ids below it are counted, not listed
    assert len(saved["closed"]) + len(saved["episodes"]) < saved["generated"] / 2
    resumed = Run(cfg, resume_from=ckpt, spawn=fake_spawn)

    async def go():
        await resumed.spawn()  # restores without training
        assert resumed.buffer.state_dict() == saved
        await resumed.start()
        await asyncio.wait_for(resumed.wait(), 60)
        await resumed.shutdown()

    asyncio.run(go())
    assert resumed.step == 12 and first.step == 12
    c = resumed.buffer.check_accounting()  # (ids admitted but not generated before the save are not re-used)
    assert c["trained"] == 12 * 8


def test_rollout_recorder_parts_pending_rows_and_a_fresh_directory(tmp_path, monkeypatch):
    from forgelab.controller import rollout_log
    from forgelab.controller.rollout_log import RolloutRecorder, read_rollouts

    eps = _block(0, 10, 0, 0)
    rec = RolloutRecorder()
    rec.on_close(eps[:3], "trained")
    assert rec.flush() == 0 and len(rec.pending) == 3  # no directory yet: the rows wait
    rec.attach(tmp_path)
    rec.on_close(eps[3:4], "dropped", "reward_error:f")
    rec.step_done(3)  # not a multiple of FLUSH_EVERY: nothing written
    assert not (tmp_path / "rollouts").exists()
    rec.step_done(rollout_log.FLUSH_EVERY)
    monkeypatch.setattr(rollout_log, "MAX_PENDING", 4)
    rec.on_close(eps[4:8], "evicted", "stale")  # 4 waiting rows: a part at once, whatever the step
    assert rec.written == 8 and rec.parts == 2 and rec.pending == []
    log = read_rollouts(tmp_path).set_index("id")
    assert list(log["status"]) == ["trained"] * 3 + ["dropped"] + ["evicted"] * 4
    assert log.loc[3, "reason"] == "reward_error:f" and log.loc[7, "reason"] == "stale"
    again = RolloutRecorder(tmp_path)  # a resume of this directory appends after the parts there
    again.on_close(eps[8:], "trained")
    again.flush()
    assert again.parts == 3 and len(read_rollouts(tmp_path)) == 10
    fresh = RolloutRecorder()
    fresh.attach(tmp_path, append=False)  # a new run of the same directory: the old run's parts go
    assert not list((tmp_path / "rollouts").glob("part-*.parquet")) and fresh.parts == 0


def test_env_runs_report_turn_and_episode_latency_percentiles(tmp_path):
    """Latency you can see (issue #29 item 3): every step of an environment run carries p50/p95/p99 of its
    episodes' turn and episode latencies, computed over all of them (checked against numpy's nearest rank)."""
    import dataclasses

    import numpy as np

    from forgelab.envs.episode import latency_percentiles

    cfg = config(tmp_path, steps=2)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, env="arithmetic_tutor", max_turns=2)).validate()
    run = run_to_end(Run(cfg, spawn=fake_spawn))
    df = run.metrics
    for kind in ("turn", "episode"):
        cols = [f"latency/{kind}_p{q}_ms" for q in (50, 95, 99)]
        assert df[cols].notna().all().all() and (df[cols[0]] <= df[cols[1]]).all() and (df[cols[1]] <= df[cols[2]]).all()
    eps = [ep for ep in run.rollout.recent if ep.info.get("turn_latency_s")]
    got = latency_percentiles(eps)
    turns = [x for ep in eps for x in ep.info["turn_latency_s"]]
    for q in (50, 95, 99):
        want = float(np.percentile(turns, q, method="inverted_cdf")) * 1e3
        assert got[f"turn_p{q}_ms"] == round(want, 6)  # the same element (nearest rank), rounded to 1 ns as recorded
    # an episode lasts at least as long as its turns together
    assert all(ep.info["episode_latency_s"] >= sum(ep.info["turn_latency_s"]) for ep in eps)


def test_a_run_directory_opens_in_the_lab_with_every_trained_episode_and_its_token_values(tmp_path):
    """`forgelab.lab.open(RUN_DIR)` (issue #28 item 3): read from the run's files, no process; every trained
    episode is in the rollout table with its token ids and generator logprobs, the metrics and the timeline are
    there, and a command is refused by name."""
    import forgelab.lab
    from forgelab.controller.recorded import RecordedRun

    run = run_to_end(Run(config(tmp_path, steps=4, reference=True), spawn=fake_spawn))
    view = forgelab.lab.open(run.out_dir)
    rec = view.run
    assert isinstance(rec, RecordedRun) and rec.state == "finished" and rec.step == 4
    assert list(rec.metrics["step"]) == list(run.metrics["step"])
    df = rec.rollouts
    trained = df[df["status"] == "trained"]
    assert len(trained) == run.buffer.counts()["trained"] == 4 * 8
    for _, r in trained.iterrows():  # the token view's columns, per token
        assert len(r["generator_logprobs"]) == len(r["completion_ids"]) > 0
        assert r["ref_logprobs"] is not None and len(r["ref_logprobs"]) == len(r["completion_ids"])
    snap = rec.snapshot()
    assert snap.name == run.config.name and snap.episodes["trained"] == 32 and snap.accuracy is not None
    assert "recorded run" in view.summary() and any(e["kind"] == "finished" for e in rec.events)
    assert "step" in view.timeline.html()
    view.inspector.widget  # builds headless, as in a notebook
    assert set(view.inspector.filtered()["id"]) <= set(df["id"])
    with pytest.raises(RuntimeError, match="set_loss: .* is a recorded run .* Run.fork_from"):
        rec.set_loss("dapo")


def test_an_evaluation_holds_new_rollouts_until_it_is_scored_and_loses_none(tmp_path):
    """While `run.evaluate()` runs, no rollout is admitted (its requests have the generator to themselves); the
    rollouts resume after it and the accounting still closes. The fake's greedy (evaluation) call yields the
    event loop 50 times mid-call: enough for the two rollout workers to admit if they were not held."""
    cfg = config(tmp_path, steps=6, max_policy_age=2)
    cfg.eval.every = 2
    held = {"evals": 0, "admitted_during": []}

    async def spawn(c):
        parts = await fake_spawn(c)
        gen = parts.generators.replicas[0]
        plain = gen.generate

        async def generate(prompt_ids_P, n=1, sampling=None, seeds=None):
            if sampling is not None and getattr(sampling, "temperature", 1.0) == 0.0:
                before = run.rollout.next_episode_id
                for _ in range(50):
                    await asyncio.sleep(0)
                held["evals"] += 1
                held["admitted_during"].append(run.rollout.next_episode_id - before)
            return await plain(prompt_ids_P, n, sampling, seeds)

        gen.generate = generate
        return parts

    run = Run(cfg, spawn=spawn)
    run_to_end(run)
    assert run.state == "finished" and run.step == 6
    assert held["evals"] == 4, held  # steps 0, 2, 4 and 6 (the last step's evaluation is the final one)
    assert held["admitted_during"] == [0] * 4, held
    assert run.gate.holds == 0
    check_accounting(run)


def test_single_turn_prompt_ids_are_rendered_once_and_equal_a_fresh_rendering():
    from transformers import AutoTokenizer

    from forgelab.config.run_config import SHIPPED_MODEL
    from forgelab.controller.rollout import SingleTurn
    from forgelab.data.prompts import format_prompt

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    encoded = []
    src = SingleTurn(None, tok)
    plain_encode = tok.encode
    tok.encode = lambda text, **kw: encoded.append(text) or plain_encode(text, **kw)
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "12+30="}]
    for prompt in ("3+4=", chat):
        fresh = plain_encode(format_prompt(tok, prompt), add_special_tokens=False)
        first = src.prompt_ids(prompt)
        first.append(-1)  # a caller mutating its list must not reach the cache
        assert src.prompt_ids(prompt) == fresh
    assert len(encoded) == 2  # each prompt rendered and encoded once


def test_a_fork_child_that_fails_to_start_gives_back_its_reserved_slot_or_its_processes(tmp_path):
    """`_start_child`: a child whose constructor raises never attached, so the slot reserved for it (a shared
    engines' `ReservedSlot`) is released; a child whose restore fails after its parts exist is shut down."""
    from forgelab.experiments.fork import _start_child

    class Reserved:
        released = 0

        async def __call__(self, cfg):
            return await fake_spawn(cfg)

        async def release(self):
            Reserved.released += 1
            return True

    class BadConfig(Run):
        def __init__(self, *a, **kw):
            raise ValueError("bad child config")

    shut = []

    class BadRestore(Run):
        async def spawn(self):
            self.parts = await self._spawn_parts(self.config)
            raise RuntimeError("restore failed")

        async def shutdown(self):
            shut.append(self.config.name)
            self.parts = None

    cfg = config(tmp_path, name="child")
    with pytest.raises(ValueError, match="bad child config"):
        asyncio.run(_start_child(BadConfig, cfg, tmp_path, Reserved(), {}, {}, None, False))
    assert Reserved.released == 1
    with pytest.raises(RuntimeError, match="restore failed"):
        asyncio.run(_start_child(BadRestore, cfg, tmp_path, Reserved(), {}, {}, None, False))
    assert shut == ["child"] and Reserved.released == 1  # shut down (its slot with it), not released twice


def test_a_checkpoint_keeps_the_zero_variance_count_a_teacher_run_reports(tmp_path):
    """`episodes_zero_variance_kept` (distillation keeps equal-reward groups) is a running count in the metrics:
    a resumed run continues it instead of starting again from 0."""
    cfg = config(tmp_path, name="zv", steps=2)
    run = Run(cfg, spawn=fake_spawn)

    async def go():
        await run.spawn()
        run.rollout.zero_variance_kept = 7
        path = await run.save_checkpoint(tmp_path / "zv_ck")
        await run.shutdown()
        resumed = Run(cfg, resume_from=path, spawn=fake_spawn)
        await resumed.spawn()
        kept = resumed.rollout.zero_variance_kept
        await resumed.shutdown()
        return kept

    assert asyncio.run(go()) == 7


def test_until_wakes_when_episodes_close_in_the_buffer_without_any_event():
    """`run.until(predicate=...)` re-checks when episodes close (here dropped, with no event or metrics row):
    a predicate on the accounting holds as soon as the drop happens, not at the next step."""
    from types import SimpleNamespace

    from forgelab.controller import controls
    from forgelab.controller.buffer import ReplayBuffer
    from forgelab.types import Episode

    async def go():
        listeners = []
        run = SimpleNamespace(buffer=ReplayBuffer(8, 1), tracker=None, step=0, state="running",
                              add_listener=listeners.append, remove_listener=listeners.remove)
        run.main_task = asyncio.ensure_future(asyncio.Event().wait())  # a run that never steps

        async def drop_later():
            await asyncio.sleep(0)
            eps = [Episode(id=i, group_id=0, prompt_ids=[1], completion_ids=[2], generator_logprobs=[-0.1],
                           policy_version=0) for i in range(3)]
            run.buffer.drop(eps, "test_drop")

        asyncio.ensure_future(drop_later())
        await controls.wait_until(lambda: run.buffer.counts()["dropped"] >= 3, bus=run, buffer=run.buffer,
                                  main_task=lambda: run.main_task, describe=lambda: run.state, timeout=20)
        run.main_task.cancel()
        return run.buffer.counts()["dropped"], listeners

    dropped, listeners = asyncio.run(go())
    assert dropped == 3 and listeners == []
