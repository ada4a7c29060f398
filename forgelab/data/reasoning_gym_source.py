"""reasoning-gym's procedural tasks as a run's problems (``rollout.task: reasoning_gym``; docs/ecosystem.md).

    rollout:
      task: reasoning_gym
      reasoning_gym:
        name: basic_arithmetic                   # any task of reasoning_gym.factory.DATASETS
        config: {min_terms: 2, max_terms: 2, max_digits: 2, operators: ["+"],
                 allow_parentheses: false, allow_negation: false}
        seed: 0                                  # reasoning-gym's own seed (training items)
        size: 1000                               # training items drawn
        prompt: expression                       # "question" (the task's text) or "expression" ("12+45=")

reasoning-gym generates every item locally from its seed (``create_dataset(name, seed=, size=, **config)``:
no download). Each item becomes a `Problem`: the prompt (its ``question``, or for arithmetic tasks its
``metadata["expression"]`` with the spaces removed and ``=`` appended, the shipped tiny model's format), the
target (its ``answer``) and, in ``info``, the whole item (`forgelab.rewards.reasoning_gym.ENTRY_KEY`), which the
rewards hand to the task's own `score_answer`.

Held-out problems come from a second draw (``heldout_seed``, default ``seed + size``) with every question that
is also a training question removed, so evaluation never sees a training problem. (reasoning-gym seeds item `i`
of a draw with ``seed + i``: a draw at ``seed + 1`` would repeat all but one training item, so the default
starts where the training draw's seeds end.) Items are plain JSON values
(tuples in the metadata become lists) so they travel through the rollout log unchanged.
"""
from __future__ import annotations

import json
from typing import Any, Protocol

from forgelab.data.tasks import Problem
from forgelab.rewards.reasoning_gym import ANSWER_TAG_KEY, ENTRY_KEY

__all__ = ["PROMPT_FORMATS", "TASK_NAME", "ReasoningGymSpec", "check_reasoning_gym", "reasoning_gym_items",
           "reasoning_gym_problems", "reasoning_gym_split"]

TASK_NAME = "reasoning_gym"
"""The value of ``rollout.task`` that reads problems from reasoning-gym (``rollout.reasoning_gym`` says which)."""


def _question(entry: dict[str, Any]) -> str:
    return str(entry["question"])


def _expression(entry: dict[str, Any]) -> str:
    expr = entry.get("metadata", {}).get("expression")
    if not isinstance(expr, str):
        raise ValueError(f"rollout.reasoning_gym.prompt: 'expression' needs items with metadata['expression'] "
                         f"(arithmetic tasks); {entry.get('metadata', {}).get('source_dataset')!r} has none: use "
                         "prompt: question")
    return expr.replace(" ", "") + "="


PROMPT_FORMATS = {"question": _question, "expression": _expression}
"""How an item becomes the prompt text: its ``question``, or its expression as ``"12+45="``."""


class ReasoningGymSpec(Protocol):
    """What this module reads of ``rollout.reasoning_gym`` (`forgelab.config.run_config.ReasoningGymConfig`)."""

    name: str | None
    config: dict[str, Any]
    seed: int
    size: int
    heldout_seed: int | None
    prompt: str
    answer_tag: str | None
    partial_credit: bool


def reasoning_gym_items(name: str, config: dict[str, Any], seed: int, size: int) -> list[dict[str, Any]]:
    """`size` items of reasoning-gym's task `name` with its parameters `config`, as JSON values.

    >>> items = reasoning_gym_items("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 2,
    ...     "operators": ["+"], "allow_parentheses": False, "allow_negation": False}, seed=0, size=2)
    >>> [(e["metadata"]["expression"], e["answer"]) for e in items]
    [('5 + 33', '38'), ('4 + 1', '5')]
    """
    import reasoning_gym

    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}  # YAML lists: the tuples it takes
    ds = reasoning_gym.create_dataset(name, seed=seed, size=size, **cfg)
    return [json.loads(json.dumps(ds[i])) for i in range(size)]


def reasoning_gym_problems(items: list[dict[str, Any]], spec: ReasoningGymSpec) -> list[Problem]:
    """`Problem`s of reasoning-gym items (prompt by `spec.prompt`, target the item's answer, the item in info)."""
    fmt = PROMPT_FORMATS[spec.prompt]
    return [Problem(prompt=fmt(e), target=str(e["answer"]), task=f"{TASK_NAME}/{spec.name}",
                    info={ENTRY_KEY: e, ANSWER_TAG_KEY: spec.answer_tag}) for e in items]


