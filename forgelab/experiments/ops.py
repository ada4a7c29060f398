"""Experiment commands on a `Run` (one line each; the work lives in its own module).

    child = await run.fork(loss="dapo")                 # forgelab.experiments.fork
    child = await Run.fork_from(checkpoint, loss="dapo")
    df = run.rescore(my_reward)                         # forgelab.controller.rollout_log
    report = await run.compare_losses(["grpo", "dapo"]) # forgelab.experiments.loss_ab
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["Experiments"]


class Experiments:
    """Mixed into `forgelab.run.Run`."""

    async def fork(self, **overrides: Any):
        """A child run from this run's state at the next step boundary, then `overrides` (see forgelab.experiments.fork)."""
        from forgelab.experiments.fork import fork

        return await fork(self, **overrides)

    @classmethod
    async def fork_from(cls, checkpoint: str | Path, config: Any = None, **overrides: Any):
        """A child run from a saved checkpoint (see forgelab.experiments.fork.fork_from)."""
        from forgelab.experiments.fork import fork_from

        return await fork_from(checkpoint, config, run_cls=cls, **overrides)

    @classmethod
    async def replay(cls, run_dir: str | Path, *, until: int | None = None, **kwargs: Any):
        """Re-execute a recorded run with its live changes; a `ReplayReport` (see forgelab.experiments.replay)."""
        from forgelab.experiments.replay import replay

        return await replay(run_dir, until=until, run_cls=cls, **kwargs)

    def rescore(self, reward: Any, episodes: list[int] | None = None):
        """Old/new reward and advantage of recorded and recent rollouts under `reward`; no process touched."""
        from forgelab.controller.rollout_log import rescore_run

        return rescore_run(self, reward, episodes)

    async def compare_losses(self, losses: list, batch: dict | None = None):
        """Each loss on one frozen batch (default: the last trained one); trainer state untouched."""
        from forgelab.experiments.loss_ab import compare_losses

        return await compare_losses(self, losses, batch)
