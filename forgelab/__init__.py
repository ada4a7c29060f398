"""forgelab: a Jupyter-first research toolkit for reinforcement learning of language models.

    from forgelab import Run, RunConfig
    run = Run(RunConfig())
    await run.start()

Heavy modules (vLLM, Monarch, torchtitan) load lazily: importing forgelab is cheap. The package's layers,
bottom to top: algos, rewards, data, runtime, envs, config, weights, engines, controller, experiments, lab,
then the `Run` facade (forgelab.run); docs/architecture.md draws them.
"""
from __future__ import annotations

__version__ = "0.1.0"

from forgelab import quiet as _quiet  # noqa: E402
from forgelab.lazy import lazy_exports  # noqa: E402

_quiet.install()  # targeted filters for known third-party noise (see forgelab.quiet); FORGELAB_VERBOSE=1 keeps it

_LAZY = {
    "Run": "forgelab.run",
    "LossSwapRefused": "forgelab.run",
    "RewardChangeRefused": "forgelab.run",
    "RunConfig": "forgelab.config",
    "ModelConfig": "forgelab.config",
    "RolloutConfig": "forgelab.config",
    "TrainConfig": "forgelab.config",
    "PlacementConfig": "forgelab.config",
    "EvalConfig": "forgelab.config",
    "TrackingConfig": "forgelab.config",
    "LoraConfig": "forgelab.config",
    "TeacherConfig": "forgelab.config",
    "ConfigError": "forgelab.config",
    "ProcessPool": "forgelab.engines",
    "SharedEngines": "forgelab.experiments.variants",
    "Primitives": "forgelab.experiments.primitives",
    "rescore": "forgelab.controller",
    "replay": "forgelab.run",
    "Episode": "forgelab.types",
    "Completion": "forgelab.types",
    "plan_memory": "forgelab.memory_plan",
}

__all__ = sorted(_LAZY)
#: old public names, still resolved with a DeprecationWarning for one release (issue #38)
_DEPRECATED = {"Engines": ("forgelab.experiments.variants", "SharedEngines")}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY, _DEPRECATED)
