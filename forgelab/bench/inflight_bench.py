"""In-flight weight updates vs draining: async GRPO on long-tailed completions, wall time to a held-out target.

    python -m forgelab.bench inflight [--quick] [--pairs 5] [--target 0.35]

The demo's model and task (the shipped tiny model on addition, group 8, batch 64, lr 1e-4, a generator, trainer
and reference process, 1 torch thread each) made long-tailed the way a reasoning task is: the answer comes
first and what follows is not scored (`leading_answer`: the completion's leading integer is its answer), and
sampling adds a logit bias of -9 to the end-of-turn token (`generator.sampling.logit_bias`; the recorded
logprobs stay the model's own, and held-out evaluation is greedy without the bias, scored by the task's exact
answer), with `max_tokens` 256. Most completions end after 2-4 tokens; a few percent run on to 256, and since
their tails are not scored, the policy keeps them (no pressure to stop). Rollouts are played a group at a time
(`prompts_per_rollout` 1, `concurrency` 16: the demo's 128 requests in flight, each group buffered when its 8
samples end, so a short group does not wait on another group's tail) and `max_policy_age` is 2 (a tail may
outlive one push).

Each pair runs the same seed under ``generator.update_mode: drain`` (a weight push stops intake and waits for
the running requests, the long tail included) and ``inflight`` (loaded between two engine steps, requests run
on), in alternating order, on one set of processes in a `ProcessPool` (spawned once, warmed by a one-step run
in each mode, then re-initialised per run: the update mode is set per run at re-initialisation, as it fixes no
engine; until 2026-11-27 each mode had its own set). Every run trains `--steps` steps (on past the target), so the final
accuracies compare runs of the same length. Time is warm wall time from the end of the step-0 held-out
evaluation to the end of the first evaluation (every `--every` steps, `--eval-n` test problems, greedy) at or
above the target; a run that misses (step or time cap) stays in, censored at the time it stopped (`censored`
counts them). `generator_idle_*` is the generator's idle time (no request in its engine) over the run's wall time
(median over pairs), from its own counters and clock; idle also counts the waits for admission (the
staleness bound holds rollouts back while the trainer is behind), which both modes have. `drain_wait_s` is
what draining itself costs: the time weight pushes waited for the running requests to finish (0 in flight).
`resets_deferred` counts pushes whose prefix-cache reset waited for an idle engine, `stale_cached` the prompt
tokens served from the prefix cache to requests added meanwhile (blocks that may come from older weights).

Last line: `inflight_over_drain_time_to_target` (median over pairs of inflight / drain; goal <= 0.75) with its
95 % interval, `inflight_over_drain_s_per_step` (the same for seconds per step: what the mode changes, free of
the steps-to-target spread between seeds), `generator_idle_drain`, `generator_idle_inflight`,
`heldout_accuracy_drain` / `_inflight` (at the last step, per pair), `accuracy_spread` (the largest gap
between two pairs of one mode) and `learning_not_worse` (median final accuracy inflight >= median drain -
that spread).

``--quick`` measures nothing; it spawns the one process set (warmed by a 1-step run in the first mode only: the
full mode's warm-up loop runs, and the generator's counters are read from the pool's idle processes; the pair
loads both modes anyway), then one pair (both modes, the alternating order's first) of 2 steps each at batch 8
(1 group x 8) with 10 held-out problems at steps 0 and 2, each censored, with the long-tailed sampling, and every
key of the JSON. Its cost is that one spawn (two before the update mode left the pool's engine key); the three
runs are re-initialisations. ``process_sets_spawned``,
``update_mode_served`` and ``weight_updates`` / ``inflight_updates`` (per run: every push of an inflight run is
loaded in flight, none of a drain run's) show that one set served both modes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time

from forgelab.bench._stats import bootstrap_median_ci, censored_time
from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.e2e import bench_config, run_forgelab, summarize_forgelab

MODES = ("drain", "inflight")
EOS_BIAS = -9.0
MAX_TOKENS = 256
TARGET = 0.35
MAX_POLICY_AGE = 2
REWARD = "forgelab.bench.inflight_bench:leading_answer"


def leading_answer(prompt: str, completion: str, target: str, **info) -> float:
    """1.0 if the completion starts with the target integer (after whitespace) and no digit follows it, else
    0.0: the answer comes first, whatever comes after it is not scored (a reasoning task's long tail).

    >>> leading_answer("", "357", "357"), leading_answer("", " 357<junk> 12", "357"), leading_answer("", "3571", "357")
    (1.0, 1.0, 0.0)
    >>> leading_answer("", "x357", "357"), leading_answer("", "-4 and more", "-4")
    (0.0, 1.0)
    """
    m = re.match(r"\s*(-?\d+)", completion)
    return 1.0 if m is not None and m.group(1) == str(target).strip() else 0.0


def configure(cfg, mode: str, eos_id: int):
    """`cfg` with long-tailed sampling, groups played one at a time and the given `generator.update_mode`."""
    cfg.rollout.max_tokens = MAX_TOKENS
    cfg.model.max_model_len = max(cfg.model.max_model_len, MAX_TOKENS + 64)
    cfg.rollout.rewards = {REWARD: 1.0}
    in_flight = cfg.rollout.prompts_per_rollout * cfg.rollout.concurrency  # groups at once (the demo: 8 x 2)
    cfg.rollout.prompts_per_rollout = 1
    cfg.rollout.concurrency = max(in_flight, 1)
    cfg.train.max_policy_age = MAX_POLICY_AGE
    cfg.generator.update_mode = mode
    cfg.generator.sampling.logit_bias = {int(eos_id): EOS_BIAS}
    return cfg.validate()


def _idle_parts(pool, cfg):
    from forgelab.engines.pool import engine_key

    key = engine_key(cfg)
    return next(p for p in pool.idle if p.key == key)


async def _gen_stats(pool, cfg) -> dict:
    return (await _idle_parts(pool, cfg).generators.fanout("stats"))[0]


async def _one(pool, cfg, target: float, time_cap_s: float) -> dict:
    """One run on the pool's warm processes; its summary plus the generator's idle fraction over it."""
    s0 = await _gen_stats(pool, cfg)
    t0 = time.perf_counter()
    res = await run_forgelab(cfg, target, time_cap_s, hf_check=False, spawn=pool, stop_at_target=False)
    wall = time.perf_counter() - t0
    s1 = await _gen_stats(pool, cfg)
    r = summarize_forgelab(res, target)
    gen_wall = s1["clock_s"] - s0["clock_s"]  # the generator's own clock between the two reads
    r["generator_idle"] = round((s1["idle_time_s"] - s0["idle_time_s"]) / gen_wall, 3)
    r["generator_busy"] = round((s1["busy_time_s"] - s0["busy_time_s"]) / gen_wall, 3)
    r["tokens_per_request"] = round((s1["tokens_generated"] - s0["tokens_generated"])
                                    / max(1, s1["requests"] - s0["requests"]), 2)
    for k in ("requests_spanning_versions", "prefix_cache_resets", "prefix_cache_resets_deferred",
              "cached_tokens_possibly_stale", "preemptions", "drain_wait_s", "weight_updates", "inflight_updates"):
        r[k] = round(s1[k] - s0[k], 3)
    r["prefix_hit_rate"] = round((s1["cached_prompt_tokens"] - s0["cached_prompt_tokens"])
                                 / max(1, s1["prompt_tokens"] - s0["prompt_tokens"]), 3)
    r["wall_s"] = round(wall, 1)
    r["update_mode_served"] = (await _idle_parts(pool, cfg).generators.engine_status())[0].update_mode
    return r


async def _main(args, out_dir: str) -> tuple[dict[str, list[dict]], dict[str, int]]:
    from transformers import AutoTokenizer

    from forgelab.engines.pool import ProcessPool

    def cfg_for(mode: str, seed: int, steps: int, eval_n: int, name: str, warmup: int | None = None):
        cfg = bench_config(steps=steps, max_policy_age=MAX_POLICY_AGE, eval_every=args.every, out_dir=out_dir,
                           name=name, seed=seed, prompts=args.prompts, eval_n=eval_n,
                           warmup=args.warmup if warmup is None else warmup)
        eos = AutoTokenizer.from_pretrained(cfg.model.path).eos_token_id
        return configure(cfg, mode, eos)

    pool = ProcessPool()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for mode in MODES[:1] if args.quick else MODES:  # spawn the processes, warm them in each mode (not measured)
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
    return runs, {"spawned": pool.spawned, "reused": pool.reused}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench inflight", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: one pair, 2 steps each (batch 8, 10 held-out problems)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--steps", type=int, default=80, help="steps of every run (they train on past the target)")
    ap.add_argument("--time-cap", type=float, default=300.0)
    args = ap.parse_args(argv or [])
    args.prompts, args.warmup = 8, None
    if args.quick:
        args.pairs, args.steps, args.every, args.eval_n, args.time_cap, args.prompts, args.warmup = 1, 2, 2, 10, 60.0, 1, 1

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"inflight: drain vs inflight, max_tokens {MAX_TOKENS}, eos bias {EOS_BIAS}, reward {REWARD}, "
          f"one group per rollout (as many in flight as the demo's rollouts hold), max_policy_age {MAX_POLICY_AGE}, "
          f"target {args.target}, "
          f"{args.pairs} pair(s), cap {args.steps} steps / {args.time_cap:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="forgelab-inflight-") as out_dir:
        runs, sets = asyncio.run(_main(args, out_dir))
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
    step_ratio = [i["s_per_step"] / d["s_per_step"] for i, d in zip(runs["inflight"], runs["drain"])
                  if i["s_per_step"] and d["s_per_step"]]
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
        "inflight_over_drain_s_per_step": round(statistics.median(step_ratio), 3) if step_ratio else None,
        "s_per_step_ratios": [round(x, 3) for x in step_ratio],
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
        "weight_updates": {m: [r["weight_updates"] for r in runs[m]] for m in MODES},
        "inflight_updates": {m: [r["inflight_updates"] for r in runs[m]] for m in MODES},
        "update_mode_served": {m: [r["update_mode_served"] for r in runs[m]] for m in MODES},
        "process_sets_spawned": sets["spawned"],
        "process_sets_reused": sets["reused"],
        "clock": "wall time from the end of the step-0 evaluation, evaluations included; misses censored",
        "goal": "inflight_over_drain_time_to_target <= 0.75",
        "goal_met": None if ratio is None else ratio <= 0.75,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