def reasoning_gym_split(spec: ReasoningGymSpec, *, eval_n: int,
                        max_train: int | None = None) -> tuple[list[Problem], list[Problem], str, dict[str, Any]]:
    """The training and held-out problems of ``rollout.reasoning_gym``, a description and manifest data.

    Training: the first `max_train` (default all) of `spec.size` items drawn with `spec.seed`. Held out: the
    first `eval_n` items of a draw with `spec.heldout_seed` (default `spec.seed + spec.size`) whose question is not a
    training question (the draw holds ``2 * eval_n + len(train)`` items at most, so a task with fewer distinct
    problems than that still fills as much as it can; none left is an error).
    """
    check_reasoning_gym(spec)
    assert spec.name is not None
    train_items = reasoning_gym_items(spec.name, spec.config, spec.seed, spec.size)
    if max_train is not None:
        train_items = train_items[:max_train]
    seen = {e["question"] for e in train_items}
    held_seed = spec.seed + spec.size if spec.heldout_seed is None else spec.heldout_seed
    drawn = reasoning_gym_items(spec.name, spec.config, held_seed, 2 * eval_n + len(seen))
    held_items = []
    for e in drawn:  # the first of each question not trained on
        if e["question"] not in seen and len(held_items) < eval_n:
            seen.add(e["question"])
            held_items.append(e)
    if not held_items:
        raise ValueError(f"rollout.reasoning_gym: every held-out item of task {spec.name!r} is also a training item; "
                         "lower rollout.reasoning_gym.size or widen the task's config")
    what = (f"data: {len(train_items)} reasoning-gym {spec.name!r} items (rollout.reasoning_gym: seed {spec.seed}, "
            f"size {spec.size}); held out: {len(held_items)} items of seed {held_seed} not in training (eval.n)")
    info = {"source": f"reasoning_gym/{spec.name}", "config": dict(spec.config), "seed": spec.seed,
            "heldout_seed": held_seed, "rows": None, "train": len(train_items), "heldout_rows": len(held_items),
            "evaluated": len(held_items), "max_train_problems": max_train}
    return reasoning_gym_problems(train_items, spec), reasoning_gym_problems(held_items, spec), what, info


def check_reasoning_gym(spec: ReasoningGymSpec) -> None:
    """Raise ``ValueError`` naming the field of ``rollout.reasoning_gym`` that is wrong: the task name, its
    parameters (reasoning-gym's own config class checks them: one item is drawn), seed, size, prompt format."""
    import reasoning_gym

    where = "rollout.reasoning_gym"
    if not spec.name:
        raise ValueError(f"{where}.name: required with rollout.task: {TASK_NAME} (a reasoning-gym task, e.g. "
                         "basic_arithmetic)")
    if spec.name not in reasoning_gym.factory.DATASETS:
        import difflib

        near = difflib.get_close_matches(spec.name, list(reasoning_gym.factory.DATASETS), n=1)
        raise ValueError(f"{where}.name: reasoning-gym has no task {spec.name!r}"
                         + (f"; did you mean {near[0]!r}?" if near else "") + " (reasoning_gym.factory.DATASETS)")
    if not isinstance(spec.config, dict):
        raise ValueError(f"{where}.config: expected a mapping of the task's parameters, got {spec.config!r}")
    import dataclasses

    config_cls = reasoning_gym.factory.DATASETS[spec.name][1]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    for key in spec.config:
        if key not in known:
            raise ValueError(f"{where}.config.{key}: not a parameter of reasoning-gym's {spec.name!r} "
                             f"({config_cls.__name__}: {', '.join(sorted(known))}); seed and size are "
                             f"{where}.seed / {where}.size")
    for field_name in ("seed", "size"):
        value = getattr(spec, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if field_name == "size" else 0):
            raise ValueError(f"{where}.{field_name}: must be a{' positive' if field_name == 'size' else ' non-negative'}"
                             f" integer, got {value!r}")
    if spec.prompt not in PROMPT_FORMATS:
        raise ValueError(f"{where}.prompt: {spec.prompt!r} is not one of {', '.join(PROMPT_FORMATS)}")
    try:
        (item,) = reasoning_gym_items(spec.name, spec.config, spec.seed, 1)
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"{where}.config: reasoning-gym refused {spec.config!r} for {spec.name!r}: "
                         f"{type(e).__name__}: {e}") from None
    PROMPT_FORMATS[spec.prompt](item)
