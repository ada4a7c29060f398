"""The run's live commands that need more than a line: the loss hot swap, reward changes, waiting on a condition.

Each is a function over the run's parts; `Run` exposes it as a one-line method
(`run.set_loss`, `run.add_reward`, `run.remove_reward`, `run.until`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from forgelab.algos import LOSSES
from forgelab.rewards.library import RewardComposer, validate

log = logging.getLogger("forgelab.controller.controls")

__all__ = ["Command", "LossSwapRefused", "RewardChangeRefused", "RewardRevisions", "prepare_loss", "swap_loss", "add_reward",
           "set_distill_coef", "rewards_for", "until"]


class Command:
    """A live command, started at once on the running event loop: ``await`` it for its result or its error.

    A coroutine that is never awaited never runs, silently (``run.set_loss("dapo")`` without ``await`` in a
    notebook cell). A command runs either way; one that fails and was not awaited logs why. With no event loop
    running (a plain script), it starts when awaited, like a coroutine.
    """

    def __init__(self, coro: Any, what: str):
        self.what, self.awaited = what, False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._coro = coro if loop is None else None
        self.task = None if loop is None else loop.create_task(coro)
        if self.task is not None:
            self.task.add_done_callback(self._done)

    def __await__(self):
        self.awaited = True
        return (self.task if self.task is not None else self._coro).__await__()

    def _done(self, task: asyncio.Task) -> None:
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


def prepare_loss(config: Any, loss: str | Callable, loss_kwargs: dict) -> tuple[str, Any, dict]:
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


async def swap_loss(run: Any, loss: str | Callable, loss_kwargs: dict) -> dict:
    """Check the loss (name, keywords), dry-run it on the last batch, then set it on the trainer: it applies at
    the next step boundary (a `train_step` already running finishes with the old loss)."""
    name, packed, loss_kwargs = prepare_loss(run.config, loss, loss_kwargs)
    from forgelab.controller.fncode import loss_record

    if run.last_batch is not None:
        report = await run.trainer.dry_run_loss(packed, run.last_batch, loss_kwargs)
        if not report.ok:
            run.emit("loss_refused", loss=name, reason=report.reason)
            raise LossSwapRefused(f"loss {name!r} refused on the last batch: {report.reason}; "
                                  "the old loss keeps training")
    applies_at = run.step + (2 if run.training_in_flight else 1)
    await run.trainer.set_loss(packed, loss_kwargs)
    run.loss_name = name
    run.emit("loss_swapped", loss=name, kwargs=loss_kwargs, applies_at_step=applies_at, code=loss_record(loss))
    return {"loss": name, "applies_at_step": applies_at}


def add_reward(run: Any, name: str, fn: Callable[..., float], weight: float, replace: bool) -> None:
    """Validate `fn` on the latest 64 rollouts (if any), then add it; raises `RewardChangeRefused`."""
    from forgelab.controller.fncode import reward_record

    recent = list(run.rollout.recent) if run.rollout is not None else []
    samples = recent[-64:]  # episodes: a TRL-style reward also reads their token ids and policy version
    if samples:
        report = validate(fn, samples, name=name)
        if not report.ok:
            raise RewardChangeRefused(f"reward {name!r} refused, the old rewards stay:\n{report}")
    run.rewards.add(name, fn, weight, replace=replace)
    run.reward_changed("reward_added", name=name, weight=weight, replace=replace, code=reward_record(fn))


def set_distill_coef(run: Any, coef: float) -> None:
    """`Run.set_distill_coef`: a reward-like change (its revision takes effect at the next scored rollout,
    recorded as ``reward_effective`` with the coefficient in it)."""
    import math

    if not run.config.teacher.enabled:
        raise RewardChangeRefused("run.set_distill_coef: this run has no teacher; set teacher.model_dir in the "
                                  "config to distil (on-policy distillation needs a teacher from the start)")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise RewardChangeRefused(f"run.set_distill_coef: {coef!r} is not a finite number; the old coefficient "
                                  f"({run.distill_coef}) stays")
    old, run.distill_coef = run.distill_coef, float(coef)
    run.reward_changed("distill_coef", old=old, new=float(coef))


def rewards_for(run: Any, flat: list) -> RewardComposer:
    """The reward set one rollout is scored with (a change lands between rollouts); the first rollout scored
    after a change records where it took effect (``reward_effective``: its first episode id)."""
    if run.replayer is not None and flat:
        run.replayer.before_scoring(run, min(ep.id for ep in flat))
    snapshot = run.rewards.snapshot()
    if flat and run.reward_revisions.unscored():
        distill = {"distill_coef": run.distill_coef} if run.config.teacher.enabled else {}
        run.emit("reward_effective", rev=run.reward_revisions.mark_scored(), first_episode=min(ep.id for ep in flat),
                 rewards=snapshot.weights, **distill)
    return snapshot


async def until(run: Any, step: int | None, predicate: Callable[[Any], bool] | None, timeout: float | None) -> Any:
    """Wait until step `step` is done (its metrics row logged: ``run.metrics`` has it) and ``predicate(run)``
    holds, re-checked on each step and event the run notifies its listeners of and each time episodes close in
    its buffer (trained, evicted or dropped; no polling). Raises
    `RuntimeError` if the run ends first (its own failure if it failed) and `asyncio.TimeoutError` after
    `timeout` seconds."""
    def logged() -> int:  # run.step moves first; the row is logged after the weight push
        rows = run.tracker.rows if run.tracker is not None else []
        return int(rows[-1]["step"]) if rows else 0

    def met() -> bool:
        return (step is None or (run.step >= step and logged() >= step)) and (predicate is None or bool(predicate(run)))

    loop, changed = asyncio.get_running_loop(), asyncio.Event()

    def wake(_msg: dict) -> None:  # service events may arrive on other threads
        loop.call_soon_threadsafe(changed.set)

    async def wait() -> None:
        while not met():
            main = run.main_task
            if main is None or main.done():
                if main is not None and not main.cancelled() and main.exception() is not None:
                    raise main.exception()
                raise RuntimeError(f"run ended ({run.state}, step {run.step}) before the awaited condition held")
            changed.clear()
            waiter = asyncio.ensure_future(changed.wait())
            await asyncio.wait({waiter, main}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    def closed(_episodes: list, _status: str, _reason: str) -> None:  # drops and evictions between steps too
        wake({})

    run.add_listener(wake)
    run.buffer.add_close_listener(closed)
    try:
        await asyncio.wait_for(wait(), timeout)
    finally:
        run.remove_listener(wake)
        run.buffer.remove_close_listener(closed)
    return run
