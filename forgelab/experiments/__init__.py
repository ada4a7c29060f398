"""Experiment operations over a run: each a function over the run's parts, with a one-line method on `Run`.

    child = await run.fork(loss="dapo")                  fork.py     (a child from the next step boundary)
    report = await run.compare_losses(["grpo", "dapo"])  loss_ab.py  (losses on one frozen batch)
    report = await forgelab.replay(run_dir)              replay.py   (rerun a recorded run, compare metrics)

`fork` and `replay` are reached through `Run` (`run.fork`, `Run.replay`, `forgelab.replay`): the modules of
the same name are this package's attributes.
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "fork_from": "forgelab.experiments.fork",
    "SharedEngines": "forgelab.experiments.variants",
    "compare_losses": "forgelab.experiments.loss_ab",
    "LossComparison": "forgelab.experiments.loss_ab",
    "ReplayReport": "forgelab.experiments.replay",
    "compare_metrics": "forgelab.experiments.replay",
    "Primitives": "forgelab.experiments.primitives",
}
__all__ = sorted(_LAZY)
#: old public names, still resolved with a DeprecationWarning for one release (issue #38)
_DEPRECATED = {"Engines": ("forgelab.experiments.variants", "SharedEngines")}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, _DEPRECATED)
