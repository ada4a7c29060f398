"""Tools through the agent door, and the agent runner: one module-scoped run of the shipped tool model
(`tiny-llama-tool`, the ``calc`` dialect) with the door and no native rollouts (``rollout.concurrency: 0``).

(d) ``tool_calls`` round-trip through the calculator dialect (the SDK's tool call, the tool message, the stitched
episode whose tool turn is the native `CalculatorToolEnv` turn's tokens, masked), and through the real MCP
calculator server (mcp 2.3, in-process and stdio, with the real mcp client); (e) an agent that raises is a failed
episode with its traceback in the rollout log and an event, one that hangs is cut at its timeout, and the
accounting identity holds; the runner's sessions train one GRPO step.
The pure dialect functions are tested without processes at the end of this file (and in the module's doctests).
"""
from __future__ import annotations

import asyncio
import json
import os

import pytest
from door_clients import door_client

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "integer arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tool_run(loop, tmp_path_factory):
    from forgelab.config.run_config import (DoorConfig, EvalConfig, ModelConfig, PlacementConfig, RolloutConfig,
                                            RunConfig, TrackingConfig, TrainConfig)
    from forgelab.recipes.tool_warmstart import TOOL_WARMSTART
    from forgelab.run import Run

    cfg = RunConfig(name="tools", model=ModelConfig(path=TOOL_WARMSTART),
                    rollout=RolloutConfig(task="multistep", group_size=2, prompts_per_rollout=1, max_tokens=24,
                                          concurrency=0),  # the door alone: no native rollouts
                    train=TrainConfig(steps=1, batch_size=4, max_policy_age=8, warmup_steps=0, seed=0),
                    eval=EvalConfig(every=0, n=2), placement=PlacementConfig(reference=False),
                    tracking=TrackingConfig(out_dir=str(tmp_path_factory.mktemp("tools")), wandb=False),
                    door=DoorConfig(enabled=True, group_size=2, max_n=8))
    run = Run(cfg)
    loop.run_until_complete(run.spawn())
    yield run
    loop.run_until_complete(run.shutdown())


async def _calling_seed(run, messages, tools):
    """A seed whose first choice is a tool call (the model calls on ~30 % of samples), found with unrecorded calls."""
    client = door_client(run)
    for seed in range(64):
        r = await client.chat.completions.create(model="tools", messages=messages, tools=tools, seed=seed,
                                                 max_tokens=24)
        if r.choices[0].message.tool_calls:
            return seed
    raise AssertionError("tiny-llama-tool made no tool call in 64 seeded samples")


async def _call_then_answer(run, session, messages, tools, run_tool):
    """Two turns in ``session``: a call the model makes (a seed found first), the tool's result, its answer."""
    seed = await _calling_seed(run, messages, tools)
    client = door_client(run, session)
    r1 = await client.chat.completions.create(model="tools", messages=messages, tools=tools, seed=seed, max_tokens=24)
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    messages = messages + [msg.model_dump(exclude_none=True)] + [await run_tool(c) for c in msg.tool_calls]
    r2 = await client.chat.completions.create(model="tools", messages=messages, tools=tools, seed=seed, max_tokens=24)
    return r1, r2


def _check_stitched(run, session, r1, r2, result):
    """The session's one episode: call (generated), the native tool turn (masked), the answer (generated)."""
    from forgelab.envs import ChatFormat

    ep, = run.door.sessions.export(session)
    (s0, e0, a0), (s1, e1, a1), (s2, e2, a2) = ep.info["turns"]
    assert (a0, a1, a2) == ("assistant", "tool", "assistant")
    assert ep.completion_ids[s0:e0] == r1.choices[0].token_ids and ep.completion_ids[s2:e2] == r2.choices[0].token_ids
    tool_turn = ChatFormat(run.tokenizer).turn_ids("tool", f"<result>{result}</result>")  # the native env's turn
    assert ep.completion_ids[s1:e1] == tool_turn and ep.loss_mask[s1:e1] == [0] * len(tool_turn)
    assert ep.loss_mask[s0:e0] == [1] * (e0 - s0) and ep.loss_mask[s2:e2] == [1] * (e2 - s2)
    # the second call's prompt is the stored ids continued (no re-rendering of the sampled call)
    assert r2.model_extra["prompt_token_ids"] == ep.prompt_ids + ep.completion_ids[:e1]


