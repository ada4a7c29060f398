"""Built-in environments: no network, verifiable rewards.

- `EchoEnv`: a trivial multi-turn environment for load tests and benchmarks
  (`turns` assistant turns, reward 1.0 for finishing, optional think time).
- `ArithmeticTutorEnv`: an arithmetic problem; the model may ask for a hint by
  replying with the word "hint" (first hint: the sum of the ones digits, second:
  the sum of the tens); any other reply is its final answer, scored exactly.
- `CalculatorToolEnv`: the model may call a calculator with
  `<calc>12*7</calc>`; the environment answers as a tool message
  `<result>84</result>` and the model then answers. Reward: 1.0 for a correct
  final answer, else partial credit `closeness * max(0, 1 - |answer - target|
  / 10)` for a wrong integer answer, plus `tool_bonus` when a
  correct answer followed a well-formed call. Answering directly is allowed,
  so the shipped model, which has never seen the tool format, earns partial
  credit and GRPO raises its mean reward from the start; tool use is shaped,
  not required. Learning it starts from `forgelab/assets/tiny-llama-tool`
  (`forgelab.recipes.tool_warmstart`), which calls on ~30 % of its samples;
  give each turn room for a call (`max_tokens` >= 24: `<calc>(7+5)*3</calc>`
  is 20 characters plus the end token). `tool_use_stats(episodes)` reads
  its counters: tool-call rate, well-formed calls, answers equal to the
  tool's result, accuracy with and without a call.

Tasks are `forgelab.data.tasks.Problem`s (prompt "12+45=", target "57"); the first
user message is the problem prompt exactly as in single-turn training, so the
shipped model answers it in the format it learnt.

    >>> import asyncio
    >>> from forgelab.data.tasks import Problem
    >>> env = CalculatorToolEnv()
    >>> asyncio.run(env.reset(Problem(prompt="12*7=", target="84", task="t")))
    '12*7='
    >>> obs, r, done, info = asyncio.run(env.step("<calc>12*7</calc>"))
    >>> obs, r, done, info["role"], info["metrics"]
    ('<result>84</result>', 0.0, False, 'tool', {'tool_calls': 1.0, 'used_tool': 1.0, 'tool_calls_ok': 1.0})
    >>> obs, r, done, info = asyncio.run(env.step("84"))
    >>> obs, r, done, info["reward_parts"], info["answer"], info["metrics"]["answer_is_result"]
    (None, 1.1, True, {'correct': 1.0, 'close': 0.0, 'tool_bonus': 0.1}, '84', 1.0)
"""
from __future__ import annotations

import ast
import asyncio
import operator
import re
from typing import Any, Sequence

from forgelab.envs.base import Env, task_prompt
from forgelab.envs.episode import env_metric_means
from forgelab.data.tasks import extract_integer_answer
from forgelab.types import Episode

__all__ = ["ArithmeticTutorEnv", "CalculatorToolEnv", "EchoEnv", "safe_calc", "tool_use_stats"]


def _target(task: Any) -> str:
    if hasattr(task, "target"):
        return str(task.target)
    if isinstance(task, dict) and "target" in task:
        return str(task["target"])
    raise ValueError(f"this environment needs a task with a target (a forgelab.data.tasks.Problem), got {task!r}")


