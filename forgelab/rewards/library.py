"""Reward functions: plain callables ``(prompt, completion, target, **info) -> float``.

A reward is any function with that signature; ``REWARDS`` names the built-ins,
and a ``RewardComposer`` sums several with weights that can be changed while a
run is going (``set_weights`` swaps one dict, so a concurrent ``score`` sees
either the old weights or the new ones, never a mix).

FAILURE RULE (a contract the controller, the trainer and the docs rely on):
if any reward function raises, or returns something that is not a finite real
number, the episode is *failed*. ``RewardComposer.score`` then returns a
``RewardResult`` whose ``errors`` hold one ``RewardFailure(name, prompt,
completion, target, error_text)`` per offending function, with the input that
triggered it and a traceback summary. ``total`` stays NaN-free (the weighted
sum of the parts that did succeed) but the episode MUST NOT be trained on: the
caller drops it with reason ``"reward_error:<name>"`` (``result.drop_reason``).
A failing reward is never silently scored 0. This holds for weight-0 rewards
too: they are still evaluated (so they can be watched) and still fail the
episode if they break.

``score`` is synchronous and has no timeout; a per-call timeout, if wanted, is
the controller's job (it runs ``score`` in an executor under
``asyncio.wait_for``). Before a live reward change is accepted, run
``validate(fn, recent_samples)``: it calls the candidate on real samples and
reports exceptions and non-finite values without changing anything.

    >>> composer = RewardComposer({"correct": (exact_answer, 1.0), "format": (answer_format, 0.1)})
    >>> result = composer.score("Compute 12+345", " 357", "357")
    >>> result.total, result.parts, result.failed
    (1.1, {'correct': 1.0, 'format': 1.0}, False)
    >>> composer.set_weights({"format": 0.0})
    >>> composer.score("Compute 12+345", "three", "357").total
    0.0
"""

from __future__ import annotations

import math
import numbers
import re
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from forgelab.rewards.math_answers import math_answer, overlong, think_format
from forgelab.rewards.reasoning_gym import reasoning_gym_exact, reasoning_gym_partial
from forgelab.rewards.trl_compat import TRLReward, as_reward

__all__ = [
    "RewardFn",
    "exact_answer",
    "answer_format",
    "extract_answer",
    "math_answer",
    "think_format",
    "overlong",
    "REWARDS",
    "RewardFailure",
    "RewardResult",
    "RewardComposer",
    "WeightedReward",
    "ValidationReport",
    "validate",
    "call_reward",
    "resolve_reward",
]

RewardFn = Callable[..., float]
"""``fn(prompt: str, completion: str, target: str, **info) -> float``."""

INTEGER_ANSWER = r"-?\d+"
"""Default well-formed answer: an optionally negative decimal integer."""

_MAX_ERROR_CHARS = 2000


# --- built-in rewards ----------------------------------------------------------


def extract_answer(completion: str) -> str:
    """The answer a completion gives. In the final-answer-only format the whole completion is the answer.

    Surrounding whitespace is stripped; nothing else is interpreted (no
    ``\\boxed{}``, no "the answer is"), so ``"0357"`` and ``"357"`` differ.

    >>> extract_answer("  357\\n")
    '357'
    """
    return completion.strip()


def exact_answer(prompt: str, completion: str, target: str, **info) -> float:
    """1.0 if the completion's answer equals ``target`` as a string (both stripped), else 0.0.

    >>> exact_answer("Compute 12+345", "357", "357"), exact_answer("Compute 12+345", " 357\\n", "357")
    (1.0, 1.0)
    >>> exact_answer("Compute 12+345", "357.", "357"), exact_answer("Compute 12+345", "The answer is 357", "357")
    (0.0, 0.0)
    """
    return 1.0 if extract_answer(completion) == str(target).strip() else 0.0


def answer_format(prompt: str, completion: str, target: str, *, answer_pattern: str = INTEGER_ANSWER, **info) -> float:
    """1.0 if the stripped completion is a bare well-formed answer (whole-string regex match), else 0.0.

    The default pattern is an integer, ``-?\\d+``; for other tasks pass
    ``answer_pattern`` as a keyword (or put it in the episode's ``info``).

    >>> answer_format("", " -12\\n", "-12"), answer_format("", "12 apples", "12")
    (1.0, 0.0)
    >>> answer_format("", "B", "B", answer_pattern=r"[A-D]")
    1.0
    """
    return 1.0 if re.fullmatch(answer_pattern, completion.strip()) else 0.0