@pytest.mark.integration
def test_tool_calls_round_trip_through_the_calc_dialect(tool_run, loop):
    """(d) The model's ``<calc>`` text is an SDK tool call; the tool message becomes ``<result>..</result>``."""
    from forgelab.envs.builtin import safe_calc

    run = tool_run
    before = run.door.counters()["agent/retokenized_segments"]

    async def run_tool(call):
        args = json.loads(call.function.arguments)
        assert call.function.name == "calculator" and set(args) == {"expression"}
        return {"role": "tool", "tool_call_id": call.id, "content": str(safe_calc(args["expression"]))}

    async def body():
        return await _call_then_answer(run, "calc", [{"role": "user", "content": "(7+5)*3="}], [CALCULATOR], run_tool)

    r1, r2 = loop.run_until_complete(body())
    call = r1.choices[0].message.tool_calls[0]
    expr = json.loads(call.function.arguments)["expression"]
    assert run.tokenizer.decode(r1.choices[0].token_ids, skip_special_tokens=True) == f"<calc>{expr}</calc>"
    _check_stitched(run, "calc", r1, r2, safe_calc(expr))
    assert run.door.counters()["agent/retokenized_segments"] == before


@pytest.mark.integration
def test_streamed_tool_calls_parse_as_the_sdk_reads_them(tool_run, loop):
    """``stream`` with ``tools``: the SDK's own stream accumulator (`ChatCompletionStreamState`) rebuilds the
    non-streamed call's tool call (name, arguments, finish_reason) from the deltas, with the same token ids; a
    ``tool_choice`` the door cannot honour (a named function, "required") is a 400 naming it."""
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    run = tool_run
    messages = [{"role": "user", "content": "(7+5)*3="}]

    async def body():
        seed = await _calling_seed(run, messages, [CALCULATOR])
        client = door_client(run)
        plain = await client.chat.completions.create(model="tools", messages=messages, tools=[CALCULATOR], seed=seed,
                                                     max_tokens=24)
        state, ids = ChatCompletionStreamState(), []
        async for chunk in await client.chat.completions.create(model="tools", messages=messages, tools=[CALCULATOR],
                                                                seed=seed, max_tokens=24, stream=True):
            state.handle_chunk(chunk)
            ids += [t for ch in chunk.choices for t in (ch.model_extra or {}).get("token_ids") or []]
        refused = []
        for choice in ({"type": "function", "function": {"name": "calculator"}}, "required"):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="tools", messages=messages, tools=[CALCULATOR],
                                                     tool_choice=choice, max_tokens=4)
            refused.append(str(e.value))
        return plain, state.get_final_completion(), ids, refused

    plain, streamed, ids, refused = loop.run_until_complete(body())
    want, got = plain.choices[0], streamed.choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls" and ids == want.token_ids
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in want.message.tool_calls]
    assert all("tool_choice" in r for r in refused)


@pytest.mark.integration
def test_tool_calls_round_trip_through_the_mcp_calculator(tool_run, loop):
    """(d) The shipped calculator as a real MCP server (in-process, then stdio): its tools are the request's
    ``tools``, the policy's calls run on it through the mcp client, and the episodes stitch as in the dialect."""
    from forgelab.envs.mcp_tools import McpTools, calculator, calculator_server, calculator_stdio

    run = tool_run

    async def body():
        out = []
        for name, server in (("mcp-inproc", calculator_server()), ("mcp-stdio", calculator_stdio())):
            async with McpTools(server) as mcp:
                assert [t["function"]["name"] for t in mcp.openai] == ["calculator"]
                r1, r2 = await _call_then_answer(run, name, [{"role": "user", "content": "12*7="}], mcp.openai,
                                                 mcp.call)
                out.append((name, r1, r2))
        return out

    for name, r1, r2 in loop.run_until_complete(body()):
        expr = json.loads(r1.choices[0].message.tool_calls[0].function.arguments)["expression"]
        _check_stitched(run, name, r1, r2, calculator(expr))


