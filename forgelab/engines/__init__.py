"""Engines: the processes a run uses and the actors in them.

    Generator (vLLM)            forgelab.engines.generator
    Trainer, ReferenceModel     forgelab.engines.trainer  (torchtitan: titan, trainer_core, trainer_support)
    spawn_parts, ProcessPool    forgelab.engines.spawn, forgelab.engines.pool
    LoRA adapters, export       forgelab.engines.lora, forgelab.engines.export (export_checkpoint)

Actors are thin: an endpoint validates its input and calls an engine (vLLM, a `TrainerState`); placement
is decided by `spawn_parts` from the config, never inside an actor. Names load lazily (vLLM, torchtitan).
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "Generator": "forgelab.engines.generator",
    "VLLMEngine": "forgelab.engines.generator",
    "Trainer": "forgelab.engines.trainer",
    "ReferenceModel": "forgelab.engines.trainer",
    "TrainerState": "forgelab.engines.trainer_core",
    "Parts": "forgelab.engines.spawn",
    "spawn_parts": "forgelab.engines.spawn",
    "ProcessPool": "forgelab.engines.pool",
    "export_checkpoint": "forgelab.engines.export",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
