"""LoRA vs full fine-tuning on the Qwen3-0.6B shape, side by side in one run: push, trainer, memory, plan.

    python -m forgelab.bench lora [--quick]

Random weights of the real shape (`forgelab.recipes.real_shapes`, written once under the cache dir);
LoRA is rank 8 on all seven projections, the reference taken from the base (no reference process).

1. **Trainer alone** (one process each, one after the other, 1 thread; ``TrainerState``, no actors) at
   full depth (``--quick``: 2 layers): full fine-tuning vs LoRA on a synthetic GRPO batch of B x L tokens:
   ``s_per_step`` (median after the first), peak RSS (VmHWM), and what a push gathers (bytes, ms).
   ``lora_trainer_peak_over_full`` (goal <= 0.55) is the ratio of the two peaks in the default configuration
   (``trainer.activation_checkpointing: auto``: on with LoRA, off for the full trainer); ``lora_no_ac_...``
   the same for LoRA with activation checkpointing turned off, and ``lora_no_ac_trainer_s_per_step_over_lora``
   what the default's recomputation costs a step.
2. **The whole loop** (a `Run`; each process's peak PSS sampled every 50 ms, ``--quick`` 1 s): the full
   loop (generator + trainer + reference) on the 2-layer shape, the LoRA loop (generator + trainer) at full depth
   (``--quick``: 2 layers). ``lora_loop_fits_24gib``: the LoRA loop's processes together peak under 24 GiB;
   ``plan_error``: the largest ``|planned - measured| / measured`` over every process of both loops
   (`forgelab.memory_plan`, goal <= 0.2).
3. **Push**: ``lora_push_over_full`` (goal <= 0.05) is the median ``weight_sync_ms`` of a LoRA loop over a
   full loop's at the same depth (2 layers; at full depth the full push only grows): gather, shared-memory
   write, and the generator's load (vLLM ``reload_weights`` vs loading the adapter).

``--quick`` runs every part on the shipped tiny model (``shape: tiny-llama``): it proves the code path in
about a minute; its numbers say nothing about the Qwen3 goals. It runs the three trainer kinds (full, LoRA,
LoRA without activation checkpointing) in three processes at once (peaks stay per process), batch 4 x 64, 2
steps each (the second timed), then the full loop (generator, trainer, reference) and the LoRA loop (generator,
trainer) of 2 steps each (the second step's push is the one compared), every process's PSS against the plan.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from forgelab.bench.common import emit_json, print_machine, run_children
from forgelab.bench.realmodel import QUICK_PSS_EVERY_S, PssSampler, vm_kib, planned_pss

GiB = 1024**3
LORA = {"enabled": True, "rank": 8, "alpha": 16.0}


# -- part 1: trainer alone ------------------------------------------------------------------------------

def _trainer_main(model_dir: str, B: int, L: int, steps: int, kind: str) -> None:
    import torch

    torch.set_num_threads(1)
    from forgelab.config.components import LoraConfig
    from forgelab.engines.trainer import TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    lora = kind.startswith("lora")
    cfg = TrainerConfig(model_dir=model_dir, lr=1e-5, device="cpu", lora=LoraConfig(**LORA) if lora else LoraConfig(),
                        activation_checkpointing=False if kind.endswith("_no_ac") else "auto")
    st = TrainerState.create(cfg, 0, 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, st.ckpt.hf_config["vocab_size"], (B, L), generator=g)
    gen_lp = st.logprobs(tokens)
    batch = {"tokens_B_L": tokens, "mask_B_T": torch.ones(B, L - 1), "generator_logprobs_B_T": gen_lp,
             "advantages_B": torch.linspace(-1, 1, B)}  # no reference logprobs: LoRA computes them from the base
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = st.train_step(batch)
        times.append(time.perf_counter() - t0)
        assert not out["skipped"], out
    t0 = time.perf_counter()
    pushed = st.push_state_dict()
    gather_ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"step_s": times, "peak_gib": vm_kib("VmHWM") * 1024 / GiB,
                      "params": sum(p.numel() for p in st.model.parameters()),
                      "trainable": sum(p.numel() for p in st.params), "gather_ms": gather_ms,
                      "push_bytes": sum(v.numel() * v.element_size() for v in pushed.values())}), flush=True)


def _children(*argss: tuple[str, ...]) -> list[dict]:
    """One child process of this module per argument tuple, all at once (`forgelab.bench.common.run_children`)."""
    return run_children("forgelab.bench.lora_bench", *argss)


def _child(*args: str) -> dict:
    return _children(args)[0]


# -- part 2: loops ----------------------------------------------------------------------------------------

def loop_config(model_dir: str, out_dir: str, steps: int, lora: bool):
    from forgelab.bench.realmodel import loop_config as base
    from forgelab.config.components import LoraConfig

    cfg = base(model_dir, out_dir, steps, prompts=1)
    cfg.name = "lora" if lora else "full"
    if lora:
        cfg.lora = LoraConfig(**LORA)
    return cfg


async def _loop(model_dir: str, steps: int, lora: bool, every_s: float = 0.05) -> dict:
    from forgelab.run import Run

    with tempfile.TemporaryDirectory(prefix="forgelab-lora-bench-") as out, PssSampler(every_s) as sampler:
        cfg = loop_config(model_dir, out, steps, lora)
        run = Run(cfg)
        await run.start()
        roles, has_reference = {}, run.reference is not None
        parts = [("generator", run.generators.handles()), ("trainer", [run.trainer])]
        if run.reference is not None:
            parts.append(("reference", run.reference.handles()))
        for name, handles in parts:
            for k, h in enumerate(handles):
                for pid in await h.pids():
                    roles[pid] = f"{name}{k}"
        await run.wait()
        df = run.metrics
        await run.shutdown()
        state, message = run.state, run.message
    if state != "finished":
        raise RuntimeError(f"the {'LoRA' if lora else 'full'} loop ended {state}: {message}")
    pss = {role: sampler.peaks.get(pid, 0) * 1024 / GiB for pid, role in roles.items()}
    later = df.iloc[1:] if len(df) > 1 else df
    measured_plan = planned_pss(cfg, pss)
    return {"s_per_step": float(statistics.median(later["step_time_s"])),
            "weight_sync_ms": float(statistics.median(later["weight_sync_ms"])),
            "peak_pss_gib": pss, "planned_pss_gib": measured_plan, "peak_total_gib": sum(pss.values()),
            "reference_process": has_reference}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_trainer":
        _trainer_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5])
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench lora", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the shipped tiny model everywhere (proves the path, not the Qwen3 numbers), the two "
                         "trainers at once, loops of 2 steps")
    ap.add_argument("--full-layers", type=int, nargs=2, default=None, metavar=("N1", "N2"),
                    help="measure the full fine-tuning trainer at these two depths and extrapolate its peak and "
                         "s/step linearly to 28 layers (its 13 GiB full-depth process may not fit a shared host)")
    args = ap.parse_args(argv)
    from forgelab.recipes.real_shapes import real_shape_checkpoint

    start = print_machine("start")
    if args.quick:  # proves the code path in about a minute: the shipped tiny model (4 layers) everywhere
        from forgelab.config.run_config import SHIPPED_MODEL

        small = deep = SHIPPED_MODEL
        shape, layers, (B, L, steps), loop_steps = "tiny-llama", 4, (4, 64, 2), 2
    else:
        small = real_shape_checkpoint("qwen3-0.6b", layers=2, max_position_embeddings=512)
        deep = real_shape_checkpoint("qwen3-0.6b", max_position_embeddings=512)
        shape, layers, (B, L, steps), loop_steps = "qwen3-0.6b", 28, (4, 256, 2), 4
    result: dict = {"suite": "lora", "quick": args.quick, "shape": shape, "lora": LORA,
                    "trainer_layers": layers, "trainer_batch": [B, L]}

    trainers = {}
    kinds = ("full", "lora", "lora_no_ac")  # the defaults ("auto": LoRA checkpoints activations), and LoRA without
    if args.quick:  # proves the path: both at once (peaks stay per process; timings share the cores)
        trainers = dict(zip(kinds, _children(*[("--_trainer", deep, str(B), str(L), str(steps), k) for k in kinds])))
    elif args.full_layers:  # full fine-tuning at two reduced depths, extrapolated linearly to the real one
        pts = [(n, _child("--_trainer", real_shape_checkpoint("qwen3-0.6b", layers=n, max_position_embeddings=512),
                          str(B), str(L), str(steps), "full")) for n in args.full_layers]
        (n1, t1), (n2, t2) = pts
        line = lambda a, b: a + (b - a) * (layers - n1) / (n2 - n1)  # noqa: E731  (memory: linear in depth)
        # step times are not extrapolated: two noisy points (a shared host) gave a negative slope once
        trainers["full"] = {"peak_gib": line(t1["peak_gib"], t2["peak_gib"]), "step_s": [],
                            "params": line(t1["params"], t2["params"]), "trainable": line(t1["trainable"], t2["trainable"]),
                            "gather_ms": line(t1["gather_ms"], t2["gather_ms"]),
                            "push_bytes": line(t1["push_bytes"], t2["push_bytes"]),
                            "extrapolated_from": {str(n): t for n, t in pts}}
        result["full_trainer_extrapolated"] = True
    for kind in kinds:  # otherwise one at a time: clean timings
        t = trainers.get(kind) or _child("--_trainer", deep, str(B), str(L), str(steps), kind)
        trainers[kind] = t
        s_step = statistics.median(t["step_s"][1:] or t["step_s"]) if t["step_s"] else float("nan")
        print(f"trainer alone, {kind:>4} ({layers} layers{', extrapolated' if 'extrapolated_from' in t else ''}, "
              f"{t['trainable'] / 1e6:.1f} M of {t['params'] / 1e6:.0f} M "
              f"trained, {B}x{L}): {s_step:.2f} s/step, "
              f"peak {t['peak_gib']:.2f} GiB, push gathers {t['push_bytes'] / 2**20:.1f} MiB in {t['gather_ms']:.0f} ms",
              flush=True)
    step = {k: statistics.median(t["step_s"][1:] or t["step_s"]) if t["step_s"] else None for k, t in trainers.items()}
    result.update(trainer=trainers, trainer_s_per_step=step,
                  lora_trainer_s_per_step_over_full=step["lora"] / step["full"] if step["full"] else None,
                  lora_trainer_peak_over_full=trainers["lora"]["peak_gib"] / trainers["full"]["peak_gib"],
                  lora_no_ac_trainer_peak_over_full=trainers["lora_no_ac"]["peak_gib"] / trainers["full"]["peak_gib"],
                  lora_no_ac_trainer_s_per_step_over_lora=step["lora_no_ac"] / step["lora"],
                  lora_push_bytes_over_full=trainers["lora"]["push_bytes"] / trainers["full"]["push_bytes"])

    shallow = "tiny" if args.quick else "2layers"
    every_s = QUICK_PSS_EVERY_S if args.quick else 0.05
    loops = {f"full_{shallow}": asyncio.run(_loop(small, loop_steps, lora=False, every_s=every_s)),
             f"lora_{shallow}": asyncio.run(_loop(small, loop_steps, lora=True, every_s=every_s))}
    if not args.quick:
        loops[f"lora_{layers}layers"] = asyncio.run(_loop(deep, loop_steps, lora=True))
    lora_deep = loops[f"lora_{shallow}" if args.quick else f"lora_{layers}layers"]
    errors = {}
    for name, lp in loops.items():
        for role, m in lp["peak_pss_gib"].items():
            if m > 0:
                errors[f"{name}/{role}"] = abs(lp["planned_pss_gib"][role] - m) / m
        print(f"loop {name}: {lp['s_per_step']:.2f} s/step, weight sync {lp['weight_sync_ms']:.1f} ms, peak PSS "
              + ", ".join(f"{r} {v:.2f} (plan {lp['planned_pss_gib'][r]:.2f})" for r, v in sorted(lp["peak_pss_gib"].items()))
              + f" GiB; total {lp['peak_total_gib']:.2f} GiB", flush=True)
    result.update(loops=loops,
                  lora_push_over_full=loops[f"lora_{shallow}"]["weight_sync_ms"] / loops[f"full_{shallow}"]["weight_sync_ms"],
                  lora_loop_peak_total_gib=lora_deep["peak_total_gib"],
                  lora_loop_fits_24gib=bool(lora_deep["peak_total_gib"] < 24.0),
                  lora_loop_layers=layers, plan_errors=errors,
                  plan_error=max(errors.values()) if errors else float("nan"))
    end = print_machine("end")
    result.update(loadavg_start=start.get("loadavg"), loadavg_end=end.get("loadavg"))
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
