"""Runs the user's reward functions on episodes: each call on a thread of its own, a timeout, a cap on hung calls.

A reward is user code: it may raise, return garbage, or hang. `RewardRunner.score`
scores a list of episodes concurrently and returns the drop reason of each
episode that could not be scored; the others get `reward += total` and their
`reward_parts` extended (an environment's own reward, if any, is kept and added to).

- A call that raises or returns a non-finite value fails its episode (the
  composer names the reward, see `forgelab.rewards.library`).
- A call that outlives `timeout_s` is abandoned: its episode is dropped with
  reason ``reward_timeout``; its thread keeps running (Python cannot kill it) and
  is counted in `hung`. `hung_message()` says when `MAX_HUNG_REWARD_CALLS` of them
  are still running, and the run pauses.

Each call gets a thread of its own, never a place in a queue: a hung call then
holds only its own thread, never a worker that other episodes queue behind (which
would also make their timeouts count queueing time). The threads are kept and
reused (`_Workers`: an idle one takes the next call, a call that finds none idle
starts a new one), because starting a thread per call blocks the controller's
event loop until the OS schedules it: 64 starts a step cost the e2e run ~30 ms a
step of a stalled loop on 2 busy cores.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from forgelab.config.run_config import RolloutConfig
    from forgelab.controller.events import Emit

from forgelab.rewards.library import RewardComposer, RewardFailure, RewardResult
from forgelab.types import Episode

__all__ = ["RewardRunner", "MAX_HUNG_REWARD_CALLS", "DEFAULT_REWARDS", "reward_weights", "configured_rewards"]

MAX_HUNG_REWARD_CALLS = 32
"""Abandoned (timed-out) reward calls still running before the run pauses: each holds a thread."""


DEFAULT_REWARDS = {"exact_answer": 1.0, "answer_format": 0.1}
"""`rollout.rewards: null` on a single-turn run; an environment run adds no reward to the environment's."""


def reward_weights(rollout: RolloutConfig | Mapping[str, object]) -> dict[str, float]:
    """The rewards a run starts with (name -> weight): `rollout.rewards`, or the default for the run's kind.
    `rollout` is a `RolloutConfig` or its dict (a saved run's config).

    >>> reward_weights({"rewards": None, "env": None}), reward_weights({"rewards": None, "env": "echo"})
    ({'exact_answer': 1.0, 'answer_format': 0.1}, {})
    """
    if isinstance(rollout, dict):
        rewards, env, task = rollout.get("rewards"), rollout.get("env"), rollout.get("task")
        partial = bool((rollout.get("reasoning_gym") or {}).get("partial_credit"))
    else:
        rewards, env, task = getattr(rollout, "rewards"), getattr(rollout, "env"), getattr(rollout, "task")
        partial = bool(getattr(getattr(rollout, "reasoning_gym", None), "partial_credit", False))
    if rewards is not None:
        return dict(rewards)
    if env is not None:
        return {}
    if task == "reasoning_gym":  # the task's own score_answer (forgelab.rewards.reasoning_gym)
        return {"reasoning_gym_partial" if partial else "reasoning_gym": 1.0}
    return dict(DEFAULT_REWARDS)


def configured_rewards(rollout: RolloutConfig | Mapping[str, object]) -> RewardComposer:
    """The `RewardComposer` a run starts with (`reward_weights`)."""
    from forgelab.rewards.library import resolve_reward

    return RewardComposer({name: (resolve_reward(name), float(w)) for name, w in reward_weights(rollout).items()})


class _Call:
    """One reward call handed to a worker thread; `is_alive()` while it runs (a hung call stays alive)."""

    __slots__ = ("fn", "done")

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.done = fn, False

    def is_alive(self) -> bool:
        return not self.done


class _Workers:
    """Daemon threads that run `_Call`s: an idle thread takes the next call; a call that finds no idle
    thread starts a new one, so a call never waits behind another. At most `max_idle` threads wait for work."""

    def __init__(self, max_idle: int = 128):
        self.max_idle = max_idle
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._names = itertools.count()

    def submit(self, call: _Call) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # one waiting thread is now promised to this call
                self._queue.put(call)
                return
        threading.Thread(target=self._work, args=(call,), name=f"forgelab-reward-{next(self._names)}",
                         daemon=True).start()

    def _work(self, call: _Call) -> None:
        while True:
            try:
                call.fn()
            finally:
                call.done = True
            with self._lock:
                if self._idle >= self.max_idle:
                    return
                self._idle += 1
            call = self._queue.get()


