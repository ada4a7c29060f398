"""forgelab: a Jupyter-first research toolkit for reinforcement learning of language models.

    from forgelab import Run, RunConfig
    run = Run(RunConfig())
    await run.start()

Heavy modules (vLLM, Monarch, torchtitan) load lazily: importing forgelab is cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

from forgelab import quiet as _quiet  # noqa: E402

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
    "ConfigError": "forgelab.config",
    "ProcessPool": "forgelab.pool",
    "rescore": "forgelab.rollout_log",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'forgelab' has no attribute {name!r}")
