"""Tinker's primitives against the fused train step, side by side on one set of shared engines.

    python -m forgelab.bench primitives [--quick] [--steps 20]

One `SharedEngines` (LoRA rank 8 on the shipped tiny model, 2 slots): slot A steps with the trainer's fused
``train_step``, slot B with the primitives a notebook loop calls (`forgelab.experiments.primitives`:
``forward_backward`` then ``optim_step``), both on the demo's batch shape (8 problems x 8 samples, a 7-token
prompt and 8 sampled tokens, GRPO's loss and advantages) and the same batch. Rounds alternate which slot goes
first. ``primitives_over_fused`` (goal <= 1.15) is the median over rounds of (B's step time / A's), with its
bootstrap 95 % interval; the first round (each path's first call) is left out.

``rest_over_python`` (goal <= 1.3): the same engines served over Tinker's REST API (`forgelab.serve`), and the
unmodified tinker SDK (``.venv-tinker``, `make tinker-venv`) driving a third slot from its own process
(`forgelab.bench._tinker_client`: one step per line on its stdin) interleaved round by round with the
Python primitives on slot B, both with ``importance_sampling`` (the REST API serves Tinker's losses) on the same
batch: the median per-round ratio of the SDK's step time (measured in the client: submit both calls, wait for
both results) to the Python step's.

``--quick`` runs 2 rounds: it proves the code path and reports the keys: round 0 (each path's first call, left
out; the fused step first) and one timed round (the primitives first), so both orders run, for both the
fused/primitives pair and the REST/Python pair (the SDK's process started once).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from forgelab.bench._stats import median_ratio
from forgelab.bench.common import emit_json, print_machine, print_table

GOAL = 1.15
REST_GOAL = 1.3


def demo_batch(seed: int = 0) -> "list[object]":
    """The demo's batch shape as Tinker datums: 8 addition prompts x 8 completions of 8 tokens, GRPO advantages
    (each group's rewards centred), the sampler's logprobs a plausible float32 value per token."""
    import torch

    from forgelab.experiments.primitive_types import Datum

    g = torch.Generator().manual_seed(seed)
    data = []
    for p in range(8):
        prompt = [1] + torch.randint(21, 31, (6,), generator=g).tolist()
        rewards = torch.randint(0, 2, (8,), generator=g).float()
        adv = rewards - rewards.mean()
        for s in range(8):
            completion = torch.randint(21, 40, (8,), generator=g).tolist()
            tokens = prompt + completion
            T = len(tokens) - 1
            on = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
            data.append(Datum(model_input=tokens[:-1], loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": [-(0.5 + float(torch.rand((), generator=g))) * w for w in on],
                "advantages": [float(adv[s]) * w for w in on]}))
            assert len(data[-1].loss_fn_inputs["target_tokens"]) == T
    return data


async def measure(rounds: int, out_dir: str) -> dict[str, object]:
    from forgelab.config.components import LoraConfig
    from forgelab.config.run_config import EvalConfig, RunConfig, TrackingConfig, TrainConfig
    from forgelab.engines.trainer_client import TrainerClient
    from forgelab.experiments.primitive_types import AdamParams
    from forgelab.experiments.primitives import Primitives, datum_batch
    from forgelab.experiments.variants import SharedEngines

    cfg = RunConfig(name="primitives-bench", lora=LoraConfig(enabled=True, rank=8, alpha=16.0),
                    train=TrainConfig(loss="grpo", lr=1e-4, warmup_steps=0), eval=EvalConfig(every=0),
                    tracking=TrackingConfig(out_dir=out_dir, wandb=False))
    engines = SharedEngines(cfg, slots=3)
    prims = Primitives(engines, f"{out_dir}/ckpt")
    try:
        fused_client = await prims.create_lora_training_client("fused")
        pieces = await prims.create_lora_training_client("pieces")
        fused = TrainerClient(fused_client.parts.trainer)  # type: ignore[arg-type]  # not None: checked by the client
        data = demo_batch()
        batch = datum_batch(data, primitive=False)
        adam = AdamParams(learning_rate=1e-4)

        async def step_fused() -> float:
            t0 = time.perf_counter()
            m = await fused.train_step(batch)
            assert not m.skipped, m
            return time.perf_counter() - t0

        async def step_pieces() -> float:
            t0 = time.perf_counter()
            await pieces.forward_backward(data, "grpo")
            await pieces.optim_step(adam)
            return time.perf_counter() - t0

        rows, pairs = [], []
        for r in range(rounds):
            if r % 2 == 0:
                f, p = await step_fused(), await step_pieces()
            else:
                p, f = await step_pieces(), await step_fused()
            rows.append({"round": r, "fused_s": round(f, 4), "primitives_s": round(p, 4), "ratio": round(p / f, 3)})
            if r > 0:
                pairs.append((p, f))
        ratio, ci = median_ratio(pairs)
        rest = await _rest_rounds(prims, data, rounds, pieces)
        return {"rows": rows, "primitives_over_fused": ratio, "primitives_over_fused_ci95": ci, **rest,
                "fused_s_per_step": round(statistics.median(f for _, f in pairs), 4),
                "primitives_s_per_step": round(statistics.median(p for p, _ in pairs), 4),
                "batch": {"sequences": len(data), "tokens_per_sequence": int(batch.tokens_B_L.shape[1])}}
    finally:
        await engines.shutdown()


async def _rest_rounds(prims: "object", data: "list[object]", rounds: int, python_client: "object") -> dict[str, object]:
    """The REST arm (see the module): ``rounds`` interleaved SDK / Python steps; the ratio and its interval."""
    import json
    import os
    from pathlib import Path

    from forgelab.experiments.primitive_types import AdamParams
    from forgelab.serve import LoopbackServer, serve_primitives

    sdk_python = Path(__file__).resolve().parents[2] / ".venv-tinker" / "bin" / "python"
    if not sdk_python.exists():
        raise SystemExit(f"{sdk_python} is missing: `make tinker-venv` builds the tinker SDK's virtualenv")
    server = LoopbackServer("bench-tinker")
    api = await serve_primitives(prims, server)  # type: ignore[arg-type]
    spec = {"model": api.base_model, "rank": api.rank, "lr": 1e-4,
            "data": [[d.model_input.to_ints() + d.loss_fn_inputs["target_tokens"][-1:].tolist(),  # type: ignore[attr-defined]
                      d.loss_fn_inputs["logprobs"].tolist(), d.loss_fn_inputs["advantages"].tolist()]  # type: ignore[attr-defined]
                     for d in data]}
    env = {**os.environ, "TINKER_BASE_URL": api.base_url, "TINKER_API_KEY": server.secret, "TINKER_TELEMETRY": "0"}
    client = Path(__file__).with_name("_tinker_client.py")  # run by path: the SDK's venv has no forgelab
    proc = await asyncio.create_subprocess_exec(str(sdk_python), str(client), json.dumps(spec), env=env,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    async def line() -> str:
        got = await asyncio.wait_for(proc.stdout.readline(), timeout=300)  # type: ignore[union-attr]
        if not got:
            err = await proc.stderr.read()  # type: ignore[union-attr]
            raise RuntimeError(f"the SDK client ended:\n{err.decode()[-3000:]}")
        return got.decode().strip()

    adam = AdamParams(learning_rate=1e-4)
    pairs, rows = [], []
    try:
        assert await line() == "ready"
        for r in range(rounds):
            async def sdk_step() -> float:
                proc.stdin.write(b"step\n")  # type: ignore[union-attr]
                await proc.stdin.drain()  # type: ignore[union-attr]
                return float(await line())

            async def py_step() -> float:
                t0 = time.perf_counter()
                await python_client.forward_backward(data, "importance_sampling")  # type: ignore[attr-defined]
                await python_client.optim_step(adam)  # type: ignore[attr-defined]
                return time.perf_counter() - t0

            if r % 2 == 0:
                rest, py = await sdk_step(), await py_step()
            else:
                py, rest = await py_step(), await sdk_step()
            rows.append({"round": r, "python_s": round(py, 4), "rest_s": round(rest, 4), "ratio": round(rest / py, 3)})
            if r > 0:
                pairs.append((rest, py))
        proc.stdin.write(b"end\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
        await api.close()
        await server.stop()
    ratio, ci = median_ratio(pairs)
    return {"rest_rows": rows, "rest_over_python": ratio, "rest_over_python_ci95": ci,
            "rest_s_per_step": round(statistics.median(a for a, _ in pairs), 4),
            "python_is_s_per_step": round(statistics.median(b for _, b in pairs), 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench primitives", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds: proves the code path, reports the keys")
    ap.add_argument("--rounds", type=int, default=21, help="rounds (each: one fused step, one primitives step)")
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    start = print_machine("start")
    with tempfile.TemporaryDirectory(prefix="forgelab-bench-primitives-") as out:
        res = asyncio.run(measure(rounds, out))
    end = print_machine("end")
    print_table(res.pop("rows"), ["round", "fused_s", "primitives_s", "ratio"])  # type: ignore[arg-type]
    print_table(res.pop("rest_rows"), ["round", "python_s", "rest_s", "ratio"])  # type: ignore[arg-type]
    print(f"primitives_over_fused {res['primitives_over_fused']} {res['primitives_over_fused_ci95']} "
          f"(goal <= {GOAL}; median over rounds after the first)")
    print(f"rest_over_python {res['rest_over_python']} {res['rest_over_python_ci95']} (goal <= {REST_GOAL})")
    emit_json({"suite": "primitives", "quick": args.quick, "rounds": rounds, **res,
               "goal": {"primitives_over_fused": GOAL, "rest_over_python": REST_GOAL},
               "meets_goal": all(res[k] is not None and res[k] <= g  # type: ignore[operator]
                                 for k, g in (("primitives_over_fused", GOAL), ("rest_over_python", REST_GOAL))),
               "machine": {"start": start, "end": end}})


if __name__ == "__main__":
    main()
