"""Staleness: synchronous (max_policy_age 0) vs asynchronous (1, 2) GRPO, wall time to a target accuracy.

    python -m forgelab.bench async [--quick] [--target 0.40] [--repeats 2]

The demo configuration (the shipped tiny model, addition, group 8, batch 64,
lr 1e-4; one generator, trainer and reference process with 1 torch thread
each on the 2 cores) run at every ``train.max_policy_age`` in (0, 1, 2): 0
makes rollouts wait for the newest weights (on-policy, generation and
training alternate), 1 (the default) and 2 let generation run that many
versions ahead of training (the GRPO loss's ratio to the generator's logprobs
corrects for the lag). Time is warm wall time from the end of the step-0
held-out evaluation to the end of the first evaluation (``Run.evaluate``, 200
test problems, every ``--every`` steps) at or above the target, evaluations
included, as in the ``e2e`` suite. A run that misses the target stays in,
censored at the time it stopped. Repeat ``k`` uses training seed ``k`` at
every age, and the order of the ages rotates between repeats.

The headline ``async_over_sync_default`` is median time at age 1 (the
default) / median time at age 0; every age's ratio is reported too
(``async_over_sync_by_age``). Asynchrony buys time per step (overlap) and may
cost steps (stale samples): the table shows both.

``--quick`` measures nothing; it runs every age (0, 1, 2) once on one `ProcessPool` (spawned for the first run,
re-initialised for the next two: the pooled path), 2 steps each (warmup 1, batch 8) with 10 held-out problems
evaluated at steps 0 and 2, each run censored (the target is out of reach in 2 steps), and every ratio, interval
and key of the JSON. Its cost is the one spawn; the runs are about a second each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile

from forgelab.bench._stats import bootstrap_median_ci, censored_time
from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.e2e import (EVAL_EVERY, EVAL_N, STEP_CAP, TARGET, TIME_CAP_S, bench_config, forgelab_with_time_cap,
                                run_forgelab, summarize_forgelab)

AGES = (0, 1, 2)


def async_ratio(times_by_age: dict[int, list[float]], age: int = 1) -> float | None:
    """Median time at `age` / median time at age 0 (times already censored: misses included).

    >>> async_ratio({0: [10.0, 12.0, 14.0], 1: [6.0, 7.0, 9.0], 2: [7.0]})
    0.583
    >>> async_ratio({0: [10.0], 1: []}) is None
    True
    """
    sync, asyn = times_by_age.get(0) or [], times_by_age.get(age) or []
    if not sync or not asyn:
        return None
    return round(statistics.median(asyn) / statistics.median(sync), 3)


async def _pooled(cfgs: list, target: float, time_cap_s: float) -> list[dict]:
    """`run_forgelab` of each config in turn on one `ProcessPool` (one spawn, then re-initialised), summarised."""
    from forgelab.engines.pool import ProcessPool

    pool = ProcessPool()
    try:
        return [summarize_forgelab(await run_forgelab(cfg, target, time_cap_s, hf_check=False, spawn=pool), target)
                for cfg in cfgs]
    finally:
        await pool.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench async", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: every age (0, 1, 2) once, 2 steps each (warmup 1, batch 8, "
                         "10 held-out problems, evaluated at steps 0, 2), the three runs in one process pool "
                         "(spawned once, re-initialised per run) instead of new processes per run")
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--every", type=int, default=EVAL_EVERY)
    ap.add_argument("--steps", type=int, default=STEP_CAP)
    ap.add_argument("--time-cap", type=float, default=TIME_CAP_S)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the three ages (seed = round; order rotates)")
    ap.add_argument("--json-out", default="", help="also write the full result (with curves) to this file")
    args = ap.parse_args(argv or [])
    prompts, eval_n, warmup = 8, EVAL_N, None
    if args.quick:
        args.steps, args.every, args.repeats, args.time_cap = 2, 2, 1, 60.0
        prompts, eval_n, warmup = 1, 10, 1

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"async: max_policy_age {AGES}, target {args.target}, eval every {args.every}, cap {args.steps} steps / "
          f"{args.time_cap:.0f} s, {args.repeats} round(s)", flush=True)
    runs: dict[int, list[dict]] = {a: [] for a in AGES}
    rows = []
    with tempfile.TemporaryDirectory(prefix="forgelab-async-") as out_dir:
        plan = [(rep, age, bench_config(steps=args.steps, max_policy_age=age, eval_every=args.every, out_dir=out_dir,
                                        name=f"age{age}_{rep}", seed=rep, prompts=prompts, eval_n=eval_n,
                                        warmup=warmup))
                for rep in range(args.repeats) for age in AGES[rep % 3:] + AGES[: rep % 3]]
        if args.quick:  # one set of processes for every run: the spawns are fixed cost, not what is measured
            pooled = asyncio.run(_pooled([cfg for _, _, cfg in plan], args.target, args.time_cap))
        for i, (rep, age, cfg) in enumerate(plan):
            r = pooled[i] if args.quick else forgelab_with_time_cap(cfg, args.target, args.time_cap, hf_check=False)
            r["seed"] = rep
            runs[age].append(r)
            rows.append({"max_policy_age": age, "rep": rep,
                         "time_to_target_s": r["time_to_target_s"] if r["reached"] else f">{r['end_s']}",
                         "steps": r["steps_to_target"] if r["reached"] else f">{r['final_step']}",
                         "s/step": r["s_per_step"], "policy_age_mean": r["policy_age_mean"],
                         "final_acc": r["final_accuracy"], "evicted": r["episodes"]["evicted"],
                         "startup_s": r["startup_s"]})
            print(f"  age {age} rep {rep}: {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    end = print_machine("end")
    print_table(rows, ["max_policy_age", "rep", "time_to_target_s", "steps", "s/step", "policy_age_mean", "final_acc",
                       "evicted", "startup_s"])
    times = {a: [censored_time(r) for r in rs] for a, rs in runs.items()}
    sps = {a: statistics.median([r["s_per_step"] for r in rs if r["s_per_step"]] or [float("nan")])
           for a, rs in runs.items()}
    by_age = {str(a): async_ratio(times, a) for a in AGES if a > 0}
    per_round = [a / s for a, s in zip(times[1], times[0])]  # same seed, same round
    default = by_age["1"]
    result = {
        "suite": "async",
        "quick": args.quick,
        "target_accuracy": args.target,
        "async_over_sync_default": default,
        "ci95": bootstrap_median_ci(per_round),
        "async_over_sync_by_age": by_age,
        "async_over_sync": default,
        "censored": {str(a): sum(not r["reached"] for r in rs) for a, rs in runs.items()},
        "time_to_target_s": {str(a): t for a, t in times.items()},
        "steps_to_target": {str(a): [r["steps_to_target"] for r in rs] for a, rs in runs.items()},
        "s_per_step": {str(a): round(v, 3) for a, v in sps.items()},
        "s_per_step_age1_over_age0": round(sps[1] / sps[0], 3),
        "clock": "wall time from the end of the step-0 evaluation, evaluations included; misses censored",
        "goal": "async_over_sync_default <= 0.67",
        "goal_met": None if default is None else default <= 0.67,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result, "runs": {str(a): rs for a, rs in runs.items()}}, f)
    emit_json(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
