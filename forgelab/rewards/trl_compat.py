"""TRL-style reward functions, unchanged: ``reward(completions, **kwargs) -> list[float]``.

TRL's `GRPOTrainer` calls each reward function once per batch with keyword arguments: ``prompts``,
``completions`` (text, or for chat prompts a list with one assistant message per completion),
``completion_ids``, every dataset column but ``prompt`` (one list each), ``trainer_state`` (its
``global_step``), and ``log_extra`` / ``log_metric``; it returns one float per completion, or ``None`` where
the reward does not apply. forgelab's rewards are per sample, ``fn(prompt, completion, target, **info)``.
`TRLReward` is the adapter: a per-sample forgelab reward that calls the TRL function with a batch of one
episode, built exactly as TRL builds its batch, so every place a forgelab reward goes (``rollout.rewards``,
`Run.add_reward`, hot swaps, `Run.rescore`, replays) takes a TRL function too.

    from trl.rewards import think_format_reward
    run.add_reward("think", think_format_reward)      # recognised by its signature, adapted
    run.add_reward("judge", trl_reward(my_fn))         # explicit, for a signature that could be either

Recognition (`is_trl_reward`): a function (or callable object) whose parameters name ``completions``,
``prompts`` or ``completion_ids`` is TRL-style; one whose first three parameters are positional (forgelab's
``prompt, completion, target``) is forgelab's. A bare ``(**kwargs)`` or ``(*args, **kwargs)`` is ambiguous
and stays forgelab's: wrap it with `trl_reward`.

What the TRL function receives for one episode (`trl_kwargs`): ``prompts=[p]`` where ``p`` is the problem's
chat messages (``info["prompt_messages"]``, set by the dataset loader for chat-format prompts) or its text;
``completions=[[{"role": "assistant", "content": text}]]`` for chat prompts, else ``[text]``;
``completion_ids=[ids]`` (the generated token ids; ``[None]`` where the caller has no episode);
``trainer_state`` with ``global_step`` = the policy version that generated the episode (the optimizer steps
done, as TRL's ``state.global_step`` at generation); each ``info`` column (and ``target``) as a one-element
list; ``log_extra``/``log_metric``, which keep the latest values on the adapter (`TRLReward.logged`).

``None`` (TRL's "does not apply") is not a failure: the reward is left out of the episode's parts and adds
nothing to its total (TRL's ``nansum``); an episode for which every reward returned ``None`` is dropped with
reason ``reward_none`` (TRL excludes it from the group's baseline and trains it with advantage 0; see
docs/from_trl.md). Async reward functions are awaited on one event loop in a daemon thread, as TRL does.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["TRLReward", "TrainerStateLike", "as_reward", "is_trl_reward", "trl_reward", "trl_kwargs",
           "PROMPT_MESSAGES"]

PROMPT_MESSAGES = "prompt_messages"
"""The `info` key holding a chat-format problem's messages (system prompt included), set by the dataset loader."""

_TRL_NAMES = ("completions", "prompts", "completion_ids")
_NOT_COLUMNS = (PROMPT_MESSAGES, "turns", "outcome", "error")  # forgelab's own episode info, never a dataset column


@dataclass(frozen=True)
class TrainerStateLike:
    """What a TRL reward reads from ``trainer_state``: ``global_step`` (optimizer steps done when the episode
    was generated: its policy version) and ``max_steps`` (``train.steps`` where known, else None)."""

    global_step: int = 0
    max_steps: int | None = None
    epoch: float | None = None


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def is_trl_reward(fn: Callable) -> bool:
    """True if `fn` has TRL's batched signature (a parameter named ``completions``, ``prompts`` or
    ``completion_ids``) rather than forgelab's ``(prompt, completion, target, **info)``.

    >>> is_trl_reward(lambda completions, **kw: [1.0]), is_trl_reward(lambda prompt, completion, target, **i: 1.0)
    (True, False)
    >>> is_trl_reward(lambda **kwargs: [1.0])   # ambiguous: stays forgelab's (wrap it with trl_reward)
    False
    """
    if isinstance(fn, TRLReward):
        return False  # already adapted
    sig = _signature(fn)
    if sig is None:
        return False
    return any(name in sig.parameters for name in _TRL_NAMES)