@pytest.mark.integration
def test_failing_agents_are_failed_episodes(tool_run, loop):
    """(e) An agent that raises after a call is a failed episode with its traceback (rollout log, event); one that
    raises before any call an empty failed episode; one that hangs is cut at its timeout; its group partner is
    buffered (dropped as group_too_small, as natively); the accounting identity holds."""
    from forgelab.controller.rollout_log import read_rollouts

    run = tool_run
    seen: dict[str, int] = {}

    async def agent(client, task):
        k = seen[task] = seen.get(task, 0) + 1
        if task == "early" and k == 1:
            raise ValueError("no call at all")
        await client.chat.completions.create(model="tools", messages=[{"role": "user", "content": "3+4="}],
                                             max_tokens=8, seed=k)
        if k == 1:
            raise RuntimeError(f"boom in {task}")
        return 1.0

    async def hang(client, task):
        await asyncio.Event().wait()

    async def body():
        report = await run.play_agents(agent, ["late", "early"], group_size=2, timeout_s=120)
        cut = await run.play_agents(hang, ["x"], group_size=1, timeout_s=0.2)
        return report, cut

    report, cut = loop.run_until_complete(body())
    assert (report.rewarded, report.failed, cut.failed) == (2, 2, 1)
    errors = [e for e in run.events if e["kind"] == "agent_error"]
    assert {e["reason"] for e in errors} == {"agent_error", "agent_timeout"} and len(errors) == 3
    late = next(e for e in errors if "boom in late" in e["error"])
    assert "Traceback" in late["error"] and "test_agent_tools.py" in late["error"]
    run.records.flush()
    log = read_rollouts(run.out_dir).set_index("id")
    failed = log.loc[report.failed_episodes]
    assert set(failed["status"]) == {"dropped"} and set(failed["reason"]) == {"agent_error"}
    by_error = {info["error"].splitlines()[0]: row for (_, row), info in zip(failed.iterrows(), failed["info"])}
    assert len(by_error["RuntimeError: boom in late"]["completion_ids"]) > 0  # its call's tokens are kept
    assert len(by_error["ValueError: no call at all"]["completion_ids"]) == 0
    assert set(log.loc[report.episodes, "reason"]) == {"group_too_small"}  # each partner alone in its group
    assert run.door.counters()["agent/failed_sessions"] >= 3
    c = run.buffer.check_accounting()
    assert c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]


@pytest.mark.integration
def test_agent_runner_trains_a_grpo_step(tool_run, loop):
    """The runner's sessions (plain openai SDK + the in-process MCP calculator) are the only episodes: two tasks x
    two sessions fill the batch of 4, GRPO trains one step on exactly them. Runs last: it starts the run."""
    from forgelab.envs.mcp_tools import McpTools, calculator_server

    run = tool_run
    finished: dict[str, int] = {}

    async def agent(client, task):
        messages = [{"role": "user", "content": task}]
        async with McpTools(calculator_server()) as mcp:
            for _ in range(2):
                r = await client.chat.completions.create(model="tools", messages=messages, tools=mcp.openai,
                                                         max_tokens=24)
                msg = r.choices[0].message
                if not msg.tool_calls:
                    break
                messages += [msg.model_dump(exclude_none=True)] + [await mcp.call(c) for c in msg.tool_calls]
        k = finished[task] = finished.get(task, 0) + 1
        return 1.0 if k == 1 else 0.0  # the first session of each task to finish wins: rewards differ in a group

    async def body():
        await run.start()
        # the step-0 held-out evaluation holds rollouts (the door answers 429 meanwhile): play once it is done
        await run.until(predicate=lambda r: len(r.accuracy_history) >= 1, timeout=300)
        report = await run.play_agents(agent, ["12+34=", "(2+3)*4="], group_size=2, concurrency=4, timeout_s=120)
        await asyncio.wait_for(run.wait(), 300)
        return report

    report = loop.run_until_complete(body())
    assert (report.rewarded, report.failed) == (4, 0) and sorted(report.rewards) == [0.0, 0.0, 1.0, 1.0]
    assert run.step == 1
    assert {run.buffer.status(i) for i in report.episodes} == {"trained"}
    c = run.buffer.check_accounting()
    assert c["trained"] == 4 and c["generated"] == c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]


