"""Every benchmark suite in sequence, then one combined table and one combined JSON line.

    python -m forgelab.bench all [--quick] [--skip e2e,async]

Each suite runs in its own process (``python -m forgelab.bench NAME``), so
one suite's torch settings (vLLM pins threads) and actors cannot leak into
the next; its output streams through, and its last line (its JSON object) is
collected. A suite that fails is reported as failed and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from forgelab.bench.common import emit_json, print_machine, print_table

#: Suites in the order `all` runs them; a suite module not listed here (a new one) runs after these.
ORDER = ("runtime", "generator", "e2e", "async", "weight_sync", "dashboard", "limits", "envs")
#: Modules that are tools, not suites.
NOT_RUN = {"all", "plot"}


def at_most(goal: float):
    return (f"<= {goal:g}", lambda v: v <= goal)


def at_least(goal: float):
    return (f">= {goal:g}", lambda v: v >= goal)


def info():
    return ("", None)


#: The headline numbers of each suite, as key -> (goal text, predicate); a predicate of None is reported only.
#: Every suite has at least one goal; a new suite adds its entry here (`GOALS["mysuite"] = {...}`).
GOALS: dict[str, dict[str, tuple[str, Any]]] = {
    "runtime": {"route_over_raw": at_most(1.2)},
    "generator": {"actor_over_bare_vllm": at_least(0.95)},
    "e2e": {"forgelab_over_trl_warm": at_most(0.4), "forgelab_over_trl_cold": at_most(0.7),
            "startup_ratio": at_most(1.2), "eval_ratio": at_most(1.0), "forgelab_over_trl_s_per_step": info()},
    "async": {"async_over_sync_default": at_most(0.67)},
    "weight_sync": {"sync_over_raw": at_most(2)},
    "dashboard": {"lab_cpu_fraction": at_most(0.02), "dashboard_throughput_ratio": at_least(0.98)},
    "limits": {"trainer_fraction_of_limit": at_least(0.5), "generator_fraction_of_limit": info(),
               "matmul_gflops_1thread": info()},
    "envs": {"generator_busy_fraction": at_least(0.9), "episodes_in_flight_max": at_least(10000),
             "generator_busy_at_10k": at_least(0.95), "turn_latency_p99_ms_at_10k": info(),
             "env_mib_per_1k_episodes": at_most(100)},
    "startup": {"warm_over_cold": at_most(0.15), "cold_s": info(), "warm_s": info()},
    "realmodel": {"plan_error": at_most(0.25), "s_per_step": info(), "loop_s_per_step": info()},
    "distill": {"distill_over_grpo_steps": at_most(1 / 3), "distill_step_cost_over_grpo": info(),
                "distill_steps_to_target": info(), "grpo_steps_to_target": info()},
    "lora": {"lora_push_over_full": at_most(0.05), "lora_trainer_peak_over_full": at_most(0.55),
             "lora_loop_peak_total_gib": at_most(24), "plan_error": at_most(0.2), "lora_loop_fits_24gib": info()},
    "variants": {"four_over_one": at_most(1.6), "four_over_separate": at_most(0.4), "fork_s": at_most(2),
                 "generator_busy_four": at_least(0.9)},
    "inflight": {"inflight_over_drain_time_to_target": at_most(0.75), "generator_idle_drain": info(),
                 "generator_idle_inflight": info()},
    "primitives": {"primitives_over_fused": at_most(1.15), "rest_over_python": at_most(1.3)},
    "agent_lift": {"door_lift_points": at_least(15), "door_minus_native_points": ("|.| <= 5", lambda v: abs(v) <= 5),
                   "native_lift_points": info()},
    "agent_door": {"door_over_native_s_per_episode": at_most(1.15), "generator_busy_1k": at_least(0.9),
                   "native_generator_busy_1k": info()},
}


def headline_rows(name: str, result: dict) -> list[dict]:
    """Table rows for one suite's JSON: its headline keys (or every top-level number) with goal and verdict.

    >>> headline_rows("async", {"async_over_sync_default": 0.6})[0]["met"]
    'yes'
    >>> [r["value"] for r in headline_rows("weight_sync", {"sync_over_raw": {"tiny": 1.0, "large": 3.0}})]
    [1.0, 3.0]
    >>> headline_rows("newsuite", {"suite": "newsuite", "steps_per_s": 2.0, "machine": {}})[0]["key"]
    'steps_per_s'
    """
    keys = [(k, g, ok) for k, (g, ok) in GOALS[name].items()] if name in GOALS else [
        (k, "", None) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    rows = []
    for key, goal, ok in keys:
        value = result.get(key)
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, v in items:
            met = "" if ok is None else ("n/a" if v is None else ("yes" if ok(v) else "no"))
            rows.append({"suite": name, "key": f"{key}[{sub}]" if sub else key, "value": v, "goal": goal, "met": met})
    return rows


def run_suite(name: str, quick: bool) -> tuple[dict | None, str]:
    """Run one suite in a child process, streaming its output; returns (its JSON, error text)."""
    cmd = [sys.executable, "-m", "forgelab.bench", name] + (["--quick"] if quick else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    last_json, tail = None, []
    for line in proc.stdout:
        print(line, end="", flush=True)
        tail = (tail + [line])[-40:]
        if line.startswith("{"):
            try:
                last_json = json.loads(line)
            except json.JSONDecodeError:
                pass
    rc = proc.wait()
    if rc != 0 or last_json is None:
        return None, f"rc {rc}: " + "".join(tail)[-1500:]
    return last_json, ""


def main(argv: list[str] | None = None) -> dict:
    from forgelab.bench import suites

    ap = argparse.ArgumentParser(prog="python -m forgelab.bench all", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every suite in its --quick mode")
    ap.add_argument("--skip", default="", help="comma-separated suites to leave out")
    ap.add_argument("--only", default="", help="comma-separated suites to run (default: all)")
    args = ap.parse_args(argv or [])
    available = set(suites())
    names = [n for n in ORDER if n in available] + sorted(available - set(ORDER) - NOT_RUN)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    names = [n for n in names if n not in args.skip.split(",")]
    start = print_machine("start")
    results, failed, seconds = {}, {}, {}
    for name in names:
        print(f"\n===== {name} =====", flush=True)
        t0 = time.perf_counter()
        res, err = run_suite(name, args.quick)
        seconds[name] = round(time.perf_counter() - t0, 1)
        if res is None:
            failed[name] = err
            print(f"===== {name} FAILED ({err.splitlines()[0] if err else ''})", flush=True)
        else:
            results[name] = res
    end = print_machine("end")
    rows = [r for n, res in results.items() for r in headline_rows(n, res)]
    rows += [{"suite": n, "key": "FAILED", "value": "", "goal": "", "met": "no"} for n in failed]
    print()
    print_table(rows, ["suite", "key", "value", "goal", "met"])
    result = {"suite": "all", "quick": args.quick, "results": results, "failed": failed, "seconds": seconds,
              "machine": {**start, "loadavg_end": end["loadavg"]}}
    emit_json(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
