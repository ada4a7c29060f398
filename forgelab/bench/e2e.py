"""End to end: forgelab asynchronous GRPO vs Hugging Face TRL ``GRPOTrainer``, wall time to a target accuracy.

    python -m forgelab.bench e2e [--quick] [--target 0.40] [--repeats 2]

Both train the shipped tiny model (3.2 M params) on the addition task from the
same 4000 train problems, chat-templated by ``forgelab.evaluate.format_prompt``,
with the same rewards (``exact_answer`` 1.0 + ``answer_format`` 0.1, forgelab's
own functions), group size 8, batch 64 (8 prompts x 8), at most 8 completion
tokens, temperature 1, AdamW at lr 1e-4 with 5 warmup steps then cosine to
0.1 x lr over the step cap, the GRPO loss (per-sequence mean, clip 0.2, k3 KL
to a frozen reference with beta 0.04), one gradient step per batch.

- forgelab: ``Run(demo_config)`` with ``max_policy_age=1``: a vLLM generator,
  a torchtitan trainer and a reference model, one process each, 1 torch
  thread each (3 processes on the 2 cores).
- TRL: ``GRPOTrainer(use_cpu=True, use_vllm=False)`` in one process that may
  use both cores, with ``--trl-threads`` torch threads (default 1: on this
  host, loaded by other jobs, a 4-step probe took 4.7 s/step with 2 threads
  and 1.4 s/step with 1; OpenMP threads spin-wait badly when cores are
  oversubscribed). Generation with HF ``generate``; policy and reference in
  the same process.

Held-out greedy accuracy on the same 200 test problems every ``--every``
steps (and at step 0). TRL's model is scored in-process by
``forgelab.evaluate.greedy_accuracy_hf``; forgelab's by ``Run.evaluate``
(greedy decoding on its generator, scored by the task's reward). Those are
two decoders of the same greedy policy: at the end of every forgelab run its
trainer exports the weights and ``greedy_accuracy_hf`` scores them too (column
``hf_check``), so the two evaluators are checked against each other. The
reported time is training wall time *excluding* evaluation (for both), from
the first step until the evaluation that first reaches the target; process
start-up (spawn / model load) is reported separately. Each side stops at the
target, at the step cap or at the time cap, whichever comes first; "not
reached" is reported as such. The two frameworks alternate (forgelab, TRL,
forgelab, TRL, ...), so load from other jobs hits both alike;
``forgelab_over_trl`` is the median over pairs of forgelab / TRL time.

TRL with vLLM (``use_vllm=True, vllm_mode="colocate"``) is not run: see
``docs/benchmarks.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from forgelab.bench.common import emit_json, print_machine, print_table

TARGET = 0.40
EVAL_EVERY = 10
STEP_CAP = 150
TIME_CAP_S = 420.0
REWARD_WEIGHTS = {"exact_answer": 1.0, "answer_format": 0.1}


def bench_config(*, steps: int, max_policy_age: int = 1, eval_every: int = EVAL_EVERY, out_dir: str,
                 name: str = "bench"):
    """The demo's configuration with the bench's step cap, eval cadence and no wandb."""
    from forgelab.demo import demo_config

    cfg = demo_config(steps, out_dir)
    cfg.name = name
    cfg.train.max_policy_age = max_policy_age
    cfg.rollout.rewards = dict(REWARD_WEIGHTS)
    cfg.eval.every = eval_every
    cfg.tracking.wandb = False
    return cfg.validate()


def time_to_target(evals: list[dict], target: float) -> float | None:
    """Training seconds (evaluation excluded) at the first evaluation whose accuracy reaches `target`.

    >>> time_to_target([{"step": 0, "train_s": 0.0, "accuracy": 0.2}, {"step": 10, "train_s": 5.0, "accuracy": 0.45}], 0.4)
    5.0
    >>> time_to_target([{"step": 0, "train_s": 0.0, "accuracy": 0.2}], 0.4) is None
    True
    """
    for e in evals:
        if e["accuracy"] >= target:
            return e["train_s"]
    return None


def summarize(label: str, evals: list[dict], target: float, **extra: Any) -> dict:
    """One row: time and step to target (or None), final step and accuracy, plus `extra`.

    >>> r = summarize("x", [{"step": 0, "train_s": 0.0, "accuracy": 0.25}, {"step": 10, "train_s": 4.0, "accuracy": 0.5}], 0.4)
    >>> r["time_to_target_s"], r["steps_to_target"], r["final_accuracy"], r["reached"]
    (4.0, 10, 0.5, True)
    """
    t = time_to_target(evals, target)
    step = next((e["step"] for e in evals if e["accuracy"] >= target), None)
    last = evals[-1] if evals else {"step": 0, "accuracy": float("nan"), "train_s": 0.0}
    return {"label": label, "reached": t is not None, "time_to_target_s": None if t is None else round(t, 2),
            "steps_to_target": step, "final_step": last["step"], "final_accuracy": last["accuracy"],
            "train_s": round(last["train_s"], 2),
            "s_per_step": round(last["train_s"] / last["step"], 3) if last["step"] else None,
            "curve": [(e["step"], round(e["train_s"], 2), e["accuracy"]) for e in evals], **extra}


# ----------------------------------------------------------------- forgelab
async def run_forgelab(cfg, target: float, time_cap_s: float, hf_check: bool = True) -> dict:
    """Train `cfg` until held-out accuracy >= target (or the caps); returns the evaluations and timings.

    ``Run.evaluate`` is wrapped on the instance (no library change) to time each
    evaluation, subtract it from the training clock and stop at the target.
    """
    from forgelab.run import Run

    t_make = time.perf_counter()
    run = Run(cfg)
    orig_evaluate = run.evaluate
    evals: list[dict] = []
    clock = {"t0": None, "eval_s": 0.0}

    async def timed_evaluate(n: int | None = None) -> float:
        s = time.perf_counter()
        if clock["t0"] is None:
            clock["t0"] = s  # training starts right after the step-0 evaluation
        acc = await orig_evaluate(n)
        d = time.perf_counter() - s
        evals.append({"step": run.step, "train_s": s - clock["t0"] - clock["eval_s"], "accuracy": acc, "eval_s": d})
        clock["eval_s"] += d
        train_s = evals[-1]["train_s"]
        if ((acc >= target and run.step > 0) or train_s > time_cap_s) and not clock.get("stopping"):
            clock["stopping"] = True  # stop after this step; awaiting stop() here would wait on ourselves
            asyncio.ensure_future(run.stop())
        return acc

    run.evaluate = timed_evaluate
    await run.start()
    spawn_s = time.perf_counter() - t_make
    try:
        try:  # the time cap is checked at each evaluation; this only guards against a stuck run
            await asyncio.wait_for(asyncio.shield(run.wait()), timeout=2 * time_cap_s + 120)
        except asyncio.TimeoutError:
            await run.stop()
        check = None
        if hf_check:
            from forgelab.evaluate import greedy_accuracy_hf

            with tempfile.TemporaryDirectory(prefix="forgelab-e2e-") as d:
                await run.trainer.call("export_hf", d)
                check = greedy_accuracy_hf(d, None, run.heldout)
        counts = run.episodes
        df = run.metrics
    finally:
        await run.shutdown()
    out = summarize("forgelab", evals, target, startup_s=round(spawn_s, 1), hf_check=check,
                    eval_s=round(clock["eval_s"], 2),
                    policy_age_mean=round(float(df["policy_age_mean"].mean()), 3) if len(df) else None,
                    episodes={k: counts[k] for k in ("generated", "trained", "evicted", "dropped")})
    return out


def forgelab_with_time_cap(cfg, target: float, time_cap_s: float, hf_check: bool = True) -> dict:
    """`run_forgelab` in a fresh event loop (one per run, like a script's `asyncio.run`)."""
    return asyncio.run(run_forgelab(cfg, target, time_cap_s, hf_check))


# ----------------------------------------------------------------------- TRL
def _trl_main(spec: dict) -> None:
    """Child process: train with TRL's GRPOTrainer, print one JSON line with the evaluations."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from forgelab.data import load_problems
    from forgelab.evaluate import format_prompt, greedy_accuracy_hf
    from forgelab.rewards import REWARDS

    t_make = time.perf_counter()
    model_dir, target, every = spec["model"], spec["target"], spec["every"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_problems("addition", "train", 4000, spec["seed"])
    heldout = load_problems("addition", "test", 200, spec["seed"])
    ds = Dataset.from_list([{"prompt": format_prompt(tok, p.prompt), "target": p.target} for p in train])

    def reward(name):
        fn = REWARDS[name]

        def score(prompts, completions, target, **_):
            return [float(fn(p, c, t)) for p, c, t in zip(prompts, completions, target)]

        score.__name__ = name
        return score

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=False, use_vllm=False, report_to="none",
        per_device_train_batch_size=spec["batch"], num_generations=spec["group"], generation_batch_size=spec["batch"],
        max_completion_length=spec["max_tokens"], learning_rate=spec["lr"], warmup_steps=spec["warmup"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        max_steps=spec["steps"], weight_decay=0.0, max_grad_norm=1.0, beta=spec["kl"], epsilon=0.2,
        loss_type="grpo", scale_rewards="group", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0,
        reward_weights=list(REWARD_WEIGHTS.values()), save_strategy="no", logging_steps=10**6,
        seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True,
    )
    evals: list[dict] = []
    clock = {"t0": None, "eval_s": 0.0}

    class Evaluate(TrainerCallback):
        def _eval(self, step, model, control):
            s = time.perf_counter()
            if clock["t0"] is None:
                clock["t0"] = s
            acc = greedy_accuracy_hf(model, tok, heldout, max_new_tokens=spec["max_tokens"])
            d = time.perf_counter() - s
            train_s = s - clock["t0"] - clock["eval_s"]
            evals.append({"step": step, "train_s": train_s, "accuracy": acc, "eval_s": d})
            clock["eval_s"] += d
            if (acc >= target and step > 0) or train_s > spec["time_cap_s"]:
                control.should_training_stop = True

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._eval(0, model, control)

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % every == 0 or state.global_step >= args.max_steps:
                self._eval(state.global_step, model, control)

    trainer = GRPOTrainer(model=model, reward_funcs=[reward(n) for n in REWARD_WEIGHTS], args=args,
                          train_dataset=ds, processing_class=tok, callbacks=[Evaluate()])
    startup_s = time.perf_counter() - t_make
    trainer.train()
    print(json.dumps({"evals": evals, "startup_s": startup_s, "eval_s": clock["eval_s"]}), flush=True)


def run_trl(*, steps: int, target: float, every: int, time_cap_s: float, threads: int, model_dir: str) -> dict:
    """TRL in a fresh process (its own torch threads, nothing shared with forgelab's controller)."""
    from forgelab.config import SHIPPED_MODEL

    with tempfile.TemporaryDirectory(prefix="forgelab-trl-") as out_dir:
        spec = {"model": model_dir or SHIPPED_MODEL, "target": target, "every": every, "steps": steps, "seed": 0,
                "batch": 64, "group": 8, "max_tokens": 8, "lr": 1e-4, "warmup": 5, "kl": 0.04,
                "time_cap_s": time_cap_s, "threads": threads, "out_dir": out_dir}
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "TRANSFORMERS_VERBOSITY": "error"}
        proc = subprocess.run([sys.executable, "-m", "forgelab.bench.e2e", "--_trl", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=time_cap_s * 3 + 300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1])
    return summarize("trl", res["evals"], target, startup_s=round(res["startup_s"], 1),
                     eval_s=round(res["eval_s"], 2), hf_check=None)


# ----------------------------------------------------------------------- main
def _row(r: dict, rep: int) -> dict:
    return {"framework": r["label"], "rep": rep, "reached": r["reached"],
            "time_to_target_s": r["time_to_target_s"] if r["reached"] else "not reached",
            "steps": r["steps_to_target"] if r["reached"] else f">{r['final_step']}",
            "s/step": r["s_per_step"], "final_acc": r["final_accuracy"],
            "hf_check": r.get("hf_check") if r.get("hf_check") is not None else "",
            "startup_s": r["startup_s"], "eval_s": r["eval_s"]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_trl":
        _trl_main(json.loads(argv[1]))
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps each, one pair, target not expected (~2 min)")
    ap.add_argument("--target", type=float, default=TARGET, help="held-out greedy accuracy to reach")
    ap.add_argument("--every", type=int, default=EVAL_EVERY, help="evaluate every this many steps")
    ap.add_argument("--steps", type=int, default=STEP_CAP, help="step cap")
    ap.add_argument("--time-cap", type=float, default=TIME_CAP_S, help="training-time cap per run (s)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating forgelab/TRL pairs")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="torch threads for the TRL process (1: on this loaded 2-core host 2 threads ran 3x slower per step)")
    ap.add_argument("--model", default="", help="model directory (default: the shipped tiny model)")
    ap.add_argument("--json-out", default="", help="also write the full result (with curves) to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.repeats, args.time_cap = 10, 5, 1, 120.0

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"e2e: target held-out greedy accuracy {args.target} on 200 test problems, eval every {args.every} steps, "
          f"cap {args.steps} steps / {args.time_cap:.0f} s; forgelab 1 thread x 3 processes, TRL {args.trl_threads} "
          f"threads x 1 process; {args.repeats} alternating pairs", flush=True)
    runs: dict[str, list[dict]] = {"forgelab": [], "trl": []}
    rows = []
    with tempfile.TemporaryDirectory(prefix="forgelab-e2e-runs-") as out_dir:
        for rep in range(args.repeats):
            order = ("forgelab", "trl") if rep % 2 == 0 else ("trl", "forgelab")
            for which in order:
                if which == "forgelab":
                    cfg = bench_config(steps=args.steps, eval_every=args.every, out_dir=out_dir, name=f"e2e{rep}")
                    if args.model:
                        cfg.model.path = args.model
                    r = forgelab_with_time_cap(cfg, args.target, args.time_cap)
                else:
                    r = run_trl(steps=args.steps, target=args.target, every=args.every, time_cap_s=args.time_cap,
                                threads=args.trl_threads, model_dir=args.model)
                runs[which].append(r)
                rows.append(_row(r, rep))
                print(f"  {which} rep {rep}: {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    end = print_machine("end")
    print_table(rows, ["framework", "rep", "reached", "time_to_target_s", "steps", "s/step", "final_acc", "hf_check",
                       "startup_s", "eval_s"])
    pairs = [(f["time_to_target_s"], t["time_to_target_s"]) for f, t in zip(runs["forgelab"], runs["trl"])
             if f["reached"] and t["reached"]]
    sps = [(f["s_per_step"], t["s_per_step"]) for f, t in zip(runs["forgelab"], runs["trl"])
           if f["s_per_step"] and t["s_per_step"]]
    ratio = round(statistics.median(a / b for a, b in pairs), 3) if pairs else None
    result = {
        "suite": "e2e",
        "target_accuracy": args.target,
        "forgelab_over_trl": ratio,
        "forgelab_over_trl_s_per_step": round(statistics.median(a / b for a, b in sps), 3) if sps else None,
        "forgelab_time_to_target_s": [r["time_to_target_s"] for r in runs["forgelab"]],
        "trl_time_to_target_s": [r["time_to_target_s"] for r in runs["trl"]],
        "forgelab_steps_to_target": [r["steps_to_target"] for r in runs["forgelab"]],
        "trl_steps_to_target": [r["steps_to_target"] for r in runs["trl"]],
        "forgelab_hf_check": [[r["final_accuracy"], r["hf_check"]] for r in runs["forgelab"]],
        "goal": "forgelab_over_trl <= 0.5",
        "goal_met": None if ratio is None else ratio <= 0.5,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**result, "runs": runs}, f)
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