# -- the dialects as pure functions (no processes) ----------------------------------------------------------

def test_calc_dialect_parse_render_round_trip():
    from forgelab.serve.tools import DIALECTS, ToolCall, check_tools, tool_calls_key

    calc = DIALECTS["calc"]
    tools = check_tools([CALCULATOR], calc)
    for text in ("<calc>12*7</calc>", "let me see<calc>(7+5)*3</calc>"):
        content, calls = calc.parse(text, tools)
        assert len(calls) == 1 and calc.render_call(content, calls, tools) == text
    assert calc.parse("84", tools) == ("84", [])
    assert calc.parse("<calc>1+2</calc> 3", tools) == ("<calc>1+2</calc> 3", [])  # not ending in the call: text
    assert calc.result_message("error") == {"role": "tool", "content": "<result>error</result>"}
    spaced = ToolCall(name="calculator", arguments='{ "expression" :"1+2"}')
    assert tool_calls_key(None, [spaced]) == tool_calls_key(*calc.parse("<calc>1+2</calc>", tools))
    with pytest.raises(ValueError, match="one tool with one string parameter"):
        check_tools([CALCULATOR, {"type": "function", "function": {"name": "other"}}], calc)
    with pytest.raises(ValueError, match="one call per turn"):
        calc.render_call(None, [spaced, spaced], tools)


def test_hermes_tool_call_parse_render():
    from forgelab.serve.tools import DIALECTS, check_tools

    h = DIALECTS["hermes"]
    tools = check_tools([CALCULATOR], h)
    two = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>')
    content, calls = h.parse(two, tools)
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"expression": "1+2"}, {"expression": "3*4"}]
    assert h.render_call(content, calls, tools) == two
    assert h.parse("no call here", tools) == ("no call here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert h.parse(broken, tools) == (broken, [])  # a malformed call stays the model's text
    listing = h.system_text(tools)
    assert "<tools>" in listing and json.dumps(CALCULATOR["function"]["parameters"]) in listing
    assert h.result_message("3") == {"role": "tool", "content": "3"}


def test_tools_unsupported_features_are_named():
    from forgelab.serve.tools import DIALECTS, check_tools

    with pytest.raises(ValueError, match="only function tools"):
        check_tools([{"type": "web_search"}], DIALECTS["hermes"])
    with pytest.raises(ValueError, match="function.strict"):
        check_tools([{"type": "function", "function": {"name": "f", "strict": True}}], DIALECTS["hermes"])
    with pytest.raises(ValueError, match="no tool dialect"):
        check_tools([CALCULATOR], None)


def test_messages_with_tool_calls_render_in_the_dialect():
    """An SDK assistant tool-call message and a tool message render as the dialect's text; a continuation matches
    the sampled choice by its calls, even when the agent re-spaced the JSON."""
    from forgelab.algos.agent_episodes import Call, Choice, start_segment
    from forgelab.data.tokenizer import build_tokenizer
    from forgelab.serve.chat import ChatRenderer, normalize_messages
    from forgelab.serve.tools import DIALECTS, check_tools, tool_calls_key

    calc = DIALECTS["calc"]
    tools = check_tools([CALCULATOR], calc)
    said = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"2*3"}'}}]}
    m = normalize_messages([{"role": "user", "content": "2*3="}, said,
                            {"role": "tool", "tool_call_id": "call_1", "content": "6"}], calc, tools)
    assert [x["content"] for x in m] == ["2*3=", "<calc>2*3</calc>", "<result>6</result>"]
    r = ChatRenderer(build_tokenizer())
    first = r.prompt_ids(m[:1])
    sampled = r.encode("<calc>2*3</calc>") + [r.eos_id]
    seg = start_segment(Call(prompt_ids=first, choices=[Choice(completion_ids=sampled, logprobs=[0.0] * len(sampled),
                                                               version=0, text="<calc>2*3</calc>")]))
    ids, k, role = r.continuation(m[:1], seg, m, lambda text: tool_calls_key(*calc.parse(text, tools)))
    assert (k, role) == (0, "tool") and ids == r.prompt_ids(m)
    with pytest.raises(ValueError, match="tool_calls"):
        normalize_messages([said])  # no tools: named


