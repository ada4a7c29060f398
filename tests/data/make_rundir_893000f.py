"""Recipe for tests/data/rundir_893000f/: a run directory written by forgelab at commit 893000f.

Run once, at 893000f, from the repository root (it was; the output is committed):

    PYTHONPATH=$PWD .venv/bin/python tests/data/make_rundir_893000f.py

Issue #38 renames and moves modules; run directories and checkpoints record module paths (a custom
function's record names its module and qualname, and its cloudpickle payload refers to every importable
function it calls by module path). `tests/test_compat_rundir.py` loads, resumes and replays this directory
with today's code, so a move that breaks an old run directory fails a test.

What it makes (in-process fakes, `forgelab.testing.fakes.fake_spawn`: no process starts, a few KB on disk):
a synchronous 6-step run on the addition task, with
  - a custom reward ``short_reward`` added live after step 1 (defined here: pickled by value into the event log
    and the checkpoints; it calls `forgelab.rewards.library.extract_answer`, pickled by module path),
  - a custom loss ``scaled_grpo(scale=0.5)`` swapped in live after step 2 (defined here; it calls
    `forgelab.algos.losses.grpo`, pickled by module path),
  - a checkpoint every 3 steps (step_000003 holds both custom functions; step_000006 is the last).
Paths in the recorded config are relative to the repository root (``model.path`` = forgelab/assets/tiny-llama,
``tracking.out_dir`` = tests/data/rundir_893000f), so the directory does not name this machine's checkout.
"""
from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

from forgelab.algos.losses import grpo
from forgelab.config import EvalConfig, ModelConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig
from forgelab.rewards.library import extract_answer
from forgelab.run import Run
from forgelab.testing.fakes import fake_spawn

OUT = "tests/data/rundir_893000f"
NAME = "compat"


def short_reward(prompt, completion, target, **info):
    """1.0 when the extracted answer has at most 2 characters."""
    return 1.0 if len(extract_answer(completion)) <= 2 else 0.0


def scaled_grpo(logprobs_B_T, *, scale=1.0, **kwargs):
    """GRPO with its loss multiplied by `scale` (reported as a metric, so its use is visible)."""
    loss, metrics = grpo(logprobs_B_T, **kwargs)
    return loss * scale, {**metrics, "loss_scale": float(scale)}


def config() -> RunConfig:
    return RunConfig(
        name=NAME,
        model=ModelConfig(path="forgelab/assets/tiny-llama"),
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=2, concurrency=2, max_tokens=6,
                              reward_timeout_s=5.0),
        train=TrainConfig(steps=6, batch_size=8, warmup_steps=1, max_policy_age=0, seed=11),
        eval=EvalConfig(every=0, n=8),
        tracking=TrackingConfig(out_dir=OUT, wandb=False, checkpoint_every=3),
        placement=PlacementConfig(),
    )


async def main() -> Path:
    run = Run(config(), spawn=fake_spawn)
    swaps = []

    def on_row(row):
        if row.get("step") == 1:
            run.add_reward("short", short_reward, 0.5)
        if row.get("step") == 2:
            swaps.append(asyncio.ensure_future(run.set_loss(scaled_grpo, scale=0.5)))

    run.add_listener(on_row)
    await run.start()
    await asyncio.wait_for(run.wait(), 120)
    await asyncio.gather(*swaps)
    await run.shutdown()
    assert run.state == "finished", run.message
    return run.out_dir


if __name__ == "__main__":
    if not Path("forgelab/assets/tiny-llama/config.json").is_file():
        sys.exit("run me from the repository root")
    shutil.rmtree(OUT, ignore_errors=True)
    out = asyncio.run(main())
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:8d}  {p}")
