"""In-flight weight updates vs draining: async GRPO on long-tailed completions, wall time to a held-out target.

    python -m forgelab.bench inflight [--quick] [--pairs 3] [--target 0.30]

The demo configuration (the shipped tiny model, addition, group 8, batch 64, lr 1e-4, `max_policy_age` 1:
asynchronous GRPO; a generator, trainer and reference process, 1 torch thread each) with long-tailed
completion lengths: `max_tokens` 128 and a logit bias of -9 on the end-of-turn token while sampling
(`generator.sampling.logit_bias`; the recorded logprobs stay the model's own, and held-out evaluation is greedy
without the bias). The trained model answers in 2-3 tokens and ends the turn with a margin of ~9 nats, so the
bias lets a few percent of the samples run on to 128 tokens: most completions are short, a few are 40x longer
(those score 0: the exact-answer reward reads the whole completion, so the policy also learns to stop).

Each pair runs the same seed under ``generator.update_mode: drain`` (a weight push stops intake and waits for
the running requests, the long tail included) and ``inflight`` (loaded between two engine steps, requests run
on), in alternating order, on one process pool (each mode's processes spawned once and warmed by a one-step
run, then re-initialised per run). Time is warm wall time from the end of the step-0 held-out evaluation to
the end of the first evaluation (every `--every` steps, `--eval-n` test problems, greedy) at or above the
target; a run that misses (step or time cap) stays in, censored at the time it stopped (`censored` counts
them). `generator_idle_*` is the generator's idle time (no request in its engine) over the run's wall time
(median over pairs), from its own counters and clock; idle also counts the waits for admission (the
staleness bound holds rollouts back while the trainer is behind), which both modes have. `drain_wait_s` is
what draining itself costs: the time weight pushes waited for the running requests to finish (0 in flight).
`resets_deferred` counts pushes whose prefix-cache reset waited for an idle engine, `stale_cached` the prompt
tokens served from the prefix cache to requests added meanwhile (blocks that may come from older weights).

Last line: `inflight_over_drain_time_to_target` (median over pairs of inflight / drain; goal <= 0.75),
`generator_idle_drain`, `generator_idle_inflight`, `heldout_accuracy_drain` / `_inflight` (final evaluation,
per pair), `accuracy_spread` (the largest gap between two pairs of one mode) and `learning_not_worse`
(median final accuracy inflight >= median drain - that spread).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from forgelab.bench._stats import bootstrap_median_ci, censored_time
from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.e2e import bench_config, run_forgelab, summarize_forgelab

MODES = ("drain", "inflight")
EOS_BIAS = -9.0
MAX_TOKENS = 128
TARGET = 0.30


def configure(cfg, mode: str, eos_id: int):
    """`cfg` with long-tailed sampling and the given `generator.update_mode`."""
    cfg.rollout.max_tokens = MAX_TOKENS
    cfg.generator.update_mode = mode
    cfg.generator.sampling.logit_bias = {int(eos_id): EOS_BIAS}
    return cfg.validate()


async def _gen_stats(pool, cfg) -> dict:
    from forgelab.engines.pool import engine_key

    key = engine_key(cfg)
    parts = next(p for p in pool.idle if p.key == key)
    return (await parts.generators.fanout("stats"))[0]


async def _one(pool, cfg, target: float, time_cap_s: float) -> dict:
    """One run on the pool's warm processes; its summary plus the generator's idle fraction over it."""
    s0 = await _gen_stats(pool, cfg)
    t0 = time.perf_counter()
    res = await run_forgelab(cfg, target, time_cap_s, hf_check=False, spawn=pool)
    wall = time.perf_counter() - t0
    s1 = await _gen_stats(pool, cfg)
    r = summarize_forgelab(res, target)
    gen_wall = s1["clock_s"] - s0["clock_s"]  # the generator's own clock between the two reads
    r["generator_idle"] = round((s1["idle_time_s"] - s0["idle_time_s"]) / gen_wall, 3)
    r["generator_busy"] = round((s1["busy_time_s"] - s0["busy_time_s"]) / gen_wall, 3)
    r["tokens_per_request"] = round((s1["tokens_generated"] - s0["tokens_generated"])
                                    / max(1, s1["requests"] - s0["requests"]), 2)
    for k in ("requests_spanning_versions", "prefix_cache_resets", "prefix_cache_resets_deferred",
              "cached_tokens_possibly_stale", "preemptions", "drain_wait_s"):
        r[k] = round(s1[k] - s0[k], 3)
    r["prefix_hit_rate"] = round((s1["cached_prompt_tokens"] - s0["cached_prompt_tokens"])
                                 / max(1, s1["prompt_tokens"] - s0["prompt_tokens"]), 3)
    r["wall_s"] = round(wall, 1)
    return r


async def _main(args, out_dir: str) -> dict[str, list[dict]]:
    from transformers import AutoTokenizer

    from forgelab.engines.pool import ProcessPool

    def cfg_for(mode: str, seed: int, steps: int, eval_n: int, name: str, warmup: int | None = None):
        cfg = bench_config(steps=steps, max_policy_age=1, eval_every=args.every, out_dir=out_dir, name=name,
                           seed=seed, prompts=args.prompts, eval_n=eval_n,
                           warmup=args.warmup if warmup is None else warmup)
        eos = AutoTokenizer.from_pretrained(cfg.model.path).eos_token_id
        return configure(cfg, mode, eos)

    pool = ProcessPool()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for mode in MODES:  # spawn and warm each mode's processes (not measured)
            await run_forgelab(cfg_for(mode, 99, 1, 4, f"warm_{mode}", warmup=0), 2.0, 60.0, hf_check=False, spawn=pool)
        for pair in range(args.pairs):
            order = MODES if pair % 2 == 0 else MODES[::-1]
            for mode in order:
                r = await _one(pool, cfg_for(mode, pair, args.steps, args.eval_n, f"{mode}{pair}"), args.target,
                               args.time_cap)
                r["pair"] = pair
                runs[mode].append(r)
                print(f"  {mode} pair {pair}: {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    finally:
        for parts in list(pool.idle):
            await parts.stop_processes()
    return runs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench inflight", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: one pair, 2 steps each (batch 8, 10 held-out problems)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--eval-n", type=int, default=100)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--time-cap", type=float, default=240.0)
    args = ap.parse_args(argv or [])
    args.prompts, args.warmup = 8, None
    if args.quick:
        args.pairs, args.steps, args.every, args.eval_n, args.time_cap, args.prompts, args.warmup = 1, 2, 2, 10, 60.0, 1, 1

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"inflight: drain vs inflight, max_tokens {MAX_TOKENS}, eos bias {EOS_BIAS}, target {args.target}, "
          f"{args.pairs} pair(s), cap {args.steps} steps / {args.time_cap:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="forgelab-inflight-") as out_dir:
        runs = asyncio.run(_main(args, out_dir))
    end = print_machine("end")
    rows = [{"mode": m, "pair": r["pair"], "time_to_target_s": r["time_to_target_s"] if r["reached"] else f">{r['end_s']}",
             "steps": r["steps_to_target"] if r["reached"] else f">{r['final_step']}", "s/step": r["s_per_step"],
             "final_acc": r["final_accuracy"], "generator_idle": r["generator_idle"],
             "tokens/request": r["tokens_per_request"], "spanning": r["requests_spanning_versions"],
             "drain_wait_s": r["drain_wait_s"], "prefix_hit": r["prefix_hit_rate"],
             "resets_deferred": r["prefix_cache_resets_deferred"], "stale_cached": r["cached_tokens_possibly_stale"]}
            for m in MODES for r in runs[m]]
    print_table(rows, ["mode", "pair", "time_to_target_s", "steps", "s/step", "final_acc", "generator_idle",
                       "tokens/request", "spanning", "drain_wait_s", "prefix_hit", "resets_deferred", "stale_cached"])
    times = {m: [censored_time(r) for r in runs[m]] for m in MODES}
    per_pair = [i / d for i, d in zip(times["inflight"], times["drain"]) if d > 0]
    ratio = round(statistics.median(per_pair), 3) if per_pair else None
    acc = {m: [r["final_accuracy"] for r in runs[m]] for m in MODES}
    spread = max((max(v) - min(v) for v in acc.values() if v), default=0.0)
    idle = {m: round(statistics.median([r["generator_idle"] for r in runs[m]]), 3) for m in MODES}
    result = {
        "suite": "inflight",
        "quick": args.quick,
        "target_accuracy": args.target,
        "inflight_over_drain_time_to_target": ratio,
        "ci95": bootstrap_median_ci(per_pair),
        "pair_ratios": [round(x, 3) for x in per_pair],
        "generator_idle_drain": idle["drain"],
        "generator_idle_inflight": idle["inflight"],
        "heldout_accuracy_drain": acc["drain"],
        "heldout_accuracy_inflight": acc["inflight"],
        "accuracy_spread": round(spread, 3),
        "learning_not_worse": statistics.median(acc["inflight"]) >= statistics.median(acc["drain"]) - spread,
        "censored": {m: sum(not r["reached"] for r in runs[m]) for m in MODES},
        "time_to_target_s": {m: times[m] for m in MODES},
        "s_per_step": {m: [r["s_per_step"] for r in runs[m]] for m in MODES},
        "tokens_per_request": {m: [r["tokens_per_request"] for r in runs[m]] for m in MODES},
        "prefix_hit_rate": {m: [r["prefix_hit_rate"] for r in runs[m]] for m in MODES},
        "requests_spanning_versions": {m: [r["requests_spanning_versions"] for r in runs[m]] for m in MODES},
        "prefix_cache_resets_deferred": {m: [r["prefix_cache_resets_deferred"] for r in runs[m]] for m in MODES},
        "cached_tokens_possibly_stale": {m: [r["cached_tokens_possibly_stale"] for r in runs[m]] for m in MODES},
        "preemptions": {m: [r["preemptions"] for r in runs[m]] for m in MODES},
        "drain_wait_s": {m: [r["drain_wait_s"] for r in runs[m]] for m in MODES},
        "clock": "wall time from the end of the step-0 evaluation, evaluations included; misses censored",
        "goal": "inflight_over_drain_time_to_target <= 0.75",
        "goal_met": None if ratio is None else ratio <= 0.75,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
