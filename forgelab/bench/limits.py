"""The physical limit: how far the generator's and the trainer's tokens/s are from this machine's matmul rate.

    python -m forgelab.bench limits [--quick]

FLOPs per token come from the parameter count N of the shipped tiny model,
counting every weight that takes part in a matrix multiply (all but the input
embedding, which is a lookup; the output projection counts): 2N per token
for a forward pass (generation, prefill and decode alike) and 6N per token for
training (forward + backward). Attention's own FLOPs (QK^T and AV, 4 x layers
x context x hidden per token) are *not* included: at these lengths (~17
tokens) they add ~1%, printed below. The rate is measured here: ``torch.mm``
in float32 on 1 thread (every forgelab process runs 1 torch thread), at the
shapes the model multiplies (hidden 256 x 768 MLP, decode rows = 64 prompts x
8 samples, training rows = a batch's tokens) and at a large square 2048^3;
best of the repeats, since other jobs' load only slows it down. So a stage's
limit is (1-thread matmul GFLOP/s at its shape) / (FLOPs per token), and

- generator: bare vLLM (the generator's own engine, 1 thread, separate
  process), 256 addition prompts x 8 samples, 8 new tokens, temperature 1:
  tokens/s over prompt + generated tokens (both cost 2N), best of 3;
- trainer: a short real ``Run`` of the demo configuration (generator,
  trainer, reference: 1 thread each, on 2 cores): trained tokens
  (``B x L`` as padded, what the trainer computes on) / ``train_time_s``
  of each step (the controller's round trip of ``train_step``), median;
  then the same batches through the same ``TrainerState.train_step`` in
  this process, best of them.

Each stage's fraction is given per CPU second (``*_fraction_of_limit``: how
close the code gets to the core while it has the core) and per wall second
(``*_fraction_of_limit_wall``: what the run got on this loaded host).

``--quick`` measures nothing; it runs each part once at its smallest: 2 matmul repeats per shape, bare vLLM in
its own process (8 prompts x 8, 1 timed run after its warm-up), a 2-step `Run` of 2 prompts x 8 (warmup 1; step
1 warms up, step 2 is the one timed row) without the reference process (nothing here reads it) and the same
batches through `TrainerState` in this process.
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

from forgelab.bench.common import emit_json, print_machine, print_table
from forgelab.bench.generator_bench import SHIPPED, process_env, bench_prompts


def flop_params(model_dir: str) -> dict:
    """Parameter counts from the checkpoint: total, and those in matmuls (total minus the input embedding)."""
    from transformers import AutoConfig

    from forgelab.bench.generator_bench import random_state_dict

    sd = random_state_dict(model_dir)
    total = sum(v.numel() for v in sd.values())
    embed = sum(v.numel() for k, v in sd.items() if k.endswith("embed_tokens.weight"))
    cfg = AutoConfig.from_pretrained(model_dir)
    return {"total": total, "matmul": total - embed, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size}


def matmul_gflops(m: int, k: int, n: int, reps: int) -> dict:
    """GFLOP/s of `torch.mm` [m, k] @ [k, n] in float32 on 1 thread, per CPU second and per wall second.

    The rate that bounds a stage is the core's, so the thread's CPU time
    (`time.thread_time`) is the clock: on a host shared with other jobs, wall
    time also counts the time the thread waited for a core. Best of `reps`.
    """
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    inner = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP per timing, so tiny shapes are not timer noise
    torch.mm(a, b)
    cpu, wall = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(inner):
            torch.mm(a, b)
        flops = 2 * m * k * n * inner
        cpu.append(flops / (time.thread_time() - c0) / 1e9)
        wall.append(flops / (time.perf_counter() - t0) / 1e9)
    return {"best": max(cpu), "median": statistics.median(cpu), "wall_best": max(wall), "shape": f"{m}x{k} @ {k}x{n}"}


def fraction(tokens_per_s: float, flops_per_token: float, gflops: float) -> float:
    """Measured tokens/s as a fraction of the matmul-bound limit `gflops * 1e9 / flops_per_token`.

    >>> fraction(1000.0, 2e6, 10.0)
    0.2
    """
    return tokens_per_s * flops_per_token / (gflops * 1e9)


# ----------------------------------------------------------------- generator
def _gen_main(model_dir: str, count: int, n: int, max_tokens: int, repeats: int) -> None:
    import torch

    torch.set_num_threads(1)
    from forgelab.engines.generator import GeneratorConfig, SamplingConfig, VLLMEngine

    engine = VLLMEngine(GeneratorConfig(model_dir=model_dir))
    params = SamplingConfig(temperature=1.0, max_tokens=max_tokens).to_vllm()
    params.n = n
    prompts = bench_prompts(model_dir, count)
    engine.llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    best = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt = sum(len(o.prompt_token_ids) for o in outs)  # prefilled once per prompt (n samples share it)
        r = {"generated_per_s": gen / wall, "processed_per_s": (gen + prompt) / wall, "generated": gen,
             "prompt_tokens": prompt, "processed_per_cpu_s": (gen + prompt) / cpu}
        best = r if best is None or r["processed_per_s"] > best["processed_per_s"] else best
    print(json.dumps(best), flush=True)


def measure_generator(model_dir: str, count: int, repeats: int) -> dict:
    env = {**os.environ, **process_env(1)}
    proc = subprocess.run([sys.executable, "-m", "forgelab.bench.limits", "--_gen", model_dir, str(count), "8", "8",
                           str(repeats)], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"generator measurement failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------- trainer
async def measure_trainer(steps: int, out_dir: str, warmup: int | None = None, prompts: int = 8,
                          reference: bool = True) -> dict:
    from forgelab.bench.e2e import bench_config
    from forgelab.run import Run

    run = Run(bench_config(steps=steps, eval_every=0, out_dir=out_dir, name="limits", warmup=warmup,
                           prompts=prompts, reference=reference))
    batches: list[dict] = []

    def on_row(msg: dict) -> None:  # after each trained step: the batch train_step received (read-only)
        if "event" not in msg and run.last_batch is not None:
            batches.append(run.last_batch)

    run.add_listener(on_row)
    await run.start()
    try:
        await run.wait()
    finally:
        await run.shutdown()
    df = run.metrics
    rows = list(zip(df["train_time_s"].tolist()[1:], batches[1:]))  # step 1 warms up
    padded = statistics.median(b["tokens_B_L"].numel() / t for t, b in rows)
    real = statistics.median(int((b["tokens_B_L"] != run.pad_id).sum()) / t for t, b in rows)
    # The same batches through the same step in this process (1 thread), timed by its CPU time too.
    from forgelab.engines.trainer import TrainerConfig
    from forgelab.engines.trainer_state import TrainerState

    state = TrainerState.create(TrainerConfig(model_dir=run.config.model.path, lr=run.config.train.lr), 0, 1)
    state.train_step(batches[0])  # warm-up
    cpu_rates, wall_rates = [], []
    for b in batches[1:]:
        t0, c0 = time.perf_counter(), time.thread_time()
        state.train_step(b)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        cpu_rates.append(b["tokens_B_L"].numel() / cpu)
        wall_rates.append(b["tokens_B_L"].numel() / wall)
    shape = tuple(batches[-1]["tokens_B_L"].shape)
    return {"padded_tokens_per_s": padded, "real_tokens_per_s": real,
            "train_time_s": statistics.median(t for t, _ in rows),
            "inproc_tokens_per_cpu_s": max(cpu_rates), "inproc_tokens_per_s": max(wall_rates),
            "tokens_B_L": f"{shape[0]}x{shape[1]}", "steps": len(rows)}


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_gen":
        _gen_main(argv[1], *map(int, argv[2:6]))
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench limits", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: 2 matmul repeats per shape, bare vLLM 1 timed run of 8 prompts x 8, "
                         "a 2-step Run of 2 prompts x 8 (warmup 1; 1 step timed after the warm-up step), no reference")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    p = flop_params(SHIPPED)
    N = p["matmul"]
    reps = 2 if args.quick else 7
    h, i = p["hidden"], p["intermediate"]
    mm_gen = matmul_gflops(64 * 8, h, i, reps)  # one decode step of 64 prompts x 8 samples through the MLP
    mm_train = matmul_gflops(64 * 17, h, i, reps)  # a batch of 64 sequences of ~17 tokens
    mm_big = matmul_gflops(2048, 2048, 2048, max(2, reps // 2))
    gen = measure_generator(SHIPPED, 8 if args.quick else 256, 1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="forgelab-limits-") as d:
        tr = asyncio.run(measure_trainer(2 if args.quick else 20, d, warmup=1 if args.quick else None,
                                         prompts=2 if args.quick else 8, reference=not args.quick))
    end = print_machine("end")

    attn_share = 4 * p["layers"] * 17 * h / (2 * N)
    gen_limit = mm_gen["best"] * 1e9 / (2 * N)
    train_limit = mm_train["best"] * 1e9 / (6 * N)
    gen_frac, gen_frac_wall = gen["processed_per_cpu_s"] / gen_limit, gen["processed_per_s"] / gen_limit
    train_frac, train_frac_wall = tr["inproc_tokens_per_cpu_s"] / train_limit, tr["padded_tokens_per_s"] / train_limit
    print(f"model: {p['total'] / 1e6:.2f} M params, N = {N / 1e6:.2f} M in matmuls; 2N = {2 * N / 1e6:.1f} MFLOP/token "
          f"(forward), 6N = {6 * N / 1e6:.1f} MFLOP/token (train); attention FLOPs not included "
          f"(~{attn_share:.1%} more at 17 tokens)")
    print_table([
        {"what": f"torch.mm fp32 1 thread {m['shape']}", "GFLOP/CPU-s best": m["best"],
         "GFLOP/CPU-s median": m["median"], "GFLOP/wall-s best": m["wall_best"]}
        for m in (mm_gen, mm_train, mm_big)], ["what", "GFLOP/CPU-s best", "GFLOP/CPU-s median", "GFLOP/wall-s best"])
    print_table([
        {"stage": "generator: bare vLLM, per CPU-s", "limit tok/s": gen_limit, "measured tok/s": gen["processed_per_cpu_s"],
         "fraction": gen_frac, "note": "prompt + generated tokens (2N each)"},
        {"stage": "generator: bare vLLM, per wall-s", "limit tok/s": gen_limit, "measured tok/s": gen["processed_per_s"],
         "fraction": gen_frac_wall, "note": f"generated only: {gen['generated_per_s']:.0f} tok/s"},
        {"stage": "trainer: train_step, per CPU-s", "limit tok/s": train_limit,
         "measured tok/s": tr["inproc_tokens_per_cpu_s"], "fraction": train_frac,
         "note": f"real batches B x L = {tr['tokens_B_L']} (6N per padded token)"},
        {"stage": "trainer: in the Run, per wall-s", "limit tok/s": train_limit,
         "measured tok/s": tr["padded_tokens_per_s"], "fraction": train_frac_wall,
         "note": f"incl. the actor round trip; {tr['real_tokens_per_s']:.0f} non-pad tok/s"},
    ], ["stage", "limit tok/s", "measured tok/s", "fraction", "note"])
    result = {
        "suite": "limits",
        "params": p["total"],
        "matmul_params": N,
        "attention_flops_included": False,
        "matmul_gflops_1thread": round(mm_big["best"], 2),
        "matmul_gflops_1thread_model_shapes": {"generate": round(mm_gen["best"], 2), "train": round(mm_train["best"], 2)},
        "generator_tokens_per_cpu_s": round(gen["processed_per_cpu_s"], 1),
        "generator_tokens_per_s": round(gen["processed_per_s"], 1),
        "generator_limit_tokens_per_s": round(gen_limit, 1),
        "generator_fraction_of_limit": round(gen_frac, 4),
        "generator_fraction_of_limit_wall": round(gen_frac_wall, 4),
        "trainer_tokens_per_cpu_s": round(tr["inproc_tokens_per_cpu_s"], 1),
        "trainer_tokens_per_s": round(tr["padded_tokens_per_s"], 1),
        "trainer_limit_tokens_per_s": round(train_limit, 1),
        "trainer_fraction_of_limit": round(train_frac, 4),
        "trainer_fraction_of_limit_wall": round(train_frac_wall, 4),
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
