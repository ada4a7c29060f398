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
- **steady state**: the way a `Run` drives rollouts: at concurrency C, the
  controller keeps ceil(C / 64) overlapping `run_groups` calls in flight
  (C / calls episodes each rounded up, at most 64: a `Run`'s rollout of 8 prompts x a
  group of 8) and starts a new call as soon as one returns, for `--steady-s`
  seconds, measured over a window that opens when the first call has returned
  (the pipeline is full) and closes when the last call is launched (before the
  drain); episodes/s counts the episodes of the calls that returned in that
  window. The generator's wall time splits into: **engine steps**
  (`busy_time_s`, inside `engine.step()`), **intake** (`intake_time_s`, vLLM
  turning new requests into engine requests: `add_request`), **idle** (no
  request in the engine: waiting for the environments) and **other** (the rest:
  Monarch messages in and out, building `Completion`s, garbage collection).
  `generator_busy_fraction` = engine steps + intake, the vLLM engine's own work
  (in vLLM's server the intake runs in the API process, beside the engine
  loop); `generator_step_fraction` and `generator_idle_fraction` are reported
  beside it. A wave's busy fraction (steps only) also counts the wave's
  ramp-up (the environment actor starting C episodes) and its tail (the last
  turns, and returning C episodes to this controller), when the generator has
  nothing to do by construction.
