"""The agent door against the native environment path, side by side in one run: seconds per episode, and the
generator's busy fraction with 1,000 agent sessions.

    python -m forgelab.bench agent_door [--quick] [--rounds 5] [--concurrency 256] [--sessions-1k 1000] [--total-1k 3000]

One `Run` of the shipped tiny model with the door open and one `EnvActor` replica (``rollout.env: echo``, two
assistant turns of at most 8 tokens, the user saying "again" between them, reward 1.0 when done), spawned and not
started: no trainer step, no native rollout worker, the generator serves only what this benchmark sends. Both
paths play *the same task* (the same addition prompts, two turns, the same reply) and end in the same place: the
run's replay buffer, through `Rollouts` (advantages, accounting), so they do the same work but for how the turns
reach the generator.

- **native**: the rollout worker's path (`Rollouts.one` over `EnvEpisodes`): admission, then `run_groups` on the
  env actor, which plays each episode's turns against the generator directly; then rewards, advantages, buffer.
  Played at its best setting of two: one call of C episodes, or C / 64 concurrent calls of 64 (a `Run`'s
  rollout of 8 prompts x a group of 8); the faster of the two in each round is the native time.
- **door**: `Run.play_agents` with an agent written against the plain ``openai.AsyncOpenAI`` client (a new client
  per session, as the runner makes them): two chat calls (the second sends the history back, extended: stitched
  into one episode from stored ids) and a returned reward of 1.0, groups of 8 sessions per task; every call goes
  through the door's HTTP server, sessions, admission and the generator service.

``door_over_native_s_per_episode`` (goal <= 1.15 at C = 256): per round, one wave of C concurrent episodes per
path (wall time from launch to the last episode buffered or dropped, over C), the paths in alternating order;
the headline is the median over rounds of door / native, with its bootstrap interval. A round in which either
path lost an episode (a failed session, a 429) stays in and is counted (``rounds_with_failures``).
``tokens_per_episode`` (generated tokens) is given per path: the same work on both sides.

``generator_busy_1k`` (goal >= 0.9): ``--total-1k`` door sessions, ``--sessions-1k`` (C = 1,000) at once: the
runner's semaphore keeps C sessions open while sessions remain, and the window opens
when the first session has ended (the pipeline is full) and closes when the last session has started (before
the drain). Busy = (the generator's engine-step time + its intake time) / its own clock over the window, as the
``envs`` suite measures the native path (whose ``generator_busy_fraction`` at 1,000 episodes is its headline);
the native path's busy fraction over the same kind of window is reported beside it
(``native_generator_busy_1k``).

``--quick`` measures nothing: one round at C = 8 (one group: both native settings are one call of 8) and the 1k
part with 48 sessions, 16 at once (the window opens at the first end and closes at the 48th start, the native
path's window at its 2 s floor); every key of the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

from forgelab.bench._stats import bootstrap_median_ci
from forgelab.bench.common import emit_json, print_machine, print_table

if TYPE_CHECKING:
    from forgelab.run import Run

GROUP = 8
"""Sessions (episodes) per task: one GRPO group."""
PER_CALL = 64
"""Episodes per native ``run_groups`` call at the Run-like setting (8 prompts x a group of 8)."""
MAX_TOKENS = 8
REPLY = "again"


def _config(out_dir: str, concurrency: int):
    from forgelab.config.run_config import (DoorConfig, EvalConfig, PlacementConfig, RolloutConfig, RunConfig,
                                            TrackingConfig, TrainConfig)

    sessions = max(1024, 2 * concurrency)
    return RunConfig(
        name="door", rollout=RolloutConfig(task="addition", env="echo", env_kwargs={"turns": 2, "reply": REPLY},
                                           max_turns=2, group_size=GROUP, prompts_per_rollout=1,
                                           max_tokens=MAX_TOKENS, temperature=1.0),
        # admission for every episode of the benchmark: nothing trains, so buffered episodes keep their slots
        train=TrainConfig(steps=1, batch_size=1024, max_policy_age=400, warmup_steps=0, seed=0),
        eval=EvalConfig(every=0, n=4), placement=PlacementConfig(reference=False, env_max_concurrent=4096),
        tracking=TrackingConfig(out_dir=out_dir, wandb=False),
        door=DoorConfig(enabled=True, group_size=GROUP, max_sessions=sessions, max_concurrent_calls=sessions,
                        idle_timeout_s=600.0)).validate()


async def _gen_stats(run: Run) -> Any:
    return (await run.generators.engine_stats())[0]


def _busy(s0, s1) -> float:
    """Engine steps + intake over the generator's own clock between two reads."""
    return ((s1.busy_time_s - s0.busy_time_s) + (s1.intake_time_s - s0.intake_time_s)) / max(1e-9, s1.clock_s - s0.clock_s)


