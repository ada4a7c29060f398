"""Multi-turn rollouts at scale: episodes/s, generator utilisation and prefix-cache reuse.

    python -m forgelab.bench envs [--quick] [--model DIR] [--think-ms 20] [--turns 2]

One `Generator` replica and one `EnvActor` replica (real Monarch processes) on
the shipped tiny model. The env actor calls the generator directly (see
`forgelab.envs.actor`); this controller only starts waves of episodes.

- **scaling**: waves of C concurrent `EchoEnv` episodes (C = 1, 10, 100, 1000;
  `--turns` assistant turns of at most 8 tokens, each environment step
  "thinks" `--think-ms` ms). Per wave: episodes/s = C / wall time, and the
  generator's busy fraction = (increase of its `busy_time_s`, the time spent
  inside vLLM engine steps) / wall time. C = 1 runs a few episodes one after
  another. A wave's wall time includes its ramp-up and its tail.
- **prefix reuse**: 4-turn episodes whose user turns are 40 characters long,
  all with different prompts. For every turn after the first, the prompt is
  the whole conversation so far; `prefix_hit_rate` is the fraction of those
  turns' prompt tokens that vLLM served from its prefix cache
  (`Completion.num_cached_tokens`). Prefix caching shares whole KV blocks only
  (32 tokens on CPU), so `prefix_hit_bound` (whole blocks of the previous
  turn's prompt + completion, over the prompt) is the best it can be.

Last line: one JSON object with `episodes_per_s_at_1000`,
`generator_busy_fraction` (at C = 1000; the goal is >= 0.9) and `prefix_hit_rate`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from forgelab.bench.common import emit_json, print_table

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tiny-llama")


def _tasks(n: int, offset: int = 0) -> list[str]:
    return [f"{(i + offset) % 90 + 10}+{(i + offset) // 90 % 90 + 1}=" for i in range(n)]


async def _wave(gen, envs, meshes, tasks, sampling, env_kwargs, max_turns) -> tuple[list, float, dict, dict]:
    s0 = (await gen.fanout("stats"))[0]
    t0 = time.perf_counter()
    groups = await envs.route("run_groups", "echo", tasks, 1, meshes, sampling, env_kwargs=env_kwargs,
                              max_turns=max_turns, max_total_tokens=512)
    wall = time.perf_counter() - t0
    s1 = (await gen.fanout("stats"))[0]
    return [ep for g in groups for ep in g], wall, s0, s1


def _prefix_reuse(episodes) -> tuple[float, float]:
    """(hit rate, block-granular bound) over the prompt tokens of every turn after the first."""
    block = 32
    cached = total = bound = 0
    for ep in episodes:
        gen_turns = [t for t in ep.info["turns"] if t[2] == "assistant"]
        for k in range(1, len(gen_turns)):
            prompt_len = len(ep.prompt_ids) + gen_turns[k][0]
            prev_len = len(ep.prompt_ids) + gen_turns[k - 1][1]  # previous prompt + its completion
            cached += ep.info["cached_tokens"][k]
            total += prompt_len
            bound += (prev_len // block) * block
    return cached / max(1, total), bound / max(1, total)


async def _main(args) -> dict:
    from forgelab.envs.actor import EnvActor, EnvActorConfig
    from forgelab.generator import Generator, GeneratorConfig, SamplingConfig

    levels = [1, 10, 100, 1000]
    gcfg = GeneratorConfig(model_dir=args.model, max_model_len=512, max_num_seqs=256)
    gen, envs = await asyncio.gather(
        Generator.options(num_replicas=1, threads=args.threads).as_service(gcfg),
        EnvActor.options(num_replicas=1).as_service(EnvActorConfig(model_dir=args.model, max_concurrent=1024)),
    )
    try:
        meshes = [h.actor for h in gen.handles() if h is not None]
        sampling = SamplingConfig(temperature=1.0, max_tokens=8)
        kw = {"turns": args.turns, "think_s": args.think_ms / 1e3}
        await _wave(gen, envs, meshes, _tasks(32), sampling, kw, args.turns)  # warm-up
        rows = []
        for c in levels:
            reps = 1 if c >= 100 or args.quick else 3
            eps, wall, busy = [], 0.0, 0.0
            for r in range(reps if c > 1 else (3 if args.quick else 8)):
                e, w, s0, s1 = await _wave(gen, envs, meshes, _tasks(c, offset=1000 * r), sampling, kw, args.turns)
                eps += e
                wall += w
                busy += s1["busy_time_s"] - s0["busy_time_s"]
            bad = sum(ep.info["outcome"] != "done" for ep in eps)
            if bad:
                raise RuntimeError(f"{bad} of {len(eps)} episodes at concurrency {c} did not finish cleanly")
            rows.append({
                "concurrency": c, "episodes": len(eps), "wall_s": wall, "episodes_per_s": len(eps) / wall,
                "generator_busy": busy / wall,
                "turn_latency_ms": 1e3 * sum(ep.info["latency_s"] for ep in eps) / len(eps) / args.turns,
            })
        print(f"EchoEnv, {args.turns} turns of <= 8 tokens, env think time {args.think_ms:g} ms per step")
        print_table(rows, ["concurrency", "episodes", "wall_s", "episodes_per_s", "generator_busy", "turn_latency_ms"])

        n_prefix = 64 if args.quick else 200
        eps, wall, s0, s1 = await _wave(gen, envs, meshes, _tasks(n_prefix, offset=5000), sampling,
                                        {"turns": 4, "reply_chars": 40}, 4)
        hit, bound = _prefix_reuse(eps)
        engine_hit = (s1["cached_prompt_tokens"] - s0["cached_prompt_tokens"]) / max(1, s1["prompt_tokens"] - s0["prompt_tokens"])
        print(f"\nprefix reuse, {n_prefix} 4-turn episodes: turns 2-4 served {hit:.1%} of their prompt tokens from "
              f"the prefix cache (bound at 32-token blocks {bound:.1%}); all turns {engine_hit:.1%}")
        top = rows[-1]
        return {
            "episodes_per_s_at_1000": round(top["episodes_per_s"], 2),
            "generator_busy_fraction": round(top["generator_busy"], 3),
            "prefix_hit_rate": round(hit, 3),
            "prefix_hit_bound": round(bound, 3),
            "prefix_hit_rate_all_turns": round(engine_hit, 3),
            "turns": args.turns, "think_ms": args.think_ms, "quick": args.quick,
            "levels": {str(r["concurrency"]): {"episodes_per_s": round(r["episodes_per_s"], 2),
                                               "generator_busy": round(r["generator_busy"], 3)} for r in rows},
        }
    finally:
        await envs.shutdown()
        await gen.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench envs", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one wave per level, fewer prefix episodes")
    ap.add_argument("--model", default=SHIPPED, help="checkpoint directory (default: the shipped tiny model)")
    ap.add_argument("--turns", type=int, default=2, help="assistant turns per episode in the scaling waves")
    ap.add_argument("--think-ms", type=float, default=20.0, help="simulated environment time per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the generator process")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    emit_json(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
