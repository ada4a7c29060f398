"""LoRA variants on shared engines vs one variant, vs the same variants as separate runs, side by side.

    python -m forgelab.bench variants [--quick]

Shipped model, LoRA rank 8 on every projection, the demo's batch shape (8 prompts x 8 samples, batch 64,
8 tokens, staleness bound 1), held-out eval of 8 problems at the start and the end of each run.

1. **One variant**: `forgelab.SharedEngines` (5 slots) are spawned (``engines_spawn_s``, not counted below), one
   LoRA run trains ``STEPS`` steps on them: ``one_s``, from ``start()`` to the end of its training task.
2. **Four variants at once**: that run is forked into 4 slots (`SharedEngines.sweep`: lr x0.5 / x2, dapo, the
   format reward off), each training ``STEPS`` more steps, all four at once on the same processes:
   ``four_s``, from the sweep's call to the last variant's end (forks included). ``fork_s``: the sweep's
   time over 4 (one fork into a slot: checkpoint of adapter + optimizer, new run directory, restore, push).
   ``generator_busy_four``: the generator's busy fraction (time in vLLM engine steps over wall time) while
   the four train, weight pushes included (they do not pause the generator).
3. **Four separate runs**: the same four configurations as four `Run`s with their own processes, one after
   the other (as without shared engines), each from ``Run(cfg)`` (process start included) to its end:
   ``separate_s``, summed. (``--quick`` runs none: 4 x (engines spawn + one_s), ``separate_runs_measured`` 0.)

``four_over_one`` = four_s / one_s (goal <= 1.6), ``four_over_separate`` = four_s / separate_s (goal <= 0.4),
``fork_s`` (goal <= 2 s), ``generator_busy_four`` (goal >= 0.9). The trainer steps the variants' batches one
after another (no shared base pass): ``trainer_s_per_step_four`` / ``trainer_s_per_step_one`` say what that
costs; ``shared_pass_over_sequential`` (`shared_pass_bound`) what sharing the base pass could save at best.
``cpu_s_one`` / ``cpu_s_four``: the CPU seconds of every process (this one and the engines') in each phase;
``cpu_util_*`` the share of the cores they kept busy (``cores_busy``: the four's, the headline), with
``cpu_s_per_episode`` (the four's CPU seconds per episode they trained; ``cpu_s_per_episode_one`` the one
variant's) beside it: busy without more work done is not progress; ``four_over_one_cpu_floor`` (`cpu_floor`) the least
``four_over_one`` the four's CPU seconds allow on this machine's cores.
Per phase (``_one``, ``_four``; `generator_clock`): the generator's time in engine steps, idle (no request
unfinished), waiting for arriving calls (admission window) and in vLLM's intake, each in seconds
(``generator_idle_s_four``, ...) and as a share of the phase's wall time (``generator_idle_frac_four``, ...);
the adapters it loaded (``adapter_loads_four``) and the time that took (``adapter_load_s_four``, between its
engine steps); the trainer's slot swaps and calls in the phase. Over the whole bench: ``trainer_slot_swaps``
(goal <= ``trainer_steps`` x 1.1), ``trainer_calls`` by endpoint (one ``train_export`` per step).
``--quick``: 1 step per phase (no warmup) at batch 16 (2 prompts x 8); its numbers prove the code path only.
Branches it runs: the engines' spawn, one variant trained on a slot, the sweep (4 forks: checkpoint, restore,
push) with the four trained at once (slot swaps on the trainer), every row after the fork step timed
(``trainer_s_per_step_four``), the CPU accounting, the estimate that stands in for the separate runs, and
`shared_pass_bound` on the last batch (1 repeat after its warm-up).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from forgelab.bench.common import emit_json, print_machine, print_table
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forgelab.run import Run

VARIANTS = {"lr_half": {"lr": 1e-3}, "lr_x2": {"lr": 4e-3}, "dapo": {"loss": "dapo"},
            "no_format": {"reward_weights": {"answer_format": 0.0}}}


def bench_config(name: str, steps: int, out_dir: str, prompts: int = 8):
    """The variants' configuration: `prompts` x 8 episodes a step (8: the demo's batch), warmup 2 steps (fewer
    when `steps` is shorter: warmup must end before the last step)."""
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig

    return RunConfig(name=name, lora=LoraConfig(enabled=True, rank=8, alpha=16.0),
                     rollout=RolloutConfig(task="addition", group_size=8, prompts_per_rollout=prompts, concurrency=2,
                                           max_tokens=8),
                     train=TrainConfig(steps=steps, batch_size=8 * prompts, lr=2e-3, warmup_steps=min(2, steps - 1),
                                       max_policy_age=1),
                     eval=EvalConfig(every=0, n=8), tracking=TrackingConfig(out_dir=out_dir, wandb=False)).validate()


def _separate_config(name: str, steps: int, out_dir: str, overrides: dict):
    cfg = bench_config(name, steps, out_dir)
    if "lr" in overrides:
        cfg.train.lr = overrides["lr"]
    if "loss" in overrides:
        cfg.train.loss = overrides["loss"]
    if "reward_weights" in overrides:
        cfg.rollout.rewards = {"exact_answer": 1.0, "answer_format": 0.1, **overrides["reward_weights"]}
    return cfg.validate()


async def _busy(engines) -> float:
    stats = await engines.parts.generators.fanout("stats")
    return sum(float(s["busy_time_s"]) for s in stats)


GENERATOR_TIMES = ("busy_time_s", "idle_time_s", "admission_wait_s", "intake_time_s")
"""The generator's own clocks (`forgelab.engines.generator.VLLMEngine.stats`): in engine steps, with no request
unfinished, waiting for arriving calls to join a step, and in vLLM's intake of new requests."""


