"""Rewards for reasoning-gym tasks: the task's own `score_answer`, as exact match or as its partial credit.

    REWARDS["reasoning_gym"]           1.0 exactly where score_answer gives 1.0, else 0.0 (the default)
    REWARDS["reasoning_gym_partial"]   score_answer's value (e.g. 0.67 for "570" when the answer is "57")

A problem made by `forgelab.data.reasoning_gym_source` carries its reasoning-gym entry (``question``, ``answer``,
``metadata``) in ``info["reasoning_gym"]``; the entry's ``metadata["source_dataset"]`` names the task whose
`score_answer` judges it (reasoning-gym's `get_score_answer_fn`, built once per task name). The answer scored is
the completion, stripped (the shipped model's final-answer-only format), or, with ``answer_tag`` set on the
task (``info["reasoning_gym_answer_tag"]``), the text inside the completion's last ``<tag>...</tag>``
(reasoning-gym's `extract_answer`; none found scores 0).

Partial credit is off by default: reasoning-gym's base `score_answer` gives ``len(oracle) / len(answer)`` to
an answer that contains the oracle, so "570" earns 0.67 for 57 and a policy can farm it by appending digits.
Choose it with ``rollout.reasoning_gym.partial_credit: true`` (docs/ecosystem.md).

    >>> entry = {"question": "Calculate 12 + 45.", "answer": "57",
    ...          "metadata": {"source_dataset": "basic_arithmetic", "expression": "12 + 45"}}
    >>> reasoning_gym_exact("12+45=", " 57", "57", reasoning_gym=entry)
    1.0
    >>> reasoning_gym_exact("12+45=", "570", "57", reasoning_gym=entry), reasoning_gym_partial("12+45=", "570", "57", reasoning_gym=entry)
    (0.0, 0.6666666666666666)
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ENTRY_KEY", "ANSWER_TAG_KEY", "reasoning_gym_answer", "reasoning_gym_partial", "reasoning_gym_exact",
           "score_answer_fn"]

ENTRY_KEY = "reasoning_gym"
"""The `Problem.info` key holding a problem's reasoning-gym entry (question, answer, metadata)."""
ANSWER_TAG_KEY = "reasoning_gym_answer_tag"
"""The `Problem.info` key holding the task's answer tag (None: the whole completion is the answer)."""


@functools.lru_cache(maxsize=None)
def score_answer_fn(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """reasoning-gym's `score_answer` of the task `name` (one scorer per task name, built on first use)."""
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(name)
    except ValueError:
        raise ValueError(f"reasoning-gym has no task {name!r}; see reasoning_gym.factory.DATASETS") from None


def reasoning_gym_answer(completion: str, answer_tag: str | None = None) -> str | None:
    """The answer a completion gives: the completion stripped, or the text of its last ``<answer_tag>`` element.

    >>> reasoning_gym_answer(" 57\\n"), reasoning_gym_answer("so <answer> 57 </answer>", "answer")
    ('57', '57')
    """
    if answer_tag is None:
        return completion.strip()
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion, tag_name=answer_tag)


def _score(completion: str, info: Mapping[str, Any]) -> float:
    entry = info.get(ENTRY_KEY)
    if not isinstance(entry, Mapping) or "answer" not in entry or "source_dataset" not in entry.get("metadata", {}):
        raise ValueError(f"this reward needs a reasoning-gym problem (info[{ENTRY_KEY!r}]: its entry with answer and "
                         "metadata.source_dataset); use it with rollout.task: reasoning_gym")
    score = score_answer_fn(str(entry["metadata"]["source_dataset"]))
    return float(score(reasoning_gym_answer(completion, info.get(ANSWER_TAG_KEY)), dict(entry)))


def reasoning_gym_exact(prompt: str, completion: str, target: str, **info: Any) -> float:
    """1.0 exactly where the task's `score_answer` gives 1.0 for the completion's answer, else 0.0."""
    return 1.0 if _score(completion, info) == 1.0 else 0.0


def reasoning_gym_partial(prompt: str, completion: str, target: str, **info: Any) -> float:
    """The task's `score_answer` value for the completion's answer (its partial credit included)."""
    return _score(completion, info)
