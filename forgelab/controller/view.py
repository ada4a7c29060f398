"""A typed, read-only view of a run, for widgets and reports.

    snap = run.snapshot()            # RunSnapshot: a frozen copy, safe to keep and compare
    snap.state, snap.step, snap.reward_weights, snap.accuracy_history
    events_of(run.events, since=0)   # [RunEvent]: typed events over the log's dicts

Widgets read this view (and `run.metrics` / `run.rollouts` DataFrames) and act
through the run's public commands; they never touch the run's parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence, TypedDict

from forgelab.controller.events import as_float, as_int

if TYPE_CHECKING:
    from forgelab.controller.buffer import EpisodeCounts

__all__ = ["RunSnapshot", "RunEvent", "events_of", "RecordedCounts"]


class RecordedCounts(TypedDict, total=False):
    """A recorded run's episode counts (`forgelab.controller.recorded.RecordedRun`): what its rollout log holds
    (empty when it holds none); a live run's are `EpisodeCounts`."""

    trained: int
    evicted: int
    dropped: int
    recorded: int


@dataclass(frozen=True)
class RunEvent:
    """One entry of a run's event log: `kind`, the `step` it happened at, unix `time`, and its own `fields`."""

    kind: str
    step: int
    time: float
    fields: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, ev: Mapping[str, object]) -> "RunEvent":
        return cls(kind=str(ev.get("kind", "")), step=as_int(ev.get("step", 0)),
                   time=as_float(ev.get("time", 0.0)),
                   fields={k: v for k, v in ev.items() if k not in ("kind", "step", "time")})

    def get(self, name: str, default: object = None) -> object:
        """A field by name, `kind`/`step`/`time` included (so code written for the log's dicts reads it too)."""
        if name in ("kind", "step", "time"):
            return getattr(self, name)
        return self.fields.get(name, default)


@dataclass(frozen=True)
class RunSnapshot:
    """The run's state at one moment (copies: changing the run later does not change a snapshot)."""

    name: str
    state: str
    """created, starting, running, paused, stopped, finished or failed."""
    step: int
    steps: int
    version: int
    loss: str
    message: str
    reward_weights: dict[str, float]
    episodes: EpisodeCounts | RecordedCounts
    """A live run's counts from its replay buffer, a recorded run's from its rollout log."""
    accuracy_history: tuple[tuple[int, float], ...]
    services: dict[str, Sequence[object]]
    events: int
    """How many events the log holds (read new ones with `run.events[n:]`)."""

    @property
    def reward_names(self) -> list[str]:
        return list(self.reward_weights)

    @property
    def accuracy(self) -> float | None:
        """The latest held-out accuracy, or None before the first evaluation."""
        return self.accuracy_history[-1][1] if self.accuracy_history else None


def events_of(events: Sequence[Mapping[str, object]], since: int = 0) -> list[RunEvent]:
    """A run's events from index `since` on, typed (the log keeps the dicts; this is a read-only copy)."""
    return [RunEvent.of(e) for e in list(events)[since:]]