REWARDS: dict[str, RewardFn] = {
    "exact_answer": exact_answer,
    "answer_format": answer_format,
    "math_answer": math_answer,
    "think_format": think_format,
    "overlong": overlong,
    "reasoning_gym": reasoning_gym_exact,
    "reasoning_gym_partial": reasoning_gym_partial,
}
"""Built-in rewards by name; a user's own function is just as good a value.

``math_answer``, ``think_format`` and ``overlong`` (for GSM8K/MATH-style data:
answer tags, ``\\boxed{}``, think tags, DAPO's overlong shaping) live in
``forgelab.rewards.math_answers``; ``overlong`` needs its budget bound
(``forgelab.rewards.math_answers.make_overlong``) or ``max_tokens`` in the problems' info.
``reasoning_gym`` / ``reasoning_gym_partial`` score a reasoning-gym task's problems with the task's own
``score_answer`` (exact match / its partial credit: ``forgelab.rewards.reasoning_gym``)."""




def resolve_reward(name: str) -> RewardFn:
    """The reward a config names: a key of `REWARDS`, or an import path ``package.module:attribute`` (from YAML,
    e.g. ``trl.rewards:think_format_reward``; a TRL-style function is adapted where it is added).

    >>> resolve_reward("exact_answer") is exact_answer, resolve_reward("forgelab.rewards:think_format").__name__
    (True, 'think_format')
    """
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in str(name):
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}, or an import path "
                       "package.module:function (e.g. trl.rewards:think_format_reward)")
    import importlib

    module, _, attr = str(name).partition(":")
    try:
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise KeyError(f"reward {name!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise KeyError(f"reward {name!r}: {fn!r} is not callable")
    return fn


# --- calling rewards safely ------------------------------------------------------


@dataclass
class RewardFailure:
    """One reward function that raised or returned a non-finite / non-numeric value, with its input."""

    name: str
    prompt: str
    completion: str
    target: str
    error_text: str
    """Exception type, message and the innermost frames, or a description of the bad value."""
    reason: str | None = None
    """The drop reason when it is not ``reward_error:<name>`` (``reward_none``: every reward returned None)."""

    @property
    def drop_reason(self) -> str:
        """The reason the episode is dropped with: ``"reward_error:<name>"`` (or `reason` when set)."""
        return self.reason or f"reward_error:{self.name}"


@dataclass
class RewardResult:
    """The score of one episode. ``parts`` are unweighted; ``total`` is the weighted sum of the parts."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)
    errors: list[RewardFailure] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True if any reward failed: the episode must be dropped, not trained on."""
        return bool(self.errors)

    @property
    def drop_reason(self) -> str | None:
        """``"reward_error:<name>"`` of the first failing reward, or None if nothing failed."""
        return self.errors[0].drop_reason if self.errors else None


def call_reward(
    name: str, fn: RewardFn, prompt: str, completion: str, target: str, info: Mapping | None = None,
    episode: object = None,
) -> tuple[float | None, RewardFailure | None]:
    """Call one reward; return ``(value, None)`` or ``(None, RewardFailure)``. Never raises.

    A TRL-style reward (`forgelab.rewards.trl_compat`) gets `episode` (an `Episode` or a recorded row: its
    ``completion_ids`` and policy version) and may return None, "does not apply": then ``(None, None)``.

    >>> call_reward("bad", lambda p, c, t, **i: float("nan"), "p", "c", "t")[1].error_text
    'returned nan; a reward must return a finite real number'
    """
    try:
        if isinstance(fn, TRLReward):
            value = fn.call_one(prompt, completion, target, info, episode)
            if value is None:
                return None, None
        else:
            value = fn(prompt, completion, target, **(info or {}))
    except Exception as exc:  # noqa: BLE001 -- any error in user code fails the episode, by contract
        text = "".join(traceback.format_exception(exc, limit=-3))
        if len(text) > _MAX_ERROR_CHARS:
            text = "..." + text[-_MAX_ERROR_CHARS:]
        return None, RewardFailure(name, prompt, completion, target, text.rstrip())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (call .item() on tensors)" if hasattr(value, "item") else ""
        return None, RewardFailure(
            name, prompt, completion, target,
            f"returned {value!r} of type {type(value).__name__}; a reward must return a float{hint}",
        )
    if not math.isfinite(value):
        return None, RewardFailure(
            name, prompt, completion, target, f"returned {value!r}; a reward must return a finite real number"
        )
    return float(value), None


def _check_weight(name: str, weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"reward {name!r}: weight must be a finite real number, got {weight!r}")
    return float(weight)


class RewardComposer:
    """A weighted sum of named rewards whose weights (and members) can change while running.

    Each change builds a new dict and swaps it in with one assignment; ``score``
    reads the dict once, so under asyncio (or threads) every episode is scored
    with one consistent set of rewards and weights.

    >>> c = RewardComposer()
    >>> c.add("correct", exact_answer, 2.0)
    >>> c.score("", "4", "4").total
    2.0
    >>> c.set_weights({"corect": 1.0})
    Traceback (most recent call last):
    ...
    KeyError: "unknown reward 'corect'; known rewards: ['correct']"
    """

    def __init__(self, rewards: Mapping[str, tuple[RewardFn, float]] | None = None):
        self._terms: dict[str, tuple[RewardFn, float]] = {}
        for name, (fn, weight) in (rewards or {}).items():
            self.add(name, fn, weight)

    @property
    def terms(self) -> dict[str, tuple[RewardFn, float]]:
        """The current ``{name: (fn, weight)}``: one read gives a consistent set, even while a cell changes it
        (each change swaps in a new dict; do not mutate the one returned)."""
        return self._terms

    def snapshot(self) -> "RewardComposer":
        """A composer frozen at the current rewards and weights: later changes to this one do not reach it."""
        frozen = RewardComposer()
        frozen._terms = self._terms
        return frozen

    def replace_all(self, other: "RewardComposer") -> None:
        """Take `other`'s rewards and weights in one swap (same object: widgets and the scorer keep it)."""
        self._terms = other.terms

    @property
    def weights(self) -> dict[str, float]:
        """Current weights by reward name (a copy)."""
        return {name: weight for name, (_, weight) in self._terms.items()}

    @property
    def names(self) -> list[str]:
        return list(self._terms)

    def add(self, name: str, fn: RewardFn, weight: float = 1.0, *, replace: bool = False) -> None:
        """Add reward ``fn`` under ``name``; an existing name needs ``replace=True``. A TRL-style batched
        function (``reward(completions, **kwargs) -> list[float]``) is recognised and adapted (`as_reward`)."""
        if not callable(fn):
            raise TypeError(f"reward {name!r}: expected a callable (prompt, completion, target, **info) -> float, got {fn!r}")
        fn = as_reward(fn)
        if name in self._terms and not replace:
            raise KeyError(f"reward {name!r} already exists; pass replace=True to swap its function")
        terms = dict(self._terms)
        terms[name] = (fn, _check_weight(name, weight))
        self._terms = terms

    def remove(self, name: str) -> None:
        """Remove the reward called ``name``."""
        self._require_known([name])
        self._terms = {k: v for k, v in self._terms.items() if k != name}

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Set the weights of some rewards; all names and values are checked before any is changed.

        Raises:
            KeyError: a name is not a known reward (the message lists the known ones).
            ValueError: a weight is not a finite real number.
        """
        self._require_known(weights)
        checked = {name: _check_weight(name, w) for name, w in weights.items()}
        self._terms = {name: (fn, checked.get(name, w)) for name, (fn, w) in self._terms.items()}

    def _require_known(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._terms:
                raise KeyError(f"unknown reward {name!r}; known rewards: {sorted(self._terms)}")

    def score(self, prompt: str, completion: str, target: str, **info) -> RewardResult:
        """Score one completion with every reward (synchronously). See the module's failure rule."""
        return self.score_sample(prompt, completion, target, info)

    def score_episode(self, ep) -> RewardResult:
        """`score` of an `Episode`: TRL-style rewards also get its ``completion_ids`` and policy version."""
        return self.score_sample(ep.prompt, ep.completion, ep.target, ep.info, ep)

    def score_sample(self, prompt: str, completion: str, target: str, info: Mapping | None = None,
                     episode: object = None) -> RewardResult:
        """`score` with `info` as a mapping and the episode (or recorded row) TRL-style rewards read."""
        terms = self._terms  # one read: a concurrent swap does not affect this episode
        result = RewardResult(total=0.0)
        total = 0.0
        for name, (fn, weight) in terms.items():
            value, failure = call_reward(name, fn, prompt, completion, target, info, episode)
            if failure is not None:
                result.errors.append(failure)
                continue
            if value is not None:  # None: a TRL-style "does not apply", left out of parts and total
                result.parts[name] = value
                total += weight * value
        if terms and not result.parts and not result.errors:
            result.errors.append(RewardFailure(
                ",".join(terms), prompt, completion, target,
                "every reward returned None (TRL's 'does not apply'); the episode has no reward", "reward_none"))
        result.total = total
        return result

    def __call__(self, prompt: str, completion: str, target: str, **info) -> float:
        """The total as a plain reward function; raises ``ValueError`` if the episode failed."""
        result = self.score(prompt, completion, target, **info)
        if result.failed:
            raise ValueError(f"{result.drop_reason}: {result.errors[0].error_text}")
        return result.total

    def __repr__(self) -> str:
        return f"RewardComposer({self.weights})"


WeightedReward = RewardComposer


# --- validating a candidate reward ------------------------------------------------


@dataclass
class ValidationReport:
    """What a candidate reward did on a set of samples. Nothing is changed by producing it."""

    name: str
    n_samples: int
    values: list[float]
    """The values of the samples that succeeded, in order."""
    failures: list[RewardFailure]

    @property
    def ok(self) -> bool:
        """True if every sample gave a finite number (and there was at least one sample)."""
        return self.n_samples > 0 and not self.failures

    def __str__(self) -> str:
        if self.n_samples == 0:
            return f"reward {self.name!r}: no samples to validate on; generate some episodes first"
        head = f"reward {self.name!r}: {len(self.values)}/{self.n_samples} samples ok"
        if self.values:
            head += f", mean {sum(self.values) / len(self.values):.4g}"
        if not self.failures:
            return head
        first = self.failures[0]
        return (
            f"{head}; {len(self.failures)} failed. First failure on completion {first.completion[:80]!r} "
            f"(target {first.target!r}):\n{first.error_text}"
        )


def _unpack_sample(sample) -> tuple[str, str, str, dict, object]:
    if hasattr(sample, "completion") and hasattr(sample, "target"):  # an Episode or similar
        return sample.prompt, sample.completion, sample.target, dict(getattr(sample, "info", None) or {}), sample
    if len(sample) == 3:
        return sample[0], sample[1], sample[2], {}, None
    prompt, completion, target, info = sample
    return prompt, completion, target, dict(info or {}), None


def validate(fn: RewardFn, samples: Iterable, *, name: str | None = None) -> ValidationReport:
    """Run candidate reward ``fn`` over recent samples and report exceptions and non-finite values.

    Args:
        fn: the candidate reward.
        samples: ``(prompt, completion, target, info)`` or ``(prompt, completion, target)``
            tuples, or objects with those attributes (e.g. ``Episode``).
        name: the name to report failures under; default ``fn.__name__``.

    >>> report = validate(exact_answer, [("Compute 2+2", "4", "4", {}), ("Compute 2+3", "6", "5", {})])
    >>> report.ok, report.values
    (True, [1.0, 0.0])
    >>> print(validate(lambda p, c, t: int(c), [("", "x", "1")], name="parse"))  # doctest: +ELLIPSIS
    reward 'parse': 0/1 samples ok; 1 failed. First failure on completion 'x' (target '1'):
    Traceback (most recent call last):
    ...
    ValueError: invalid literal for int() with base 10: 'x'
    """
    name = name or getattr(fn, "__name__", "reward")
    fn = as_reward(fn)
    values: list[float] = []
    failures: list[RewardFailure] = []
    n = 0
    for sample in samples:
        n += 1
        prompt, completion, target, info, episode = _unpack_sample(sample)
        value, failure = call_reward(name, fn, prompt, completion, target, info, episode)
        if failure is not None:
            failures.append(failure)
        elif value is not None:  # None: a TRL-style "does not apply"
            values.append(value)
    return ValidationReport(name=name, n_samples=n, values=values, failures=failures)
