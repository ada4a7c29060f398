"""The agent runner: the user's own async agent function, run as the run's rollouts through the agent door.

    async def agent(client: openai.AsyncOpenAI, task) -> float:     # plain openai SDK; any framework works
        r = await client.chat.completions.create(model="...", messages=[{"role": "user", "content": task}])
        return 1.0 if r.choices[0].message.content == "57" else 0.0

    report = await run.play_agents(agent, ["12+45=", "3*4="], group_size=2, concurrency=64, timeout_s=60)
    report.rewarded, report.failed, report.episodes

What it really is: for each task, ``group_size`` sessions of the door (each its own ``openai.AsyncOpenAI`` whose
key names the session), at most ``concurrency`` at once; each session's reward closes it into the task's group
(`AgentSessions.reward`), so GRPO normalises advantages over the sessions of one task. An agent that raises, or runs
past ``timeout_s`` (it is cancelled), or returns no finite number, becomes a failed episode (`AgentSessions.fail`:
dropped with reason ``agent_error`` / ``agent_timeout``, its traceback in ``info["error"]``, so in the rollout log)
and an ``agent_error`` event; its group is buffered without it. Nothing is lost: every session is rewarded or failed,
and the buffer's accounting identity holds.

It receives its collaborators typed (the door's sessions, its URL and key, the event emitter), never the `Run`.
"""
from __future__ import annotations

import asyncio
import math
import secrets
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from forgelab.controller.agent_sessions import AgentSessions, DoorBusy, DoorRefused, UnknownSession
from forgelab.controller.events import Emit

__all__ = ["AgentFn", "AgentReport", "AgentRunner"]

AgentFn = Callable[[object, object], Awaitable[float | str]]
"""``async def agent(client: openai.AsyncOpenAI, task) -> reward``: a number, or a string: the target the door's
reward functions (``door.rewards``) score the session's final transcript against."""


@dataclass
class AgentReport:
    """What one `AgentRunner.play` did: sessions rewarded and failed, their rewards and episode ids."""

    rewarded: int = 0
    failed: int = 0
    rewards: list[float] = field(default_factory=list)
    episodes: list[int] = field(default_factory=list)
    """Ids of the episodes the rewarded sessions closed with."""
    failed_episodes: list[int] = field(default_factory=list)
    """Ids of the failed sessions' (dropped) episodes."""
    errors: list[str] = field(default_factory=list)
    """One line per failed session: the session and the exception."""