def test_runner_groups_failures_and_timeouts_over_fakes():
    """`AgentRunner` over in-process sessions and a fake client (no processes): G sessions per task share its group;
    a raise, a timeout, a non-finite reward and a reward with no call are failed sessions (dropped, event with the
    traceback), counted toward their group, which is then closed without them."""
    from forgelab.algos.agent_episodes import Call, Choice
    from forgelab.controller.agent_runner import AgentRunner
    from forgelab.controller.agent_sessions import AgentSessions, DoorLimits

    class Sink:
        def __init__(self):
            self.next, self.closed, self.dropped = 0, [], []

        async def open(self):
            self.next += 1
            return self.next - 1

        async def close(self, groups):
            self.closed += groups

        async def discard(self, episodes, reason):
            self.dropped += [(ep.id, reason, ep.info["error"]) for ep in episodes]

        async def forget(self, episode_id):
            pass

        wait_open = open  # admission is always open here

    sink, events = Sink(), []
    sessions = AgentSessions(DoorLimits(group_size=3), sink)

    class Client:  # records one call in its session, as the door would
        def __init__(self, base_url, key):
            self.session = key.split(".", 1)[1]

        async def call(self):
            s = sessions.session(self.session)
            async with s.lock:
                k = await sessions.plan(s, [1, 2])
                sessions.record(s, k, Call(prompt_ids=[1, 2], choices=[Choice(completion_ids=[3], logprobs=[-0.1],
                                                                             version=0, text="x")]))

        async def close(self):
            pass

    async def agent(client, task):
        if task == "silent":
            return 1.0  # no call: a failed session
        await client.call()
        if task == "raise":
            raise KeyError("bad tool")
        if task == "hang":
            await asyncio.Event().wait()
        return float("nan") if task == "nan" else 0.5

    runner = AgentRunner(sessions, base_url="http://x/v1", key="tml-k", emit=lambda kind, **f: events.append((kind, f)),
                         client=Client)
    report = asyncio.run(runner.play(agent, ["ok", "raise", "hang", "nan", "silent"], group_size=2, timeout_s=0.5,
                                     task_key=str))
    assert (report.rewarded, report.failed) == (2, 8) and report.rewards == [0.5, 0.5]
    assert [len(g) for g in sink.closed] == [2]  # only "ok"'s group has episodes; the others closed empty
    reasons = sorted(r for _, r, _ in sink.dropped)
    assert reasons == ["agent_error"] * 6 + ["agent_timeout"] * 2
    assert all("Traceback" in e for _, r, e in sink.dropped if "KeyError" in e) and len(events) == 8
    assert sessions.counters()["agent/open_sessions"] == 0 and sessions.counters()["agent/open_groups"] == 0
    assert sessions.counters()["agent/failed_sessions"] == 8


