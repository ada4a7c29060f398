"""The environments a run can name: `ENVS` (name -> factory) and `make_env`, which builds one.

    from forgelab.envs import ENVS, make_env
    ENVS["my_env"] = MyEnv                 # then RolloutConfig(env="my_env")
    env = make_env("calculator")           # a fresh environment (one per episode)

`ENVS` maps a name to a factory (a class or function taking keyword arguments,
`RolloutConfig.env_kwargs`); adding an environment is adding an entry. The
factory must be importable by name in the env actor's process (define it in a
module, not in a notebook cell).
"""
from __future__ import annotations

from typing import Any, Callable

from forgelab.envs.builtin import ArithmeticTutorEnv, CalculatorToolEnv, EchoEnv
from forgelab.envs.skyrl import SkyRLGymEnv

__all__ = ["ENVS", "make_env"]

ENVS: dict[str, Callable[..., Any]] = {
    "echo": EchoEnv,
    "arithmetic_tutor": ArithmeticTutorEnv,
    "calculator": CalculatorToolEnv,
    "skyrl_gym": SkyRLGymEnv,  # skyrl-gym's text environments (env_kwargs: env_id, ...; forgelab.envs.skyrl)
}
"""Environment name -> factory (see `RolloutConfig.env`)."""


def make_env(env: str | Callable[..., Any], kwargs: dict | None = None, registry: dict | None = None) -> Any:
    """A fresh environment: `env` is a name in `registry` (default `ENVS`) or a factory."""
    if registry is None:
        registry = ENVS
    if isinstance(env, str):
        if env not in registry:
            raise KeyError(f"unknown environment {env!r}; known: {', '.join(sorted(registry))} "
                           "(or pass a factory: a class or function returning an object with async reset/step)")
        env = registry[env]
    if not callable(env):
        raise TypeError(f"environment must be a registry name or a factory, got {env!r}")
    obj = env(**(kwargs or {}))
    for name in ("reset", "step"):
        if not callable(getattr(obj, name, None)):
            raise TypeError(f"environment {type(obj).__name__} has no {name}() method; see forgelab.envs.base")
    return obj
