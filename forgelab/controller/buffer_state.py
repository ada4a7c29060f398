"""Checking a saved replay-buffer state before it is installed (`ReplayBuffer.load_state_dict` is atomic).

`checked_state(state)` converts and cross-checks the fields of a `ReplayBuffer.state_dict()` (format 1: every
closed id; format 2: the watermark and the closed ids from it up) and raises ``ValueError`` naming the problem;
it changes nothing.
"""
from __future__ import annotations

from collections import Counter
from typing import TypedDict

from forgelab.types import Episode

__all__ = ["checked_state", "CheckedState"]


class CheckedState(TypedDict):
    """A saved buffer state, converted and cross-checked (what `checked_state` returns)."""

    generated: int
    trained: int
    evicted: int
    dropped: int
    watermark: int
    dropped_reasons: Counter[str]
    closed: dict[int, str]
    """Episode id (from the watermark up) -> ``trained``, ``evicted`` or ``dropped``."""
    episodes: list[Episode]


def checked_state(state: object) -> CheckedState:
    """The fields of a ``ReplayBuffer.state_dict()`` converted and cross-checked, or ``ValueError``; changes nothing."""
    where = "ReplayBuffer.load_state_dict"

    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: {what}; the buffer was left unchanged")

    def count(value: object, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
            raise bad(f"{name} must be a non-negative integer, got {value!r}")
        if value < 0:
            raise bad(f"{name} must be a non-negative integer, got {value!r}")
        return int(value)

    if not isinstance(state, dict):
        raise bad(f"expected the dict from state_dict(), got {type(state).__name__}")
    fmt = state.get("format")
    if fmt not in (1, 2):
        raise bad(f"unknown format {fmt!r}, expected 1 or 2")
    missing = [k for k in ("generated", "trained", "evicted", "dropped", "dropped_reasons", "closed", "episodes")
               if k not in state]
    if missing:
        raise bad(f"missing keys {missing}")
    n = {k: count(state[k], k) for k in ("generated", "trained", "evicted", "dropped")}
    # format 1 listed every closed id; format 2 those from the watermark up (the others are counted only)
    n["watermark"] = count(state["watermark"], "watermark") if fmt == 2 and "watermark" in state else 0
    if fmt == 2 and "watermark" not in state:
        raise bad("missing key 'watermark' (format 2)")
    reasons = state["dropped_reasons"]
    if not isinstance(reasons, dict) or not all(isinstance(k, str) for k in reasons):
        raise bad(f"dropped_reasons must map reason strings to counts, got {reasons!r}")
    dropped_reasons = Counter({k: count(v, f"dropped_reasons[{k!r}]") for k, v in reasons.items()})
    if sum(dropped_reasons.values()) != n["dropped"]:
        raise bad(f"dropped_reasons sum to {sum(dropped_reasons.values())} but dropped={n['dropped']}")
    closed: dict[int, str] = {}
    for item in state["closed"]:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or item[1] not in ("trained", "evicted", "dropped"):
            raise bad(f"closed entry {item!r} is not [episode_id, 'trained' | 'evicted' | 'dropped']")
        i = count(item[0], "closed episode id")
        if i < n["watermark"]:
            raise bad(f"closed episode {i} is below the watermark {n['watermark']}")
        if i in closed:
            raise bad(f"episode {i} appears twice in closed")
        closed[i] = item[1]
    statuses = Counter(closed.values())
    for status in ("trained", "evicted"):  # with no watermark, every trained/evicted episode keeps its id
        if statuses[status] > n[status] or (n["watermark"] == 0 and statuses[status] != n[status]):
            raise bad(f"{status}={n[status]} but {statuses[status]} episodes are closed as {status}")
    if statuses["dropped"] > n["dropped"]:
        raise bad(f"dropped={n['dropped']} but {statuses['dropped']} episodes are closed as dropped")
    episodes: list[Episode] = []
    held_ids: set[int] = set()
    for k, d in enumerate(state["episodes"]):
        try:
            ep = Episode(**d)
        except TypeError as e:
            raise bad(f"episode {k} cannot be rebuilt ({e})") from None
        if ep.id in closed or ep.id in held_ids:
            raise bad(f"episode {ep.id} is held twice, or is also closed as {closed.get(ep.id, 'held')}")
        if ep.id < n["watermark"]:
            raise bad(f"held episode {ep.id} is below the watermark {n['watermark']}")
        held_ids.add(ep.id)
        episodes.append(ep)
    held = n["trained"] + n["evicted"] + n["dropped"] + len(episodes)
    if n["generated"] != held:
        raise bad(f"generated={n['generated']} but trained + evicted + dropped + held episodes = {held}")
    return CheckedState(generated=n["generated"], trained=n["trained"], evicted=n["evicted"], dropped=n["dropped"],
                        watermark=n["watermark"], dropped_reasons=dropped_reasons, closed=closed, episodes=episodes)