async def generator_clock(engines) -> dict[str, float]:
    """The generators' time counters summed over replicas (`GENERATOR_TIMES`), their adapter loads
    (``adapter_load_s``, ``adapter_loads``: `forgelab.weights.adapter_slots.AdapterSlots`) and the trainer's
    slot swaps and steps' calls, read now; `clock_delta` of two reads is one phase's breakdown."""
    stats = await engines.parts.generators.fanout("stats")
    out = {k: sum(float(s[k]) for s in stats) for k in GENERATOR_TIMES}
    slots = await engines.slot_stats()
    gens = slots["generators"]
    out["adapter_load_s"] = sum(float(g["push_ms"]) for g in gens) / 1e3
    out["adapter_loads"] = float(sum(int(g["pushes"]) for g in gens))
    out["trainer_slot_swaps"] = float(slots["trainer"]["swaps"])
    out["trainer_calls"] = float(sum(slots["trainer"]["calls"].values()))
    out["trainer_base_passes"] = float(slots["trainer"]["base_passes"])
    return out


def clock_delta(before: dict[str, float], after: dict[str, float], wall_s: float, phase: str) -> dict[str, float]:
    """One phase's breakdown from two `generator_clock` reads: each time in seconds and as a share of the
    phase's wall time (``generator_<time>_<phase>``, ``..._frac_<phase>``), the counts as they are.

    >>> d = clock_delta({"idle_time_s": 1.0, "adapter_loads": 2.0}, {"idle_time_s": 3.0, "adapter_loads": 6.0}, 10.0, "four")
    >>> d["generator_idle_s_four"], d["generator_idle_frac_four"], d["adapter_loads_four"]
    (2.0, 0.2, 4.0)
    """
    out: dict[str, float] = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if k.endswith("_time_s") or k.endswith("_wait_s"):
            name = "generator_" + k.replace("_time_s", "").replace("_s", "")
            out[f"{name}_s_{phase}"] = round(d, 3)
            out[f"{name}_frac_{phase}"] = round(d / wall_s, 3)
        elif k == "adapter_load_s":
            out[f"adapter_load_s_{phase}"] = round(d, 3)
            out[f"adapter_load_frac_{phase}"] = round(d / wall_s, 3)
        else:
            out[f"{k}_{phase}"] = d
    return out