_WORKERS = _Workers()
"""One pool per process: runs come and go in a notebook, the threads stay few."""


class RewardRunner:
    """Scores episodes with a `RewardComposer` in threads under a timeout.

    Args:
        composer: the run's rewards (changed live by `Run.add_reward` & co.).
        timeout_s: seconds one episode's scoring may take.
        emit: ``emit(kind, **fields)`` records an event; each failed episode is a ``reward_error`` event
            with its reason, its input (prompt, completion, target) and the error's text.
    """

    def __init__(self, composer: RewardComposer, timeout_s: float, emit: Emit | None = None) -> None:
        self.composer = composer
        self.timeout_s = timeout_s
        self.emit = emit
        self.failures: deque[RewardFailure] = deque(maxlen=200)  # the latest; the event log keeps them all
        self.hung: list[_Call] = []  # timed-out calls, abandoned but maybe still running (`is_alive()`)

    async def score(self, episodes: list[Episode], composer: RewardComposer | None = None) -> dict[int, str]:
        """Score every episode (with `composer`, default the runner's); return ``{episode id: drop reason}``
        for those that failed."""
        composer = composer or self.composer
        if not episodes or not composer.names:
            return {}
        results = await asyncio.gather(*(self._score_one(ep, composer) for ep in episodes), return_exceptions=True)
        self.hung = [t for t in self.hung if t.is_alive()]
        failed: dict[int, str] = {}
        for ep, res in zip(episodes, results):
            if isinstance(res, asyncio.TimeoutError):
                why = f"reward took longer than rollout.reward_timeout_s={self.timeout_s}s"
                failed[ep.id] = self._fail(ep, RewardFailure("timeout", ep.prompt, ep.completion, ep.target, why),
                                           "reward_timeout")
            elif isinstance(res, BaseException):
                fail = RewardFailure("composer", ep.prompt, ep.completion, ep.target, f"{type(res).__name__}: {res}")
                failed[ep.id] = self._fail(ep, fail, fail.drop_reason)
            elif res.failed:
                self.failures.extend(res.errors[1:])
                failed[ep.id] = self._fail(ep, res.errors[0], res.errors[0].drop_reason)  # = res.drop_reason
            else:
                ep.reward += res.total
                ep.reward_parts = {**ep.reward_parts, **res.parts}
        return failed

    def _fail(self, ep: Episode, failure: RewardFailure, reason: str) -> str:
        self.failures.append(failure)
        if self.emit is not None:
            self.emit("reward_error", reason=reason, prompt=ep.prompt, completion=ep.completion, target=ep.target,
                      error=failure.error_text[-500:])
        return reason

    async def _score_one(self, ep: Episode, composer: RewardComposer) -> RewardResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RewardResult] = loop.create_future()

        def settle(value: RewardResult | None, error: BaseException | None) -> None:
            if fut.done():  # already cancelled by the timeout
                return
            if error is not None:
                fut.set_exception(error)
            elif value is not None:  # always, when there is no error
                fut.set_result(value)

        def work() -> None:
            value: RewardResult | None
            error: BaseException | None
            try:
                value, error = composer.score_episode(ep), None  # TRL-style rewards read its token ids
            except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine
                value, error = None, e
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop closed while this call hung
                pass

        call = _Call(work)
        _WORKERS.submit(call)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            self.hung.append(call)
            raise

    def hung_message(self) -> str | None:
        """A message for people when too many abandoned calls still run (the run pauses on it), else None."""
        self.hung = [t for t in self.hung if t.is_alive()]
        if len(self.hung) < MAX_HUNG_REWARD_CALLS:
            return None
        last = self.failures[-1] if self.failures else None
        return (
            f"paused: {len(self.hung)} reward calls exceeded rollout.reward_timeout_s={self.timeout_s}s and are "
            f"still running (each holds a thread); rewards: {self.composer.names}; last input: "
            f"{getattr(last, 'completion', '')[:80]!r}. Fix or remove the hanging reward "
            "(run.remove_reward(name) / run.add_reward(name, fn, replace=True)), then run.resume()"
        )
