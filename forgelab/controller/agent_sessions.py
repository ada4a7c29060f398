"""The agent door's sessions: each agent episode's recorded calls, its admission slot, its reward, its end.

    sessions = AgentSessions(DoorLimits(...), RolloutSink(rollouts, buffer))
    s = sessions.session("ep7")                  # get or open (429 `DoorBusy` past max_sessions)
    async with s.lock:                           # one call of a session at a time
        k = sessions.plan(s, prompt_ids, prefer) # the tail choice it extends, or None (a new segment: admitted here)
        ...generate...
        sessions.record(s, k, call, role="tool", messages=messages)
    await sessions.reward("ep7", 1.0, group="task-3")   # the session's episodes -> its group -> the buffer
    await sessions.reward_transcript("ep8", "46", group="task-3")  # scored by the door's reward functions
    await sessions.sweep()                       # idle sessions expire (their episodes dropped: session_expired)

A session is a list of segments (`forgelab.algos.agent_episodes.Segment`); each segment becomes one `Episode`
and holds one admission slot of the replay buffer from its first call to its end (`ReplayBuffer.admit` with a
fresh episode id: the staleness bound counts agent episodes like native ones). When admission is closed (the
buffer is full up to the staleness bound, an evaluation holds rollouts, the run stops) a call that needs a new
segment gets `DoorBusy` (429 with Retry-After), never a queue.

A reward closes the session: every segment's episode gets it and joins the session's group (a key the agent
chooses; none: a group of its own); once ``group_size`` sessions of a key are rewarded the group goes through the
rollouts' path (`Rollouts.add_played`: advantages, reference logprobs, the buffer). Expiry drops an idle session's
episodes with reason ``session_expired`` (counted in the buffer's accounting) and buffers a group that waited
``idle_timeout_s`` as it is (too small a group is dropped there as ``group_too_small``, as natively).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from forgelab.algos.agent_episodes import Call, Segment, extend_segment, extends, segment_episode, start_segment
from forgelab.controller.buffer import ReplayBuffer
from forgelab.controller.rollout import Gate
from forgelab.rewards.library import RewardComposer
from forgelab.types import Episode

__all__ = ["AgentSession", "AgentSessions", "DoorBusy", "DoorLimits", "DoorRefused", "EpisodeSink", "RolloutSink",
           "UnknownSession"]

log = logging.getLogger("forgelab.controller.agent_sessions")


class DoorBusy(Exception):
    """Admission is full: answer 429 with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DoorRefused(ValueError):
    """A request the door will not serve (400): the message names what and what to do."""


class UnknownSession(KeyError):
    """No open session has this id (404)."""


@dataclass(frozen=True, kw_only=True)
class DoorLimits:
    """The door's bounds (`forgelab.config.run_config.DoorConfig`)."""

    idle_timeout_s: float = 600.0
    max_sessions: int = 1024
    max_segments: int = 8
    group_size: int = 2
    retry_after_s: float = 1.0


class EpisodeSink(Protocol):
    """Where agent episodes go: admission slots with fresh ids, then the buffer (`RolloutSink`)."""

    async def open(self) -> int | None:
        """Admit one episode: its fresh id, or None when admission is closed."""
        ...

    async def wait_open(self) -> int | None:
        """Admit one episode, waiting until admission opens (as a native rollout worker waits): its fresh id, or
        None once the run stops."""
        ...

    async def close(self, groups: list[list[Episode]]) -> None:
        """Number the groups, buffer them as native rollouts are, and give their slots back."""
        ...

    async def discard(self, episodes: list[Episode], reason: str) -> None:
        """Drop episodes (counted) with ``reason`` and give their slots back."""
        ...

    async def forget(self, episode_id: int) -> None:
        """Give back the slot of an admitted episode that never recorded a call."""
        ...


class PlayedRollouts(Protocol):
    """What the sink uses of `forgelab.controller.rollout.Rollouts`."""

    gate: Gate

    def take_ids(self, episodes: int, groups: int = 0) -> tuple[int, int]: ...

    async def add_played(self, groups: list[list[Episode]], failed: dict[int, str] | None = None) -> None: ...

    def drop_played(self, episodes: list[Episode], reason: str) -> None: ...


