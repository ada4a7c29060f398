"""Helpers shared by benchmark suites: timing, a text table, the JSON line."""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Iterable, Sequence


def median_ms(samples_ns: Sequence[int | float]) -> float:
    """Median of nanosecond samples, in milliseconds."""
    if not samples_ns:
        raise ValueError("median_ms: no samples")
    return statistics.median(samples_ns) / 1e6


def now_ns() -> int:
    return time.perf_counter_ns()


class Timer:
    """`with Timer() as t: ...` then `t.ns` / `t.ms`."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ns = time.perf_counter_ns() - self.start

    @property
    def ms(self) -> float:
        return self.ns / 1e6


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print dict rows as an aligned text table with the given columns."""
    def fmt(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def emit_json(result: dict[str, Any]) -> None:
    """Print `result` as one JSON line; suites call this last."""
    print(json.dumps(result, sort_keys=False), flush=True)