- **prefix reuse**: 4-turn episodes whose user turns are 40 characters long,
  all with different prompts. For every turn after the first, the prompt is
  the whole conversation so far; `prefix_hit_rate` is the fraction of those
  turns' prompt tokens that vLLM served from its prefix cache
  (`Completion.num_cached_tokens`). Prefix caching shares whole KV blocks only
  (32 tokens on CPU), so `prefix_hit_bound` (whole blocks of the previous
  turn's prompt + completion, over the prompt) is the best it can be.

- **10,000 episodes over environment replicas**: the steady state at C = 10,000 (`--big`) with the
  episodes spread over 2 and then 4 `EnvActor` replicas (`run_groups` calls routed round-robin by the
  service, each replica allowed C / replicas + one call's episodes at once), the same generator. The
  window opens once the first call has returned (a call's round trip at this load is tens of seconds) and
  lasts `--big-s` seconds. Episodes in flight are sampled every 0.5 s from the replicas' own counters (the
  sum of their `running` episodes at one moment); turn latency percentiles come from the episodes returned
  in the window (`info["turn_latency_s"]`: a turn's generation, queueing included, and its environment step).
  Memory: each replica's resident set before the level and its peak (`ru_maxrss`) after it;
  `env_mib_per_1k_episodes` is the summed growth (peak - before) over the most episodes in flight, in
  thousands: what the episodes themselves cost, the processes' fixed ~300 MiB each (interpreter, torch,
  Monarch, tokenizer) reported beside it as `env_rss_peak_mib`.

Last line: one JSON object with `episodes_per_s_at_1000` (steady state),
`generator_busy_fraction` (steady state at C = 1000, engine steps + intake; the
goal is >= 0.9), `generator_step_fraction`, `generator_idle_fraction`, the
wave's `generator_busy_fraction_wave` (steps only), `prefix_hit_rate`, and for the 10,000 level
`episodes_in_flight_max` (goal >= 10,000), `generator_busy_at_10k` (goal >= 0.95), `turn_latency_p99_ms_at_10k`
and `env_mib_per_1k_episodes` (goal <= 100), each the worse of the 2- and 4-replica runs (per replica
count under `big`).

``--quick`` measures nothing; it runs every part once at its smallest: the warm-up wave, one wave per level
(C = 1 once, 10, 100: the 1000 level runs the same code), the steady state at 10 (one call in flight) and 100 (two
overlapping calls) for 3 s each (a window needs a call back after the pipeline filled: a call at 100 returns in
about a second), 16 prefix-reuse episodes, and the replicas level at 200 episodes over 2 replicas (the routed path
needs two; 4 calls, 2 per replica) for 2 s after it filled, with its in-flight sampling and memory readings. The
keys named for 1000 and 10,000 then hold the quick mode's top levels (100 and 200).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from forgelab.bench.common import emit_json, print_machine, print_table

PER_CALL = 64  # episodes per steady-state run_groups call: a Run's rollout (8 prompts x group 8)
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


async def _steady(gen, envs, meshes, c, sampling, env_kwargs, max_turns, seconds, after_fill=False) -> dict:
    """Keep about `c` episodes in flight with overlapping `run_groups` calls for `seconds` (from the start, or
    with `after_fill` from the window's start); see the docstring."""
    n_calls = -(-c // PER_CALL)
    per_call = -(-c // n_calls)  # n_calls * per_call >= c: at least c episodes in flight
    offset = iter(range(10**6, 10**9, per_call))
    done: list[tuple[float, int, list, list]] = []  # (time returned, episodes, outcomes, turn latencies in s)

    async def one() -> None:
        groups = await envs.route("run_groups", "echo", _tasks(per_call, next(offset)), 1, meshes, sampling,
                                  env_kwargs=env_kwargs, max_turns=max_turns, max_total_tokens=512)
        eps = [ep for g in groups for ep in g]
        done.append((time.perf_counter(), per_call, [ep.info["outcome"] for ep in eps],
                     [t for ep in eps for t in ep.info.get("turn_latency_s", ())]))

    t_end = time.perf_counter() + seconds
    running = {asyncio.ensure_future(one()) for _ in range(n_calls)}
    window_start = s_start = None
    while True:
        finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for f in finished:
            f.result()
        if window_start is None:  # the pipeline is full once the first call came back
            window_start, s_start = time.perf_counter(), (await gen.fanout("stats"))[0]
            e_start = _sum_env_stats(await envs.fanout("stats"))
            if after_fill:
                t_end = window_start + seconds
        if time.perf_counter() >= t_end:
            break
        running |= {asyncio.ensure_future(one()) for _ in finished}
    window_end, s_end = time.perf_counter(), (await gen.fanout("stats"))[0]
    e_end = _sum_env_stats(await envs.fanout("stats"))
    await asyncio.gather(*running)  # drain (not measured)
    in_window = [d for d in done if window_start < d[0] <= window_end]
    bad = sum(o != "done" for _, _, outs, _ in done for o in outs)
    if bad:
        raise RuntimeError(f"{bad} steady-state episodes at concurrency {c} did not finish cleanly")
    wall = window_end - window_start
    # the generator's fractions over its own clock: its stats answer can wait behind queued generate calls
    gen_wall = s_end["clock_s"] - s_start["clock_s"] if "clock_s" in s_start else wall
    lat = sorted(t for *_, ts in in_window for t in ts)
    return {"window_s": wall, "episodes": sum(n for _, n, *_ in in_window),
            "episodes_per_s": sum(n for _, n, *_ in in_window) / wall,
            "turn_latency_ms": {f"p{q}": 1e3 * _nearest_rank(lat, q / 100) for q in (50, 95, 99)} if lat else {},
            "busy": (s_end["busy_time_s"] - s_start["busy_time_s"]) / gen_wall,
            "intake": (s_end["intake_time_s"] - s_start["intake_time_s"]) / gen_wall,
            "idle": (s_end["idle_time_s"] - s_start["idle_time_s"]) / gen_wall,
            "idle_periods": s_end["idle_periods"] - s_start["idle_periods"],
            "gen_cpu": (s_end["cpu_time_s"] - s_start["cpu_time_s"]) / gen_wall,
            "env_cpu": (e_end["cpu_time_s"] - e_start["cpu_time_s"]) / wall,
            "env_gc": (e_end["gc_pause_s"] - e_start["gc_pause_s"]) / wall,
            "gen_gc": (s_end["gc_pause_s"] - s_start["gc_pause_s"]) / gen_wall,
            "env_gc_max_ms": 1e3 * e_end["gc_max_pause_s"],
            "calls": n_calls}


def _sum_env_stats(stats: list[dict]) -> dict:
    """The replicas' counters added up (CPU and GC time; the largest single GC pause)."""
    return {"cpu_time_s": sum(s["cpu_time_s"] for s in stats), "gc_pause_s": sum(s["gc_pause_s"] for s in stats),
            "gc_max_pause_s": max(s["gc_max_pause_s"] for s in stats)}


async def _big(gen, meshes, model: str, replicas: int, c: int, sampling, env_kwargs, max_turns, seconds) -> dict:
    """The steady state at `c` episodes over `replicas` environment actors, with episodes in flight (sampled)
    and the replicas' memory; see the docstring."""
    from forgelab.envs.actor import EnvActor, EnvActorConfig

    envs = await EnvActor.options(num_replicas=replicas).as_service(
        EnvActorConfig(model_dir=model, max_concurrent=-(-c // replicas) + PER_CALL))
    try:
        before = await envs.fanout("stats")
        in_flight = [0]

        async def sample() -> None:
            while True:
                in_flight.append(sum(s["running"] for s in await envs.fanout("stats")))
                await asyncio.sleep(0.5)

        poller = asyncio.ensure_future(sample())
        try:
            r = await _steady(gen, envs, meshes, c, sampling, env_kwargs, max_turns, seconds, after_fill=True)
        finally:
            poller.cancel()
        after = await envs.fanout("stats")
    finally:
        await envs.shutdown()
    growth = sum(a["peak_rss_mib"] - b["rss_mib"] for a, b in zip(after, before))
    r.update(replicas=replicas, in_flight_max=max(in_flight), env_growth_mib=growth,
             env_rss_peak_mib=sum(a["peak_rss_mib"] for a in after),
             env_mib_per_1k=growth / max(1e-9, max(in_flight) / 1000))
    return r


def _nearest_rank(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, max(0, int(-(-q * len(sorted_xs) // 1)) - 1))]


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
    from forgelab.engines.generator import Generator, GeneratorConfig, SamplingConfig

    levels = [1, 10, 100] if args.quick else [1, 10, 100, 1000]
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
            eps, wall, busy, idle, admit = [], 0.0, 0.0, 0.0, 0.0
            for r in range(reps if c > 1 else (1 if args.quick else 8)):
                e, w, s0, s1 = await _wave(gen, envs, meshes, _tasks(c, offset=1000 * r), sampling, kw, args.turns)
                eps += e
                wall += w
                busy += s1["busy_time_s"] - s0["busy_time_s"]
                idle += s1["idle_time_s"] - s0["idle_time_s"]
                admit += s1["admission_wait_s"] - s0["admission_wait_s"]
            bad = sum(ep.info["outcome"] != "done" for ep in eps)
            if bad:
                raise RuntimeError(f"{bad} of {len(eps)} episodes at concurrency {c} did not finish cleanly")
            rows.append({
                "concurrency": c, "episodes": len(eps), "wall_s": wall, "episodes_per_s": len(eps) / wall,
                "generator_busy": busy / wall, "generator_idle": idle / wall, "admission_wait": admit / wall,
                "turn_latency_ms": 1e3 * sum(ep.info["latency_s"] for ep in eps) / len(eps) / args.turns,
            })
        steady = []
        for c in ((10, 100) if args.quick else (100, 1000)):
            r = await _steady(gen, envs, meshes, c, sampling, kw, args.turns, args.steady_s)
            steady.append({"concurrency": c, "calls in flight": r["calls"], "window_s": r["window_s"],
                           "episodes": r["episodes"], "episodes_per_s": r["episodes_per_s"],
                           "steps": r["busy"], "intake": r["intake"], "busy": r["busy"] + r["intake"],
                           "idle": r["idle"], "other": 1 - r["busy"] - r["intake"] - r["idle"],
                           "idle_periods": r["idle_periods"], "generator_cpu": r["gen_cpu"], "env_cpu": r["env_cpu"],
                           "generator_gc": r["gen_gc"], "env_gc": r["env_gc"], "env_gc_max_ms": r["env_gc_max_ms"]})
        print(f"EchoEnv, {args.turns} turns of <= 8 tokens, env think time {args.think_ms:g} ms per step")
        print("waves (C episodes started together, wall time to the last one):")
        print_table(rows, ["concurrency", "episodes", "wall_s", "episodes_per_s", "generator_busy", "generator_idle",
                           "admission_wait", "turn_latency_ms"])
        print(f"\nsteady state ({args.steady_s:g} s per level, overlapping run_groups calls):")
        print_table(steady, ["concurrency", "calls in flight", "window_s", "episodes", "episodes_per_s", "steps",
                             "intake", "busy", "idle", "other", "idle_periods"])
        print("generator process CPU, environment actor CPU and time in garbage collection (fractions of wall):")
        print_table(steady, ["concurrency", "generator_cpu", "env_cpu", "generator_gc", "env_gc", "env_gc_max_ms"])

        n_prefix = 16 if args.quick else 200
        eps, wall, s0, s1 = await _wave(gen, envs, meshes, _tasks(n_prefix, offset=5000), sampling,
                                        {"turns": 4, "reply_chars": 40}, 4)
        hit, bound = _prefix_reuse(eps)
        engine_hit = (s1["cached_prompt_tokens"] - s0["cached_prompt_tokens"]) / max(1, s1["prompt_tokens"] - s0["prompt_tokens"])
        print(f"\nprefix reuse, {n_prefix} 4-turn episodes: turns 2-4 served {hit:.1%} of their prompt tokens from "
              f"the prefix cache (bound at 32-token blocks {bound:.1%}); all turns {engine_hit:.1%}")
        big = []
        for k in args.big_replicas:
            r = await _big(gen, meshes, args.model, k, args.big, sampling, kw, args.turns, args.big_s)
            big.append({"replicas": k, "in flight max": r["in_flight_max"], "window_s": r["window_s"],
                        "episodes_per_s": r["episodes_per_s"], "busy": r["busy"] + r["intake"], "idle": r["idle"],
                        **{f"turn {q} ms": r["turn_latency_ms"].get(q, float("nan")) for q in ("p50", "p95", "p99")},
                        "env_cpu": r["env_cpu"], "env_gc_max_ms": r["env_gc_max_ms"], "env growth MiB": r["env_growth_mib"],
                        "env peak MiB": r["env_rss_peak_mib"], "MiB / 1k episodes": r["env_mib_per_1k"]})
        print(f"\n{args.big} episodes in flight over environment replicas ({args.big_s:g} s after the pipeline filled):")
        print_table(big, ["replicas", "in flight max", "window_s", "episodes_per_s", "busy", "idle", "turn p50 ms",
                          "turn p95 ms", "turn p99 ms", "env_cpu", "env_gc_max_ms", "env growth MiB", "env peak MiB",
                          "MiB / 1k episodes"])
        top, st = rows[-1], steady[-1]
        return {
            "episodes_in_flight_max": min(b["in flight max"] for b in big),
            "generator_busy_at_10k": round(min(b["busy"] for b in big), 3),
            "turn_latency_p99_ms_at_10k": round(max(b["turn p99 ms"] for b in big), 1),
            "env_mib_per_1k_episodes": round(max(b["MiB / 1k episodes"] for b in big), 1),
            "big": {str(b["replicas"]): {k: (round(v, 3) if isinstance(v, float) else v) for k, v in b.items()}
                    for b in big},
            "episodes_per_s_at_1000": round(st["episodes_per_s"], 2),
            "generator_busy_fraction": round(st["busy"], 3),
            "generator_step_fraction": round(st["steps"], 3),
            "generator_idle_fraction": round(st["idle"], 3),
            "episodes_per_s_at_1000_wave": round(top["episodes_per_s"], 2),
            "generator_busy_fraction_wave": round(top["generator_busy"], 3),
            "prefix_hit_rate": round(hit, 3),
            "prefix_hit_bound": round(bound, 3),
            "prefix_hit_rate_all_turns": round(engine_hit, 3),
            "turns": args.turns, "think_ms": args.think_ms, "quick": args.quick,
            "levels": {str(r["concurrency"]): {"episodes_per_s": round(r["episodes_per_s"], 2),
                                               "generator_busy": round(r["generator_busy"], 3)} for r in rows},
            "steady": {str(r["concurrency"]): {"episodes_per_s": round(r["episodes_per_s"], 2),
                                               "generator_busy": round(r["busy"], 3),
                                               "generator_idle": round(r["idle"], 3)} for r in steady},
        }
    finally:
        await envs.shutdown()
        await gen.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench envs", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: one wave per level (1, 10, 100), steady state at 10 and 100 for 3 s each, "
                         "16 prefix-reuse episodes, 200 episodes over 2 replicas for 2 s")
    ap.add_argument("--model", default=SHIPPED, help="checkpoint directory (default: the shipped tiny model)")
    ap.add_argument("--turns", type=int, default=2, help="assistant turns per episode in the scaling waves")
    ap.add_argument("--think-ms", type=float, default=20.0, help="simulated environment time per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the generator process")
    ap.add_argument("--steady-s", type=float, default=None,
                    help="seconds of steady-state load per level (default 20, --quick 3)")
    ap.add_argument("--big", type=int, default=None,
                    help="episodes in flight at the replicas level (default 10000, --quick 200)")
    ap.add_argument("--big-replicas", default=None, help="environment replica counts, comma-separated (default 2,4; "
                    "--quick 2)")
    ap.add_argument("--big-s", type=float, default=None, help="seconds measured at that level once the pipeline "
                    "filled (default 30, --quick 2)")
    args = ap.parse_args(argv)
    if args.steady_s is None:
        args.steady_s = 3.0 if args.quick else 20.0
    args.big = args.big or (200 if args.quick else 10000)
    args.big_replicas = [int(x) for x in (args.big_replicas or ("2" if args.quick else "2,4")).split(",")]
    args.big_s = args.big_s or (2.0 if args.quick else 30.0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = print_machine("start")
    result = asyncio.run(_main(args))
    end = print_machine("end")
    emit_json({"suite": "envs", **result, "goal": "generator_busy_fraction >= 0.9",
               "goal_met": result["generator_busy_fraction"] >= 0.9,
               "machine": {**start, "loadavg_end": end["loadavg"]}})


if __name__ == "__main__":
    main()
