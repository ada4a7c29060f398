"""The agent door as one part of a run: its loopback server, its sessions and its expiry sweep.

    door = await AgentDoor.open(cfg.door, name=cfg.name, generators=parts.generators, tokenizer=tok,
                                rollouts=rollouts, buffer=buffer, max_model_len=cfg.model.max_model_len)
    door.base_url            # http://127.0.0.1:<port>/v1 (the OpenAI SDK's base_url)
    door.key                 # the run's secret (api_key; "<key>.<session>" names a session)
    await door.close()       # open sessions' episodes dropped (door_closed), server stopped

It receives the run's collaborators (generator service, tokenizer, rollouts, buffer), never the `Run`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from forgelab.config.run_config import DoorConfig
from forgelab.controller.agent_runner import AgentRunner
from forgelab.controller.agent_sessions import AgentSessions, DoorLimits, PlayedRollouts, RolloutSink
from forgelab.controller.buffer import ReplayBuffer
from forgelab.controller.events import Emit
from forgelab.generation import Generators
from forgelab.serve.http import LoopbackServer
from forgelab.serve.openai_api import OpenAIDoor
from forgelab.serve.tools import choose_dialect

__all__ = ["AgentDoor"]

log = logging.getLogger("forgelab.serve.door")


class AgentDoor:
    """A started agent door (`open`): the server, the API and the sessions."""

    def __init__(self, server: LoopbackServer, api: OpenAIDoor, sessions: AgentSessions, sweep_s: float):
        self.server, self.api, self.sessions = server, api, sessions
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, config: DoorConfig, *, name: str, generators: Generators, tokenizer: Any,
                   rollouts: PlayedRollouts, buffer: ReplayBuffer, max_model_len: int, group_size: int,
                   server: LoopbackServer | None = None, lora_slot: str | None = None) -> AgentDoor:
        """Mount the API on ``server`` (a new loopback server when None), start it and the expiry sweep."""
        server = server or LoopbackServer(name, port=config.port)
        limits = DoorLimits(idle_timeout_s=config.idle_timeout_s, max_sessions=config.max_sessions,
                            max_segments=config.max_segments, group_size=config.group_size or group_size,
                            retry_after_s=config.retry_after_s)
        scorer = None
        if config.rewards:
            from forgelab.rewards.library import RewardComposer, resolve_reward

            scorer = RewardComposer({n: (resolve_reward(n), float(w)) for n, w in config.rewards.items()})
        sessions = AgentSessions(limits, RolloutSink(rollouts, buffer), scorer=scorer,
                                 decode=lambda ids: str(tokenizer.decode(ids)))
        api = OpenAIDoor(server, generators, tokenizer, sessions, model_name=config.model_name or name,
                         max_model_len=max_model_len, max_n=config.max_n,
                         max_concurrent_calls=config.max_concurrent_calls, retry_after_s=config.retry_after_s,
                         lora_slot=lora_slot, tool_dialect=choose_dialect(config.tool_dialect, tokenizer))
        server.mount(api.router())
        await server.start()
        door = cls(server, api, sessions, sweep_s=min(max(config.idle_timeout_s / 4, 0.05), 30.0))
        door._sweeper = asyncio.get_running_loop().create_task(door._sweep(), name=f"forgelab-door-sweep-{name}")
        return door

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's ``base_url``: ``http://127.0.0.1:<port>/v1``."""
        return self.server.base_url + "/v1"

    @property
    def key(self) -> str:
        """The run's secret (the SDK's ``api_key``; ``f"{key}.{session}"`` records a session)."""
        return self.server.secret

    @property
    def model_name(self) -> str:
        return self.api.model_name

    def runner(self, emit: Emit) -> AgentRunner:
        """An `AgentRunner` over this door: the user's agent function as rollouts (``emit``: the run's events)."""
        return AgentRunner(self.sessions, base_url=self.base_url, key=self.key, emit=emit)

    def counters(self) -> dict[str, int]:
        """The ``agent/*`` counters (`AgentSessions.counters`)."""
        return self.sessions.counters()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            try:
                await self.sessions.sweep()
            except Exception:  # never let one bad sweep end expiry
                log.exception("forgelab: the agent door's expiry sweep failed")

    async def close(self) -> None:
        """Refuse new calls, stop the sweep and the server, drop open sessions' episodes (``door_closed``)."""
        self.api.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.server.stop()
        await self.sessions.close_all("door_closed")
