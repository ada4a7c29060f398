"""Records that hold (issue #25, items 2 and 5) on real processes: one run with 8 prompts x 64 samples per step.

The run starts on a loss *function* passed as `train.loss` (defined here, as a notebook cell would define it):
the trainer process receives it and runs it (its marker metric is in every metrics row). It is stopped while
its 12th train step is in flight; its rollout log then holds every episode the replay buffer closed (trained,
evicted or dropped), each once and with its final status, and the trained ones are exactly the 12 x 512 the
trainer stepped on. Before the fix, rows were taken from a deque of the newest 2,000 episodes every 4 steps
(2,048 episodes at this size) and a stop lost everything after the last multiple of 4.
"""
from __future__ import annotations

import asyncio
import sys

import cloudpickle
import pytest

pytestmark = pytest.mark.integration

# functions defined here travel by value (as a notebook cell's would), not as an import of this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])

P, G, STOP_IN_STEP = 8, 64, 12


def marked_dapo(logprobs_B_T, **kwargs):
    """DAPO with a marker metric: a metrics row holding ``marked == 1.0`` was computed by this function."""
    from forgelab.algos import LOSSES

    loss, metrics = LOSSES["dapo"](logprobs_B_T, **kwargs)
    return loss, {**metrics, "marked": 1.0}


def test_custom_loss_run_stopped_mid_step_logs_every_closed_episode(tmp_path):
    from forgelab.config.run_config import (EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig,
                                            TrainConfig)
    from forgelab.controller.rollout_log import read_rollouts
    from forgelab.engines.spawn import spawn_parts
    from forgelab.run import Run

    cfg = RunConfig(
        name="log",
        # max_tokens 2: the cheapest completions that still give rewards some variance
        rollout=RolloutConfig(task="addition", group_size=G, prompts_per_rollout=P, concurrency=2, max_tokens=2),
        train=TrainConfig(steps=100, batch_size=P * G, lr=1e-4, warmup_steps=1, max_policy_age=1,
                          max_buffer=4 * P * G, loss=marked_dapo),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=str(tmp_path), wandb=False),
        placement=PlacementConfig(reference=False),
    )
    trained_rows: list[int] = []  # episodes per train_step call, as the trainer received them
    in_last_step = asyncio.Event()

    async def spawn(c):
        parts = await spawn_parts(c)
        call = parts.trainer.call

        async def counting_call(endpoint, *args, **kwargs):
            if endpoint == "train_step":
                trained_rows.append(int(args[0]["tokens_B_L"].shape[0]))
                if len(trained_rows) == STOP_IN_STEP:
                    in_last_step.set()
            return await call(endpoint, *args, **kwargs)

        parts.trainer.call = counting_call
        return parts

    async def go() -> Run:
        run = Run(cfg, spawn=spawn)
        await run.start()
        try:
            await asyncio.wait_for(in_last_step.wait(), 600)
            assert run.training_in_flight  # the stop lands in the middle of step 12
            await run.stop()
        finally:
            await run.shutdown()
        return run

    run = asyncio.run(go())
    assert run.state == "stopped" and run.step == STOP_IN_STEP, (run.state, run.step, run.message)
    assert trained_rows == [P * G] * STOP_IN_STEP
    # the trainer ran the function it was given: its marker is in every row, under its own name
    m = run.metrics
    assert list(m["marked"]) == [1.0] * STOP_IN_STEP and set(m["loss_name"]) == {"marked_dapo"}

    c = run.buffer.check_accounting()
    log = read_rollouts(run.out_dir)
    assert log["id"].is_unique
    status = log.set_index("id")["status"]
    # every trained episode is in the log, and no more: 12 steps x 512 episodes
    assert c["trained"] == P * G * STOP_IN_STEP == int((status == "trained").sum())
    # and every other closed one, each with the status the buffer closed it with
    assert int((status == "evicted").sum()) == c["evicted"]
    assert int((status == "dropped").sum()) == c["dropped"]
    assert set(log["policy_version"][status == "trained"]) <= set(range(STOP_IN_STEP))
    # what the buffer still holds is not closed: not in the log (a resume may train it)
    held = {ep.id for ep in run.buffer.buffered()} | {ep.id for ep in run.buffer.in_flight()}
    assert held.isdisjoint(set(log["id"]))