class RolloutSink:
    """`EpisodeSink` over the run's rollouts and replay buffer: an agent episode is admitted, numbered, advantaged,
    buffered, dropped and released exactly as a native rollout's (`Rollouts.worker`)."""

    def __init__(self, rollouts: PlayedRollouts, buffer: ReplayBuffer):
        self.rollouts, self.buffer = rollouts, buffer

    async def open(self) -> int | None:
        gate = self.rollouts.gate
        if gate.stopping or not gate.may_admit() or not self.buffer.may_admit(1):
            return None
        return self._admit()

    def _admit(self) -> int:
        """A fresh episode id, its slot reserved in the buffer (admission was checked open)."""
        first, _ = self.rollouts.take_ids(1)
        self.buffer.admit(1, first_id=first)
        return first

    async def wait_open(self) -> int | None:
        while True:
            gate = self.rollouts.gate
            async with gate.changed:  # woken when the buffer or the served version changes, an evaluation ends,
                # the run stops, or the run (re)starts with a new gate (`Rollouts.use_gate`)
                await gate.changed.wait_for(lambda: gate.stopping or gate is not self.rollouts.gate
                                            or (gate.may_admit() and self.buffer.may_admit(1)))
                if gate is not self.rollouts.gate:
                    continue
                return None if gate.stopping else self._admit()

    async def _release(self, ids: list[int]) -> None:
        gate = self.rollouts.gate
        async with gate.changed:
            for i in ids:
                self.buffer.release(1, first_id=i)
            gate.changed.notify_all()

    async def close(self, groups: list[list[Episode]]) -> None:
        _, first_group = self.rollouts.take_ids(0, len(groups))
        for g, eps in enumerate(groups):
            for ep in eps:
                ep.group_id = first_group + g
        flat = [ep for g in groups for ep in g]
        try:
            await self.rollouts.add_played(groups)
        except BaseException as e:
            lost = [ep for ep in flat if self.buffer.status(ep.id) is None]
            if lost:
                self.rollouts.drop_played(lost, f"rollout_error:{type(e).__name__}")
            raise
        finally:
            await self._release([ep.id for ep in flat])

    async def discard(self, episodes: list[Episode], reason: str) -> None:
        try:
            self.rollouts.drop_played(episodes, reason)
        finally:
            await self._release([ep.id for ep in episodes])

    async def forget(self, episode_id: int) -> None:
        await self._release([episode_id])


