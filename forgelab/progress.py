"""Console progress for scripts and the CLI: a progress bar, a per-step table, and the end-of-run summary."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Protocol


class FollowedRun(Protocol):
    """What the console reporter reads of a run (`forgelab.run.Run` provides it; this module sits below it)."""

    config: Any
    accuracy_history: list[tuple[int, float]]
    episodes: dict[str, Any]
    step: int

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None: ...
    def remove_listener(self, fn: Callable[[dict[str, Any]], None]) -> None: ...
    async def start(self) -> Any: ...
    async def wait(self) -> None: ...
    async def shutdown(self) -> None: ...

COLUMNS = [
    ("step", "{:>5d}"), ("reward_mean", "{:>7.3f}"), ("heldout_accuracy", "{:>6.3f}"), ("loss", "{:>8.4f}"),
    ("kl_ref", "{:>7.4f}"), ("entropy", "{:>6.3f}"), ("policy_age_mean", "{:>5.2f}"), ("tokens_per_s", "{:>7.0f}"),
    ("step_time_s", "{:>6.2f}"),
]
HEAD = {"step": "step", "reward_mean": "reward", "heldout_accuracy": "acc", "loss": "loss", "kl_ref": "kl",
        "entropy": "entr", "policy_age_mean": "age", "tokens_per_s": "tok/s", "step_time_s": "sec"}


class ConsoleReporter:
    """Listens to a Run: prints one table row per step under a tqdm progress bar."""

    def __init__(self, run: FollowedRun, every: int = 1, stream=None):
        from tqdm import tqdm

        self.run = run
        self.every = every
        self.stream = stream or sys.stdout
        # The bar is for terminals; in a log file (CI, `make demo > log`) the table alone reads better.
        self.bar = tqdm(total=run.config.train.steps, desc="GRPO", unit="step", file=sys.stderr,
                        dynamic_ncols=True, leave=True, disable=not sys.stderr.isatty())
        self._header = False
        run.add_listener(self._on)

    def _fmt(self, row: dict) -> str:
        out = []
        for col, fmt in COLUMNS:
            v = row.get(col)
            width = len(fmt.format(0 if "d" in fmt else 0.0))
            if v is None or (isinstance(v, float) and v != v):
                out.append(" " * (width - 1) + "-")
            else:
                out.append(fmt.format(int(v) if "d" in fmt else float(v)))
        return " ".join(out)

    def _on(self, row: dict) -> None:
        if "event" in row:
            ev = row["event"]
            if ev["kind"] == "data":  # the data split the run made, in words
                self.bar.write(f"  {ev.get('message', '')}", file=self.stream)
                return
            if ev["kind"] in ("loss_swapped", "reward_weights", "step_skipped", "paused", "replica_failed",
                              "replica_restarted", "failed", "eval"):
                detail = {k: v for k, v in ev.items() if k not in ("kind", "time")}
                self.bar.write(f"  [event] {ev['kind']} {detail}", file=self.stream)
            return
        self.bar.update(1)
        if row["step"] % self.every:
            return
        if not self._header:
            hdr = []
            for col, fmt in COLUMNS:
                width = len(fmt.format(0 if "d" in fmt else 0.0))
                hdr.append(HEAD[col].rjust(width))
            self.bar.write(" ".join(hdr), file=self.stream)
            self._header = True
        self.bar.write(self._fmt(row), file=self.stream)

    def close(self) -> None:
        self.run.remove_listener(self._on)
        self.bar.close()


SUMMARY_EPISODES = ("generated", "trained", "evicted", "dropped", "buffered", "in_flight")
"""The episode counts a summary shows: all five terms of generated = trained + evicted + dropped + buffered + in_flight."""


async def follow_run(run: FollowedRun, *, started_at: float, start: bool = False, ndigits: int | None = None) -> dict:
    """Follow `run` with a `ConsoleReporter` until it ends, shut it down, and return its summary.

    Args:
        run: a `forgelab.run.Run`.
        started_at: the `time.time()` the summary's ``minutes`` count from.
        start: attach the reporter first, then `run.start()` (so the step-0 eval event is printed too);
            leave False for a run the caller has already started.
        ndigits: round the accuracies to this many digits (None: as measured).

    Returns ``{"task", "accuracy_before", "accuracy_after", "steps", "minutes", "episodes", "cores_busy",
    "cpu_s_per_episode", "cores_busy_by_part"}`` (the last three: `cpu_keys`); an
    accuracy is None when the run never evaluated, ``episodes`` holds the counts in `SUMMARY_EPISODES` (they
    close: generated is the sum of the others) and ``dropped_reasons``.
    A failure of the run is re-raised after the shutdown.
    """
    reporter = ConsoleReporter(run)
    if start:
        await run.start()
    try:
        await run.wait()
    finally:
        reporter.close()
        await run.shutdown()
    acc = run.accuracy_history
    counts = run.episodes

    def rounded(x: float) -> float:
        return x if ndigits is None else round(x, ndigits)

    return {
        "task": run.config.rollout.task,
        "accuracy_before": rounded(acc[0][1]) if acc else None,
        "accuracy_after": rounded(acc[-1][1]) if acc else None,
        "steps": run.step,
        "minutes": round((time.time() - started_at) / 60, 2),
        "episodes": {**{k: counts[k] for k in SUMMARY_EPISODES}, "dropped_reasons": counts["dropped_reasons"]},
        **cpu_keys(run),
    }


def cpu_keys(run: object) -> dict[str, object]:
    """``cores_busy`` and ``cpu_s_per_episode`` over the run's steady state (`forgelab.runtime.cpu_use`), with
    ``cores_busy_by_part``; None values when the run trained fewer than two steps (or has no meter)."""
    cpu_use = getattr(run, "cpu_use", None)
    use = cpu_use() if callable(cpu_use) else None
    if use is None:
        return {"cores_busy": None, "cpu_s_per_episode": None, "cores_busy_by_part": None}
    d = use.as_dict()
    return {k: d[k] for k in ("cores_busy", "cpu_s_per_episode", "cores_busy_by_part")}