class EchoEnv(Env):
    """`turns` assistant turns; after each one but the last the user says `reply`. Reward 1.0 when done.

    `think_s` simulates a slow environment (asyncio sleep per step);
    `reply_chars` pads the reply to that length (longer conversations for prefix-cache measurements).
    """

    def __init__(self, turns: int = 2, think_s: float = 0.0, reply: str = "again", reply_chars: int = 0):
        self.turns, self.think_s, self.reply, self.reply_chars = turns, think_s, reply, reply_chars
        self.t = 0

    async def reset(self, task: Any) -> str:
        self.t = 0
        return task_prompt(task)

    async def step(self, action_text: str):
        if self.think_s:
            await asyncio.sleep(self.think_s)
        self.t += 1
        if self.t >= self.turns:
            return None, 1.0, True, {}
        reply = self.reply
        if self.reply_chars > len(reply):
            reply = (reply + " ") * (self.reply_chars // (len(reply) + 1) + 1)
            reply = reply[: self.reply_chars]
        return reply, 0.0, False, {"role": "user"}


class ArithmeticTutorEnv(Env):
    """An addition problem with up to `max_hints` hints on request (a reply containing `hint_word`).

    Hints (for a + b): 1st the ones digits "2+5=7", 2nd the tens "10+40=50".
    Final answer: reward 1.0 if exact, minus `hint_cost` per hint taken.
    """

    def __init__(self, hint_word: str = "hint", max_hints: int = 2, hint_cost: float = 0.1):
        self.hint_word, self.max_hints, self.hint_cost = hint_word.lower(), max_hints, hint_cost
        self.hints = 0

    async def reset(self, task: Any) -> str:
        self.target = _target(task)
        info = getattr(task, "info", None) or (task.get("info", {}) if isinstance(task, dict) else {})
        self.a, self.b = info.get("a"), info.get("b")
        if self.a is None or self.b is None:  # parse "a+b=" when the task carries no operands
            m = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*=?\s*", task_prompt(task))
            if not m:
                raise ValueError(f"ArithmeticTutorEnv needs an addition task (a+b=), got {task_prompt(task)!r}")
            self.a, self.b = int(m.group(1)), int(m.group(2))
        self.hints = 0
        return task_prompt(task)

    def _hint(self) -> str:
        a, b = int(self.a), int(self.b)
        if self.hints == 1:
            return f"{a % 10}+{b % 10}={a % 10 + b % 10}"
        return f"{a // 10 * 10}+{b // 10 * 10}={a // 10 * 10 + b // 10 * 10}"

    async def step(self, action_text: str):
        if self.hint_word in action_text.lower() and self.hints < self.max_hints:
            self.hints += 1
            return self._hint(), 0.0, False, {"role": "user", "hint": self.hints}
        answer = extract_integer_answer(action_text)
        correct = 1.0 if answer is not None and answer == self.target else 0.0
        cost = self.hint_cost * self.hints if correct else 0.0
        return None, correct - cost, True, {"reward_parts": {"correct": correct, "hint_cost": -cost}, "answer": answer}


_CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_calc(expr: str, max_abs: int = 10**12) -> int:
    """Evaluate an integer expression with + - * and brackets (no names, no calls, no powers).

    >>> safe_calc("(7+5)*3-4"), safe_calc("-2*3")
    (32, -6)
    """
    if len(expr) > 200:
        raise ValueError("expression too long")
    node = ast.parse(expr.strip(), mode="eval").body

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            v = _OPS[type(n.op)](ev(n.left), ev(n.right))
            if abs(v) > max_abs:
                raise ValueError("result too large")
            return v
        raise ValueError(f"unsupported expression element {type(n).__name__}")

    return ev(node)


class CalculatorToolEnv(Env):
    """An arithmetic problem with a calculator tool; see the module docstring for the protocol and reward.

    At most `max_calls` tool calls; a malformed call gets `<result>error</result>`.
    `tool_bonus` is paid only with a correct final answer that followed a well-formed call;
    `closeness` scales the partial credit of a wrong integer answer (0 turns it off).

    Step infos carry `metrics` counters (summed per episode into `info["env_metrics"]`, averaged
    per step by a `Run` as `env/<name>`): `used_tool` (1 on the first call), `tool_calls`,
    `tool_calls_ok` (well-formed calls) and `answer_is_result` (1 when the final answer is the
    result of the last well-formed call).
    """

    def __init__(self, max_calls: int = 2, tool_bonus: float = 0.1, closeness: float = 0.5):
        self.max_calls, self.tool_bonus, self.closeness = max_calls, tool_bonus, closeness
        self.calls = 0
        self.good_call = False
        self.result: str | None = None

    async def reset(self, task: Any) -> str:
        self.target = _target(task)
        self.calls, self.good_call, self.result = 0, False, None
        return task_prompt(task)

    async def step(self, action_text: str):
        m = _CALL_RE.search(action_text)
        if m is not None and self.calls < self.max_calls:
            self.calls += 1
            counts = {"tool_calls": 1.0, "used_tool": 1.0 if self.calls == 1 else 0.0}
            try:
                self.result = str(safe_calc(m.group(1)))
                self.good_call = True
                return (f"<result>{self.result}</result>", 0.0, False,
                        {"role": "tool", "tool_call": "ok", "metrics": counts | {"tool_calls_ok": 1.0}})
            except (ValueError, SyntaxError, ZeroDivisionError):
                return "<result>error</result>", 0.0, False, {"role": "tool", "tool_call": "malformed", "metrics": counts}
        answer = extract_integer_answer(action_text)
        correct = 1.0 if answer is not None and answer == self.target else 0.0
        close = 0.0
        if answer is not None and not correct:
            t = int(self.target)
            close = self.closeness * max(0.0, 1.0 - abs(int(answer) - t) / 10)
        bonus = self.tool_bonus if correct and self.good_call else 0.0
        parts = {"correct": correct, "close": close, "tool_bonus": bonus}
        used = 1.0 if self.result is not None and answer == self.result else 0.0
        # every counter is named at the end (adding 0), so a batch without calls still logs them
        counts = {"tool_calls": 0.0, "used_tool": 0.0, "tool_calls_ok": 0.0, "answer_is_result": used}
        return None, correct + close + bonus, True, {"reward_parts": parts, "answer": answer, "metrics": counts}


def tool_use_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Tool use over `CalculatorToolEnv` episodes, from their `env_metrics` counters (rates are fractions
    in [0, 1], NaN when there is nothing to count; `reward_mean` is in reward units).

    - `tool_rate`: episodes with at least one `<calc>` call;
    - `wellformed_rate`: well-formed calls / calls (NaN without calls);
    - `result_use_rate`: episodes whose final answer equals the tool's result / episodes with a call;
    - `accuracy`: episodes whose final answer is correct (with or without the tool);
    - `accuracy_with_tool`, `accuracy_direct`: the same among episodes with / without a call.

        >>> from types import SimpleNamespace as E
        >>> called = E(info={"env_metrics": {"used_tool": 1.0, "tool_calls": 1.0, "tool_calls_ok": 1.0,
        ...                                  "answer_is_result": 1.0}}, reward=1.1, reward_parts={"correct": 1.0})
        >>> direct = E(info={"env_metrics": {"answer_is_result": 0.0}}, reward=0.0, reward_parts={"correct": 0.0})
        >>> s = tool_use_stats([called, direct])
        >>> s["tool_rate"], s["result_use_rate"], s["accuracy_with_tool"], s["accuracy_direct"]
        (0.5, 1.0, 1.0, 0.0)
    """
    n = len(episodes)
    m = env_metric_means(list(episodes))
    used = [ep.info.get("env_metrics", {}).get("used_tool", 0.0) > 0 for ep in episodes]
    tool = [ep for ep, u in zip(episodes, used) if u]
    direct = [ep for ep, u in zip(episodes, used) if not u]
    nan = float("nan")

    def acc(eps):
        return sum(ep.reward_parts.get("correct", 0.0) for ep in eps) / len(eps) if eps else nan

    calls = m.get("tool_calls", 0.0)
    return {
        "episodes": n,
        "tool_rate": len(tool) / n,
        "wellformed_rate": m.get("tool_calls_ok", 0.0) / calls if calls else nan,
        "result_use_rate": m.get("answer_is_result", 0.0) * n / len(tool) if tool else nan,
        "accuracy": acc(episodes),
        "accuracy_with_tool": acc(tool),
        "accuracy_direct": acc(direct),
        "reward_mean": sum(ep.reward for ep in episodes) / n,
    }
