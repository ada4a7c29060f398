"""skyrl-gym's text environments as forgelab environments (``rollout.env: skyrl_gym``; docs/ecosystem.md).

    rollout:
      env: skyrl_gym
      env_kwargs: {env_id: gsm8k_multi_turn, extras: {max_turns: 2}}
      max_turns: 2

skyrl-gym's API is synchronous: ``skyrl_gym.make(id, env_config=, extras=)`` builds one environment per episode,
``init(messages) -> (messages, metadata)`` starts it, ``step(text) -> {observations, reward, done, metadata}``
answers each assistant turn (observations are chat messages). `SkyRLGymEnv` calls each of them in a worker
thread (``asyncio.to_thread``), so the env actor's event loop, which plays thousands of episodes at once, never
blocks on one environment (forgelab.envs.base).

The episode's problem reaches the environment as skyrl-gym's datasets hand it over: the prompt as the first user
message of ``init``, and ``extras = {"reward_spec": {"method": "rule", "ground_truth": problem.target},
"extra_info": problem.info, **env_kwargs["extras"]}``. Each step's observation messages become the next message
(their contents joined by newlines, spoken by the last one's role), the step's reward is summed into the
episode's (``reward_parts["skyrl"]``), and the environment's numeric ``get_metrics()`` reach ``env/<name>`` at
the end. An environment of your own is registered in skyrl-gym by ``entry_point`` ("package.module:Class",
importable in the env actor's process) under ``env_id`` when that id is not yet known.

    >>> import asyncio
    >>> from forgelab.data.tasks import Problem
    >>> env = SkyRLGymEnv(env_id="gsm8k")
    >>> asyncio.run(env.reset(Problem(prompt="12+45=", target="57", task="addition")))
    '12+45='
    >>> asyncio.run(env.step("#### 57"))[:3]
    (None, 1.0, True)
"""
from __future__ import annotations

import asyncio
from typing import Any

from forgelab.envs.base import Env, StepResult, task_prompt

__all__ = ["SkyRLGymEnv"]


def _registered(env_id: str, entry_point: str | None) -> None:
    import skyrl_gym

    if env_id in skyrl_gym.registry:
        return
    if entry_point is None:
        raise ValueError(f"skyrl_gym: unknown env_id {env_id!r}; skyrl-gym knows {', '.join(sorted(skyrl_gym.registry))} "
                         "(or give entry_point: 'package.module:Class' to register yours)")
    skyrl_gym.register(id=env_id, entry_point=entry_point)


class SkyRLGymEnv(Env):
    """One skyrl-gym text environment per episode, behind forgelab's async `reset` / `step`.

    Args:
        env_id: the skyrl-gym environment id (``skyrl_gym.registry``: gsm8k, gsm8k_multi_turn, aime, ...).
        env_config: skyrl-gym's ``env_config`` for the environment's constructor.
        extras: merged over the per-problem extras (``reward_spec``, ``extra_info``), e.g. ``{max_turns: 2}``.
        entry_point: "package.module:Class" registered under `env_id` when skyrl-gym does not know it yet.
    """

    def __init__(self, env_id: str, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None,
                 entry_point: str | None = None):
        _registered(env_id, entry_point)  # a bad id fails when the config is validated, not mid-run
        self.env_id, self.env_config, self.extras = env_id, dict(env_config or {}), dict(extras or {})
        self.env: Any = None

    async def reset(self, task: Any) -> str:
        import skyrl_gym

        info = dict(getattr(task, "info", None) or {})
        extras = {"reward_spec": {"method": "rule", "ground_truth": str(getattr(task, "target", ""))},
                  "extra_info": info, **self.extras}
        self.env = await asyncio.to_thread(skyrl_gym.make, self.env_id, env_config=self.env_config, extras=extras)
        messages, _ = await asyncio.to_thread(self.env.init, [{"role": "user", "content": task_prompt(task)}])
        users = [m for m in messages if m.get("role") == "user"]
        if not users:
            raise ValueError(f"skyrl_gym {self.env_id!r}: init returned no user message ({messages!r})")
        return str(users[-1]["content"])

    async def step(self, action_text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("SkyRLGymEnv.step before reset")
        out = await asyncio.to_thread(self.env.step, action_text)
        reward, done = float(out["reward"]), bool(out["done"])
        info: dict[str, Any] = {"reward_parts": {"skyrl": reward}}
        messages = list(out.get("observations") or [])
        if done:
            metrics = self.env.get_metrics() if hasattr(self.env, "get_metrics") else {}
            info["metrics"] = {k: float(v) for k, v in (metrics or {}).items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
            await asyncio.to_thread(self.env.close)
            return None, reward, True, info
        info["role"] = str(messages[-1].get("role", "user")) if messages else "user"
        return "\n".join(str(m.get("content", "")) for m in messages), reward, False, info
