"""The run's live commands that need more than a line: the loss hot swap, reward changes, waiting on a condition.

Each is a function over the run's parts; `Run` exposes it as a one-line method
(`run.set_loss`, `run.add_reward`, `run.remove_reward`, `run.until`).
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from forgelab.algos import LOSSES
from forgelab.rewards.library import RewardComposer, validate

__all__ = ["LossSwapRefused", "RewardChangeRefused", "RewardRevisions", "swap_loss", "add_reward", "rewards_for",
           "until"]


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


async def swap_loss(run: Any, loss: str | Callable, loss_kwargs: dict) -> dict:
    """Check the loss (name, keywords), dry-run it on the last batch, then set it on the trainer: it applies at
    the next step boundary (a `train_step` already running finishes with the old loss)."""
    if isinstance(loss, str) and loss not in LOSSES:
        raise LossSwapRefused(f"unknown loss {loss!r}; known: {', '.join(sorted(LOSSES))}; or pass your own function")
    if not isinstance(loss, str) and not callable(loss):
        raise LossSwapRefused(f"set_loss expects a loss name or a function, got {loss!r}")
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    from forgelab.algos.loss_checks import LossError, check_loss_kwargs, completion_budget, with_completion_budget

    try:  # a misspelt hyperparameter is refused before anything runs
        check_loss_kwargs(loss, loss_kwargs)
    except LossError as e:
        raise LossSwapRefused(str(e)) from None
    loss_kwargs = with_completion_budget(loss, loss_kwargs, completion_budget(run.config.rollout))
    from forgelab.controller.fncode import loss_record
    from forgelab.engines.trainer import pack_loss

    packed = loss if isinstance(loss, str) else pack_loss(loss)
    if run.last_batch is not None:
        report = (await run.trainer.call("dry_run_loss", packed, run.last_batch, loss_kwargs))[0]
        if not report.get("ok"):
            run.emit("loss_refused", loss=name, reason=report.get("reason"))
            raise LossSwapRefused(f"loss {name!r} refused on the last batch: {report.get('reason')}; "
                                  "the old loss keeps training")
    applies_at = run.step + (2 if run.training_in_flight else 1)
    await run.trainer.call("set_loss", packed, loss_kwargs)
    run.loss_name = name
    run.emit("loss_swapped", loss=name, kwargs=loss_kwargs, applies_at_step=applies_at, code=loss_record(loss))
    return {"loss": name, "applies_at_step": applies_at}


def add_reward(run: Any, name: str, fn: Callable[..., float], weight: float, replace: bool) -> None:
    """Validate `fn` on the latest 64 rollouts (if any), then add it; raises `RewardChangeRefused`."""
    from forgelab.controller.fncode import reward_record

    recent = list(run.rollout.recent) if run.rollout is not None else []
    samples = [(ep.prompt, ep.completion, ep.target, ep.info) for ep in recent[-64:]]
    if samples:
        report = validate(fn, samples, name=name)
        if not report.ok:
            raise RewardChangeRefused(f"reward {name!r} refused, the old rewards stay:\n{report}")
    run.rewards.add(name, fn, weight, replace=replace)
    run.reward_changed("reward_added", name=name, weight=weight, replace=replace, code=reward_record(fn))


def rewards_for(run: Any, flat: list) -> RewardComposer:
    """The reward set one rollout is scored with (a change lands between rollouts); the first rollout scored
    after a change records where it took effect (``reward_effective``: its first episode id)."""
    if run.replayer is not None and flat:
        run.replayer.before_scoring(run, min(ep.id for ep in flat))
    snapshot = run.rewards.snapshot()
    if flat and run.reward_revisions.unscored():
        run.emit("reward_effective", rev=run.reward_revisions.mark_scored(), first_episode=min(ep.id for ep in flat),
                 rewards=snapshot.weights)
    return snapshot


async def until(run: Any, step: int | None, predicate: Callable[[Any], bool] | None, timeout: float | None) -> Any:
    """Wait until ``run.step >= step`` and ``predicate(run)`` hold, re-checked on each step and event the run
    notifies its listeners of (no polling). Raises `RuntimeError` if the run ends first (its own failure if it
    failed) and `asyncio.TimeoutError` after `timeout` seconds."""
    def met() -> bool:
        return (step is None or run.step >= step) and (predicate is None or bool(predicate(run)))

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

    run.add_listener(wake)
    try:
        await asyncio.wait_for(wait(), timeout)
    finally:
        run.remove_listener(wake)
    return run
