"""A real architecture's shapes: the Qwen3-0.6B trainer alone, the whole loop at reduced depth, the memory plan.

    python -m forgelab.bench realmodel [--quick]

Random weights of the real shapes (`forgelab.recipes.real_shapes`, built once
under the cache dir). Three parts, each in its own process so peaks are clean:

1. **Trainer alone, full depth** (``--quick``: 2 layers, ``trainer_layers`` says which)
   (Qwen3-0.6B: 28 layers, 596 M parameters, fp32,
   AdamW; the whole loop in fp32 would not fit 24 GiB beside a generator and a
   reference): ``TrainerState`` (no actors, one process, 2 threads) trains a
   synthetic GRPO batch of B x L tokens; ``s_per_step`` is the median step after
   the first; ``peak_gib`` the process's peak RSS (VmHWM; one process, nothing
   shared, so RSS = PSS).
2. **Logits memory**, same B x L tokens, on the real output projection (the tied
   embedding, 151,936 x 1,024) with hidden states of the real width: peak RSS
   growth over the inputs of logprobs + entropy, forward and backward (gradients
   for the hidden states and the projection), chunked
   (`forgelab.algos.logprobs.chunked_logprobs_entropy`) vs full logits
   (`gather_logprobs` + `token_entropy` on ``h @ W.T``). The full path is measured
   at that size when ``full_measured_tokens`` equals the batch's tokens; otherwise
   at two smaller sizes and extrapolated linearly (``full_extrapolated``: true).
3. **The whole loop** on the 2-layer Qwen3-0.6B shape (full width and vocabulary):
   a `Run` with a vLLM generator, the trainer, a reference and shared-memory weight
   sync; ``loop_s_per_step`` and ``weight_sync_ms`` are medians over the steps after
   the first; each process's peak PSS is sampled every 50 ms (``--quick``: 1 s) from
   ``/proc/PID/smaps_rollup`` (PSS splits the shared weights file between the
   processes mapping it, so it is counted once). ``plan`` is `forgelab.memory_plan`'s
   estimate for the same config (the shared file's share added to the trainer
   and each generator, as PSS counts it); ``plan_error`` the largest
   ``|planned - measured| / measured`` over the processes (goal <= 0.25).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from forgelab.bench.common import emit_json, print_machine, run_children

GiB = 1024**3


def vm_kib(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- part 1: trainer alone --------------------------------------------------------------------------

def _trainer_main(model_dir: str, B: int, L: int, steps: int) -> None:
    import torch

    torch.set_num_threads(2)
    from forgelab.engines.trainer import TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    st = TrainerState.create(TrainerConfig(model_dir=model_dir, lr=1e-5, device="cpu"), 0, 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 151936, (B, L), generator=g)
    gen_lp = st.logprobs(tokens)
    batch = {"tokens_B_L": tokens, "mask_B_T": torch.ones(B, L - 1), "generator_logprobs_B_T": gen_lp,
             "advantages_B": torch.linspace(-1, 1, B)}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = st.train_step(batch)
        times.append(time.perf_counter() - t0)
        assert not out["skipped"], out
    print(json.dumps({"step_s": times, "peak_gib": vm_kib("VmHWM") * 1024 / GiB,
                      "params": sum(p.numel() for p in st.model.parameters())}), flush=True)


# -- part 2: logits memory ----------------------------------------------------------------------------

def _logits_main(model_dir: str, N: int, mode: str) -> None:
    import torch
    from safetensors import safe_open

    torch.set_num_threads(2)
    from forgelab.algos.logprobs import chunked_logprobs_entropy, gather_logprobs, token_entropy

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.embed_tokens.weight").requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, N, w.shape[1], generator=g).requires_grad_(True)
    y = torch.randint(0, w.shape[0], (1, N), generator=g)
    _reset_peak()
    base = vm_kib("VmRSS")
    if mode == "chunked":
        lp, ent = chunked_logprobs_entropy(h, w, y)
    else:
        z = h @ w.t()
        lp, ent = gather_logprobs(z, y), token_entropy(z)
    (lp.sum() + ent.sum()).backward()
    print(json.dumps({"peak_gib": (vm_kib("VmHWM") - base) * 1024 / GiB}), flush=True)


def _children(*argss: tuple[str, ...]) -> list[dict]:
    """One child process of this module per argument tuple, all at once (`forgelab.bench.common.run_children`)."""
    return run_children("forgelab.bench.realmodel", *argss)


def _child(*args: str) -> dict:
    return _children(args)[0]


# -- part 3: the whole loop -----------------------------------------------------------------------------

class PssSampler:
    """Peak PSS of every descendant process of this one, sampled in a thread."""

    def __init__(self, every_s: float = 0.05):
        import psutil

        self.me, self.every_s, self.peaks = psutil.Process(), every_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for p in self.me.children(recursive=True):
                kib = _pss_kib(p.pid)
                self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), kib)
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def loop_config(model_dir: str, out_dir: str, steps: int, prompts: int = 2, warmup: int = 1):
    from forgelab.config.run_config import (EvalConfig, ModelConfig, PlacementConfig, RolloutConfig, RunConfig,
                                 TrackingConfig, TrainConfig)

    return RunConfig(
        name="realmodel",
        model=ModelConfig(path=model_dir, max_model_len=64),
        rollout=RolloutConfig(task="addition", group_size=4, prompts_per_rollout=prompts, concurrency=1, max_tokens=8),
        train=TrainConfig(steps=steps, batch_size=4 * prompts, lr=1e-5, warmup_steps=warmup, max_policy_age=1, seed=0),
        eval=EvalConfig(every=0, n=2),
        tracking=TrackingConfig(out_dir=out_dir, wandb=False),
        placement=PlacementConfig(reference=True),
    )


#: PSS sampling period of the quick modes' loops (this one's and lora's): each sample lists every process on the
#: host and reads each descendant's smaps_rollup (the kernel walks its pages: ~50 ms of CPU for a 2 GiB process),
#: so at the full mode's 50 ms the sampler keeps a core busy for the loop's whole life.
QUICK_PSS_EVERY_S = 1.0


async def _loop(model_dir: str, steps: int, prompts: int = 2, every_s: float = 0.05) -> dict:
    from forgelab.run import Run

    with tempfile.TemporaryDirectory(prefix="forgelab-realmodel-") as out, PssSampler(every_s) as sampler:
        cfg = loop_config(model_dir, out, steps, prompts, warmup=min(1, steps - 1))
        run = Run(cfg)
        await run.start()
        roles = {}
        for name, handles in (("generator", run.generators.handles()), ("reference", run.reference.handles()),
                              ("trainer", [run.trainer])):
            for k, h in enumerate(handles):
                for pid in await h.pids():
                    roles[pid] = f"{name}{k}"
        await run.wait()
        df = run.metrics
        await run.shutdown()
        state, message = run.state, run.message
    if state != "finished":
        raise RuntimeError(f"the loop run ended {state}: {message}")
    pss = {role: sampler.peaks.get(pid, 0) * 1024 / GiB for pid, role in roles.items()}
    later = df.iloc[1:] if len(df) > 1 else df
    return {"cfg": cfg, "loop_s_per_step": float(statistics.median(later["step_time_s"])),
            "weight_sync_ms": float(statistics.median(later["weight_sync_ms"])),
            "peak_pss_gib": pss, "steps": len(df)}


def planned_pss(cfg, measured: dict[str, float]) -> dict[str, float]:
    """`forgelab.memory_plan` per process, with the shared weights file split as PSS splits it (trainer + generators)."""
    from forgelab.memory_plan import plan_memory

    plan = plan_memory(cfg)
    parts = plan.by_name()
    mappers = 1 + cfg.placement.generator_replicas
    out = {}
    for role in measured:
        kind = role.rstrip("0123456789")
        p = parts[kind].peak
        if kind in ("trainer", "generator"):
            p += plan.shared_bytes / mappers
        out[role] = p / GiB
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_trainer":
        _trainer_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return {}
    if argv and argv[0] == "--_logits":
        _logits_main(argv[1], int(argv[2]), argv[3])
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench realmodel", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="trainer alone at 2 layers (not 28), batch 1 x 64, 1 step, beside the logits children; "
                         "loop 1 step of 1 prompt x 4 (no warmup)")
    ap.add_argument("--batch", type=int, default=None, help="trainer-alone rows (default 4; quick 1)")
    ap.add_argument("--seq", type=int, default=None, help="trainer-alone tokens per row (default 256; quick 64)")
    ap.add_argument("--skip-trainer", action="store_true", help="skip part 1 (the full-depth trainer)")
    args = ap.parse_args(argv)
    from forgelab.recipes.real_shapes import real_shape_checkpoint

    B = args.batch or (1 if args.quick else 4)
    L = args.seq or (64 if args.quick else 256)
    steps = 1 if args.quick else 3
    start = print_machine("start")
    result: dict = {"suite": "realmodel", "quick": args.quick, "shape": "qwen3-0.6b", "trainer_batch": [B, L]}

    small = real_shape_checkpoint("qwen3-0.6b", layers=2, max_position_embeddings=512)
    N = B * (L - 1)
    logits_args = [("--_logits", small, str(N), "chunked")]
    if N <= 2048:
        logits_args.append(("--_logits", small, str(N), "full"))
    else:
        n1, n2 = 256, 512
        logits_args += [("--_logits", small, str(n), "full") for n in (n1, n2)]
    logits = None
    if not args.skip_trainer:
        # --quick (CI): the 2-layer shape, not the 28-layer one (a 10+ GiB process and a 2.4 GB checkpoint)
        full = small if args.quick else real_shape_checkpoint("qwen3-0.6b", max_position_embeddings=512)
        result["trainer_layers"] = 2 if args.quick else 28
        trainer_args = ("--_trainer", full, str(B), str(L), str(steps))
        if args.quick:  # proves the path: the logits children start beside the trainer (one import wait, not 3)
            t, *logits = _children(trainer_args, *logits_args)
        else:
            t = _child(*trainer_args)
        result.update(s_per_step=statistics.median(t["step_s"][1:] or t["step_s"]), peak_gib=t["peak_gib"],
                      trainer_params=t["params"], trainer_step_s=t["step_s"])
        print(f"trainer alone ({result['trainer_layers']} layers, {t['params'] / 1e6:.0f} M params, {B}x{L}): "
              f"{result['s_per_step']:.2f} s/step, peak {t['peak_gib']:.2f} GiB", flush=True)
    if logits is None:
        logits = [_child(*a) for a in logits_args]
    result["logits_peak_gib_chunked"] = logits[0]["peak_gib"]
    if N <= 2048:
        result["logits_peak_gib_full"] = logits[1]["peak_gib"]
        result.update(full_extrapolated=False, full_measured_tokens=N)
    else:
        p1, p2 = (r["peak_gib"] for r in logits[1:])
        result["logits_peak_gib_full"] = p1 + (p2 - p1) * (N - n1) / (n2 - n1)
        result.update(full_extrapolated=True, full_measured_tokens=[n1, n2])
    print(f"logits memory for {N} tokens: chunked {result['logits_peak_gib_chunked']:.3f} GiB, "
          f"full {result['logits_peak_gib_full']:.3f} GiB", flush=True)

    # --quick runs every part once: the trainer alone (1 step), both logits paths measured (64 tokens: no
    # extrapolation), and a 1-step loop: generation, the train step, its weight push (the row's weight_sync_ms)
    # and the PSS of every process (generator, trainer, reference) against the plan
    loop = asyncio.run(_loop(small, *((1, 1, QUICK_PSS_EVERY_S) if args.quick else (4, 2))))
    measured = loop.pop("peak_pss_gib")
    cfg = loop.pop("cfg")
    plan = planned_pss(cfg, measured)
    errors = {r: abs(plan[r] - measured[r]) / measured[r] for r in measured if measured[r] > 0}
    result.update(loop, peak_pss_gib=measured, planned_pss_gib=plan,
                  plan_error=max(errors.values()) if errors else float("nan"), plan_errors=errors)
    for r in sorted(measured):
        print(f"  {r:<11} peak PSS {measured[r]:.2f} GiB, planned {plan[r]:.2f} GiB ({errors.get(r, float('nan')):+.0%})")
    end = print_machine("end")
    result.update(loadavg_start=start.get("loadavg"), loadavg_end=end.get("loadavg"))
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
