"""Learning through the agent door: the tutorial's agent (plain openai SDK + the MCP calculator) against the native
tool environment, same steps and seeds, held-out accuracy before and after.

    python -m forgelab.bench agent_lift [--quick] [--steps 40] [--seeds 1] [--eval-n 200]

Two arms per seed, one after the other in this process, each a full `Run` of GRPO from `tiny-llama-tool` on the
``multistep`` task with `tests/test_tool_warmstart.py`'s configuration (batch 64 = 8 problems x 8 samples, lr 1e-4,
staleness 1, 24 tokens a turn, 3 turns; ``train.seed`` the seed):

- ``native``: ``rollout.env: calculator``: the run's rollout workers play `CalculatorToolEnv` episodes (the env
  actor calls the generator; the env runs the calculator and scores the last turn).
- ``door``: no native rollouts (``rollout.concurrency: 0``, ``door.enabled``): `calculator_agent`, an ``async def``
  written against a plain ``openai.AsyncOpenAI`` client pointed at the run's door, whose tools are the shipped
  calculator served by a real MCP server (`forgelab.envs.McpTools`, in-process), played as the run's rollouts by
  `Run.play_agents` (each play: the next 8 problems of the run's own problem stream, 8 sessions each, one GRPO
  group per problem). Its reward is `calculator_reward`: the environment's (correct + partial credit + tool
  bonus), computed by the agent from the final message.

Held-out accuracy is measured the same way in both arms: `Run.evaluate` (greedy; each of the run's ``--eval-n``
held-out problems played as one `CalculatorToolEnv` episode, scored by the task's exact answer) before the first
step and after the last. Beside it, ``agent_heldout``: the same problems answered by the agent itself through the
door at temperature 0 (calls without a session: served, not recorded), in both arms (the native arm opens the door
only for this). The lifts are after - before in points (100 x accuracy).

What a door play is: `drive_agents` waits until the run admits a whole play (the evaluation gate is open and the
buffer's staleness bound leaves room for 64 episodes), then plays it; so the door arm overlaps one play with one
train step, as a native run with ``max_policy_age: 1`` does (the native arm's two rollout workers keep up to two
plays in flight). No play starts once the buffer holds enough episodes for every step; a session refused all
the same (the run ending under it) fails as ``agent_error`` and is counted (``failed``), never trained.

``--quick`` proves the code path and measures nothing: each arm 2 steps of 2 problems x 4 samples, 4 held-out
problems, both arms on one `ProcessPool` (the same engine key: the native arm spawns the processes, the door
arm re-initialises them; the full mode gives each arm new processes). Last line: JSON with ``door_lift_points``
(goal >= 15), ``native_lift_points``, ``door_minus_native_points`` (goal: |.| <= 5), per-seed accuracies and the
wall seconds of each arm.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

from forgelab.bench.common import emit_json, print_machine, print_table

if TYPE_CHECKING:
    from forgelab.run import Run

ARMS = ("native", "door")


# -- the agent (the tutorial's, tutorials/14_agents.ipynb) ---------------------------------------------------------

def calculator_reward(text: str | None, target: str, good_call: bool, *, tool_bonus: float = 0.1,
                      closeness: float = 0.5) -> float:
    """`CalculatorToolEnv`'s reward for a final message: 1 for the exact integer answer, plus ``tool_bonus`` when a
    well-formed calculator call came before it; a wrong integer earns ``closeness * max(0, 1 - |a - t| / 10)``;
    anything else (no integer, a tool call in the last turn: ``text`` None) 0.

    >>> calculator_reward("36", "36", True), calculator_reward(" 36", "36", False), calculator_reward("34", "36", True)
    (1.1, 1.0, 0.4)
    >>> calculator_reward(None, "36", True), calculator_reward("about 36", "36", False)
    (0.0, 0.0)
    """
    from forgelab.data.tasks import extract_integer_answer

    answer = extract_integer_answer(text or "")
    if answer is None:
        return 0.0
    if answer == target:
        return 1.0 + (tool_bonus if good_call else 0.0)
    return closeness * max(0.0, 1.0 - abs(int(answer) - int(target)) / 10)


async def calculator_agent(client: Any, problem: Any, *, model: str, temperature: float = 1.0, max_tokens: int = 24,
                           max_turns: int = 3, max_calls: int = 2) -> float:
    """The tutorial's agent: the problem as a user message, at most ``max_turns`` chat calls through ``client`` (a
    plain ``openai.AsyncOpenAI``) with the MCP calculator's tools; each tool call the policy makes (at most
    ``max_calls``) runs on the MCP server and its result goes back as a ``tool`` message. Returns
    `calculator_reward` of the final message (the protocol and reward of `CalculatorToolEnv`)."""
    from forgelab.envs import McpTools, calculator_server

    messages: list[Any] = [{"role": "user", "content": problem.prompt}]
    calls, good_call, answer = 0, False, None
    async with McpTools(calculator_server()) as mcp:
        for _ in range(max_turns):
            r = await client.chat.completions.create(model=model, messages=messages, tools=mcp.openai,
                                                     temperature=temperature, max_tokens=max_tokens)
            msg = r.choices[0].message
            if not msg.tool_calls or calls >= max_calls:
                answer = msg.content
                break
            calls += 1
            results = [await mcp.call(c) for c in msg.tool_calls]
            good_call = good_call or any(res["content"] != "error" for res in results)
            messages += [msg.model_dump(exclude_none=True), *results]
    return calculator_reward(answer, problem.target, good_call)


# -- the arms ----------------------------------------------------------------------------------------------------

def arm_config(arm: str, *, steps: int, seed: int, eval_n: int, out_dir: str, prompts: int = 8, group: int = 8) -> Any:
    """The `RunConfig` of one arm (``"native"`` or ``"door"``): `tests/test_tool_warmstart.py`'s GRPO run."""
    from forgelab.config.run_config import (DoorConfig, EvalConfig, ModelConfig, PlacementConfig, RolloutConfig,
                                            RunConfig, TrackingConfig, TrainConfig)
    from forgelab.recipes.tool_warmstart import TOOL_WARMSTART

    if arm not in ARMS:
        raise ValueError(f"agent_lift: unknown arm {arm!r}; one of {ARMS}")
    return RunConfig(
        name=f"lift-{arm}-{seed}", model=ModelConfig(path=TOOL_WARMSTART),
        rollout=RolloutConfig(task="multistep", env="calculator", group_size=group, prompts_per_rollout=prompts,
                              concurrency=2 if arm == "native" else 0, max_tokens=24, max_turns=3),
        train=TrainConfig(steps=steps, batch_size=prompts * group, lr=1e-4, warmup_steps=min(2, steps - 1),
                          max_policy_age=1, seed=seed),
        eval=EvalConfig(every=0, n=eval_n), placement=PlacementConfig(reference=False),
        tracking=TrackingConfig(out_dir=out_dir, wandb=False),
        door=DoorConfig(enabled=True, group_size=group, max_sessions=4 * prompts * group),
    ).validate()


