"""Start-up time: a cold run (new processes) and a warm one (the processes a finished run left in a pool).

    python -m forgelab.bench startup [--quick]

Both are timed from `Run(config)` to the first completed training step (the
metrics row of step 1) with the shipped tiny model, on the same config (only
the run name differs), with the step-0 evaluation off. Cold: `Run(cfg,
spawn=pool)` on an empty `forgelab.engines.pool.ProcessPool` spawns generator and
trainer (and reference) processes; warm: a second `Run` on the pool the first
left idle re-initialises the same processes (trainer rebuilt from the config,
generators reset to the fresh weights as version 0). Goal: warm_over_cold <= 0.15.
The full mode times the warm start 3 times (median); --quick once: one cold start and one warm one, each
branch of the pool (spawn, re-initialise) once; nothing smaller runs both. --quick leaves the reference process
out (generator and trainer only: the pool spawns and re-initialises every service alike; leaving it out took the
quick mode from 46.0 to 35.3 CPU-s).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from forgelab.bench.common import emit_json, print_machine, print_table


def _config(out_dir: str, name: str, reference: bool = True):
    from forgelab.config.run_config import EvalConfig, PlacementConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(
        name=name,
        rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=2, concurrency=2, max_tokens=8),
        train=TrainConfig(steps=2, batch_size=16, lr=1e-4, warmup_steps=0, max_policy_age=0, seed=0),
        eval=EvalConfig(every=0, n=1),
        tracking=TrackingConfig(out_dir=out_dir, wandb=False),
        placement=PlacementConfig(reference=reference),
    )


async def _first_step(pool, out_dir: str, name: str, reference: bool = True) -> tuple[float, list[int], float]:
    """Seconds from Run(config) to step 1, the run's process ids, and the spawn/re-init seconds."""
    from forgelab.run import Run

    t0 = time.perf_counter()
    run = Run(_config(out_dir, name, reference), spawn=pool)
    run.evaluator.skip_initial()  # step-0 evaluation off
    await run.start()
    await run.until(step=1, timeout=900)
    seconds = time.perf_counter() - t0
    pids = await pool.pids(run.parts)
    spawn_s = run.parts.seconds
    await run.shutdown()  # back to the pool
    return seconds, sorted(p for v in pids.values() for p in v), spawn_s


async def _run(warm_repeats: int, reference: bool = True) -> dict:
    from forgelab.engines.pool import ProcessPool

    pool = ProcessPool()
    out = tempfile.mkdtemp(prefix="forgelab-bench-startup-")
    try:
        cold_s, cold_pids, cold_spawn = await _first_step(pool, out, "cold", reference)
        warm = [await _first_step(pool, out, f"warm{i}", reference) for i in range(warm_repeats)]
    finally:
        await pool.shutdown()
    warm_s = statistics.median(w[0] for w in warm)
    return {
        "suite": "startup", "cold_s": round(cold_s, 2), "warm_s": round(warm_s, 2),
        "warm_over_cold": round(warm_s / cold_s, 3), "warm_runs_s": [round(w[0], 2) for w in warm],
        "cold_spawn_s": round(cold_spawn, 2), "warm_reinit_s": round(statistics.median(w[2] for w in warm), 2),
        "same_processes": all(w[1] == cold_pids for w in warm), "processes": len(cold_pids),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m forgelab.bench startup")
    parser.add_argument("--quick", action="store_true",
                        help="proves the code path: one cold start, then one warm start (default: 3, median), "
                             "no reference process")
    args = parser.parse_args(argv or [])
    start = print_machine("start")
    result = asyncio.run(_run(*((1, False) if args.quick else (3, True))))
    end = print_machine("end")
    result.update({"quick": args.quick, "goal": "warm_over_cold <= 0.15", "goal_met": result["warm_over_cold"] <= 0.15,
                   "machine": {**start, "loadavg_end": end["loadavg"]}})
    print(f"startup bench: Run(config) -> first training step, shipped model, step-0 eval off, pid {os.getpid()}")
    print_table(
        [{"start": "cold (new processes)", "seconds": result["cold_s"], "of which spawn/re-init": result["cold_spawn_s"]},
         {"start": "warm (pooled processes)", "seconds": result["warm_s"], "of which spawn/re-init": result["warm_reinit_s"]},
         {"start": "warm / cold", "seconds": result["warm_over_cold"], "of which spawn/re-init": ""}],
        ["start", "seconds", "of which spawn/re-init"],
    )
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