def tree_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of this process and every live descendant (the engines' processes), by pid."""
    import psutil

    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:  # exited between the listing and the read
            pass
    return out


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two `tree_cpu` reads by the processes alive at the second (a new one counts whole).

    >>> cpu_between({1: 2.0, 2: 5.0}, {1: 3.5, 3: 1.0})
    2.5
    """
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def _trainer_s(run: "Run", after: int = 0) -> float:
    df = run.metrics
    df = df[df["step"] > after]
    return float(statistics.median(df["step_time_s"])) if len(df) else float("nan")


async def _run(steps: int, quick: bool, out_dir: str) -> dict:
    from forgelab.experiments.variants import SharedEngines
    from forgelab.run import Run

    prompts = 2 if quick else 8
    engines = SharedEngines(bench_config("one", steps, out_dir, prompts), slots=5)
    t0 = time.perf_counter()
    await engines.start()
    spawn_s = time.perf_counter() - t0
    one = Run(bench_config("one", steps, out_dir, prompts), spawn=engines)
    try:
        g0, c0, t0 = await generator_clock(engines), tree_cpu(), time.perf_counter()
        await one.start()
        await one.wait()
        one_s = time.perf_counter() - t0
        cpu_one = cpu_between(c0, tree_cpu())
        breakdown = clock_delta(g0, await generator_clock(engines), one_s, "one")
        assert one.state == "finished", one.message

        g0 = await generator_clock(engines)
        busy0, c0, t0 = await _busy(engines), tree_cpu(), time.perf_counter()
        kids = await engines.sweep(one, {n: {**o, "steps": 2 * steps} for n, o in VARIANTS.items()})
        sweep_s = time.perf_counter() - t0
        await asyncio.gather(*(k.wait() for k in kids.values()))
        four_s = time.perf_counter() - t0
        cpu_four = cpu_between(c0, tree_cpu())
        busy_four = (await _busy(engines) - busy0) / four_s
        breakdown.update(clock_delta(g0, await generator_clock(engines), four_s, "four"))
        for n, k in kids.items():
            assert k.state == "finished", (n, k.message)
        stats = await engines.slot_stats()
        last_batch = next(iter(kids.values())).last_batch
        trainer_four = statistics.median(_trainer_s(k, steps) for k in kids.values())
        trainer_one = _trainer_s(one)
        trained = one.step + sum(k.step - steps for k in kids.values())  # every step the shared trainer took
        episodes_one = one.step * one.config.train.batch_size  # trained in each phase (the forks from step `steps`)
        episodes_four = sum((k.step - steps) * k.config.train.batch_size for k in kids.values())
        for k in kids.values():
            await k.shutdown()
    finally:
        await one.shutdown()
        await engines.shutdown()

    separate, runs_sep = [], list(VARIANTS.items())[: 0 if quick else 4]
    for n, o in runs_sep:
        t0 = time.perf_counter()
        run = Run(_separate_config(f"sep_{n}", steps, out_dir, o))
        try:
            await run.start()
            await run.wait()
            separate.append(time.perf_counter() - t0)
            assert run.state == "finished", run.message
        finally:
            await run.shutdown()
    # --quick measures no separate run: each is estimated as a process start (the engines' spawn) + one_s
    separate_s = sum(separate) if separate else 4 * (spawn_s + one_s)
    return {"steps": steps, "engines_spawn_s": spawn_s, "one_s": one_s, "four_s": four_s, "separate_s": separate_s,
            "separate_runs_s": separate, "separate_runs_measured": len(separate), "sweep_s": sweep_s,
            "fork_s": sweep_s / len(VARIANTS), "four_over_one": four_s / one_s, "four_over_separate": four_s / separate_s,
            "generator_busy_four": busy_four, "trainer_s_per_step_one": trainer_one,
            "trainer_s_per_step_four": trainer_four, **cpu_floor(cpu_one, one_s, cpu_four, four_s),
            "cpu_s_per_episode": round(cpu_four / episodes_four, 4) if episodes_four else None,
            "cpu_s_per_episode_one": round(cpu_one / episodes_one, 4) if episodes_one else None,
            "trainer_slot_swaps": stats["trainer"]["swaps"],
            "trainer_slot_swap_s": stats["trainer"]["swap_s"], "trainer_steps": trained,
            "trainer_slot_swaps_per_step": stats["trainer"]["swaps"] / max(1, trained),
            "trainer_calls": stats["trainer"]["calls"], **breakdown, "last_batch": last_batch}


def cpu_floor(cpu_one: float, one_s: float, cpu_four: float, four_s: float, cores: int | None = None) -> dict:
    """How busy the cores were in each phase, and the least `four_over_one` the four's own work allows here: their
    CPU seconds (all processes) spread over every core with no idle moment, over one variant's wall time. A
    scheduler can only approach it; less work per variant (a shared base pass, which saves at most
    ``1 - shared_pass_over_sequential`` of the trainer's part) is the only way below it.

    >>> r = cpu_floor(cpu_one=12.0, one_s=10.0, cpu_four=40.0, four_s=24.0, cores=2)
    >>> r["cpu_util_one"], r["cpu_util_four"], r["cpu_four_over_one"], r["four_over_one_cpu_floor"]
    (0.6, 0.833, 3.333, 2.0)
    """
    import os

    cores = cores or len(os.sched_getaffinity(0))
    return {"cpu_s_one": round(cpu_one, 2), "cpu_s_four": round(cpu_four, 2),
            "cpu_util_one": round(cpu_one / (cores * one_s), 3), "cpu_util_four": round(cpu_four / (cores * four_s), 3),
            "cpu_four_over_one": round(cpu_four / cpu_one, 3),
            "four_over_one_cpu_floor": round(cpu_four / (cores * one_s), 3)}


def shared_pass_bound(batch: dict, copies: int = 4, repeats: int = 3) -> dict:
    """What one shared base pass could save at best: a LoRA `TrainerState` (this process, 1 thread) steps
    ``batch`` alone and ``copies`` copies of it concatenated (the rows of ``copies`` variants in one forward and
    backward, no per-row adapter cost counted); ``shared_pass_over_sequential`` = t(copies x B) / (copies x t(B)).
    Below 1 a shared pass would pay off; about 1 means the base's forward and backward already cost what their
    rows do (compute bound), and stepping the variants one after another loses nothing."""
    import torch
    import torch.distributed as dist

    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import RunConfig
    from forgelab.engines.trainer import TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    torch.set_num_threads(1)
    big = {k: (torch.cat([v] * copies) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    st = TrainerState.create(TrainerConfig(model_dir=RunConfig().model.path, lr=1e-4, device="cpu",
                                           lora=LoraConfig(enabled=True, rank=8, alpha=16.0)), 0, 1)
    times: dict[str, list[float]] = {"one": [], "shared": []}
    try:
        for _ in range(repeats + 1):  # the first of each is a warm-up
            for name, b in (("one", batch), ("shared", big)):
                t0 = time.perf_counter()
                st.train_step(b)
                times[name].append(time.perf_counter() - t0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    one, shared = statistics.median(times["one"][1:]), statistics.median(times["shared"][1:])
    return {"trainer_step_s_b": one, "trainer_step_s_shared": shared,
            "shared_pass_over_sequential": shared / (copies * one)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench variants", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 step per phase at batch 16; the separate runs estimated, not run")
    ap.add_argument("--steps", type=int, default=None, help="steps per phase (default 20; --quick 1)")
    args = ap.parse_args(argv or [])
    steps = args.steps or (1 if args.quick else 20)
    start = print_machine("start")
    with tempfile.TemporaryDirectory(prefix="forgelab-variants-") as d:
        r = asyncio.run(_run(steps, args.quick, d))
    r.update(shared_pass_bound(r.pop("last_batch"), repeats=1 if args.quick else 3))
    r["cores_busy"] = r["cpu_util_four"]  # the headline (issue 42): the four variants' phase, beside its CPU-s/episode
    end = print_machine("end")
    print(f"variants bench: shipped model, LoRA rank 8, batch {16 if args.quick else 64} "
          f"({2 if args.quick else 8} x 8), {steps} steps per variant")
    print_table([
        {"what": "engines spawn (not counted)", "seconds": r["engines_spawn_s"], "ratio": ""},
        {"what": f"1 variant, {steps} steps", "seconds": r["one_s"], "ratio": 1.0},
        {"what": f"4 variants at once on the same engines, {steps} steps each", "seconds": r["four_s"],
         "ratio": r["four_over_one"]},
        {"what": "4 separate runs, own processes, back to back", "seconds": r["separate_s"],
         "ratio": r["separate_s"] / r["one_s"]},
        {"what": "one fork into a slot", "seconds": r["fork_s"], "ratio": ""},
        {"what": "generator busy fraction with 4 variants", "seconds": r["generator_busy_four"], "ratio": ""},
        {"what": "trainer s/step, 1 variant | 4 variants", "seconds": r["trainer_s_per_step_one"],
         "ratio": r["trainer_s_per_step_four"]},
        {"what": "CPU seconds (all processes), 1 variant | 4 variants", "seconds": r["cpu_s_one"],
         "ratio": r["cpu_four_over_one"]},
        {"what": "cores busy, 1 variant | 4 variants", "seconds": r["cpu_util_one"], "ratio": r["cpu_util_four"]},
        {"what": "CPU seconds per trained episode, 1 variant | 4 variants", "seconds": r["cpu_s_per_episode_one"],
         "ratio": r["cpu_s_per_episode"]},
        {"what": "least four_over_one for the four's CPU seconds on these cores", "seconds": "",
         "ratio": r["four_over_one_cpu_floor"]},
        {"what": "trainer alone: 1 batch | 4 batches in one pass", "seconds": r["trainer_step_s_b"],
         "ratio": r["shared_pass_over_sequential"]},
        *({"what": f"{k.replace('_', ' ')} share of wall, 1 variant | 4 variants", "seconds": r[f"{k}_frac_one"],
           "ratio": r[f"{k}_frac_four"]} for k in ("generator_busy", "generator_idle", "generator_admission_wait",
                                                   "generator_intake", "adapter_load")),
        {"what": "trainer slot swaps | per step", "seconds": r["trainer_slot_swaps"],
         "ratio": round(r["trainer_slot_swaps_per_step"], 3)},
    ], ["what", "seconds", "ratio"])
    result = {"suite": "variants", "quick": args.quick, **r,
              "goals": {"four_over_one": "<= 1.6", "four_over_separate": "<= 0.4", "fork_s": "<= 2",
                        "generator_busy_four": ">= 0.9"},
              "machine": {**start, "loadavg_end": end["loadavg"]}}
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
