"""Checking a saved replay-buffer state before it is installed (`ReplayBuffer.load_state_dict` is atomic).

`checked_state(state)` converts and cross-checks the fields of a `ReplayBuffer.state_dict()` (format 1: every
closed id; format 2: the watermark and the closed ids from it up) and raises ``ValueError`` naming the problem;
it changes nothing.
"""
from __future__ import annotations

from collections import Counter

from forgelab.types import Episode

__all__ = ["checked_state"]


def checked_state(state) -> dict:
    """The fields of a ``ReplayBuffer.state_dict()`` converted and cross-checked, or ``ValueError``; changes nothing."""
    where = "ReplayBuffer.load_state_dict"

    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: {what}; the buffer was left unchanged")

    def count(value, name: str) -> int:
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
    out = {k: count(state[k], k) for k in ("generated", "trained", "evicted", "dropped")}
    # format 1 listed every closed id; format 2 those from the watermark up (the others are counted only)
    out["watermark"] = count(state["watermark"], "watermark") if fmt == 2 and "watermark" in state else 0
    if fmt == 2 and "watermark" not in state:
        raise bad("missing key 'watermark' (format 2)")
    reasons = state["dropped_reasons"]
    if not isinstance(reasons, dict) or not all(isinstance(k, str) for k in reasons):
        raise bad(f"dropped_reasons must map reason strings to counts, got {reasons!r}")
    out["dropped_reasons"] = Counter({k: count(v, f"dropped_reasons[{k!r}]") for k, v in reasons.items()})
    if sum(out["dropped_reasons"].values()) != out["dropped"]:
        raise bad(f"dropped_reasons sum to {sum(out['dropped_reasons'].values())} but dropped={out['dropped']}")
    closed: dict[int, str] = {}
    for item in state["closed"]:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or item[1] not in ("trained", "evicted", "dropped"):
            raise bad(f"closed entry {item!r} is not [episode_id, 'trained' | 'evicted' | 'dropped']")
        i = count(item[0], "closed episode id")
        if i < out["watermark"]:
            raise bad(f"closed episode {i} is below the watermark {out['watermark']}")
        if i in closed:
            raise bad(f"episode {i} appears twice in closed")
        closed[i] = item[1]
    out["closed"] = closed
    statuses = Counter(closed.values())
    for status in ("trained", "evicted"):  # with no watermark, every trained/evicted episode keeps its id
        if statuses[status] > out[status] or (out["watermark"] == 0 and statuses[status] != out[status]):
            raise bad(f"{status}={out[status]} but {statuses[status]} episodes are closed as {status}")
    if statuses["dropped"] > out["dropped"]:
        raise bad(f"dropped={out['dropped']} but {statuses['dropped']} episodes are closed as dropped")
    episodes: list[Episode] = []
    held_ids: set[int] = set()
    for n, d in enumerate(state["episodes"]):
        try:
            ep = Episode(**d)
        except TypeError as e:
            raise bad(f"episode {n} cannot be rebuilt ({e})") from None
        if ep.id in closed or ep.id in held_ids:
            raise bad(f"episode {ep.id} is held twice, or is also closed as {closed.get(ep.id, 'held')}")
        if ep.id < out["watermark"]:
            raise bad(f"held episode {ep.id} is below the watermark {out['watermark']}")
        held_ids.add(ep.id)
        episodes.append(ep)
    out["episodes"] = episodes
    held = out["trained"] + out["evicted"] + out["dropped"] + len(episodes)
    if out["generated"] != held:
        raise bad(f"generated={out['generated']} but trained + evicted + dropped + held episodes = {held}")
    return out
