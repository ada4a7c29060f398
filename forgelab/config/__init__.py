"""Configuration: one `RunConfig` whose sections nest like the components they configure.

    from forgelab.config import RunConfig
    cfg = RunConfig.from_yaml("configs/addition.yaml")   # or from_dict / the dataclasses directly

`run_config` holds the run's sections and their validation, `components` each component's own
`Config` (generator, trainer, reference, environment actor), `sections` how a YAML section reaches a
component's config, `value_types` the type checks an unknown or wrong value meets.
"""
from forgelab.config.components import (EnvActorConfig, GeneratorConfig, LoraConfig, ReferenceConfig,
                                        SamplingConfig, TeacherConfig, TrainerConfig)
from forgelab.config.run_config import (SHIPPED_MODEL, ConfigError, DoorConfig, EvalConfig, HostsConfig, ModelConfig, PlacementConfig,
                                        ReasoningGymConfig, RolloutConfig, RunConfig, TrackingConfig, TrainConfig)

__all__ = ["SHIPPED_MODEL", "ConfigError", "DoorConfig", "EnvActorConfig", "EvalConfig", "GeneratorConfig", "HostsConfig", "LoraConfig", "ModelConfig",
           "PlacementConfig", "ReasoningGymConfig", "ReferenceConfig", "RolloutConfig", "RunConfig", "SamplingConfig", "TeacherConfig",
           "TrackingConfig", "TrainConfig", "TrainerConfig"]
