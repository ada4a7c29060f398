"""Multi-turn environments: the protocol, the episode runner, built-in environments, the env actor.

    from forgelab.envs import ENVS, EnvActor, EnvActorConfig
    cfg = RunConfig(rollout=RolloutConfig(env="calculator"))   # a Run plays episodes instead of single turns

- `base`: what an environment is (async `reset(task) -> str`, `step(text) -> (obs, reward, done, info)`);
- `episode`: the token-in/token-out episode runner (`run_episode`, `ChatFormat`, `EpisodeLimits`);
- `builtin`: `EchoEnv`, `ArithmeticTutorEnv`, `CalculatorToolEnv` (and its `tool_use_stats`);
- `skyrl`: `SkyRLGymEnv`, skyrl-gym's synchronous text environments behind the async protocol;
- `registry`: `ENVS` (name -> factory; adding an environment is adding an entry) and `make_env`;
- `actor`: `EnvActor`, thousands of episodes as asyncio tasks in one process;
- `mcp_tools`: the calculator as an MCP server (`calculator_server`, `calculator_stdio`) and `McpTools` (an MCP
  server's tools as OpenAI tools, for agents through the door: docs/agents.md).

The factory of a registered environment must be importable by name in the env
actor's process (define it in a module, not in a notebook cell).
"""
from __future__ import annotations

from forgelab.envs.base import Env
from forgelab.envs.builtin import ArithmeticTutorEnv, CalculatorToolEnv, EchoEnv, tool_use_stats
from forgelab.envs.episode import DROP_OUTCOMES, ChatFormat, EpisodeLimits, env_metric_means, run_episode
from forgelab.envs.registry import ENVS, make_env
from forgelab.envs.skyrl import SkyRLGymEnv


def __getattr__(name: str):
    if name in ("EnvActor", "EnvActorConfig"):  # imports Monarch: only when asked for
        from forgelab.envs import actor

        return getattr(actor, name)
    if name in ("McpTools", "calculator_server", "calculator_stdio"):  # not imported with the package, so that
        from forgelab.envs import mcp_tools                              # `python -m forgelab.envs.mcp_tools` runs clean

        return getattr(mcp_tools, name)
    raise AttributeError(f"module 'forgelab.envs' has no attribute {name!r}")


__all__ = [
    "DROP_OUTCOMES", "ENVS", "ArithmeticTutorEnv", "CalculatorToolEnv", "ChatFormat", "EchoEnv", "Env",
    "EnvActor", "EnvActorConfig", "EpisodeLimits", "McpTools", "SkyRLGymEnv", "calculator_server", "calculator_stdio",
    "env_metric_means", "make_env", "run_episode", "tool_use_stats",
]