class TRLReward:
    """A TRL-style batched reward as a forgelab per-sample reward (see the module docstring).

    Args:
        fn: ``fn(completions, **kwargs) -> list[float | None]``, sync or async.
        max_steps: what ``trainer_state.max_steps`` says (TRL: the run's total steps); None if unknown.
        name: shown in errors; default ``fn.__name__``.
    """

    none_is_not_applicable = True
    """A ``None`` result means "does not apply" (TRL), not a failure."""

    def __init__(self, fn: Callable, *, max_steps: int | None = None, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"trl_reward: expected a callable reward(completions, **kwargs), got {fn!r}")
        self.fn = fn
        self.__wrapped__ = fn
        self.max_steps = max_steps
        self.__name__ = name or getattr(fn, "__name__", type(fn).__name__)
        self.logged: dict[str, Any] = {}
        """The latest ``log_extra(column, values)`` / ``log_metric(name, value)`` calls, by name."""

    def __repr__(self) -> str:
        return f"trl_reward({self.__name__})"

    def __call__(self, prompt: str, completion: str, target: str, **info: Any) -> float | None:
        """The reward of one completion without its episode (``completion_ids=[None]``, ``global_step`` 0)."""
        return self.call_one(prompt, completion, target, info, None)

    def call_one(self, prompt: str, completion: str, target: str, info: Mapping | None,
                 episode: Any = None) -> float | None:
        """The reward of one episode: the TRL function on a batch of one; its one value, or None."""
        kwargs = trl_kwargs(prompt, completion, target, info or {}, episode, max_steps=self.max_steps,
                            log_extra=self._log_extra, log_metric=self._log_metric)
        out = self.fn(**kwargs)
        if inspect.isawaitable(out):
            out = _run_async(out)
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
            raise TypeError(f"TRL-style reward {self.__name__!r} returned {out!r}; it must return a list with one "
                            "reward per completion")
        if len(out) != 1:
            raise ValueError(f"TRL-style reward {self.__name__!r} returned {len(out)} rewards for 1 completion; "
                             "it must return exactly one reward per completion")
        value = out[0]
        return None if value is None else (value.item() if hasattr(value, "item") else value)

    def _log_extra(self, column: str, values: list) -> None:
        self.logged[column] = values

    def _log_metric(self, name: str, value: float) -> None:
        self.logged[name] = value

    def __getstate__(self) -> dict:
        return {**self.__dict__, "logged": {}}


def trl_reward(fn: Callable, *, max_steps: int | None = None) -> TRLReward:
    """Mark `fn` as a TRL-style reward explicitly (for a signature `is_trl_reward` calls ambiguous, such as
    ``(**kwargs)``); the result is a forgelab reward."""
    return fn if isinstance(fn, TRLReward) else TRLReward(fn, max_steps=max_steps)


def as_reward(fn: Callable) -> Callable:
    """`fn` as a forgelab reward: a TRL-style function adapted (`TRLReward`), anything else unchanged."""
    return TRLReward(fn) if is_trl_reward(fn) else fn


def _field(episode: Any, name: str, default: Any = None) -> Any:
    if episode is None:
        return default
    if isinstance(episode, Mapping):
        return episode.get(name, default)
    return getattr(episode, name, default)


def trl_kwargs(prompt: str, completion: str, target: str, info: Mapping, episode: Any = None, *,
               max_steps: int | None = None, log_extra: Callable | None = None,
               log_metric: Callable | None = None) -> dict[str, Any]:
    """The keyword arguments TRL's `GRPOTrainer` would pass for this one completion (a batch of one).

    `episode` is an `Episode` or a recorded rollout row (a mapping): it gives ``completion_ids`` and the
    policy version (``trainer_state.global_step``).

    >>> kw = trl_kwargs("2+2=", "4", "4", {"solution": "4"}, {"completion_ids": [7], "policy_version": 3})
    >>> kw["prompts"], kw["completions"], kw["completion_ids"], kw["solution"], kw["trainer_state"].global_step
    (['2+2='], ['4'], [[7]], ['4'], 3)
    >>> trl_kwargs("hi", "yo", "", {"prompt_messages": [{"role": "user", "content": "hi"}]})["completions"]
    [[{'role': 'assistant', 'content': 'yo'}]]
    """
    messages = info.get(PROMPT_MESSAGES)
    chat = messages is not None
    ids = _field(episode, "completion_ids")
    step = _field(episode, "policy_version", 0)
    kwargs: dict[str, Any] = {
        "prompts": [list(messages) if chat else prompt],
        "completions": [[{"role": "assistant", "content": completion}] if chat else completion],
        "completion_ids": [None if ids is None else [int(t) for t in ids]],
        "target": [target],
    }
    for key, value in info.items():
        if key not in _NOT_COLUMNS and key not in kwargs:
            kwargs[key] = [value]
    kwargs["trainer_state"] = TrainerStateLike(global_step=int(step or 0), max_steps=max_steps)
    kwargs["log_extra"] = log_extra or (lambda column, values: None)
    kwargs["log_metric"] = log_metric or (lambda name, value: None)
    return kwargs


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _run_async(awaitable: Any) -> Any:
    """Await `awaitable` on the adapter's event loop (one daemon thread per process, as TRL keeps one)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="forgelab-trl-rewards", daemon=True).start()
            _LOOP = loop

    async def wrap() -> Any:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrap(), _LOOP).result()
