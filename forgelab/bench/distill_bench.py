"""On-policy distillation vs GRPO from the same start: held-out accuracy against training steps, side by side.

    python -m forgelab.bench distill [--quick] [--steps N] [--eval-every K] [--seeds S]

The student is the shipped base (held-out greedy accuracy 0.25 on addition); the teacher is the shipped model
after GRPO on addition (`forgelab.recipes.distill_teacher`: made once and cached, its held-out accuracy recorded
with it). Two arms per seed, run one after the other in this process on the same machine, each a full `Run`
of the demo's configuration (`forgelab.demo.demo_config`, 8 x 8 episodes a step, staleness 1) with held-out
accuracy every K steps:

- ``distill``: ``teacher: {model_dir: <teacher>}``, ``rollout.advantage: none`` (rewards teach nothing: every
  token's advantage is ``teacher logprob - student logprob``), no reference process and no KL to one (the
  teacher's process takes its place).
- ``grpo``: the demo itself (group z-score advantages, KL to the reference, 0.04).

Target: 90 % of the teacher's held-out accuracy. An arm stops at the first evaluation at or above it (its
steps-to-target) or at `--steps`; an arm that never reaches it is counted as censored at `--steps` (a lower
bound), never dropped. ``distill_over_grpo_steps`` is the ratio of the median steps-to-target over seeds
(censored values included; the goal is at most 1/3). ``distill_step_cost_over_grpo``: the ratio of the median
wall seconds per step (the time between consecutive metrics rows, evaluations included).

``--quick`` proves the code path and measures nothing: a stand-in teacher (the base at temperature 0.5, no
training, so no recipe run) with an unreachable target; each arm 2 steps (warmup 1) with 8 held-out problems
evaluated at steps 0 and 2. Branches it runs: both arms' configurations (teacher process, no reference, no KL,
``advantage: none``; and the demo's GRPO with its reference), a run that ends at its last step without reaching
the target (`run_arm`'s censored path, counted at `--steps` in `summarise`), the reverse-KL columns of the
distill arm, and every key of the JSON. Its cost is the two arms' process starts; the steps are a few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import tempfile
from typing import Any

from forgelab.bench.common import emit_json, print_machine, print_table

TARGET_FRACTION = 0.9


def arm_config(arm: str, teacher: str | None, steps: int, eval_every: int, eval_n: int, seed: int, out_dir: str):
    """The `RunConfig` of one arm (``"distill"`` or ``"grpo"``)."""
    from forgelab.config.components import TeacherConfig
    from forgelab.demo import demo_config

    cfg = demo_config(max(steps, 10), out_dir=out_dir)  # (the demo's 5 warmup steps need more steps to validate)
    cfg = dataclasses.replace(cfg, name=f"{arm}-{seed}", train=dataclasses.replace(
                                  cfg.train, seed=seed, steps=steps, warmup_steps=min(cfg.train.warmup_steps, steps - 1)),
                              eval=dataclasses.replace(cfg.eval, every=eval_every, n=eval_n),
                              tracking=dataclasses.replace(cfg.tracking, wandb=False))
    if arm == "distill":
        cfg = dataclasses.replace(
            cfg, teacher=TeacherConfig(model_dir=teacher, coef=1.0),
            rollout=dataclasses.replace(cfg.rollout, advantage="none"),
            train=dataclasses.replace(cfg.train, loss_kwargs={"kl_coef": 0.0}),
            placement=dataclasses.replace(cfg.placement, reference=False))
    return cfg.validate()


async def run_arm(cfg: Any, target: float) -> dict:
    """Train until the held-out accuracy reaches `target` or the last step; its curve, steps and cost."""
    from forgelab.run import Run

    run = Run(cfg)
    reached = lambda r: any(s > 0 and a >= target for s, a in r.accuracy_history)  # noqa: E731
    await run.start()
    try:
        await run.until(predicate=reached)
        await run.stop()
    except RuntimeError:  # ran to its last step first
        pass
    await run.wait()
    df = run.metrics
    await run.shutdown()
    if run.state not in ("finished", "stopped"):
        raise RuntimeError(f"{cfg.name}: the run ended {run.state}: {run.message}")
    curve = [[int(s), float(a)] for s, a in run.accuracy_history]
    hit = next((s for s, a in curve if s > 0 and a >= target), None)
    gaps = df["time"].diff().dropna().tolist()
    out = {"curve": curve, "steps_to_target": hit, "steps_run": int(run.step),
           "s_per_step": float(statistics.median(gaps)) if gaps else float("nan")}
    if "distill/reverse_kl" in df.columns:
        kl = df["distill/reverse_kl"].tolist()
        out["reverse_kl_first_last"] = [float(statistics.fmean(kl[:5])), float(statistics.fmean(kl[-5:]))]
    return out


def stand_in_teacher(out_dir: str) -> str:
    """The shipped model at temperature 0.5 (lm_head doubled): a teacher with no training, for ``--quick``."""
    from safetensors.torch import load_file, save_file

    from forgelab.config.run_config import SHIPPED_MODEL

    d = f"{out_dir}/stand-in-teacher"
    shutil.copytree(SHIPPED_MODEL, d)
    sd = load_file(f"{d}/model.safetensors")
    sd["lm_head.weight"] = sd["lm_head.weight"] * 2
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    return d


def summarise(arms: dict[str, list[dict]], steps: int) -> dict:
    """Median steps-to-target per arm, a miss counted as `steps` (censored), and their ratio.

    >>> s = summarise({"distill": [{"steps_to_target": 30, "s_per_step": 1.2}],
    ...                "grpo": [{"steps_to_target": None, "s_per_step": 1.0}]}, 200)
    >>> s["distill_steps_to_target"], s["grpo_steps_to_target"], s["censored"], s["distill_over_grpo_steps"]
    (30.0, 200.0, {'distill': 0, 'grpo': 1}, 0.15)
    """
    out: dict[str, Any] = {"censored": {}}
    for arm, results in arms.items():
        vals = [r["steps_to_target"] if r["steps_to_target"] is not None else steps for r in results]
        out[f"{arm}_steps_to_target"] = float(statistics.median(vals))
        out["censored"][arm] = sum(r["steps_to_target"] is None for r in results)
        out[f"{arm}_s_per_step"] = float(statistics.median(r["s_per_step"] for r in results))
    out["distill_over_grpo_steps"] = out["distill_steps_to_target"] / out["grpo_steps_to_target"]
    out["distill_step_cost_over_grpo"] = out["distill_s_per_step"] / out["grpo_s_per_step"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench distill", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 steps per arm, 8 held-out problems at steps 0 and 2, a stand-in teacher (proves the code path)")
    ap.add_argument("--steps", type=int, default=250, help="step budget per arm (default 250)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--teacher-steps", type=int, default=250, help="GRPO steps of the recipe's teacher")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.eval_every, a.eval_n, a.seeds = 2, 2, 8, 1
    machine = print_machine("start")
    work = tempfile.mkdtemp(prefix="forgelab-distill-bench-")
    try:
        if a.quick:
            teacher = {"path": stand_in_teacher(work), "heldout_accuracy": None, "cached": None}
            target = 1.01  # unreachable: the quick mode measures nothing
            print("distill --quick: stand-in teacher (base at temperature 0.5), unreachable target", flush=True)
        else:
            from forgelab.recipes.teacher import distill_teacher

            teacher = distill_teacher(a.teacher_steps)
            target = round(TARGET_FRACTION * teacher["heldout_accuracy"], 4)
            print(f"teacher {teacher['path']} (cached: {teacher['cached']}): held-out accuracy "
                  f"{teacher['heldout_accuracy']}; target {target}", flush=True)
        arms: dict[str, list[dict]] = {"distill": [], "grpo": []}
        for seed in range(a.seeds):
            for arm in ("distill", "grpo"):
                cfg = arm_config(arm, teacher["path"], a.steps, a.eval_every, a.eval_n, seed, work)
                r = asyncio.run(run_arm(cfg, target))
                arms[arm].append(r)
                print(f"{arm} seed {seed}: steps to target {r['steps_to_target']} (ran {r['steps_run']}), "
                      f"{r['s_per_step']:.3f} s/step, curve {r['curve']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = summarise(arms, a.steps)
    rows = [{"arm": arm, "seed": i, "steps_to_target": r["steps_to_target"] if r["steps_to_target"] is not None
             else f">{a.steps}", "s_per_step": r["s_per_step"],
             "final_accuracy": r["curve"][-1][1] if r["curve"] else float("nan")}
            for arm, rs in arms.items() for i, r in enumerate(rs)]
    print_table(rows, ["arm", "seed", "steps_to_target", "s_per_step", "final_accuracy"])
    print(f"distill/grpo steps to target: {s['distill_over_grpo_steps']:.3f} (goal <= 0.333); "
          f"per-step cost distill/grpo: {s['distill_step_cost_over_grpo']:.3f}", flush=True)
    result = {"suite": "distill", **{k: s[k] for k in ("distill_steps_to_target", "grpo_steps_to_target",
                                                      "distill_over_grpo_steps", "distill_step_cost_over_grpo")},
              "censored": s["censored"], "seeds": a.seeds, "steps_budget": a.steps, "eval_every": a.eval_every,
              "eval_n": a.eval_n, "target": target, "teacher_accuracy": teacher["heldout_accuracy"],
              "teacher_cached": teacher["cached"], "quick": a.quick,
              "s_per_step": {"distill": s["distill_s_per_step"], "grpo": s["grpo_s_per_step"]},
              "curves": {arm: [r["curve"] for r in rs] for arm, rs in arms.items()},
              "reverse_kl_first_last": [r.get("reverse_kl_first_last") for r in arms["distill"]],
              "machine": {"start": machine, "end": print_machine("end")}}
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
