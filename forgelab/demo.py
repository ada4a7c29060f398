"""`make demo`: asynchronous GRPO on the addition task from the shipped base model.

Spawns a vLLM generator, a torchtitan trainer and a reference model as Monarch
actors, trains with a staleness bound of 1, prints a progress bar and a
per-step table, writes metrics.csv / metrics.parquet, learning_curve.png and
an offline wandb run under runs/demo/, and ends with held-out greedy accuracy
before and after. The last line is one JSON object.
"""
from __future__ import annotations

import json
import time

from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig


def demo_config(steps: int | None = None, out_dir: str = "runs") -> RunConfig:
    """The demo's configuration (also used by tutorial 07 and the e2e benchmark)."""
    return RunConfig(
        name="demo",
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=8, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=steps or 200, batch_size=64, lr=1e-4, warmup_steps=5, max_policy_age=1, loss="grpo"),
        eval=EvalConfig(every=25, n=200),
        tracking=TrackingConfig(out_dir=out_dir),
    ).validate()


async def demo(steps: int | None = None, out_dir: str = "runs") -> int:
    from forgelab.progress import follow_run
    from forgelab.run import Run

    t0 = time.time()
    cfg = demo_config(steps, out_dir)
    print(f"forgelab demo: asynchronous GRPO on '{cfg.rollout.task}' from {cfg.model.path}", flush=True)
    print(f"  {cfg.train.steps} steps x {cfg.train.batch_size} episodes (group {cfg.rollout.group_size}), "
          f"loss {cfg.train.loss}, max_policy_age {cfg.train.max_policy_age}", flush=True)
    run = Run(cfg)
    # The reporter attaches before start(), so the step-0 held-out evaluation is printed as an
    # `[event] eval` line (it runs in the background: start() returns before it finishes).
    result = await follow_run(run, started_at=t0, start=True, ndigits=4)
    print(f"  metrics: {run.out_dir / 'metrics.csv'}; curve: {run.out_dir / 'learning_curve.png'}; "
          f"wandb (offline): {run.tracker.wandb_dir if run.tracker else None}", flush=True)
    print(json.dumps(result), flush=True)
    return 0 if run.state == "finished" else 1
