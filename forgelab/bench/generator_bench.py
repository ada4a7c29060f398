"""Generator throughput and weight-update latency: bare vLLM vs the Generator actor vs HF.

    python -m forgelab.bench generator [--quick] [--model DIR] [--threads N]

The same chat-templated addition prompts (n samples each, temperature 1,
stop at the end-of-turn token) go through

- ``bare_vllm``: ``vllm.LLM.generate`` in a fresh subprocess, built by the same
  ``VLLMEngine`` constructor as the actor (same engine settings);
- ``actor``: a ``Generator`` actor, one ``generate`` call from this controller
  (includes the Monarch round trip and returning ids + logprobs);
- ``hf``: HF ``generate`` (sampling, KV cache, left padding) in this process;

on the shipped tiny model (3.2 M params) and on a randomly initialised
~50 M-param Llama with the same tokenizer (where vLLM's batching pays off).
Weight-update latency is the controller's round trip of ``update_weights``
with the full HF state dict. Every process uses ``--threads`` torch threads.
Tokens/s counts generated tokens (eos included): best of the timed runs after
one warm-up. Bare vLLM and actor runs alternate in pairs (7 on the tiny model,
the order flipping each pair); ``actor_over_bare_vllm`` is the median over
those pairs of actor / bare tokens/s (the machine's load drifts), and
``pair_ratios`` lists every pair's ratio.

``--quick`` measures nothing; it runs the tiny model only: bare vLLM and the actor built at once, 8 prompts x 8,
2 bare/actor pairs (both orders), 1 HF run, 1 weight update through the actor, and every key of the JSON (the
~50 M model, made only for the full mode, is left out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from forgelab.bench.common import Worker, emit_json, print_machine, print_table

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny-llama")


def bench_prompts(model_dir: str, count: int) -> list[str]:
    from transformers import AutoTokenizer

    from forgelab.data import format_prompt
    from forgelab.data.tasks import get_task

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [format_prompt(tok, p.prompt) for p in get_task("addition").make("test", count, 0)]


def make_large_model(out_dir: str, hidden: int = 768, layers: int = 8) -> int:
    """A random-init Llama (untied, float32) with forgelab's character tokenizer; returns its params."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from forgelab.data.tokenizer import build_tokenizer, save_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64 // 3,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    save_tokenizer(tok, out_dir)
    return sum(p.numel() for p in model.parameters())


