"""Engines: the processes a run uses and the actors in them.

    Generator (vLLM)            forgelab.engines.generator
    Trainer, ReferenceModel     forgelab.engines.trainer  (the actors)
      their contract            forgelab.engines.contracts (TrainBatch, StepMetrics, AdamParams, ...),
                                forgelab.engines.trainer_client (TrainerClient, ReferenceClient, TrainerAPI)
      the state and the step    forgelab.engines.trainer_state (torchtitan: titan*), trainer_optim (schedule,
                                AdamW hyperparameters), trainer_dist (process group, norms, RNG), loss_specs
                                (losses by name or by value), loss_compare (a loss A/B on one batch)
      adapter slots             forgelab.engines.trainer_slots (SlotTable, SlotTrainer)
    spawn_parts, ProcessPool    forgelab.engines.spawn, forgelab.engines.pool
    LoRA adapters, export       forgelab.engines.lora_adapters, forgelab.engines.export (export_checkpoint)

Renamed in issue #38 (the old paths import with a DeprecationWarning for one release): trainer_core ->
trainer_state, trainer_support -> loss_specs / trainer_optim / trainer_dist / contracts, lora -> lora_adapters,
lora_slots -> trainer_slots, loss_eval -> loss_compare.

Actors are thin: an endpoint validates its input and calls an engine (vLLM, a `TrainerState`); placement
is decided by `spawn_parts` from the config, never inside an actor. Names load lazily (vLLM, torchtitan).
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "Generator": "forgelab.engines.generator",
    "VLLMEngine": "forgelab.engines.generator",
    "Trainer": "forgelab.engines.trainer",
    "ReferenceModel": "forgelab.engines.trainer",
    "TrainerState": "forgelab.engines.trainer_state",
    "TrainerClient": "forgelab.engines.trainer_client",
    "ReferenceClient": "forgelab.engines.trainer_client",
    "TrainBatch": "forgelab.engines.contracts",
    "StepMetrics": "forgelab.engines.contracts",
    "AdamParams": "forgelab.engines.contracts",
    "Parts": "forgelab.engines.spawn",
    "spawn_parts": "forgelab.engines.spawn",
    "ProcessPool": "forgelab.engines.pool",
    "export_checkpoint": "forgelab.engines.export",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