class AgentRunner:
    """Runs an agent function as rollouts through the door (see the module docstring).

    Args:
        sessions: the door's sessions (rewards, failures, groups).
        base_url: the door's OpenAI base URL; key: the run's door key (a session's key is ``f"{key}.{session}"``).
        emit: the run's event emitter (``agent_error`` events).
        client: ``client(base_url, api_key)`` -> an ``openai.AsyncOpenAI`` (default: the SDK's, no retries, all the
            sessions of one `play` over one shared HTTP connection pool: a new ``httpx`` client per session would
            build a TLS context each time, ~50 ms of CPU, even for plain http).
    """

    def __init__(self, sessions: AgentSessions, *, base_url: str, key: str, emit: Emit,
                 client: Callable[[str, str], object] | None = None):
        self.sessions, self.base_url, self.key, self.emit = sessions, base_url, key, emit
        self._client = client
        self._nonce = secrets.token_hex(4)  # session ids of two `play` calls never collide
        self._plays = 0

    async def play(self, agent: AgentFn, tasks: Sequence[object], *, group_size: int | None = None,
                   concurrency: int = 64, timeout_s: float = 300.0,
                   task_key: Callable[[object], str] | None = None, wait_for_admission: bool = True) -> AgentReport:
        """Run ``agent`` on each task ``group_size`` times (default: the door's group size), at most
        ``concurrency`` sessions at once, each within ``timeout_s``; returns when every session was rewarded or
        failed. ``task_key(task)`` names its group (default: its index in this call).

        With ``wait_for_admission`` (the default) a session starts only once the run admits its episode, as a
        native rollout waits (the replay buffer full up to the staleness bound, an evaluation running): its agent's
        first call is then never refused, and ``timeout_s`` counts from there. A session the run stops before
        admitting fails with reason ``run_stopped``. False: sessions start at once, and a call made while admission
        is closed gets the door's 429 (an agent that handles it may retry)."""
        g_size = group_size or self.sessions.limits.group_size
        if g_size < 1 or concurrency < 1 or not timeout_s > 0:
            raise ValueError(f"AgentRunner.play: group_size ({g_size}) and concurrency ({concurrency}) must be >= 1 "
                             f"and timeout_s ({timeout_s}) > 0")
        self._plays += 1
        prefix = f"agent-{self._nonce}-{self._plays}"
        report = AgentReport()
        slots = asyncio.Semaphore(concurrency)
        shared = _SharedClients(concurrency) if self._client is None else None
        make = shared.client if shared is not None else self._client
        assert make is not None

        async def one(t: int, task: object, g: int) -> None:
            sid, group = f"{prefix}-t{t}-s{g}", f"{prefix}:{task_key(task) if task_key else t}"
            async with slots:
                if wait_for_admission:
                    try:
                        admitted = await self.sessions.reserve(sid)
                    except DoorBusy as e:  # door.max_sessions open at once (the door's other callers included)
                        await self._fail(report, sid, group, g_size, "agent_error", f"DoorBusy: {e}")
                        return
                    if not admitted:
                        await self._fail(report, sid, group, g_size, "run_stopped", "the run stopped before it "
                                         "admitted this session's episode; the agent did not run")
                        return
                client = make(self.base_url, f"{self.key}.{sid}")
                try:
                    try:
                        got = await asyncio.wait_for(agent(client, task), timeout_s)
                        target = got if isinstance(got, str) else None
                        reward = 0.0 if target is not None else float(got)
                        if not math.isfinite(reward):
                            raise ValueError(f"the agent returned reward {reward!r}; return a finite number")
                    except asyncio.TimeoutError:
                        await self._fail(report, sid, group, g_size, "agent_timeout",
                                         f"the agent ran past timeout_s={timeout_s:g} s and was cancelled")
                        return
                    except Exception as e:
                        await self._fail(report, sid, group, g_size, "agent_error",
                                         f"{describe(e)}\n{traceback.format_exc()}")
                        return
                    try:
                        if target is not None:
                            ids, scored, dropped = await self.sessions.reward_transcript(sid, target, group,
                                                                                         group_size=g_size)
                            if dropped is not None:  # a reward function failed: the session failed (counted)
                                report.failed += 1
                                report.failed_episodes += ids
                                report.errors.append(f"{sid}: {dropped}")
                                return
                            reward = float(scored or 0.0)
                        else:
                            ids = await self.sessions.reward(sid, reward, group, group_size=g_size)
                    except DoorRefused as e:
                        if target is not None and self.sessions.scorer is None:
                            await self._fail(report, sid, group, g_size, "agent_error", str(e))
                            return
                        await self._fail(report, sid, group, g_size, "agent_error", "the agent returned a reward "
                                         "without a call recorded through its client (no call, or none admitted)")
                        return
                    except UnknownSession:
                        await self._fail(report, sid, group, g_size, "agent_error", "the agent returned a reward "
                                         "without a call recorded through its client (no call, or none admitted)")
                        return
                    report.rewarded += 1
                    report.rewards.append(reward)
                    report.episodes += ids
                finally:
                    close = getattr(client, "close", None)
                    if shared is None and close is not None:  # the shared pool is closed once, below
                        await close()

        try:
            await asyncio.gather(*(one(t, task, g) for t, task in enumerate(tasks) for g in range(g_size)))
        finally:
            if shared is not None:
                await shared.aclose()
        return report

    async def _fail(self, report: AgentReport, sid: str, group: str, g_size: int, reason: str, error: str) -> None:
        ids = await self.sessions.fail(sid, reason, error, group, group_size=g_size)
        first = error.splitlines()[0] if error else reason
        report.failed += 1
        report.failed_episodes += ids
        report.errors.append(f"{sid}: {first}")
        self.emit("agent_error", session=sid, reason=reason, error=error[-2000:], episodes=ids)


def describe(e: BaseException) -> str:
    """``Type: message`` of an agent's exception; for an exception group (an MCP client's task group, an
    ``asyncio.TaskGroup``), of the exceptions inside it, which say what went wrong.

    >>> describe(ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("bad tool"), KeyError("x")]))
    "ValueError: bad tool; KeyError: 'x' (in ExceptionGroup: unhandled errors in a TaskGroup)"
    """
    if isinstance(e, BaseExceptionGroup):
        leaves: list[BaseException] = []
        stack: list[BaseException] = list(e.exceptions)
        while stack:
            x = stack.pop(0)
            if isinstance(x, BaseExceptionGroup):
                stack[:0] = list(x.exceptions)
            else:
                leaves.append(x)
        return "; ".join(f"{type(x).__name__}: {x}" for x in leaves) + f" (in {type(e).__name__}: {e.message})"
    return f"{type(e).__name__}: {e}"


class _SharedClients:
    """``openai.AsyncOpenAI`` clients (one per session: the key names it, no retries) over one HTTP connection pool
    of at least ``concurrency`` connections. Connecting may wait up to 60 s (the SDK's 5 s fails sessions when a
    thousand connect at once to a loop that is busy serving them); reads keep the SDK's 600 s."""

    def __init__(self, concurrency: int):
        import importlib

        import openai

        self._openai = openai
        # the SDK's HTTP package (httpx, or the httpx2 fork openai 3.x ships with): its own Limits type
        http_pkg = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
        n = max(concurrency, 100)
        # keep-alive 30 s, under the door server's 75 s: a pooled connection is never the one the server closes
        self.http = openai.DefaultAsyncHttpxClient(
            limits=http_pkg.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=30.0),
            timeout=http_pkg.Timeout(600.0, connect=60.0))

    def client(self, base_url: str, api_key: str) -> object:
        return self._openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=self.http)

    async def aclose(self) -> None:
        await self.http.aclose()