class Native:
    """The rollout worker's path, driven here: admit, `Rollouts.one` (env actor episodes), release."""

    def __init__(self, run: Run):
        self.run = run

    async def call(self, prompts: int) -> None:
        r = self.run.rollout
        buf = self.run.buffer
        r.config.rollout.prompts_per_rollout = prompts  # `Rollouts.admit` reads it per call
        n = prompts * GROUP
        if not buf.admit(n, first_id=r.next_episode_id):
            raise RuntimeError("agent_door bench: the buffer refused admission (raise train.max_policy_age)")
        admitted = r.admit()
        try:
            await r.one(admitted)
        finally:
            buf.release(n, first_id=admitted.first_episode)

    async def wave(self, c: int, per_call: int) -> float:
        """C episodes at once as calls of ``per_call`` episodes; wall seconds."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self.call(per_call // GROUP) for _ in range(c // per_call)))
        return time.perf_counter() - t0


def _agent(model: str):
    async def agent(client, task: str) -> float:
        m = [{"role": "user", "content": task}]
        r = await client.chat.completions.create(model=model, messages=m, max_tokens=MAX_TOKENS, temperature=1.0)
        m += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": REPLY}]
        await client.chat.completions.create(model=model, messages=m, max_tokens=MAX_TOKENS, temperature=1.0)
        return 1.0

    return agent


def _tasks(run: Run, k: int) -> list[str]:
    from forgelab.envs.base import task_prompt

    return [task_prompt(p) for p in run.rollout.stream.next(k)]


async def _door_wave(run: Run, c: int, timeout_s: float) -> tuple[float, Any]:
    t0 = time.perf_counter()
    report = await run.play_agents(_agent(run.door.model_name), _tasks(run, c // GROUP), group_size=GROUP,
                                   concurrency=c, timeout_s=timeout_s)
    return time.perf_counter() - t0, report


def _gen_tokens(run: Run, first_id: int) -> list[int]:
    """Generated tokens of the episodes with id >= first_id still readable (buffered)."""
    return [sum(ep.loss_mask) if ep.loss_mask is not None else len(ep.completion_ids)
            for ep in run.buffer.buffered() if ep.id >= first_id]


async def _steady_door(run: Run, sessions: int, total: int, timeout_s: float) -> dict:
    """``total`` door sessions, ``sessions`` at once (module docstring): busy over the steady window."""
    started = 0
    marks: dict[str, Any] = {}
    opened, closing = asyncio.Event(), asyncio.Event()
    inner = _agent(run.door.model_name)

    async def agent(client, task):
        nonlocal started
        started += 1
        if started >= total:
            closing.set()  # the last session started: the drain begins
        try:
            return await inner(client, task)
        finally:
            opened.set()  # a session ended: the pipeline is full

    async def monitor():
        await opened.wait()
        marks["t0"], marks["s0"] = time.perf_counter(), await _gen_stats(run)
        await closing.wait()
        marks["t1"], marks["s1"] = time.perf_counter(), await _gen_stats(run)

    mon = asyncio.ensure_future(monitor())
    t_start = time.perf_counter()
    report = await run.play_agents(agent, _tasks(run, total // GROUP), group_size=GROUP, concurrency=sessions,
                                   timeout_s=timeout_s)
    wall = time.perf_counter() - t_start
    await asyncio.wait_for(mon, 60)
    return {"busy": round(_busy(marks["s0"], marks["s1"]), 3), "window_s": round(marks["t1"] - marks["t0"], 1),
            "sessions": total, "wall_s": round(wall, 1), "failed": report.failed, "errors": report.errors[:3],
            "episodes_per_s": round(report.rewarded / wall, 1)}


async def _steady_native(run: Run, c: int, seconds: float) -> dict:
    """About ``c`` native episodes in flight (calls of `PER_CALL`, a new one when one returns) for ``seconds``
    after the first returned: busy over that window."""
    native = Native(run)
    n_calls = max(1, c // PER_CALL)
    window: dict[str, Any] = {}
    t_end: float | None = None
    episodes = 0
    running = {asyncio.ensure_future(native.call(PER_CALL // GROUP)) for _ in range(n_calls)}
    while True:
        finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for f in finished:
            f.result()
        if "s0" not in window:
            window["t0"], window["s0"] = time.perf_counter(), await _gen_stats(run)
            t_end = window["t0"] + seconds
        else:
            episodes += len(finished) * PER_CALL
        if t_end is not None and time.perf_counter() >= t_end:
            window["t1"], window["s1"] = time.perf_counter(), await _gen_stats(run)
            break
        running |= {asyncio.ensure_future(native.call(PER_CALL // GROUP)) for _ in finished}
    await asyncio.gather(*running)
    return {"busy": round(_busy(window["s0"], window["s1"]), 3),
            "window_s": round(window["t1"] - window["t0"], 1),
            "episodes_per_s": round(episodes / max(1e-9, window["t1"] - window["t0"]), 1)}


async def _main(args, out_dir: str) -> dict:
    from forgelab.run import Run

    run = Run(_config(out_dir, max(args.concurrency, args.sessions_1k)))
    await run.spawn()
    native = Native(run)
    rounds: list[dict] = []
    try:
        await native.wave(GROUP * 2, GROUP)  # warm both paths (not measured)
        await _door_wave(run, GROUP * 2, args.timeout)
        c = args.concurrency
        settings = {"one_call": c, "calls_of_64": min(PER_CALL, c)}
        for i in range(args.rounds):
            row: dict[str, Any] = {"round": i}
            order = ("native", "door") if i % 2 == 0 else ("door", "native")
            for side in order:
                first = run.rollout.next_episode_id
                if side == "native":
                    row["native_by_setting"] = {}
                    for name, per_call in settings.items():
                        row["native_by_setting"][name] = round(await native.wave(c, per_call) / c, 5)
                    row["native_s_per_episode"] = min(row["native_by_setting"].values())
                    row["native_tokens"] = _gen_tokens(run, first)
                else:
                    wall, report = await _door_wave(run, c, args.timeout)
                    row["door_s_per_episode"] = round(wall / c, 5)
                    row["door_failed"] = report.failed
                    row["door_tokens"] = _gen_tokens(run, first)
            row["ratio"] = round(row["door_s_per_episode"] / row["native_s_per_episode"], 3)
            row["native_tokens_per_episode"] = round(statistics.mean(row.pop("native_tokens") or [0]), 2)
            row["door_tokens_per_episode"] = round(statistics.mean(row.pop("door_tokens") or [0]), 2)
            rounds.append(row)
            print(f"  round {i}: {row}", flush=True)
        door_1k = await _steady_door(run, args.sessions_1k, args.total_1k, args.timeout)
        print(f"  door at {args.sessions_1k} sessions: {door_1k}", flush=True)
        native_1k = await _steady_native(run, args.sessions_1k, max(2.0, door_1k["window_s"]))
        print(f"  native at {args.sessions_1k} episodes: {native_1k}", flush=True)
        acct = run.buffer.check_accounting()
        counters = run.door.counters()
    finally:
        await run.shutdown()
    return {"rounds": rounds, "door_1k": door_1k, "native_1k": native_1k, "accounting": dict(acct),
            "counters": counters}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench agent_door", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: one round at C=8; 48 sessions, 16 at once")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--sessions-1k", type=int, default=1000)
    ap.add_argument("--total-1k", type=int, default=3000, help="door sessions played at --sessions-1k at once")
    ap.add_argument("--timeout", type=float, default=300.0, help="an agent session's timeout_s")
    args = ap.parse_args(argv or [])
    if args.quick:
        args.rounds, args.concurrency, args.sessions_1k, args.total_1k = 1, GROUP, 16, 48
    if args.concurrency % PER_CALL and args.concurrency > PER_CALL or args.concurrency % GROUP:
        ap.error(f"--concurrency must be a multiple of {GROUP} (and of {PER_CALL} above it)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"agent_door: door (openai SDK agents, 2 turns) vs native (env actor, echo env, 2 turns), C = "
          f"{args.concurrency}, {args.rounds} round(s); generator busy at {args.sessions_1k} sessions for "
          f"{args.total_1k} sessions", flush=True)
    with tempfile.TemporaryDirectory(prefix="forgelab-agent-door-") as out_dir:
        res = asyncio.run(_main(args, out_dir))
    end = print_machine("end")
    rounds = res["rounds"]
    print_table(rounds, ["round", "native_s_per_episode", "door_s_per_episode", "ratio", "door_failed",
                         "native_tokens_per_episode", "door_tokens_per_episode"])
    ratios = [r["ratio"] for r in rounds]
    ratio = round(statistics.median(ratios), 3) if ratios else None
    busy = res["door_1k"]["busy"]
    acct = res["accounting"]
    result = {
        "suite": "agent_door",
        "quick": args.quick,
        "concurrency": args.concurrency,
        "door_over_native_s_per_episode": ratio,
        "ci95": bootstrap_median_ci(ratios),
        "round_ratios": ratios,
        "native_s_per_episode": [r["native_s_per_episode"] for r in rounds],
        "native_by_setting": [r["native_by_setting"] for r in rounds],
        "door_s_per_episode": [r["door_s_per_episode"] for r in rounds],
        "tokens_per_episode": {"native": [r["native_tokens_per_episode"] for r in rounds],
                               "door": [r["door_tokens_per_episode"] for r in rounds]},
        "rounds_with_failures": sum(r["door_failed"] > 0 for r in rounds),
        "generator_busy_1k": busy,
        "sessions_1k": args.sessions_1k,
        "door_1k": res["door_1k"],
        "native_generator_busy_1k": res["native_1k"]["busy"],
        "native_1k": res["native_1k"],
        "accounting_holds": acct["generated"] == acct["trained"] + acct["evicted"] + acct["dropped"]
        + acct["buffered"] + acct["in_flight"],
        "agent_counters": {k: v for k, v in res["counters"].items() if k in (
            "agent/sessions", "agent/calls", "agent/retokenized_segments", "agent/failed_sessions", "agent/busy")},
        "goal": "door_over_native_s_per_episode <= 1.15 at 256 sessions; generator_busy_1k >= 0.9",
        "goals_met": {"door_over_native_s_per_episode": None if ratio is None else ratio <= 1.15,
                      "generator_busy_1k": None if busy is None or math.isnan(busy) else busy >= 0.9},
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main()
