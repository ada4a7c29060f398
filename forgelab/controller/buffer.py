"""A replay buffer that bounds off-policy lag and accounts for every episode it ever saw.

Life of an episode (``status``)::

    add ──> buffered ──sample──> in_flight ──mark_trained──> trained
               │                    ├──mark_dropped(reason)──> dropped
               │                    └──requeue──> buffered
               ├──(too old at sample time)──> evicted   (reason "stale")
               └──(buffer over max_size)───> dropped   (reason "buffer_full")
    drop(episodes, reason) / record_generated(n, reason): generated and dropped
    before ever reaching the buffer (reward errors, zero-variance groups, ...)

An episode generated with weights ``policy_version`` is *stale* once
``current_version - policy_version > max_policy_age``; ``max_policy_age = 0``
is on-policy training. The accounting identity

    generated == trained + evicted + dropped + buffered + in_flight

holds after every call (``check_accounting`` asserts it), and no episode is
ever trained twice (``mark_trained`` raises ``EpisodeAlreadyTrained``).

Closing an episode (trained, evicted, dropped) notifies the close listeners
(``add_close_listener``): the rollout log records each episode once, there.

Bounded bookkeeping. Episode ids are assigned in increasing blocks at
admission (``admit(n, first_id=...)``). The *watermark* is the lowest id that
may still matter: below it every id is closed or was never generated (its
rollout failed first). Exact statuses are kept for ids at or above it (a few
steps' worth); below it only the latest ``keep_statuses`` closed statuses are
kept, for views, and an older id reads ``"closed"``. Checkpoints hold the
watermark and the statuses above it, so their size does not grow with the run.

The buffer is not locked: call it from one thread (the controller's event loop).

    >>> from forgelab.types import Episode
    >>> def ep(i, group, version):
    ...     return Episode(id=i, group_id=group, prompt_ids=[1], completion_ids=[2],
    ...                    generator_logprobs=[-1.0], policy_version=version)
    >>> buf = ReplayBuffer(batch_size=2, max_policy_age=1)
    >>> _ = buf.add([ep(0, 0, 0), ep(1, 0, 0)]); _ = buf.add([ep(2, 1, 1), ep(3, 1, 1)])
    >>> batch = buf.sample(current_version=2)  # group 0 is 2 versions old: evicted
    >>> [e.id for e in batch]
    [2, 3]
    >>> buf.mark_trained(batch)
    >>> {k: buf.counts()[k] for k in ("generated", "trained", "evicted", "buffered")}
    {'generated': 4, 'trained': 2, 'evicted': 2, 'buffered': 0}
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypedDict, cast

from forgelab.controller.buffer_state import checked_state
from forgelab.types import Episode

__all__ = ["ReplayBuffer", "EpisodeAlreadyTrained", "EpisodeCounts", "STATUSES", "CLOSED"]

log = logging.getLogger("forgelab.controller.buffer")

STATUSES = ("buffered", "in_flight", "trained", "evicted", "dropped")
CLOSED = "closed"
"""`status` of an id below the watermark whose exact status is no longer kept (trained, evicted or dropped:
the rollout log has which), or that was never generated (its rollout failed first)."""


class EpisodeCounts(TypedDict):
    """`ReplayBuffer.counts()`: ``generated == trained + evicted + dropped + buffered + in_flight``."""

    generated: int
    trained: int
    evicted: int
    dropped: int
    buffered: int
    in_flight: int
    dropped_reasons: dict[str, int]
    """Dropped episodes by reason (``step_skipped``, ``buffer_full``, ...)."""


class EpisodeAlreadyTrained(RuntimeError):
    """An episode was marked trained a second time: a bug in whoever sampled it."""


class ReplayBuffer:
    """FIFO buffer of episodes with policy-age eviction, a size bound and full accounting.

    Args:
        batch_size: episodes per ``sample``.
        max_policy_age: how many policy versions behind the trainer an episode
            may be when sampled (0 = strictly on-policy).
        max_size: most episodes held in the buffer (in-flight ones excluded);
            None for unbounded. When an ``add`` exceeds it the oldest are
            dropped with reason ``"buffer_full"``.
        keep_statuses: how many closed statuses below the watermark stay
            readable through ``status`` / ``drop_reason`` (for views of recent
            episodes); older ids read ``"closed"``.
    """

    def __init__(self, batch_size: int, max_policy_age: int, max_size: int | None = None, *,
                 keep_statuses: int = 16384):
        if batch_size < 1:
            raise ValueError(f"ReplayBuffer: batch_size must be >= 1, got {batch_size}")
        if max_policy_age < 0:
            raise ValueError(f"ReplayBuffer: max_policy_age must be >= 0 (0 = on-policy), got {max_policy_age}")
        if max_size is not None and max_size < batch_size:
            raise ValueError(
                f"ReplayBuffer: max_size={max_size} is smaller than batch_size={batch_size}, so no batch "
                "could ever be sampled; raise max_size or use None for unbounded"
            )
        self.batch_size = batch_size
        self.max_policy_age = max_policy_age
        self.max_size = max_size
        self._buffered: dict[int, Episode] = {}  # insertion order is age order: oldest first
        self._in_flight: dict[int, Episode] = {}
        self._closed: dict[int, str] = {}  # id >= watermark -> "trained" | "evicted" | "dropped"
        self._reasons: dict[int, str] = {}  # id >= watermark -> why it was dropped
        self._watermark = 0  # every id below is closed or was never generated
        self._old: OrderedDict[int, tuple[str, str]] = OrderedDict()  # latest (status, reason) below the watermark
        self.keep_statuses = keep_statuses
        self._pending: dict[int, int] = {}  # first id -> ids of an admitted block (admit(n, first_id))
        self._next_id = 0  # one past the highest id seen (added, closed or admitted)
        self._close_listeners: list[Callable[[list[Episode], str, str], None]] = []
        self._generated = 0
        self._trained = 0
        self._evicted = 0
        self._dropped = 0
        self._dropped_reasons: Counter[str] = Counter()
        self._reserved = 0  # admitted for generation, not yet added or dropped
        self.served_version = 0  # the policy version the generators serve (last completed weight push)

    # --- admission (what may be generated) -------------------------------------

    def may_admit(self, n: int) -> bool:
        """Whether ``n`` more episodes may start generating without going stale before they can be trained.

        Episodes started while the generators serve version v can be trained up to
        step v + max_policy_age, so at most (v + max_policy_age + 1) * batch_size
        episodes may be live (reserved, buffered, in flight or trained); evicted and
        dropped ones gave their slot back. With max_policy_age = 0 this is
        synchronous on-policy RL.

        >>> buf = ReplayBuffer(batch_size=4, max_policy_age=0)
        >>> buf.admit(4), buf.may_admit(1)
        (True, False)
        >>> buf.served_version = 1; buf.may_admit(4)
        True
        """
        live = self._trained + len(self._buffered) + len(self._in_flight) + self._reserved
        return live + n <= (self.served_version + self.max_policy_age + 1) * self.batch_size

    def admit(self, n: int, first_id: int | None = None) -> bool:
        """Reserve ``n`` episode slots if ``may_admit(n)``; the caller later calls ``release(n, first_id)``.

        ``first_id``: the episodes will have ids ``first_id .. first_id + n - 1`` (blocks admitted in increasing
        order). Given, it lets the buffer bound its bookkeeping (the watermark, see the module docstring).
        """
        if not self.may_admit(n):
            return False
        if first_id is not None:
            if first_id < self._watermark or first_id in self._pending:
                raise ValueError(f"ReplayBuffer.admit: ids from {first_id} are below the watermark "
                                 f"{self._watermark} or already admitted; admit fresh, increasing ids")
            self._pending[first_id] = n
            self._next_id = max(self._next_id, first_id + n)
        self._reserved += n
        return True

    def release(self, n: int, first_id: int | None = None) -> None:
        """Give back ``n`` reserved slots (their episodes were added or dropped, or never generated)."""
        if n < 0 or n > self._reserved:
            raise ValueError(f"ReplayBuffer.release: {n} slots released but {self._reserved} are reserved")
        if first_id is not None and self._pending.pop(first_id, None) is None:
            raise ValueError(f"ReplayBuffer.release: no block admitted from id {first_id}")
        self._reserved -= n
        if first_id is not None:
            self._advance_watermark()

    @property
    def watermark(self) -> int:
        """The lowest episode id whose exact status is kept: every id below is closed or was never generated."""
        return self._watermark

    def _advance_watermark(self) -> None:
        held = [*self._buffered, *self._in_flight]
        w = min([*self._pending, *held, self._next_id])
        if w <= self._watermark:
            return
        for i in [i for i in self._closed if i < w]:
            self._old[i] = (self._closed.pop(i), self._reasons.pop(i, ""))
        while len(self._old) > self.keep_statuses:
            self._old.popitem(last=False)
        self._watermark = w

    def add_close_listener(self, fn: Callable[[list[Episode], str, str], None]) -> None:
        """``fn(episodes, status, reason)`` each time episodes close: status "trained", "evicted" (reason
        "stale") or "dropped" (with its reason). Called after the buffer's state changed; an error is logged."""
        self._close_listeners.append(fn)

    def remove_close_listener(self, fn: Callable[[list[Episode], str, str], None]) -> None:
        """Stop calling ``fn`` (added by `add_close_listener`); a no-op if it is not there."""
        self._close_listeners[:] = [f for f in self._close_listeners if f is not fn]

    def _closed_now(self, episodes: list[Episode], status: str, reason: str = "") -> None:
        if not episodes:
            return
        for fn in list(self._close_listeners):
            try:
                fn(episodes, status, reason)
            except Exception:  # a listener (the rollout log) must not break the accounting
                log.exception("forgelab: a replay-buffer close listener failed")

    @property
    def reserved(self) -> int:
        """Slots admitted for generation whose episodes are not yet added or dropped (rollouts being played)."""
        return self._reserved

    def ready(self, current_version: int) -> bool:
        """Evict stale episodes; True when a batch can be sampled (the staleness bound on the training side)."""
        self.evict_stale(current_version)
        return len(self._buffered) >= self.batch_size

    # --- status ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._buffered)

    def status(self, episode_id: int) -> str | None:
        """``"buffered"``, ``"in_flight"``, ``"trained"``, ``"evicted"``, ``"dropped"``, or None if never seen;
        `CLOSED` (``"closed"``) for an id below the watermark whose exact status is no longer kept."""
        if episode_id in self._buffered:
            return "buffered"
        if episode_id in self._in_flight:
            return "in_flight"
        if episode_id in self._closed:
            return self._closed[episode_id]
        if episode_id < self._watermark:
            old = self._old.get(episode_id)
            return old[0] if old is not None else CLOSED
        return None

    def _is_closed(self, episode_id: int) -> bool:
        return episode_id in self._closed or episode_id < self._watermark

    def buffered(self) -> list[Episode]:
        """The buffered episodes, oldest first (a copy of the list; the episodes are shared)."""
        return list(self._buffered.values())

    def in_flight(self) -> list[Episode]:
        """The sampled episodes not yet marked, oldest first."""
        return list(self._in_flight.values())

    def counts(self) -> EpisodeCounts:
        """Counters: ``generated``, ``trained``, ``evicted``, ``dropped``, ``buffered``, ``in_flight``, ``dropped_reasons``."""
        return EpisodeCounts(
            generated=self._generated,
            trained=self._trained,
            evicted=self._evicted,
            dropped=self._dropped,
            buffered=len(self._buffered),
            in_flight=len(self._in_flight),
            dropped_reasons=dict(self._dropped_reasons),
        )

    def check_accounting(self) -> EpisodeCounts:
        """Raise ``AssertionError`` unless ``generated == trained + evicted + dropped + buffered + in_flight``."""
        c = self.counts()
        accounted = c["trained"] + c["evicted"] + c["dropped"] + c["buffered"] + c["in_flight"]
        if c["generated"] != accounted or sum(c["dropped_reasons"].values()) != c["dropped"]:
            raise AssertionError(
                f"replay buffer accounting is broken: generated={c['generated']} but trained + evicted + dropped "
                f"+ buffered + in_flight = {accounted} ({c}); an episode was added or removed outside the "
                "buffer's methods"
            )
        return c

    # --- in -------------------------------------------------------------------

    def _require_new(self, episodes: Sequence[Episode]) -> None:
        ids = [ep.id for ep in episodes]
        repeated = [i for i, n in Counter(ids).items() if n > 1]
        if repeated:
            raise ValueError(f"ReplayBuffer: episode ids {repeated[:10]} appear twice in one call; ids must be unique")
        for i in ids:
            seen = self.status(i)
            if seen is not None:
                raise ValueError(
                    f"ReplayBuffer: episode id {i} was already seen (status {seen!r}); every episode needs a "
                    "fresh unique id"
                )

    def drop_reason(self, episode_id: int) -> str:
        """Why a dropped episode was dropped ("" if it was not, or the reason was not kept across a restore
        or below the watermark)."""
        if episode_id in self._reasons:
            return self._reasons[episode_id]
        old = self._old.get(episode_id)
        return old[1] if old is not None else ""

    def _close_dropped(self, episode_id: int, reason: str) -> None:
        self._reasons[episode_id] = reason
        self._closed[episode_id] = "dropped"
        self._next_id = max(self._next_id, episode_id + 1)
        self._dropped += 1
        self._dropped_reasons[reason] += 1

    def add(self, episodes: Iterable[Episode]) -> list[Episode]:
        """Add freshly generated episodes (whole groups); return any dropped because the buffer is full."""
        episodes = list(episodes)
        self._require_new(episodes)
        self._generated += len(episodes)
        for ep in episodes:
            self._buffered[ep.id] = ep
            self._next_id = max(self._next_id, ep.id + 1)
        return self._enforce_max_size()

    def _enforce_max_size(self) -> list[Episode]:
        overflow: list[Episode] = []
        if self.max_size is None:
            return overflow
        while len(self._buffered) > self.max_size:
            oldest_id = next(iter(self._buffered))
            overflow.append(self._buffered.pop(oldest_id))
            self._close_dropped(oldest_id, "buffer_full")
        self._closed_now(overflow, "dropped", "buffer_full")
        return overflow

    def drop(self, episodes: Iterable[Episode], reason: str) -> None:
        """Drop episodes with ``reason``: new ones (never added; counted as generated too), buffered or in-flight ones.

        Use it for episodes rejected before the buffer, e.g. ``"reward_error:<name>"``.
        """
        episodes = list(episodes)
        repeated = [i for i, n in Counter(ep.id for ep in episodes).items() if n > 1]
        if repeated:
            raise ValueError(f"ReplayBuffer.drop: episode ids {repeated[:10]} appear twice in one call")
        for ep in episodes:
            if self._is_closed(ep.id):
                raise ValueError(
                    f"ReplayBuffer.drop: episode {ep.id} is already {self.status(ep.id)}; it cannot be dropped"
                )
        for ep in episodes:
            if ep.id in self._buffered:
                del self._buffered[ep.id]
            elif ep.id in self._in_flight:
                del self._in_flight[ep.id]
            else:
                self._generated += 1
            self._close_dropped(ep.id, reason)
        self._closed_now(episodes, "dropped", reason)

    def record_generated(self, n: int, reason: str) -> None:
        """Count ``n`` episodes that were generated and dropped with ``reason`` without an ``Episode`` object."""
        if n < 0:
            raise ValueError(f"ReplayBuffer.record_generated: n must be >= 0, got {n}")
        self._generated += n
        self._dropped += n
        self._dropped_reasons[reason] += n

    # --- out ------------------------------------------------------------------

    def evict_stale(self, current_version: int) -> list[Episode]:
        """Evict (reason ``"stale"``) every buffered episode more than ``max_policy_age`` versions old; return them."""
        stale = [
            ep for ep in self._buffered.values() if current_version - ep.policy_version > self.max_policy_age
        ]
        for ep in stale:
            del self._buffered[ep.id]
            self._closed[ep.id] = "evicted"
        self._evicted += len(stale)
        self._closed_now(stale, "evicted", "stale")
        return stale

    def sample(self, current_version: int) -> list[Episode] | None:
        """Evict stale episodes, then take ``batch_size`` episodes, or return None if there are not enough.

        Oldest first, whole groups preferred: groups that fit in what is left of
        the batch are taken whole, in age order; only then is the batch filled
        with the oldest remaining episodes (splitting a group). With
        ``max_policy_age == 0`` "oldest" is admission order (group ids), not
        arrival order, so the batches do not depend on which rollout finished
        first (deterministic synchronous runs). The returned
        episodes are in flight until ``mark_trained``, ``mark_dropped`` or ``requeue``.
        """
        self.evict_stale(current_version)
        if len(self._buffered) < self.batch_size:
            return None
        groups: dict[object, list[int]] = {}
        for ep in self._buffered.values():
            groups.setdefault(ep.group_id, []).append(ep.id)
        order = list(self._buffered)
        if self.max_policy_age == 0:  # on-policy: groups in admission (id) order, so batches are deterministic
            try:
                # group ids are ints in forgelab's rollouts; ids that do not compare raise TypeError, caught below
                groups = dict(sorted(groups.items(), key=lambda kv: cast(int, kv[0])))
            except TypeError:  # group ids that do not compare: keep age order
                pass
            order = [i for ids in groups.values() for i in ids]
        chosen: set[int] = set()
        for ids in groups.values():
            if len(chosen) + len(ids) <= self.batch_size:
                chosen.update(ids)
            if len(chosen) == self.batch_size:
                break
        for i in order:
            if len(chosen) == self.batch_size:
                break
            chosen.add(i)
        batch = [self._buffered[i] for i in order if i in chosen]
        for ep in batch:
            del self._buffered[ep.id]
            self._in_flight[ep.id] = ep
        return batch

    def _take_in_flight(self, episodes: Iterable[Episode], what: str) -> list[Episode]:
        episodes = list(episodes)
        for ep in episodes:
            if ep.id in self._in_flight:
                continue
            if self.status(ep.id) == "trained":
                raise EpisodeAlreadyTrained(
                    f"ReplayBuffer.{what}: episode {ep.id} was already trained on; an episode is never trained "
                    "twice (did two steps share a batch?)"
                )
            raise ValueError(
                f"ReplayBuffer.{what}: episode {ep.id} is not in flight (status {self.status(ep.id)!r}); only "
                "episodes returned by sample() can be marked"
            )
        repeated = [i for i, n in Counter(ep.id for ep in episodes).items() if n > 1]
        if repeated:
            raise EpisodeAlreadyTrained(f"ReplayBuffer.{what}: episode ids {repeated[:10]} appear twice in one call")
        for ep in episodes:
            del self._in_flight[ep.id]
        return episodes

    def mark_trained(self, episodes: Iterable[Episode]) -> None:
        """Record that the trainer stepped on these in-flight episodes."""
        taken = self._take_in_flight(episodes, "mark_trained")
        for ep in taken:
            self._closed[ep.id] = "trained"
            self._trained += 1
        self._closed_now(taken, "trained")

    def mark_dropped(self, episodes: Iterable[Episode], reason: str) -> None:
        """Record that these in-flight episodes will not be trained on (e.g. the step was skipped)."""
        taken = self._take_in_flight(episodes, "mark_dropped")
        for ep in taken:
            self._close_dropped(ep.id, reason)
        self._closed_now(taken, "dropped", reason)

    def requeue(self, episodes: Iterable[Episode]) -> list[Episode]:
        """Put in-flight episodes back at the front of the buffer (e.g. the trainer failed transiently).

        They keep their age and may be evicted at the next ``sample``; returns
        any dropped for ``max_size``.
        """
        back = {ep.id: ep for ep in self._take_in_flight(episodes, "requeue")}
        self._buffered = {**back, **self._buffered}
        return self._enforce_max_size()

    # --- checkpointing ----------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Counters, episode statuses and the episodes still held, as plain Python (picklable, JSON-able).

        In-flight episodes are saved as buffered: the step that took them has
        not been recorded, so after a restore they can be sampled again. Statuses
        are saved from the watermark up (format 2): the size does not grow with the run.
        """
        return {
            "format": 2,
            "watermark": self._watermark,
            "generated": self._generated,
            "trained": self._trained,
            "evicted": self._evicted,
            "dropped": self._dropped,
            "dropped_reasons": dict(self._dropped_reasons),
            "closed": [[i, s] for i, s in self._closed.items()],
            "episodes": [dataclasses.asdict(ep) for ep in [*self._in_flight.values(), *self._buffered.values()]],
        }

    def load_state_dict(self, state: object) -> list[Episode]:
        """Restore from ``state_dict()``; ``batch_size``, ``max_policy_age`` and ``max_size`` stay as constructed.

        Atomic: the whole state is checked first (format, counters, statuses,
        episodes, the accounting identity) and a bad one raises ``ValueError``
        naming the problem with the buffer unchanged. If it holds more episodes
        than this buffer's ``max_size``, the oldest are dropped with reason
        ``"buffer_full"`` (counted like any other drop) and returned.
        """
        checked = checked_state(state)
        episodes = checked["episodes"]
        overflow: list[Episode] = []
        if self.max_size is not None and len(episodes) > self.max_size:
            overflow, episodes = episodes[: len(episodes) - self.max_size], episodes[len(episodes) - self.max_size:]
        # Nothing below can raise: install the checked state in one go.
        self._generated, self._trained = checked["generated"], checked["trained"]
        self._evicted, self._dropped = checked["evicted"], checked["dropped"]
        self._dropped_reasons, self._closed = checked["dropped_reasons"], checked["closed"]
        self._watermark = checked["watermark"]
        self._reasons = {}
        self._old = OrderedDict()
        self._pending = {}
        self._reserved = 0
        self._in_flight = {}
        self._buffered = {ep.id: ep for ep in episodes}
        self._next_id = max([self._watermark, *(i + 1 for i in self._closed), *(ep.id + 1 for ep in overflow),
                             *(i + 1 for i in self._buffered)])
        for ep in overflow:
            self._close_dropped(ep.id, "buffer_full")
        self._closed_now(overflow, "dropped", "buffer_full")
        self.check_accounting()
        return overflow
