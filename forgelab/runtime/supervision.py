"""Supervision: a child's death becomes an event, never the controller's death.

Monarch 0.6 calls `monarch.actor.unhandled_fault_hook(failure)` on the
controller when a process of one of its meshes dies, and its default hook
exits the controller (a notebook kernel included). `install()` replaces it
with a hook that records a `FaultEvent` and notifies listeners (services use
this to mark a replica unhealthy and respawn it), and returns normally, which
tells Monarch the fault is handled.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("forgelab.supervision")


@dataclass
class FaultEvent:
    """A mesh failure as the controller saw it."""

    mesh_name: str
    crashed_ranks: list[int]
    message: str
    time: float = field(default_factory=time.time)


_lock = threading.Lock()
_events: list[FaultEvent] = []
_listeners: list[Callable[[FaultEvent], None]] = []
_installed = False


def _parse(failure: object) -> FaultEvent:
    text = str(failure)
    mesh = getattr(failure, "mesh_name", None)
    if mesh is None:
        m = re.search(r"mesh_name=([^,\s]+)", text)
        mesh = m.group(1) if m else "?"
    ranks = getattr(failure, "crashed_ranks", None)
    if ranks is None:
        m = re.search(r"crashed_ranks=\[([0-9, ]*)\]", text)
        ranks = [int(x) for x in m.group(1).split(",") if x.strip()] if m else []
    return FaultEvent(mesh_name=str(mesh), crashed_ranks=list(ranks), message=text)


def _hook(failure: object) -> None:
    try:
        event = _parse(failure)
    except Exception:  # never let the hook itself raise: raising means "unhandled"
        event = FaultEvent(mesh_name="?", crashed_ranks=[], message=repr(failure))
    with _lock:
        _events.append(event)
        listeners = list(_listeners)
    log.warning("forgelab: process failure in mesh %s ranks %s", event.mesh_name, event.crashed_ranks)
    for fn in listeners:
        try:
            fn(event)
        except Exception:
            log.exception("forgelab: fault listener %r failed", fn)


def install() -> None:
    """Install forgelab's fault hook (idempotent). Called before any spawn."""
    global _installed
    import monarch.actor

    if monarch.actor.unhandled_fault_hook is not _hook:
        monarch.actor.unhandled_fault_hook = _hook
    _installed = True


def events() -> list[FaultEvent]:
    """All faults seen by this controller, oldest first."""
    with _lock:
        return list(_events)


def add_listener(fn: Callable[[FaultEvent], None]) -> None:
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Callable[[FaultEvent], None]) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")