def random_state_dict(model_dir: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


def process_env(threads: int) -> dict[str, str]:
    from forgelab.runtime.component import Placement

    return Placement(threads=threads).process_env()


# ----------------------------------------------------------------- the paths
class BareVLLM(Worker):
    """`LLM.generate` in a fresh process (built by the same `VLLMEngine` as the actor); `run()` is one timed run."""

    def __init__(self, model_dir: str, count: int, n: int, max_tokens: int, threads: int):
        super().__init__("bare vLLM", ["-m", "forgelab.bench.generator_bench", "--_bare", model_dir, str(count), str(n),
                                       str(max_tokens), str(threads)], threads)

    def run(self) -> float:
        return super().run()["tokens_per_s"]


def _bare_main(model_dir: str, count: int, n: int, max_tokens: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from forgelab.engines.generator import GeneratorConfig, SamplingConfig, VLLMEngine

    engine = VLLMEngine(GeneratorConfig(model_dir=model_dir))
    params = SamplingConfig(temperature=1.0, max_tokens=max_tokens).to_vllm()
    params.n = n
    prompts = bench_prompts(model_dir, count)
    engine.llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(json.dumps({"tokens_per_s": tokens / wall, "tokens": tokens}), flush=True)


async def run_pair(model_dir: str, count: int, n: int, max_tokens: int, repeats: int, threads: int,
                   update_reps: int) -> tuple[dict, dict]:
    """Alternate timed runs of bare vLLM and the actor; then time actor weight updates."""
    from forgelab.engines.generator import Generator, GeneratorConfig, SamplingConfig

    prompts = bench_prompts(model_dir, count)
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    gen = bare = None
    try:  # both engines build at once (their start-up is not what is measured)
        built = await asyncio.gather(
            asyncio.to_thread(BareVLLM, model_dir, count, n, max_tokens, threads),
            Generator.options(procs=1, threads=threads).as_actor(GeneratorConfig(model_dir=model_dir)),
            return_exceptions=True)
        bare, gen = (None if isinstance(b, BaseException) else b for b in built)
        for b in built:  # the one that did build is closed below
            if isinstance(b, BaseException):
                raise b
        await gen.generate.call_one(prompts[:8], n=n, sampling=sampling)  # warm-up
        bare_tps, actor_tps = [], []

        async def actor_run() -> float:
            t0 = time.perf_counter()
            groups = await gen.generate.call_one(prompts, n=n, sampling=sampling)
            wall = time.perf_counter() - t0
            return sum(len(c.completion_ids) for g in groups for c in g) / wall

        for i in range(repeats):  # the order flips each pair: neither side always runs second
            if i % 2 == 0:
                bare_tps.append(bare.run())
                actor_tps.append(await actor_run())
            else:
                actor_tps.append(await actor_run())
                bare_tps.append(bare.run())
        bare.close()
        stats = await gen.stats.call_one()
        weights = random_state_dict(model_dir)
        update_ms, engine_ms = [], []
        for version in range(1, update_reps + 1):
            t0 = time.perf_counter()
            await gen.update_weights.call_one(version, weights)
            update_ms.append((time.perf_counter() - t0) * 1e3)
            engine_ms.append((await gen.stats.call_one())["last_update_ms"])
    finally:
        if bare is not None:
            bare.close()
        if gen is not None:
            await gen.shutdown()
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    actor = {"tokens_per_s": max(actor_tps), "update_ms": statistics.median(update_ms),
             "update_engine_ms": statistics.median(engine_ms), "bytes": nbytes,
             "mean_batch": stats["mean_concurrent_requests"],
             # paired runs: the ratio of each pair, then the median over pairs
             "over_bare": statistics.median(a / b for a, b in zip(actor_tps, bare_tps)),
             "pair_ratios": [round(a / b, 3) for a, b in zip(actor_tps, bare_tps)]}
    return {"tokens_per_s": max(bare_tps)}, actor


def run_hf(model_dir: str, count: int, n: int, max_tokens: int, repeats: int, batch: int = 512) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    rows = [p for p in bench_prompts(model_dir, count) for _ in range(n)]

    @torch.no_grad()
    def generate(texts: list[str]) -> int:
        tokens = 0
        for start in range(0, len(texts), batch):
            enc = tok(texts[start : start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            new = out[:, enc["input_ids"].shape[1] :]
            done = (new == tok.eos_token_id).int().cumsum(1)
            tokens += int(((done == 0) | ((done == 1) & (new == tok.eos_token_id))).sum())
        return tokens

    generate(rows[:8])  # warm-up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = generate(rows)
        best = max(best, tokens / (time.perf_counter() - t0))
    return {"tokens_per_s": best}


# ----------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_bare":
        _bare_main(argv[1], *map(int, argv[2:6]))
        return {}
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench generator", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: tiny model only, 8 prompts x 8, 2 bare/actor pairs (both orders), "
                         "1 HF run, 1 weight update")
    ap.add_argument("--model", default=SHIPPED, help="small model directory (default: the shipped tiny model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    start = print_machine("start")
    n, max_tokens = 8, 16
    configs = [("tiny", args.model, 8 if args.quick else 256, 2 if args.quick else 7)]
    tmp = None
    if not args.quick:
        tmp = tempfile.TemporaryDirectory(prefix="forgelab-bench-")
        params = make_large_model(tmp.name)
        configs.append((f"large-{params / 1e6:.0f}M", tmp.name, 32, 2))

    rows, tokens_per_s, update_ms, ratios, pair_ratios = [], {}, {}, {}, {}
    try:
        for label, model_dir, count, repeats in configs:
            bare, actor = asyncio.run(run_pair(model_dir, count, n, max_tokens, repeats, args.threads,
                                               update_reps=1 if args.quick else 3))
            hf = run_hf(model_dir, count, n, max_tokens, 1 if args.quick else repeats)
            size = f"{label} ({actor['bytes'] / 2**20:.1f} MiB)"
            for path, r in (("bare_vllm", bare), ("actor", actor), ("hf", hf)):
                tokens_per_s[f"{label}/{path}"] = round(r["tokens_per_s"], 1)
                rows.append({"model": label, "path": path, "prompts x n": f"{count} x {n}",
                             "tokens/s": r["tokens_per_s"]})
            ratios[label] = actor["over_bare"]
            pair_ratios[label] = actor["pair_ratios"]
            update_ms[size] = round(actor["update_ms"], 1)
            rows.append({"model": label, "path": "update_weights", "prompts x n": size,
                         "tokens/s": "", "ms": actor["update_ms"], "engine ms": actor["update_engine_ms"]})
    finally:
        if tmp is not None:
            tmp.cleanup()
    print_table(rows, ["model", "path", "prompts x n", "tokens/s", "ms", "engine ms"])
    result = {
        "suite": "generator",
        "actor_over_bare_vllm": round(ratios["tiny"], 3),
        "actor_over_bare_vllm_by_model": {k: round(v, 3) for k, v in ratios.items()},
        "pair_ratios": pair_ratios,
        "weight_update_ms": update_ms,
        "tokens_per_s": tokens_per_s,
        "quick": args.quick,
        "goal": "actor_over_bare_vllm >= 0.95",
        "goal_met": ratios["tiny"] >= 0.95,
        "machine": {**start, "loadavg_end": print_machine("end")["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
