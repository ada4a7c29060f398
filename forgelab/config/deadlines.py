"""The ``watchdog:`` section: when a call or weight push that stopped answering or progressing is declared stuck
(`forgelab.runtime.watchdog` reads it; docs/hangs.md)."""
from __future__ import annotations

from dataclasses import dataclass

from forgelab.config.value_types import ConfigError

__all__ = ["WatchdogConfig"]


@dataclass(kw_only=True)
class WatchdogConfig:
    """When a wait is a hang (`watchdog:`; docs/hangs.md, `forgelab.runtime.watchdog`). Generous by default: at
    10,000 episodes in flight a turn's p99 is ~30 s, and a slow call that makes progress is never flagged."""

    enabled: bool = True
    """Watch every service call and weight push (False: wait as long as it takes)."""
    unresponsive_s: float = 120.0
    """A process whose heartbeat thread (or, with no progress either, its event loop) has not beaten for this
    long is stuck: SIGSTOPped, deadlocked, or its host gone."""
    no_progress_s: float = 600.0
    """A call or weight push during which none of its processes moved a progress counter for this long is
    stuck."""
    heartbeat_s: float = 1.0
    """How often each process writes its heartbeat file (and how often a waiting call reads them)."""
    py_spy: str | None = None
    """The py-spy executable for stack dumps; None: the one beside this Python (the venv's), else on PATH.
    A path that does not exist means py-spy is unavailable: the faulthandler dump is used."""

    def validate(self) -> None:
        for name in ("unresponsive_s", "no_progress_s", "heartbeat_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"watchdog.{name}: must be a positive number of seconds, got {value!r}")
        if self.heartbeat_s * 2 > self.unresponsive_s:
            raise ConfigError(f"watchdog.heartbeat_s: {self.heartbeat_s} must be at most half of "
                              f"watchdog.unresponsive_s={self.unresponsive_s} (a heartbeat or two may be late)")