async def agent_heldout(run: Run, problems: list[Any], concurrency: int = 64) -> float:
    """The agent's greedy accuracy on ``problems`` through the run's door (no session: served, not recorded)."""
    import openai

    # the SDK's retries: an unrecorded call is safe to repeat (a pooled keep-alive connection the server closed
    # under load is a connection error the SDK retries)
    client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=run.door_key)
    slots = asyncio.Semaphore(concurrency)

    async def one(p: Any) -> float:
        async with slots:
            reward = await calculator_agent(client, p, model=run.door.model_name, temperature=0.0)
            return 1.0 if reward >= 1.0 else 0.0

    try:
        return statistics.fmean(await asyncio.gather(*(one(p) for p in problems)))
    finally:
        await client.close()


async def drive_agents(run: Run, *, prompts: int, group: int, timeout_s: float = 300.0) -> list[Any]:
    """Play `calculator_agent` as the run's rollouts until the run ends: each play the run's next ``prompts``
    problems x ``group`` sessions, started once the run admits all of them (see the module docstring)."""
    agent = _bound_agent(run.door.model_name)
    n = prompts * group

    def ready(r: Run) -> bool:
        return bool(r.accuracy_history) and r.gate.may_admit() and r.buffer.may_admit(n)

    reports = []
    while run.main_task is not None and not run.main_task.done():
        c = run.buffer.check_accounting()
        if c["trained"] + c["buffered"] + c["in_flight"] >= run.config.train.steps * run.config.train.batch_size:
            break  # enough episodes for every step: a play more would be cut off by the run's end
        try:
            await run.until(predicate=ready, timeout=5.0)  # woken by steps, events and closed episodes
        except asyncio.TimeoutError:
            continue  # re-check (a weight push may not wake the waiter)
        except RuntimeError:
            break  # the run ended
        reports.append(await run.play_agents(agent, run.stream.next(prompts), group_size=group, concurrency=n,
                                             timeout_s=timeout_s))
    return reports


