"""The run's live commands that need more than a line: the loss hot swap, reward changes, waiting on a condition.

`RewardControls` owns the live reward set, its revisions and the distillation coefficient; `prepare_loss`
checks a loss before the training loop swaps it in (`TrainingLoop.swap_loss`); `wait_until` waits on a
condition over the run's events. `Run` exposes each as a one-line method (`run.set_loss`, `run.add_reward`,
`run.remove_reward`, `run.until`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Callable, Generic, Protocol, TypeVar

from forgelab.algos import LOSSES
from forgelab.controller.buffer import ReplayBuffer
from forgelab.controller.events import Emitter, Event, EventBus
from forgelab.rewards.library import RewardComposer, RewardFn, validate
from forgelab.types import Episode

if TYPE_CHECKING:
    from forgelab.config.run_config import RunConfig
    from forgelab.engines.loss_specs import LossSpec

T = TypeVar("T")

log = logging.getLogger("forgelab.controller.controls")

__all__ = ["Command", "LossSwapRefused", "RewardChangeRefused", "RewardRevisions", "RewardControls", "prepare_loss",
           "wait_until"]


class Command(Generic[T]):
    """A live command, started at once on the running event loop: ``await`` it for its result or its error.

    A coroutine that is never awaited never runs, silently (``run.set_loss("dapo")`` without ``await`` in a
    notebook cell). A command runs either way; one that fails and was not awaited logs why. With no event loop
    running (a plain script), it starts when awaited, like a coroutine.
    """

    def __init__(self, coro: Coroutine[object, object, T], what: str):
        self.what, self.awaited = what, False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._coro = coro if loop is None else None
        self.task: asyncio.Task[T] | None = None if loop is None else loop.create_task(coro)
        if self.task is not None:
            self.task.add_done_callback(self._done)

    def __await__(self) -> Generator[object, None, T]:
        self.awaited = True
        if self.task is not None:
            return self.task.__await__()
        assert self._coro is not None  # __init__ keeps the coroutine exactly when it made no task
        return self._coro.__await__()

    def _done(self, task: asyncio.Task[T]) -> None:
        if not task.cancelled() and task.exception() is not None and not self.awaited:
            log.warning("forgelab: %s failed and nothing awaited it: %s: %s", self.what,
                        type(task.exception()).__name__, task.exception())

    def __repr__(self) -> str:
        t = self.task
        if t is None or not t.done():
            return f"<{self.what}: running (await it for the result)>"
        if t.cancelled():
            return f"<{self.what}: cancelled>"
        return f"<{self.what}: failed: {t.exception()!r}>" if t.exception() is not None else f"<{self.what}: {t.result()!r}>"


class RewardRevisions:
    """Counts reward changes made and the one the rollouts were last scored with, so the first rollout scored
    after a change can record where it took effect (``reward_effective``)."""

    def __init__(self) -> None:
        self.made = 0
        self.scored = 0

    def bump(self) -> int:
        """A change was made; its revision number."""
        self.made += 1
        return self.made

    def unscored(self) -> bool:
        """A change was made that no rollout has been scored with yet."""
        return self.made != self.scored

    def mark_scored(self) -> int:
        """The rollouts are now scored with the latest change; its revision number."""
        self.scored = self.made
        return self.made


class LossSwapRefused(ValueError):
    """A loss failed its dry run on the last batch; the old loss keeps training."""


class RewardChangeRefused(ValueError):
    """A reward failed validation on recent rollouts; the old rewards stay."""


def prepare_loss(config: RunConfig, loss: LossSpec,
                 loss_kwargs: dict[str, object]) -> tuple[str, LossSpec, dict[str, object]]:
    """``(name, spec for the trainer, keywords)`` of a loss as the trainer will run it: the name checked, the
    keywords checked (a misspelt hyperparameter is refused before anything runs) and completed with the
    completion budget (``max_tokens``, for ``dr_grpo``-style losses), a function packed by value.
    `Run.set_loss` and `Run.compare_losses` both resolve losses here. Raises `LossSwapRefused`."""
    if isinstance(loss, str) and loss not in LOSSES:
        raise LossSwapRefused(f"unknown loss {loss!r}; known: {', '.join(sorted(LOSSES))}; or pass your own function")
    if not isinstance(loss, str) and not callable(loss):
        raise LossSwapRefused(f"expected a loss name or a function, got {loss!r}")
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    from forgelab.algos.loss_checks import (LossError, check_loss_kwargs, completion_budget, with_completion_budget,
                                            without_reference)

    try:
        check_loss_kwargs(loss, loss_kwargs)
    except LossError as e:
        raise LossSwapRefused(str(e)) from None
    loss_kwargs = with_completion_budget(loss, dict(loss_kwargs), completion_budget(config.rollout))
    if not config.placement.reference:  # the same rule as the config's: an explicit kl_coef > 0 is refused
        try:
            loss_kwargs, note = without_reference(loss, loss_kwargs)
        except LossError as e:
            raise LossSwapRefused(str(e)) from None
        if note is not None:
            log.warning("forgelab: %s", note)
    from forgelab.engines.loss_specs import shipped_loss

    # a built-in travels by name; a function, or a LOSSES entry only this process has, by value
    return name, shipped_loss(loss), loss_kwargs


class ScoringHook(Protocol):
    """Called before a rollout is scored (a replay re-applies its recorded reward changes here)."""

    def before_scoring(self, first_episode: int) -> None: ...


class RewardControls:
    """The run's reward set as it changes live, and the one writer of what goes with it: the revision counter
    (`RewardRevisions`) and the distillation coefficient.

    Args:
        composer: the run's `RewardComposer` (the same object widgets and the scorer hold).
        bus: the run's `EventBus` (``reward_*`` / ``distill_coef`` / ``reward_effective`` events).
        teacher_enabled: the run distils (``teacher`` in its config): `set_distill_coef` is allowed.
        distill_coef: the coefficient the run starts with (``teacher.coef``).
        recent: ``() -> episodes`` a new reward is validated on (the newest rollouts), empty before any.
    """

    def __init__(self, composer: RewardComposer, bus: Emitter, *, teacher_enabled: bool, distill_coef: float,
                 recent: Callable[[], list[Episode]] = list) -> None:
        self.composer, self.bus, self.teacher_enabled = composer, bus, teacher_enabled
        self.distill_coef = float(distill_coef)
        self.revisions = RewardRevisions()
        self.recent = recent
        self.hook: ScoringHook | None = None

    @property
    def names(self) -> list[str]:
        return self.composer.names

    def validate_on(self, recent: Callable[[], list[Episode]]) -> None:
        """Where new rewards find the rollouts they are validated on (the run's `Rollouts`, once it has one)."""
        self.recent = recent

    def set_hook(self, hook: ScoringHook | None) -> None:
        """Called before each rollout is scored (a replay's `Replayer`)."""
        self.hook = hook

    def changed(self, kind: str, **fields: object) -> None:
        """Record a change to the reward set (the event carries its revision number)."""
        self.bus.emit(kind, **fields, rev=self.revisions.bump())

    def set_weights(self, weights: dict[str, float]) -> None:
        old = self.composer.weights
        self.composer.set_weights(weights)
        self.changed("reward_weights", old=old, new=self.composer.weights)

    def remove(self, name: str) -> None:
        self.composer.remove(name)
        self.changed("reward_removed", name=name)

    def add(self, name: str, fn: RewardFn, weight: float, replace: bool) -> None:
        """Validate `fn` on the latest 64 rollouts (if any), then add it; raises `RewardChangeRefused`."""
        from forgelab.controller.function_code import reward_record

        samples = list(self.recent())[-64:]  # episodes: a TRL-style reward also reads their token ids and version
        if samples:
            report = validate(fn, samples, name=name)
            if not report.ok:
                raise RewardChangeRefused(f"reward {name!r} refused, the old rewards stay:\n{report}")
        self.composer.add(name, fn, weight, replace=replace)
        self.changed("reward_added", name=name, weight=weight, replace=replace, code=reward_record(fn))

    def set_distill_coef(self, coef: float) -> None:
        """`Run.set_distill_coef`: a reward-like change (its revision takes effect at the next scored rollout,
        recorded as ``reward_effective`` with the coefficient in it)."""
        import math

        if not self.teacher_enabled:
            raise RewardChangeRefused("run.set_distill_coef: this run has no teacher; set teacher.model_dir in the "
                                      "config to distil (on-policy distillation needs a teacher from the start)")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
            raise RewardChangeRefused(f"run.set_distill_coef: {coef!r} is not a finite number; the old coefficient "
                                      f"({self.distill_coef}) stays")
        old, self.distill_coef = self.distill_coef, float(coef)
        self.changed("distill_coef", old=old, new=float(coef))

    def restore(self, composer: RewardComposer | None, weights: dict[str, float] | None,
                distill_coef: float | None) -> None:
        """A checkpoint's reward set (or, from before reward code was saved, its weights of the rewards this run
        knows) and its live distillation coefficient."""
        if composer is not None:
            self.composer.replace_all(composer)  # same composer object: widgets and the scorer hold it
        elif weights is not None:
            self.composer.set_weights({k: v for k, v in weights.items() if k in self.composer.weights})
        if distill_coef is not None:  # the coefficient as the run had changed it, not the config's
            self.distill_coef = float(distill_coef)

    def rewards_for(self, flat: list[Episode]) -> RewardComposer:
        """The reward set one rollout is scored with (a change lands between rollouts); the first rollout scored
        after a change records where it took effect (``reward_effective``: its first episode id)."""
        if self.hook is not None and flat:
            self.hook.before_scoring(min(ep.id for ep in flat))
        snapshot = self.composer.snapshot()
        if flat and self.revisions.unscored():
            distill = {"distill_coef": self.distill_coef} if self.teacher_enabled else {}
            self.bus.emit("reward_effective", rev=self.revisions.mark_scored(), first_episode=min(ep.id for ep in flat),
                          rewards=snapshot.weights, **distill)
        return snapshot


async def wait_until(met: Callable[[], bool], *, bus: EventBus, buffer: ReplayBuffer,
                     main_task: Callable[[], "asyncio.Task[None] | None"], describe: Callable[[], str],
                     timeout: float | None) -> None:
    """Wait until ``met()`` holds, re-checked on each step and event the `bus` tells its listeners of and each
    time episodes close in the `buffer` (trained, evicted or dropped; no polling). Raises `RuntimeError` if the
    run's ``main_task()`` ends first (its own failure if it failed; ``describe()`` says where the run stopped)
    and `asyncio.TimeoutError` after `timeout` seconds."""
    loop, changed = asyncio.get_running_loop(), asyncio.Event()

    def wake(_msg: Event) -> None:  # service events may arrive on other threads
        loop.call_soon_threadsafe(changed.set)

    async def wait() -> None:
        while not met():
            main = main_task()
            if main is None or main.done():
                failure = None if main is None or main.cancelled() else main.exception()
                if failure is not None:
                    raise failure
                raise RuntimeError(f"run ended ({describe()}) before the awaited condition held")
            changed.clear()
            waiter = asyncio.ensure_future(changed.wait())
            await asyncio.wait({waiter, main}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    def closed(_episodes: list[Episode], _status: str, _reason: str) -> None:  # drops and evictions between steps too
        wake({})

    bus.add_listener(wake)
    buffer.add_close_listener(closed)
    try:
        await asyncio.wait_for(wait(), timeout)
    finally:
        bus.remove_listener(wake)
        buffer.remove_close_listener(closed)
