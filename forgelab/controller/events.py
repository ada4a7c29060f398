"""A run's history of changes: an append-only event log, in memory and in `events.jsonl`.

    log = EventLog()
    log.emit("loss_swapped", step=12, loss="dapo", applies_at_step=13)
    log.attach(run_dir / "events.jsonl")     # earlier events are written out too
    bus = EventBus(log, step=lambda: loop.step)  # what the run's parts emit through (and widgets listen to)
    log[-1]["kind"], len(log), [e for e in log if e["kind"] == "checkpoint"]
    EventLog.read(run_dir)                   # a finished run's events, from its file

Every event is a plain dict with ``kind``, ``step`` (the run's step when it was
recorded) and ``time`` (unix seconds), plus its own fields. Each event is
JSON-round-tripped before it is kept, so the list in memory and the lines in the
file hold the same values (a value JSON cannot hold is stored as its ``repr``).
The log is the one owner of a run's history: the timeline, ``forgelab show``,
replay and the dashboards all read it. Nothing is ever removed or rewritten.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Iterator, Protocol, SupportsFloat, SupportsIndex, SupportsInt, overload

EVENTS_FILE = "events.jsonl"

Event = dict[str, object]
"""One event as the log keeps it: ``kind`` (str), ``step`` (int), ``time`` (unix seconds) and its own fields, each
a JSON value. Metrics rows passed to the listeners are dicts of the same shape."""

Listener = Callable[[Event], None]
"""What `EventBus.add_listener` takes: called with a metrics row or ``{"event": event}``."""


def as_int(value: object) -> int:
    """``int(value)`` for a JSON value read back from an event, a record or a manifest (typed: the value is
    ``object``); a value ``int()`` does not take raises ``TypeError`` as ``int()`` would."""
    if isinstance(value, (str, bytes, bytearray, SupportsInt, SupportsIndex)):
        return int(value)
    raise TypeError(f"int() argument must be a string, a bytes-like object or a real number, not "
                    f"'{type(value).__name__}'")


def as_float(value: object) -> float:
    """``float(value)`` for a JSON value read back from an event, a record or a manifest; ``TypeError`` as
    ``float()`` would for a value it does not take."""
    if isinstance(value, (str, bytes, bytearray, SupportsFloat, SupportsIndex)):
        return float(value)
    raise TypeError(f"float() argument must be a string or a real number, not '{type(value).__name__}'")


class Emitter(Protocol):
    """What a part that records events receives (an `EventBus`, or a test's recorder)."""

    def emit(self, kind: str, **fields: object) -> None: ...


class Emit(Protocol):
    """``emit(kind, **fields)``: the bound `EventBus.emit` a part receives when it records events and nothing else."""

    def __call__(self, kind: str, **fields: object) -> None: ...

_log = logging.getLogger("forgelab.run")


def _jsonable(value: object) -> object:
    """Fallback for json.dumps: sets/tuples as lists, numbers as numbers, anything else as its repr."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    for cast in (float, int):
        try:
            if hasattr(value, "item"):  # numpy / torch scalars
                return cast(value.item())
        except Exception:
            pass
    return repr(value)


class EventLog(Sequence[Event]):
    """Append-only list of event dicts, mirrored line by line to a JSONL file once attached."""

    def __init__(self, path: str | Path | None = None, *, append: bool = False):
        self._events: list[Event] = []
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()  # service callbacks may emit from other threads
        self.path: Path | None = None
        if path is not None:
            self.attach(path, append=append)

    # ------------------------------------------------------------------ writing
    def emit(self, kind: str, *, step: int = 0, **fields: object) -> Event:
        """Record one event; returns it as stored (and as written to the file)."""
        raw = {"kind": str(kind), "step": int(step), "time": time.time(), **fields}
        line = json.dumps(raw, default=_jsonable)
        ev: Event = json.loads(line)
        with self._lock:
            self._events.append(ev)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(line + "\n")
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:
                pass
        return ev

    def attach(self, path: str | Path, *, append: bool = False) -> None:
        """Mirror the log to `path` (a file, or a run directory holding events.jsonl).

        `append=False` starts the file afresh with the events recorded so far
        (a new run). `append=True` keeps the file's earlier events (a run resumed
        in its own directory): they are read back first, so memory and file
        still agree, followed by the events recorded so far.
        """
        path = Path(path)
        if path.is_dir() or path.suffix != ".jsonl":
            path = path / EVENTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            earlier = _read_lines(path) if append and path.is_file() else []
            self._events = earlier + self._events
            with path.open("w") as f:
                for ev in self._events:
                    f.write(json.dumps(ev, default=_jsonable) + "\n")
            self.path = path

    def add_listener(self, fn: Listener) -> None:
        """fn(event) after each new event (exceptions in fn are ignored)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    # ------------------------------------------------------------------ reading
    @staticmethod
    def read(path: str | Path) -> list[Event]:
        """The events of a run directory (or of an events.jsonl file), oldest first."""
        path = Path(path)
        if path.is_dir():
            path = path / EVENTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no event log at {path} (runs write it when they start)")
        return _read_lines(path)

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self if e["kind"] in kinds]

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: "slice[object, object, object]") -> list[Event]: ...
    def __getitem__(self, i: "int | slice[object, object, object]") -> Event | list[Event]:
        with self._lock:
            return self._events[i]

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        with self._lock:
            snapshot = list(self._events)
        return iter(snapshot)

    def __repr__(self) -> str:
        kinds = [e["kind"] for e in self._events[-5:]]
        return f"<EventLog {len(self)} events, last {kinds}{' -> ' + str(self.path) if self.path else ''}>"


def _read_lines(path: Path) -> list[Event]:
    out: list[Event] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            # a line cut short by a crash while writing: keep what is whole
            if n < len(path.read_text().splitlines()):
                raise
    return out


class EventBus:
    """A run's event log plus the listeners told of each event and metrics row (widgets, `Run.until`).

    The parts that record events (rollouts, training, controls) receive this, not the run: ``emit(kind,
    **fields)`` stamps the step the run is at (read through `step`, owned by the training loop) and tells
    every listener; ``notify(row)`` passes a metrics row on. A listener that raises is logged, never fatal.
    """

    def __init__(self, log: EventLog | None = None, step: Callable[[], int] | None = None) -> None:
        self.log = log if log is not None else EventLog()
        self._step: Callable[[], int] = step or (lambda: 0)
        self._listeners: list[Listener] = []

    def read_step_from(self, step: Callable[[], int]) -> None:
        """Where `emit` reads the current step (the training loop, once the run has one)."""
        self._step = step

    def emit(self, kind: str, **fields: object) -> None:
        """Record an event (kind, the current step, fields) in the log and tell the listeners."""
        step = as_int(fields.pop("step")) if "step" in fields else self._step()  # an explicit step= wins
        self.notify({"event": self.log.emit(kind, step=step, **fields)})

    def notify(self, msg: Event) -> None:
        """Tell every listener about a metrics row or an event; a failing listener is logged."""
        for fn in list(self._listeners):
            try:
                fn(msg)
            except Exception:
                _log.exception("forgelab: run listener failed")

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)
