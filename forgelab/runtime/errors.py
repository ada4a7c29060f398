"""A service's errors, in a module without Monarch (the watchdog's `StuckError` is one of them)."""
from __future__ import annotations

__all__ = ["NoHealthyReplicaError", "ReplicaFailedError"]


class NoHealthyReplicaError(RuntimeError):
    """No replica of a service can take a call right now."""


class ReplicaFailedError(RuntimeError):
    """A replica's process died during a call that could not be retried."""
