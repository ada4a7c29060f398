"""What an environment is: a Python object with an async `reset` and an async `step`.

    class Env:
        async def reset(self, task) -> str                         # the first user message
        async def step(self, action_text: str) -> (observation, reward, done, info)

- `task` is whatever the caller hands out: in a `Run` it is a
  `forgelab.data.tasks.Problem` (prompt, target, info), in a benchmark anything
  picklable. `reset` returns the text of the first user message.
- `action_text` is the assistant's last turn, decoded (special tokens removed).
- `observation` is the text of the next message (None when `done`), `reward`
  a float for this step (an episode's reward is the sum of its steps'),
  `done` ends the episode, `info` a dict; `info["role"]` says who speaks the
  observation ("user", the default, or "tool"), `info["reward_parts"]`
  (name -> float) is summed per name into the episode's `reward_parts`, and
  `info["metrics"]` (name -> float, counters such as tool calls) into
  `episode.info["env_metrics"]` (a `Run` logs their per-episode means as `env/<name>`).

One object serves one episode: the episode runner builds a fresh one per
episode (`forgelab.envs.registry.make_env`), so an environment may keep its state in attributes.
Both methods are coroutines on a shared event loop (thousands of episodes run
in one process): never block in them; wrap blocking work in
`await asyncio.to_thread(...)`. A step that takes longer than
`step_timeout_s` is abandoned and its episode dropped (`env_timeout`).
"""
from __future__ import annotations

from typing import Any

__all__ = ["Env", "StepResult", "task_prompt"]

StepResult = tuple["str | None", float, bool, dict]
"""`(observation, reward, done, info)`."""


class Env:
    """Base class of forgelab environments (subclassing is optional: any object with these coroutines works)."""

    async def reset(self, task: Any) -> str:
        """Start an episode for `task`; return the first user message."""
        raise NotImplementedError

    async def step(self, action_text: str) -> StepResult:
        """React to the assistant's turn: `(observation | None, reward, done, info)`."""
        raise NotImplementedError


def task_prompt(task: Any) -> str:
    """The user-facing text of a task: `task.prompt`, `task["prompt"]` or `str(task)`."""
    if hasattr(task, "prompt"):
        return str(task.prompt)
    if isinstance(task, dict) and "prompt" in task:
        return str(task["prompt"])
    return str(task)
