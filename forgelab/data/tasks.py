"""Toy tasks with verifiable answers, generated deterministically from a seed.

Two tasks ship in ``TASKS``:

- ``addition``: ``"12+45="`` -> ``"57"``. Each operand has 1-2 digits
  (digit count uniform, then the value uniform among numbers of that length).
- ``multistep``: ``"(7+5)*3="`` -> ``"36"``. Three operands in 1..9 joined by
  two of ``+ - *``, unbracketed or with brackets around the first or the last
  pair; usual precedence; the answer may be negative (``"-12"``). Mixing
  precedence, brackets and products makes it harder than addition for the
  tiny model, so the base model is clearly imperfect on it.

Answer format: the assistant's completion is the final answer only -- an
integer in decimal, optionally with a leading ``-``, e.g. ``357``. The end of
turn token ends it; surrounding whitespace is tolerated by ``extract_answer``,
anything else (words, a second number) makes the answer ``None`` and the reward
0.0. Rewards are exact-answer correctness, 1.0 or 0.0.

Train and test never overlap: a problem belongs to the test split iff the
SHA-256 of ``"<task>:<canonical problem>"`` falls in 1 of ``TEST_BUCKETS``
buckets, whatever the seed. ``make(split, n, seed)`` draws problems from a
``random.Random`` seeded with ``(task, split, seed)`` and keeps the first ``n``
distinct ones that belong to ``split``.

    >>> task = get_task("addition")
    >>> p = task.make("test", 1, seed=0)[0]
    >>> task.reward(p.prompt, p.target, p.target, **p.info)
    1.0
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

TEST_BUCKETS = 10
"""One problem in ``TEST_BUCKETS`` (by hash) is a test problem; the rest are train."""

ADDITION_MAX_DIGITS = 2
"""Operands of ``addition`` have 1..ADDITION_MAX_DIGITS digits (3 was too hard for the tiny
model to learn in a few CPU minutes of SFT)."""

_INT_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One problem. ``prompt`` is the user's message text, not chat-templated."""

    prompt: str
    target: str
    task: str
    info: dict = field(default_factory=dict, hash=False, compare=True)


def split_of(task_name: str, key: str) -> str:
    """The split ("train" or "test") that the canonical problem ``key`` belongs to."""
    digest = hashlib.sha256(f"{task_name}:{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def extract_integer_answer(completion: str) -> str | None:
    """The integer the completion consists of, or None if it is anything else.

    >>> extract_integer_answer(" 357\\n"), extract_integer_answer("-4"), extract_integer_answer("35 7")
    ('357', '-4', None)
    """
    text = completion.strip()
    if not _INT_RE.fullmatch(text):
        return None
    return str(int(text))  # canonical: "007" -> "7", "-0" -> "0"


@dataclass(kw_only=True)
class Task:
    """A family of problems with an exact-answer reward.

    ``sample(rng) -> (key, prompt, target, info)`` draws one problem; ``key`` is
    its canonical form, used for the train/test split and to dedupe.
    """

    name: str
    """Registry name, also stored in every ``Problem.task``."""
    sample: Callable[[random.Random], tuple[str, str, str, dict]]
    """Draws one problem from ``rng``: ``(key, prompt, target, info)``."""
    max_answer_chars: int = 8
    """Longest well-formed answer in characters (bounds generation length)."""

    def make(self, split: str, n: int, seed: int) -> list[Problem]:
        """``n`` distinct problems of ``split`` ("train" or "test"), deterministic in ``seed``."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        seen: set[str] = set()
        out: list[Problem] = []
        attempts, max_attempts = 0, 200 * n + 10_000
        while len(out) < n:
            attempts += 1
            if attempts > max_attempts:
                raise ValueError(
                    f"task {self.name!r}: found only {len(out)} distinct {split} problems "
                    f"after {max_attempts} draws (asked for {n}); ask for fewer"
                )
            key, prompt, target, info = self.sample(rng)
            if key in seen or split_of(self.name, key) != split:
                continue
            seen.add(key)
            out.append(Problem(prompt=prompt, target=target, task=self.name, info=info))
        return out

    def extract_answer(self, completion: str) -> str | None:
        """The canonical answer in ``completion``, or None if it is malformed."""
        return extract_integer_answer(completion)

    def reward(self, prompt: str, completion: str, target: str, **info) -> float:
        """1.0 if the completion's answer equals ``target`` exactly, else 0.0.

        >>> TASKS["addition"].reward("2+2=", "4", "4"), TASKS["addition"].reward("2+2=", "5", "4")
        (1.0, 0.0)
        """
        answer = self.extract_answer(completion)
        return 1.0 if answer is not None and answer == target else 0.0


# --- addition ---------------------------------------------------------------


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _sample_addition(rng: random.Random) -> tuple[str, str, str, dict]:
    a, b = _operand(rng, ADDITION_MAX_DIGITS), _operand(rng, ADDITION_MAX_DIGITS)
    expr = f"{a}+{b}"
    return expr, f"{expr}=", str(a + b), {"a": a, "b": b}


# --- multistep arithmetic ----------------------------------------------------

_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def safe_eval_int(expr: str) -> int:
    """Evaluate an integer expression of ``+ - *``, brackets and literals, nothing else.

    Parses with ``ast`` and walks the tree, so no arbitrary code can run.

    >>> safe_eval_int("(7+5)*3-4")
    32
    """
    tree = ast.parse(expr, mode="eval")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not an integer +-* expression: {expr!r}")

    return walk(tree)


def _sample_multistep(rng: random.Random) -> tuple[str, str, str, dict]:
    a, b, c = (rng.randint(1, 9) for _ in range(3))
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    expr = rng.choice(
        (f"{a}{op1}{b}{op2}{c}", f"({a}{op1}{b}){op2}{c}", f"{a}{op1}({b}{op2}{c})")
    )
    return expr, f"{expr}=", str(safe_eval_int(expr)), {"expr": expr}


TASKS: dict[str, Task] = {
    "addition": Task(name="addition", sample=_sample_addition, max_answer_chars=4),
    "multistep": Task(name="multistep", sample=_sample_multistep, max_answer_chars=4),
}
"""The toy tasks by name (``rollout.task``): generated from a seed, disjoint train/test splits."""


def get_task(name: str) -> Task:
    """The registered task called ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; known tasks: {sorted(TASKS)}. "
            "Register a new one with forgelab.data.tasks.TASKS[name] = Task(...)"
        ) from None
