"""Staleness: synchronous (max_policy_age 0) vs asynchronous (1, 2) GRPO, wall time to a target accuracy.

    python -m forgelab.bench async [--quick] [--target 0.40] [--repeats 1]

The demo configuration (the shipped tiny model, addition, group 8, batch 64,
lr 1e-4; one generator, trainer and reference process with 1 torch thread
each on the 2 cores) run three times, differing only in
``train.max_policy_age``: 0 makes rollouts wait for the newest weights
(on-policy, generation and training alternate), 1 and 2 let generation run
that many versions ahead of training (the GRPO loss's ratio to the
generator's logprobs corrects for the lag). Time is training wall time to
the first held-out greedy evaluation (``Run.evaluate``, 200 test problems,
every ``--every`` steps) at or above the target, evaluation excluded, as in
the ``e2e`` suite. With ``--repeats`` > 1 the order of the three rotates
between repeats; the ratio ``async_over_sync`` is (best of age 1 and 2) /
age 0, on the median time per age. Asynchrony buys time per step (overlap),
and may cost steps (stale samples): the table shows both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.e2e import EVAL_EVERY, STEP_CAP, TARGET, TIME_CAP_S, bench_config, forgelab_with_time_cap

AGES = (0, 1, 2)


def async_ratio(times_by_age: dict[int, list[float | None]]) -> float | None:
    """(best median time of the asynchronous ages) / (median time of age 0); None if age 0 or all async missed.

    >>> async_ratio({0: [10.0], 1: [6.0], 2: [7.0]})
    0.6
    >>> async_ratio({0: [None], 1: [6.0]}) is None
    True
    """
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    sync = med(times_by_age.get(0, []))
    asyn = [m for a, ts in times_by_age.items() if a > 0 and (m := med(ts)) is not None]
    if sync is None or not asyn:
        return None
    return round(min(asyn) / sync, 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench async", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps per age, target not expected (~5 min loaded)")
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--every", type=int, default=EVAL_EVERY)
    ap.add_argument("--steps", type=int, default=STEP_CAP)
    ap.add_argument("--time-cap", type=float, default=TIME_CAP_S)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the three ages (order rotates)")
    ap.add_argument("--json-out", default="", help="also write the full result (with curves) to this file")
    args = ap.parse_args(argv or [])
    if args.quick:
        args.steps, args.every, args.repeats, args.time_cap = 10, 5, 1, 120.0

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"async: max_policy_age {AGES}, target {args.target}, eval every {args.every}, cap {args.steps} steps / "
          f"{args.time_cap:.0f} s, {args.repeats} round(s)", flush=True)
    runs: dict[int, list[dict]] = {a: [] for a in AGES}
    rows = []
    with tempfile.TemporaryDirectory(prefix="forgelab-async-") as out_dir:
        for rep in range(args.repeats):
            order = AGES[rep % 3:] + AGES[: rep % 3]
            for age in order:
                cfg = bench_config(steps=args.steps, max_policy_age=age, eval_every=args.every, out_dir=out_dir,
                                   name=f"age{age}_{rep}")
                r = forgelab_with_time_cap(cfg, args.target, args.time_cap, hf_check=False)
                runs[age].append(r)
                rows.append({"max_policy_age": age, "rep": rep,
                             "time_to_target_s": r["time_to_target_s"] if r["reached"] else "not reached",
                             "steps": r["steps_to_target"] if r["reached"] else f">{r['final_step']}",
                             "s/step": r["s_per_step"], "policy_age_mean": r["policy_age_mean"],
                             "final_acc": r["final_accuracy"], "evicted": r["episodes"]["evicted"],
                             "startup_s": r["startup_s"]})
                print(f"  age {age} rep {rep}: {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    end = print_machine("end")
    print_table(rows, ["max_policy_age", "rep", "time_to_target_s", "steps", "s/step", "policy_age_mean", "final_acc",
                       "evicted", "startup_s"])
    times = {a: [r["time_to_target_s"] for r in rs] for a, rs in runs.items()}
    sps = {a: statistics.median([r["s_per_step"] for r in rs if r["s_per_step"]] or [float("nan")])
           for a, rs in runs.items()}
    ratio = async_ratio(times)
    result = {
        "suite": "async",
        "target_accuracy": args.target,
        "async_over_sync": ratio,
        "time_to_target_s": {str(a): t for a, t in times.items()},
        "steps_to_target": {str(a): [r["steps_to_target"] for r in rs] for a, rs in runs.items()},
        "s_per_step": {str(a): round(v, 3) for a, v in sps.items()},
        "s_per_step_async_over_sync": round(min(sps[1], sps[2]) / sps[0], 3),
        "goal": "async_over_sync <= 0.67",
        "goal_met": None if ratio is None else ratio <= 0.67,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result, "runs": {str(a): rs for a, rs in runs.items()}}, f)
    emit_json(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
