"""RunConfig's component sections, derived from the component configs themselves.

Each section of a `RunConfig` that configures an actor has the fields of that
actor's config dataclass, minus the fields whose value is shared with other
components and therefore set in one place elsewhere in the `RunConfig`
(`SHARED` below: the model path and dtype come from `model`, the learning
rate from `train`, ...):

    section      component config                    shared fields come from
    generator    forgelab.engines.generator.GeneratorConfig   model.*, placement.kv_cache_gib, rollout.temperature/top_p/max_tokens, lora
    trainer      forgelab.engines.trainer.TrainerConfig       model.path/dtype, train.*, lora
    reference    forgelab.engines.trainer.ReferenceConfig     model.path/dtype
    envs         forgelab.envs.actor.EnvActorConfig   model.*, placement.env_max_concurrent, rollout.max_turns/env_step_timeout_s

A field added to a component config is a YAML key of its section with no
other edit; `build_component(cfg, "trainer")` is the config the actor gets.
"""
from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

from forgelab.config.components import EnvActorConfig, GeneratorConfig, LoraConfig, ReferenceConfig, TrainerConfig

#: RunConfig section -> its component's config class.
COMPONENTS: dict[str, type] = {
    "generator": GeneratorConfig,
    "trainer": TrainerConfig,
    "reference": ReferenceConfig,
    "envs": EnvActorConfig,
}

#: The top-level `lora` section sets every field of the trainer's and the generator's LoRA config.
_LORA = {f.name: f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)}

#: Component field -> the RunConfig path that sets it for every component (a dict for a nested config).
SHARED: dict[str, dict[str, Any]] = {
    "generator": {
        "model_dir": "model.path", "dtype": "model.dtype", "max_model_len": "model.max_model_len",
        "kv_cache_gib": "placement.kv_cache_gib", "lora": _LORA,
        "sampling": {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "max_tokens": "rollout.max_tokens"},
    },
    "trainer": {
        "model_dir": "model.path", "dtype": "model.dtype", "lr": "train.lr", "warmup_steps": "train.warmup_steps",
        "total_steps": "train.steps", "min_lr_ratio": "train.min_lr_ratio", "weight_decay": "train.weight_decay",
        "max_grad_norm": "train.max_grad_norm", "loss": "train.loss", "loss_kwargs": "train.loss_kwargs",
        "is_cap": "train.is_cap", "seed": "train.seed", "lora": _LORA,
    },
    "reference": {"model_dir": "model.path", "dtype": "model.dtype"},
    "envs": {
        "model_dir": "model.path", "max_concurrent": "placement.env_max_concurrent",
        "limits": {"max_turns": "rollout.max_turns", "max_total_tokens": "model.max_model_len",
                   "step_timeout_s": "rollout.env_step_timeout_s"},
    },
}


def _derive(name: str, component: type, shared: dict[str, Any]) -> type | None:
    """A kw_only dataclass with `component`'s own fields (same types and defaults), minus `shared` ones.

    Returns None when every field is shared (the section would be empty).
    """
    hints = typing.get_type_hints(component)
    specs = []
    for f in dataclasses.fields(component):
        owner = shared.get(f.name)
        if isinstance(owner, str):
            continue
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            sub = _derive(name.removesuffix("Section") + f.name.title().replace("_", "") + "Section", t, owner or {})
            if sub is not None:
                specs.append((f.name, sub, dataclasses.field(default_factory=sub)))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, t, dataclasses.field(default_factory=f.default_factory)))
        elif f.default is not dataclasses.MISSING:
            specs.append((f.name, t, dataclasses.field(default=f.default)))
        else:
            raise TypeError(f"{component.__name__}.{f.name} has no default: give it one, or set it from "
                            f"another section in forgelab.config.sections.SHARED")
    if not specs:
        return None
    cls = dataclasses.make_dataclass(name, specs, kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = (f"The fields of {component.__module__}.{component.__name__} that are set per component "
                   f"(see its docstrings); shared ones: {', '.join(f'{k} <- {v}' for k, v in shared.items() if isinstance(v, str)) or 'none'}.")
    cls.COMPONENT = component
    cls.SHARED = shared
    globals()[name] = cls  # importable by name (pickling, notebooks)
    return cls


GeneratorSection = _derive("GeneratorSection", GeneratorConfig, SHARED["generator"])
TrainerSection = _derive("TrainerSection", TrainerConfig, SHARED["trainer"])
ReferenceSection = _derive("ReferenceSection", ReferenceConfig, SHARED["reference"])
EnvsSection = _derive("EnvsSection", EnvActorConfig, SHARED["envs"])


def _lookup(cfg: Any, path: str) -> Any:
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _fill(component: type, section: Any, shared: dict[str, Any], cfg: Any) -> Any:
    hints = typing.get_type_hints(component)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(component):
        owner = shared.get(f.name)
        if isinstance(owner, str):
            kwargs[f.name] = copy.deepcopy(_lookup(cfg, owner))
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _fill(hints[f.name], getattr(section, f.name, None), owner or {}, cfg)
        else:
            kwargs[f.name] = copy.deepcopy(getattr(section, f.name))
    return component(**kwargs)


def build_component(cfg: Any, section: str) -> Any:
    """The config object the `section` component ("generator", "trainer", "reference", "envs") is spawned with."""
    return _fill(COMPONENTS[section], getattr(cfg, section), SHARED[section], cfg)


def shared_owner(section_cls: type, key: str) -> str | None:
    """The RunConfig path that sets `key` of a derived section (None if the key is not shared)."""
    owner = getattr(section_cls, "SHARED", {}).get(key)
    return owner if isinstance(owner, str) else None
