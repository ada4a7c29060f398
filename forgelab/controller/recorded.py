"""A run directory read back as a run's view, with no process: what the lab's panels read of a live `Run`
(`metrics`, `rollouts`, `events`, `snapshot()`, `status()`), from the files the run wrote.

    rec = RecordedRun("runs/demo")       # a finished run, or one still running in another kernel
    rec.metrics.tail(); rec.rollouts; rec.snapshot().accuracy
    rec.reload()                          # read the files again (a run still writing them)

Read-only: a recorded run takes no command (`set_loss`, `pause`, ...); each says so and names the way to act
(fork it from a checkpoint with `Run.fork_from`). `forgelab.lab.open(run_dir)` shows one in the lab.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

from forgelab.controller.events import Event, EventLog, Listener, as_float, as_int
from forgelab.controller.rollout_log import read_rollouts
from forgelab.controller.view import RecordedCounts, RunSnapshot

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["RecordedRun"]

_ENDED = {"finished": "finished", "stopped": "stopped", "failed": "failed"}


def _mapping(value: object, what: str) -> dict[object, object]:
    """`value` (a manifest section or an event's field, read back from JSON) as a dict; {} when it is empty."""
    value = value or {}
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {type(value).__name__} {value!r}, not a mapping")
    return value


class RecordedRun:
    """A run directory (metrics.csv, events.jsonl, rollouts/, manifest.json) as a read-only run view."""

    def __init__(self, run_dir: str | Path):
        self.out_dir = Path(run_dir)
        if not (self.out_dir / "events.jsonl").is_file() and not (self.out_dir / "metrics.csv").is_file():
            raise FileNotFoundError(f"{run_dir} is not a forgelab run directory (no events.jsonl or metrics.csv); "
                                    "pass the directory a run wrote (tracking.out_dir / name)")
        self.reload()

    def reload(self) -> "RecordedRun":
        """Read the run's files again (a run still running elsewhere keeps appending to them)."""
        import pandas as pd

        manifest_path = self.out_dir / "manifest.json"
        self.manifest: dict[str, object] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        cfg = _mapping(self.manifest.get("config"), "manifest config")
        self.name = str(cfg.get("name") or self.out_dir.name)
        self.steps = as_int(_mapping(cfg.get("train"), "manifest config.train").get("steps") or 0)
        self.events: Sequence[Event] = (EventLog.read(self.out_dir) if (self.out_dir / "events.jsonl").is_file()
                                        else [])
        metrics_path = self.out_dir / "metrics.csv"
        self.metrics = pd.read_csv(metrics_path) if metrics_path.is_file() else pd.DataFrame()
        self.rollouts: pd.DataFrame
        try:
            self.rollouts = _inspector_columns(read_rollouts(self.out_dir))
        except FileNotFoundError:
            self.rollouts = pd.DataFrame()
        return self

    # ------------------------------------------------------------------ the view a panel reads
    @property
    def state(self) -> str:
        """The run's last lifecycle event (finished, stopped, failed), else "running" (still being written)."""
        for e in reversed(self.events):
            kind = e["kind"]
            if isinstance(kind, str) and kind in _ENDED:
                return _ENDED[kind]
        return "running"

    @property
    def step(self) -> int:
        return int(self.metrics["step"].max()) if len(self.metrics) and "step" in self.metrics else 0

    @property
    def accuracy_history(self) -> list[tuple[int, float]]:
        return [(as_int(e.get("step", 0)), as_float(e["accuracy"])) for e in self.events
                if e["kind"] == "eval" and e.get("accuracy") is not None]

    def _reward_weights(self) -> dict[str, float]:
        rollout = _mapping(_mapping(self.manifest.get("config"), "manifest config").get("rollout"),
                           "manifest config.rollout")
        weights = dict(_mapping(rollout.get("rewards"), "manifest config.rollout.rewards"))
        for e in self.events:  # the live changes, in order
            if e["kind"] == "reward_weights":
                weights.update(_mapping(e.get("new"), "reward_weights event's new"))
            elif e["kind"] == "reward_removed":
                weights.pop(e.get("name"), None)
            elif e["kind"] == "reward_added":
                weights[e.get("name")] = e.get("weight", 1.0)
        return {str(k): float(v) for k, v in weights.items() if isinstance(v, (int, float))}

    def _episodes(self) -> RecordedCounts:
        df = self.rollouts
        if not len(df) or "status" not in df:
            return {}
        status = df["status"].astype(str).str.split(":").str[0]
        return {"trained": int((status == "trained").sum()), "evicted": int((status == "evicted").sum()),
                "dropped": int((status == "dropped").sum()), "recorded": int(len(df))}

    def _version_and_loss(self) -> tuple[int, str]:
        """The last metrics row's policy version and loss name (0 and "" before the first row)."""
        if not len(self.metrics):
            return 0, ""
        last = self.metrics.iloc[-1]
        return as_int(last.get("version", 0)), str(last.get("loss_name", ""))

    def status(self) -> dict[str, object]:
        version, loss = self._version_and_loss()
        return {"state": self.state, "step": self.step, "steps": self.steps, "version": version, "loss": loss,
                "reward_weights": self._reward_weights(), "message": f"recorded run {self.out_dir}",
                "episodes": self._episodes(), "services": {}}

    def snapshot(self) -> RunSnapshot:
        version, loss = self._version_and_loss()
        return RunSnapshot(name=self.name, state=self.state, step=self.step, steps=self.steps, version=version,
                           loss=loss, message=f"recorded run {self.out_dir}", reward_weights=self._reward_weights(),
                           episodes=self._episodes(), accuracy_history=tuple(self.accuracy_history), services={},
                           events=len(self.events))

    def add_listener(self, fn: Listener) -> None:
        """Nothing is live: a recorded run never notifies (call `reload()` and refresh the panels)."""

    def remove_listener(self, fn: Listener) -> None:
        """See `add_listener`."""

    def __getattr__(self, name: str) -> NoReturn:
        if name in _COMMANDS:
            raise RuntimeError(f"{name}: {self.out_dir} is a recorded run (read-only, no process); to train from "
                               "it, fork one of its checkpoints: `await Run.fork_from(path, ...)`")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<RecordedRun {self.name} {self.state} step {self.step}/{self.steps} at {self.out_dir}>"


_COMMANDS = frozenset({"start", "stop", "pause", "resume", "set_loss", "set_reward_weights", "add_reward",
                       "remove_reward", "save_checkpoint", "fork", "compare_losses", "push_weights", "evaluate"})


class _Row(Protocol):
    """A frame's row as ``DataFrame.apply(..., axis=1)`` passes it (a pandas Series), read by column name."""

    def __getitem__(self, key: str) -> object: ...

    def get(self, key: str, default: object = None) -> object: ...


def _values(value: object, column: str) -> Collection[object]:
    """A list column's value (a numpy array or a list, as parquet reads it back)."""
    if not isinstance(value, Collection):
        raise TypeError(f"rollout log column {column!r} holds {type(value).__name__} {value!r}, not a list")
    return value


def _worst_mismatch(r: _Row) -> float:
    """The largest |trainer - generator| logprob over an episode's trained tokens (nan if it never trained)."""
    lps = r["trainer_logprobs"]
    if lps is None or isinstance(lps, float):
        return float("nan")
    lps = _values(lps, "trainer_logprobs")
    mask_value = r.get("loss_mask")
    mask: list[object] = ([1] * len(lps) if mask_value is None or isinstance(mask_value, float)
                          else list(_values(mask_value, "loss_mask")))
    diffs = [abs(as_float(t) - as_float(g))
             for t, g, m in zip(lps, _values(r["generator_logprobs"], "generator_logprobs"), mask) if m]
    return max(diffs) if diffs else 0.0


def _inspector_columns(df: pd.DataFrame) -> pd.DataFrame:
    """The rollout log's rows in the columns `run.rollouts` has (status "dropped:<reason>" as a live run shows)."""
    df = df.copy()
    if "status" in df and "reason" in df:
        dropped = df["status"] == "dropped"
        df.loc[dropped, "status"] = "dropped:" + df.loc[dropped, "reason"].astype(str)
    for name, parts in (("reward_parts", "reward/"),):
        if name in df:
            expanded = df[name].apply(lambda d: d if isinstance(d, dict) else {})
            for key in sorted({k for d in expanded for k in d}):
                df[parts + key] = expanded.map(lambda d, k=key: d.get(k))
    if {"trainer_logprobs", "generator_logprobs"} <= set(df.columns):
        df["mismatch_max"] = df.apply(_worst_mismatch, axis=1) if len(df) else []
    if "info" in df and "turns" not in df:
        df["turns"] = df["info"].map(lambda i: (i or {}).get("turns") if isinstance(i, dict) else None)
    return df