@dataclass(eq=False)
class AgentSession:
    """One agent episode's state: its segments (each with its admitted episode id) and its last chat history."""

    id: str
    last_used: float
    segments: list[Segment] = field(default_factory=list)
    episode_ids: list[int] = field(default_factory=list)
    messages: list[Mapping[str, object]] | None = None
    """The last chat call's messages (what a next chat call must start with to continue it)."""
    disconnects: int = 0
    """Calls whose client went away while they generated (not recorded; the episode says how many)."""
    pending_id: int | None = None
    """An episode id admitted for a new segment whose first call is being generated."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None


@dataclass
class _Group:
    size: int
    episodes: list[Episode] = field(default_factory=list)
    sessions: int = 0
    last: float = 0.0


class AgentSessions:
    """The door's sessions and groups, bounded in number and in time (see the module docstring).

    Args:
        limits: the bounds.
        sink: where episodes go (`RolloutSink`).
        clock: seconds, monotonic (tests pass their own).
        scorer: the reward functions `reward_transcript` scores a final transcript with (``door.rewards``); None:
            rewards are numbers only.
        decode: token ids -> text (the prompt of a session made of completions calls, for the scorer).
    """

    def __init__(self, limits: DoorLimits, sink: EpisodeSink, clock: Callable[[], float] = time.monotonic,
                 scorer: RewardComposer | None = None, decode: Callable[[list[int]], str] | None = None):
        self.limits, self.sink, self.clock = limits, sink, clock
        self.scorer, self.decode = scorer, decode
        self._sessions: OrderedDict[str, AgentSession] = OrderedDict()  # least recently used first
        self._groups: dict[str, _Group] = {}
        self._counts: dict[str, int] = {k: 0 for k in (
            "sessions", "calls", "segments", "retokenized_segments", "episodes", "rewarded_sessions",
            "expired_sessions", "failed_sessions", "busy")}

    # -- views ------------------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """``agent/*`` counters since the door opened: sessions, calls, segments, retokenized_segments (a call
        that did not extend its session's last call), episodes, rewarded_sessions, expired_sessions,
        failed_sessions (`fail`: an agent that raised or timed out), busy (429s),
        and open_sessions / open_groups now."""
        return {**{f"agent/{k}": v for k, v in self._counts.items()},
                "agent/open_sessions": len(self._sessions), "agent/open_groups": len(self._groups)}

    def get(self, session_id: str) -> AgentSession:
        """The open session ``session_id`` (`UnknownSession` if none)."""
        s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSession(session_id)
        return s

    def export(self, session_id: str, choice: int = 0) -> list[Episode]:
        """The episodes the session would close with now (numbered with their admitted ids, unrewarded): its own
        calls only."""
        return self._episodes(self.get(session_id), choice)

    # -- calls --------------------------------------------------------------------------------------------
    def session(self, session_id: str) -> AgentSession:
        """The session ``session_id``, opened on first use (`DoorBusy` when ``max_sessions`` are open)."""
        s = self._sessions.get(session_id)
        if s is None:
            if len(self._sessions) >= self.limits.max_sessions:
                self._counts["busy"] += 1
                raise DoorBusy(f"the agent door has {len(self._sessions)} sessions open (door.max_sessions); "
                               "reward or let idle ones expire, or raise door.max_sessions", self.limits.retry_after_s)
            s = self._sessions[session_id] = AgentSession(id=session_id, last_used=self.clock())
            self._counts["sessions"] += 1
        self._sessions.move_to_end(session_id)
        s.last_used = self.clock()
        return s

    async def reserve(self, session_id: str) -> bool:
        """Open session ``session_id`` and take the admission slot its first call will use, waiting until the run
        admits an episode (`EpisodeSink.wait_open`; `AgentRunner.play` calls this before an agent starts, so its
        first call is never a 429); False when the run stops first. `DoorBusy` past ``max_sessions``."""
        s = self.session(session_id)
        async with s.lock:
            if s.segments or s.pending_id is not None:
                return True
            eid = await self.sink.wait_open()
            if eid is None:
                if not s.segments and self._sessions.get(s.id) is s:  # holds no place
                    del self._sessions[s.id]
                return False
            s.pending_id = eid
            s.last_used = self.clock()
            return True

    async def plan(self, s: AgentSession, prompt_ids: list[int], prefer: int | None = None) -> int | None:
        """The tail choice of the current segment that ``prompt_ids`` extends; None: the call starts a new segment,
        whose admission slot is taken here (`DoorBusy` when admission is closed, `DoorRefused` past
        ``max_segments``). Call it under ``s.lock``."""
        seg = s.current
        k = extends(seg, prompt_ids, prefer) if seg is not None else None
        if k is not None:
            return k
        if s.pending_id is not None:
            return None
        if len(s.segments) >= self.limits.max_segments:
            raise DoorRefused(f"session {s.id!r} has {len(s.segments)} segments (door.max_segments): each call whose "
                              "messages do not continue the session's last call starts one; reward the session and "
                              "use a new one, or raise door.max_segments")
        eid = await self.sink.open()
        if eid is None:
            self._counts["busy"] += 1
            if not s.segments and self._sessions.get(s.id) is s:  # refused at its first call: do not hold a place
                del self._sessions[s.id]
            raise DoorBusy("the run admits no new episode now (the replay buffer is full up to the staleness bound "
                           "train.max_policy_age, an evaluation holds rollouts, or the run stops); retry later",
                           self.limits.retry_after_s)
        s.pending_id = eid
        return None

    def record(self, s: AgentSession, k: int | None, call: Call, role: str = "user",
               messages: list[Mapping[str, object]] | None = None) -> None:
        """Record ``call`` in ``s``: extending tail choice ``k`` of the current segment, or (k None) as the first
        call of a new segment (after `plan` admitted it). Call it under ``s.lock``."""
        seg = s.current
        if k is not None and seg is not None:
            s.segments[-1] = extend_segment(seg, k, call, role=role)
        else:
            if s.pending_id is None:
                raise RuntimeError("AgentSessions.record: a new segment without an admitted id (call plan first)")
            if s.segments:
                self._counts["retokenized_segments"] += 1
            s.segments.append(start_segment(call))
            s.episode_ids.append(s.pending_id)
            s.pending_id = None
            self._counts["segments"] += 1
        s.messages = messages
        s.last_used = self.clock()
        self._counts["calls"] += 1

    async def abandon(self, s: AgentSession) -> None:
        """A call failed before recording: give back the slot `plan` took for it, if any. Under ``s.lock``."""
        if s.pending_id is not None:
            eid, s.pending_id = s.pending_id, None
            await self.sink.forget(eid)

    def disconnected(self, s: AgentSession) -> None:
        """A call of ``s`` lost its client while it generated: nothing was recorded (`abandon` gave its slot back);
        the session's episodes carry the count (``info["client_disconnects"]``)."""
        s.disconnects += 1
        s.last_used = self.clock()

    # -- ends -----------------------------------------------------------------------------------------------
    def _episodes(self, s: AgentSession, choice: int) -> list[Episode]:
        last = len(s.segments) - 1
        eps = [segment_episode(seg, choice if i == last else 0) for i, seg in enumerate(s.segments)]
        for i, (ep, eid) in enumerate(zip(eps, s.episode_ids)):
            ep.id = eid
            ep.task = f"agent:{s.id}"
            ep.info.update(session=s.id, segment=i, segments=len(eps), client_disconnects=s.disconnects)
        return eps

    async def reward(self, session_id: str, reward: float, group: str | None = None, choice: int = 0,
                     parts: Mapping[str, float] | None = None, group_size: int | None = None) -> list[int]:
        """Close session ``session_id`` with ``reward`` (every segment's episode gets it) into ``group``; the
        episode ids. The group is buffered once ``group_size`` (default: the door's) sessions joined it (None: a
        group of its own)."""
        s = self.get(session_id)
        async with s.lock:
            if not s.segments:
                raise DoorRefused(f"session {session_id!r} has no recorded call to reward")
            tail = len(s.segments[-1].tail)
            if not 0 <= choice < tail:
                raise DoorRefused(f"choice {choice} is not one of the last call's {tail} choices")
            eps = self._episodes(s, choice)
            for ep in eps:
                ep.reward = float(reward)
                ep.reward_parts = {k: float(v) for k, v in (parts or {"agent": reward}).items()}
                if group is not None:
                    ep.info["agent_group"] = group
            await self.abandon(s)
            del self._sessions[session_id]
        self._counts["rewarded_sessions"] += 1
        self._counts["episodes"] += len(eps)
        await self._join(group if group is not None else f"\0{session_id}", eps,
                         1 if group is None else group_size or self.limits.group_size)
        return [ep.id for ep in eps]

    def transcript(self, session_id: str, target: str = "", choice: int = 0) -> Episode:
        """The session's final transcript as the episode a reward function scores: its last segment's episode with
        ``prompt`` the first user message (or the decoded first prompt of a completions session), ``completion``
        the last assistant turn's text (as a native multi-turn episode has them), ``target``, and
        ``info["messages"]``: the last chat call's messages then the chosen answer (role, content)."""
        s = self.get(session_id)
        if not s.segments:
            raise DoorRefused(f"session {session_id!r} has no recorded call to score")
        tail = len(s.segments[-1].tail)
        if not 0 <= choice < tail:
            raise DoorRefused(f"choice {choice} is not one of the last call's {tail} choices")
        ep = self._episodes(s, choice)[-1]
        msgs = [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in (s.messages or [])]
        first_user = next((m["content"] for m in msgs if m["role"] == "user"), None)
        ep.prompt = first_user if first_user is not None else (self.decode(ep.prompt_ids) if self.decode else "")
        ep.target = target
        ep.info["messages"] = msgs + [{"role": "assistant", "content": ep.completion}]
        return ep

    async def reward_transcript(self, session_id: str, target: str, group: str | None = None, choice: int = 0,
                                group_size: int | None = None) -> tuple[list[int], float | None, str | None]:
        """Close the session with the reward the door's reward functions (``scorer``) give its final transcript
        (`transcript`) against ``target``, as `reward` does with a number (the parts are the functions' values).
        A reward function that raises or returns no finite number fails the session instead (its episodes dropped
        with ``reward_error:<name>``, as a native episode's). ``(episode ids, reward or None, drop reason or None)``."""
        if self.scorer is None:
            raise DoorRefused("this door has no reward functions (door.rewards): post a number as 'reward', or set "
                              "door.rewards to score transcripts against a 'target'")
        result = self.scorer.score_episode(self.transcript(session_id, target, choice))
        if result.failed:
            reason = result.drop_reason or "reward_error"
            return await self.fail(session_id, reason, result.errors[0].error_text, group, group_size), None, reason
        return await self.reward(session_id, result.total, group, choice, result.parts, group_size), result.total, None

    async def _join(self, key: str, eps: list[Episode], size: int) -> None:
        """One more session of group ``key`` ended (with ``eps``: none for a failed one); buffer the group once
        ``size`` sessions ended."""
        g = self._groups.setdefault(key, _Group(size=size))
        g.episodes += eps
        g.sessions += 1
        g.last = self.clock()
        if g.sessions >= g.size:
            del self._groups[key]
            if g.episodes:
                await self.sink.close([g.episodes])

    async def fail(self, session_id: str, reason: str, error: str, group: str | None = None,
                   group_size: int | None = None) -> list[int]:
        """Close session ``session_id`` as failed (its agent raised or timed out): its episodes are dropped with
        ``reason``, ``info["outcome"] = reason`` and ``info["error"] = error`` (the traceback), so they are in the
        rollout log and the accounting; a session that never made a call becomes one empty episode (a fresh
        admitted id, no tokens) dropped the same way, unless admission is closed. The failed session counts
        toward ``group`` (it is not waited for). The dropped episode ids."""
        s = self._sessions.get(session_id)
        eps: list[Episode] = []
        if s is not None:
            async with s.lock:
                eps = self._episodes(s, 0) if s.segments else []
                await self.abandon(s)
                self._sessions.pop(session_id, None)
        if not eps:
            eid = await self.sink.open()
            if eid is not None:
                eps = [Episode(id=eid, group_id=0, prompt_ids=[], completion_ids=[], generator_logprobs=[],
                               policy_version=-1, task=f"agent:{session_id}", loss_mask=[],
                               info={"session": session_id, "calls": 0})]
        for ep in eps:
            ep.info.update(outcome=reason, error=error)
            if group is not None:
                ep.info["agent_group"] = group
        self._counts["failed_sessions"] += 1
        if eps:
            await self.sink.discard(eps, reason)
        if group is not None:
            await self._join(group, [], group_size or self.limits.group_size)
        return [ep.id for ep in eps]

    async def sweep(self) -> dict[str, int]:
        """Expire sessions idle for ``idle_timeout_s`` (their episodes dropped: ``session_expired``) and buffer
        groups that waited as long; what it did."""
        now = self.clock()
        old = [s for s in self._sessions.values() if now - s.last_used >= self.limits.idle_timeout_s
               and not s.lock.locked()]
        dropped = 0
        for s in old:
            del self._sessions[s.id]
            self._counts["expired_sessions"] += 1
            await self.abandon(s)
            if s.segments:
                eps = self._episodes(s, 0)
                dropped += len(eps)
                await self.sink.discard(eps, "session_expired")
        stale = [k for k, g in self._groups.items() if now - g.last >= self.limits.idle_timeout_s]
        for k in stale:
            await self.sink.close([self._groups.pop(k).episodes])
        return {"expired_sessions": len(old), "episodes_dropped": dropped, "groups_flushed": len(stale)}

    async def close_all(self, reason: str = "door_closed") -> None:
        """The door closes: every open session's episodes are dropped with ``reason``, waiting groups buffered."""
        for s in list(self._sessions.values()):
            del self._sessions[s.id]
            await self.abandon(s)
            if s.segments:
                await self.sink.discard(self._episodes(s, 0), reason)
        for k in list(self._groups):
            await self.sink.close([self._groups.pop(k).episodes])
