"""The agent-lift benchmark's pieces without processes: the agent's reward is `CalculatorToolEnv`'s (computed by
stepping the real environment through the same turns), the agent plays the calculator protocol through the real
`openai` SDK and the real MCP calculator server (against a scripted OpenAI-compatible server), and the summary
arithmetic. The learning claim itself is `python -m forgelab.bench agent_lift` (docs/agents.md)."""
from __future__ import annotations

import asyncio
import json

import pytest

from forgelab.bench.agent_lift import arm_config, calculator_agent, calculator_reward, summarise
from forgelab.data.tasks import Problem
from forgelab.envs import CalculatorToolEnv

PROBLEM = Problem(prompt="(7+5)*3=", target="36", task="multistep")


async def _env_reward(turns: list[str]) -> float:
    """Step the real environment through the assistant turns; its final reward."""
    env = CalculatorToolEnv()
    await env.reset(PROBLEM)
    reward = 0.0
    for text in turns:
        _, reward, done, _ = await env.step(text)
        if done:
            return reward
    return reward


@pytest.mark.parametrize("turns", [
    ["36"], ["35"], ["30"], ["26"], ["twelve"], [" 036 "],                 # direct answers: right, close, far, none
    ["<calc>(7+5)*3</calc>", "36"], ["<calc>(7+5)*3</calc>", "34"],          # a good call, then right / close
    ["<calc>(7+5)*</calc>", "36"],                                          # a malformed call: no tool bonus
    ["<calc>7+5</calc>", "<calc>12*3</calc>", "36"],                        # two calls, then the answer
])
def test_agent_reward_is_the_environment_reward(turns):
    calls = turns[:-1]
    good = any(calculator_reward_call_ok(c) for c in calls)
    assert calculator_reward(turns[-1], PROBLEM.target, good) == pytest.approx(asyncio.run(_env_reward(turns)),
                                                                               abs=1e-12)


def calculator_reward_call_ok(text: str) -> bool:
    from forgelab.envs.mcp_tools import calculator

    return calculator(text.removeprefix("<calc>").removesuffix("</calc>")) != "error"


class _Scripted:
    """A stand-in OpenAI server (an httpx transport): answers each chat call with the next scripted message, and
    keeps the requests it got."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []

    def __call__(self, request):
        import httpx

        body = json.loads(request.content)
        self.requests.append(body)
        msg = self.replies.pop(0)
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop"}]})


def _play(replies):
    import httpx
    import openai

    server = _Scripted(replies)
    client = openai.AsyncOpenAI(base_url="http://door.test/v1", api_key="k",
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(server)))
    return asyncio.run(calculator_agent(client, PROBLEM, model="m")), server.requests


def _call(expr, cid="call_1"):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}]}


def test_agent_runs_calls_on_the_mcp_calculator_and_sends_results_back():
    reward, requests = _play([_call("(7+5)*3"), {"role": "assistant", "content": "36"}])
    assert reward == pytest.approx(1.1)  # right after a well-formed call
    assert [t["function"]["name"] for t in requests[0]["tools"]] == ["calculator"]  # the MCP server's tool list
    assert requests[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "36"}
    assert requests[1]["messages"][-2]["tool_calls"][0]["id"] == "call_1"
    assert all(r["max_tokens"] == 24 and r["temperature"] == 1.0 for r in requests)


def test_agent_stops_at_its_call_and_turn_limits():
    # a malformed call gets "error" back and no bonus; a third call is an answer-less last turn (reward 0)
    reward, requests = _play([_call("(7+5)*"), _call("12*3", "call_2"), _call("36", "call_3")])
    assert reward == 0.0 and len(requests) == 3
    assert requests[1]["messages"][-1]["content"] == "error"
    reward, _ = _play([_call("(7+5)*"), {"role": "assistant", "content": "36"}])
    assert reward == pytest.approx(1.0)


def test_arms_differ_only_in_who_plays():
    a, b = (arm_config(arm, steps=40, seed=3, eval_n=200, out_dir="/tmp/x") for arm in ("native", "door"))
    assert (a.rollout.concurrency, b.rollout.concurrency) == (2, 0)
    for section in ("train", "eval", "model"):
        assert getattr(a, section) == getattr(b, section), section
    assert a.rollout.env == b.rollout.env == "calculator" and a.train.seed == 3 and a.train.batch_size == 64
    with pytest.raises(ValueError, match="unknown arm"):
        arm_config("other", steps=2, seed=0, eval_n=8, out_dir="/tmp/x")


def test_summarise_takes_medians_over_seeds():
    rs = [{"before": 0.1, "after": a, "agent_before": 0.1, "agent_after": a} for a in (0.5, 0.7, 0.8)]
    s = summarise({"native": rs, "door": rs[:1]})
    assert s["native_lift_points"] == pytest.approx(60.0) and s["door_lift_points"] == pytest.approx(40.0)
    assert s["door_minus_native_points"] == pytest.approx(-20.0)


def test_doctests():
    import doctest

    from forgelab.bench import agent_lift

    result = doctest.testmod(agent_lift)
    assert result.failed == 0 and result.attempted > 0
