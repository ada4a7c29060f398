"""Deprecated (kept one release for old imports): the experiment commands are methods of `forgelab.run.Run`.

`Run.fork`, `Run.fork_from`, `Run.replay`, `Run.rescore` and `Run.compare_losses` each call their module
(`forgelab.experiments.fork`, `.replay`, `.loss_ab`, `forgelab.controller.rollout_log`); this mixin is empty.
"""
from __future__ import annotations

import warnings

__all__ = ["Experiments"]

warnings.warn("forgelab.experiments.ops is deprecated: the experiment commands are forgelab.Run methods",
              DeprecationWarning, stacklevel=2)


class Experiments:
    """Deprecated: an empty mixin (the commands are `forgelab.run.Run` methods)."""