def test_play_waits_for_admission_and_paces_itself_to_training():
    """`AgentRunner.play` over the run's own admission path (`RolloutSink` on a real `ReplayBuffer` and `Gate`; the
    client is a fake that records one call as the door would): with the buffer admitting 2 episodes (batch 2,
    staleness 0), of 4 sessions only 2 agents start; the others wait, not failing with the door's 429, until the
    served version moves (a training step), then run. A session still waiting when the run stops fails with
    ``run_stopped`` and its agent never runs. Without waiting, the agent's first call meets a closed admission."""
    from forgelab.algos.agent_episodes import Call, Choice
    from forgelab.controller.agent_runner import AgentRunner
    from forgelab.controller.agent_sessions import AgentSessions, DoorBusy, DoorLimits, RolloutSink
    from forgelab.controller.buffer import ReplayBuffer
    from forgelab.controller.rollout import Gate

    class Rollouts:  # what RolloutSink uses of `Rollouts`: ids, the gate, buffering played groups
        def __init__(self, buffer):
            self.gate, self.buffer, self.next, self.groups, self.dropped = Gate(), buffer, 0, 0, []

        def take_ids(self, episodes, groups=0):
            first = (self.next, self.groups)
            self.next, self.groups = self.next + episodes, self.groups + groups
            return first

        async def add_played(self, groups, failed=None):
            self.buffer.add([ep for g in groups for ep in g])

        def drop_played(self, episodes, reason):
            self.dropped += [(ep.id, reason) for ep in episodes]

    buffer = ReplayBuffer(batch_size=2, max_policy_age=0)
    rollouts = Rollouts(buffer)
    sessions = AgentSessions(DoorLimits(group_size=2), RolloutSink(rollouts, buffer))
    started = []

    class Client:
        def __init__(self, base_url, key):
            self.session = key.split(".", 1)[1]

        async def call(self):
            s = sessions.session(self.session)
            async with s.lock:
                k = await sessions.plan(s, [1, 2])  # DoorBusy (a 429) if admission were closed and nothing reserved
                sessions.record(s, k, Call(prompt_ids=[1, 2], choices=[Choice(completion_ids=[3], logprobs=[-0.1],
                                                                             version=buffer.served_version, text="x")]))

        async def close(self):
            pass

    async def agent(client, task):
        started.append((task, buffer.served_version))
        await client.call()
        return 1.0

    events = []
    runner = AgentRunner(sessions, base_url="http://x/v1", key="tml-k", emit=lambda kind, **f: events.append(kind),
                         client=Client)

    async def body():
        play = asyncio.ensure_future(runner.play(agent, ["a", "b"], group_size=2, concurrency=4, task_key=str))
        while buffer.counts()["buffered"] < 2:  # the first group is played and buffered ...
            await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        assert started == [("a", 0), ("a", 0)] and not play.done()  # ... and the second waits, not failed
        buffer.served_version = 1  # a training step was pushed: admission opens again
        await rollouts.gate.notify()
        report = await asyncio.wait_for(play, 10)
        assert (report.rewarded, report.failed) == (4, 0), report.errors
        assert started[2:] == [("b", 1), ("b", 1)]
        # a session waiting when the run stops fails as run_stopped; its agent never runs
        play = asyncio.ensure_future(runner.play(agent, ["c"], group_size=2, task_key=str))
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(started) == 4
        rollouts.gate.stopping = True
        await rollouts.gate.notify()
        report = await asyncio.wait_for(play, 10)
        assert (report.rewarded, report.failed) == (0, 2) and len(started) == 4
        assert all("run stopped before it admitted" in e for e in report.errors), report.errors
        assert sessions.counters()["agent/open_sessions"] == 0
        # without waiting, the agent starts at once and its first call meets the closed admission
        rollouts.gate.stopping = False
        report = await runner.play(agent, ["d"], group_size=1, task_key=str, wait_for_admission=False)
        assert report.failed == 1 and "DoorBusy" in report.errors[0] and started[-1] == ("d", 1)
        buffer.check_accounting()

    asyncio.run(body())
    assert DoorBusy  # the 429 the waiting spares an agent


def test_config_door_only_runs_and_dialect_names():
    """``rollout.concurrency: 0`` is a door-only run (refused without the door, named); a bad dialect is named."""
    from forgelab.config.run_config import ConfigError, DoorConfig, RolloutConfig, RunConfig
    from forgelab.data.tokenizer import build_tokenizer
    from forgelab.serve.tools import choose_dialect

    RunConfig(door=DoorConfig(enabled=True), rollout=RolloutConfig(concurrency=0)).validate()
    with pytest.raises(ConfigError, match="needs door.enabled"):
        RunConfig(rollout=RolloutConfig(concurrency=0)).validate()
    with pytest.raises(ConfigError, match="door.tool_dialect"):
        RunConfig(door=DoorConfig(enabled=True, tool_dialect="")).validate()
    with pytest.raises(ValueError, match="unknown dialect 'qwen'"):
        choose_dialect("qwen", None)
    tok = build_tokenizer()
    assert choose_dialect("auto", tok).name == "calc" and choose_dialect("none", tok) is None

    class Qwen:
        chat_template = "{% for m in messages %}...<tool_call>...{% endfor %}"

    assert choose_dialect("auto", Qwen()).name == "hermes"