def _bound_agent(model: str) -> Any:
    async def agent(client: Any, problem: Any) -> float:
        return await calculator_agent(client, problem, model=model)

    return agent


async def run_arm(cfg: Any, spawn: Any = None) -> dict[str, Any]:
    """One arm: held-out accuracy (`Run.evaluate`, and the agent's) before step 1 and after the last step.
    ``spawn``: a `ProcessPool` to take the processes from (``--quick``), or None for new ones."""
    from forgelab.run import Run

    t0 = time.perf_counter()
    run = Run(cfg, spawn=spawn)
    out: dict[str, Any] = {}
    try:
        await run.spawn()
        out["agent_before"] = await agent_heldout(run, list(run.heldout))
        t1 = time.perf_counter()
        await run.start()
        reports = []
        if cfg.rollout.concurrency == 0:
            reports = await drive_agents(run, prompts=cfg.rollout.prompts_per_rollout, group=cfg.rollout.group_size)
        await run.wait()
        out["train_s"] = time.perf_counter() - t1
        out["agent_after"] = await agent_heldout(run, list(run.heldout))
        if run.state != "finished":
            raise RuntimeError(f"{cfg.name}: the run ended {run.state}: {run.message}")
        (s0, before), (s1, after) = run.accuracy_history[0], run.accuracy_history[-1]
        df = run.metrics
        out.update(before=before, after=after, steps=int(s1), reward_first10=float(df["reward_mean"].iloc[:10].mean()),
                   reward_last10=float(df["reward_mean"].iloc[-10:].mean()))
        # token truth and staleness, to tell the arms' training apart (means over the run's steps)
        out["train_means"] = {k: round(float(df[k].mean()), 5) for k in (
            "mismatch/abs_mean", "mismatch/max", "clip_frac", "policy_age_mean", "policy_age_max", "loss",
            "completion_len") if k in df.columns}
        if reports:
            out.update(sessions=sum(r.rewarded + r.failed for r in reports), failed=sum(r.failed for r in reports),
                       errors=sorted({e.split(": ", 1)[-1][:120] for r in reports for e in r.errors})[:5],
                       retokenized_segments=run.door.counters()["agent/retokenized_segments"])
        c = run.buffer.check_accounting()
        out["accounting_holds"] = c["generated"] == (c["trained"] + c["evicted"] + c["dropped"] + c["buffered"]
                                                     + c["in_flight"])
    finally:
        await run.shutdown()
    out["wall_s"] = time.perf_counter() - t0
    return out


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median lifts over seeds, in points, and the door's minus the native's.

    >>> s = summarise({"native": [{"before": 0.1, "after": 0.7, "agent_before": 0.1, "agent_after": 0.72}],
    ...                "door": [{"before": 0.1, "after": 0.66, "agent_before": 0.12, "agent_after": 0.7}]})
    >>> s["native_lift_points"], s["door_lift_points"], s["door_minus_native_points"]
    (60.0, 56.0, -4.0)
    """
    out: dict[str, Any] = {}
    for arm, rs in results.items():
        out[f"{arm}_lift_points"] = round(statistics.median(100 * (r["after"] - r["before"]) for r in rs), 2)
        out[f"{arm}_agent_lift_points"] = round(statistics.median(100 * (r["agent_after"] - r["agent_before"])
                                                                  for r in rs), 2)
    out["door_minus_native_points"] = round(out["door_lift_points"] - out["native_lift_points"], 2)
    return out


async def _pooled_arms(cfgs: list[Any]) -> list[dict[str, Any]]:
    """`run_arm` of each config in turn on one `ProcessPool` (``--quick``: both arms have the same engine key, so
    the first spawns the processes and the next re-initialises them)."""
    from forgelab.engines.pool import ProcessPool

    pool = ProcessPool()
    try:
        out = [await run_arm(cfg, spawn=pool) for cfg in cfgs]
        if pool.spawned != 1:
            raise RuntimeError(f"agent_lift --quick: the arms spawned {pool.spawned} process sets, not 1 "
                               f"({pool.last_note})")
        return out
    finally:
        await pool.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench agent_lift", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 steps of 2 x 4 episodes per arm, 4 held-out problems, one process pool")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=1, help="train.seed 0 .. seeds-1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated: native,door")
    a = ap.parse_args(argv)
    prompts, group = (2, 4) if a.quick else (8, 8)
    if a.quick:
        a.steps, a.eval_n, a.seeds = 2, 4, 1
    arms = [x for x in a.arms.split(",") if x]
    machine = print_machine("start")
    work = tempfile.mkdtemp(prefix="forgelab-agent-lift-")
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        plan = [(seed, arm, arm_config(arm, steps=a.steps, seed=seed, eval_n=a.eval_n, out_dir=work, prompts=prompts,
                                       group=group))
                for seed in range(a.first_seed, a.first_seed + a.seeds) for arm in arms]
        if a.quick:  # one set of processes for both arms: the spawn is fixed cost, not what quick checks
            pooled = asyncio.run(_pooled_arms([cfg for _, _, cfg in plan]))
        for i, (seed, arm, cfg) in enumerate(plan):
            r = pooled[i] if a.quick else asyncio.run(run_arm(cfg))
            r["seed"] = seed
            results[arm].append(r)
            print(f"{arm} seed {seed}: held-out {r['before']:.3f} -> {r['after']:.3f} (agent {r['agent_before']:.3f}"
                  f" -> {r['agent_after']:.3f}); rollout reward {r['reward_first10']:.3f} -> {r['reward_last10']:.3f};"
                  f" {r['wall_s']:.0f} s" + (f"; {r['failed']} of {r['sessions']} sessions failed"
                                              if "sessions" in r else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [{"arm": arm, "seed": r["seed"], "before": r["before"], "after": r["after"],
             "lift_points": 100 * (r["after"] - r["before"]), "agent_before": r["agent_before"],
             "agent_after": r["agent_after"], "wall_s": r["wall_s"]} for arm, rs in results.items() for r in rs]
    print_table(rows, ["arm", "seed", "before", "after", "lift_points", "agent_before", "agent_after", "wall_s"])
    s = summarise(results) if set(results) == set(ARMS) else {}
    if s:
        print(f"lift: door {s['door_lift_points']:+.1f} points (goal >= 15), native {s['native_lift_points']:+.1f}; "
              f"door - native {s['door_minus_native_points']:+.1f} (goal within 5)", flush=True)
    nan = math.nan
    emit_json({"suite": "agent_lift", "door_lift_points": s.get("door_lift_points", nan),
               "native_lift_points": s.get("native_lift_points", nan),
               "door_minus_native_points": s.get("door_minus_native_points", nan),
               "agent_lift_points": {arm: s.get(f"{arm}_agent_lift_points", nan) for arm in arms},
               "steps": a.steps, "seeds": a.seeds, "eval_n": a.eval_n, "quick": a.quick,
               "per_seed": {arm: [{k: v for k, v in r.items()} for r in rs] for arm, rs in results.items()},
               "machine": {"start": machine, "end": print_machine("end")}})
    return results


if __name__ == "__main__":
    main()
