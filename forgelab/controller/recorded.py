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
from pathlib import Path
from typing import Any

from forgelab.controller.events import EventLog
from forgelab.controller.rollout_log import read_rollouts
from forgelab.controller.view import RunSnapshot

__all__ = ["RecordedRun"]

_ENDED = {"finished": "finished", "stopped": "stopped", "failed": "failed"}


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
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        cfg = self.manifest.get("config") or {}
        self.name = str(cfg.get("name") or self.out_dir.name)
        self.steps = int((cfg.get("train") or {}).get("steps") or 0)
        self.events = EventLog.read(self.out_dir) if (self.out_dir / "events.jsonl").is_file() else []
        metrics_path = self.out_dir / "metrics.csv"
        self.metrics = pd.read_csv(metrics_path) if metrics_path.is_file() else pd.DataFrame()
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
            if e["kind"] in _ENDED:
                return _ENDED[e["kind"]]
        return "running"

    @property
    def step(self) -> int:
        return int(self.metrics["step"].max()) if len(self.metrics) and "step" in self.metrics else 0

    @property
    def accuracy_history(self) -> list[tuple[int, float]]:
        return [(int(e.get("step", 0)), float(e["accuracy"])) for e in self.events
                if e["kind"] == "eval" and e.get("accuracy") is not None]

    def _reward_weights(self) -> dict[str, float]:
        weights = dict(((self.manifest.get("config") or {}).get("rollout") or {}).get("rewards") or {})
        for e in self.events:  # the live changes, in order
            if e["kind"] == "reward_weights":
                weights.update(e.get("new") or {})
            elif e["kind"] == "reward_removed":
                weights.pop(e.get("name"), None)
            elif e["kind"] == "reward_added":
                weights[e.get("name")] = e.get("weight", 1.0)
        return {str(k): float(v) for k, v in weights.items() if isinstance(v, (int, float))}

    def _episodes(self) -> dict[str, Any]:
        df = self.rollouts
        if not len(df) or "status" not in df:
            return {}
        status = df["status"].astype(str).str.split(":").str[0]
        counts = {k: int((status == k).sum()) for k in ("trained", "evicted", "dropped")}
        counts["recorded"] = int(len(df))
        return counts

    def status(self) -> dict:
        last = self.metrics.iloc[-1] if len(self.metrics) else {}
        return {"state": self.state, "step": self.step, "steps": self.steps,
                "version": int(last.get("version", 0)) if len(self.metrics) else 0,
                "loss": str(last.get("loss_name", "")) if len(self.metrics) else "",
                "reward_weights": self._reward_weights(), "message": f"recorded run {self.out_dir}",
                "episodes": self._episodes(), "services": {}}

    def snapshot(self) -> RunSnapshot:
        st = self.status()
        return RunSnapshot(name=self.name, state=st["state"], step=st["step"], steps=st["steps"],
                           version=st["version"], loss=st["loss"], message=st["message"],
                           reward_weights=st["reward_weights"], episodes=st["episodes"],
                           accuracy_history=tuple(self.accuracy_history), services={}, events=len(self.events))

    def add_listener(self, fn: Any) -> None:
        """Nothing is live: a recorded run never notifies (call `reload()` and refresh the panels)."""

    def remove_listener(self, fn: Any) -> None:
        """See `add_listener`."""

    def __getattr__(self, name: str) -> Any:
        if name in _COMMANDS:
            raise RuntimeError(f"{name}: {self.out_dir} is a recorded run (read-only, no process); to train from "
                               "it, fork one of its checkpoints: `await Run.fork_from(path, ...)`")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<RecordedRun {self.name} {self.state} step {self.step}/{self.steps} at {self.out_dir}>"


_COMMANDS = frozenset({"start", "stop", "pause", "resume", "set_loss", "set_reward_weights", "add_reward",
                       "remove_reward", "save_checkpoint", "fork", "compare_losses", "push_weights", "evaluate"})


def _inspector_columns(df):
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
        def worst(r) -> float:
            lps = r["trainer_logprobs"]
            if lps is None or isinstance(lps, float):
                return float("nan")
            mask = r.get("loss_mask")
            mask = [1] * len(lps) if mask is None or isinstance(mask, float) else list(mask)
            diffs = [abs(float(t) - float(g)) for t, g, m in zip(lps, r["generator_logprobs"], mask) if m]
            return max(diffs) if diffs else 0.0
        df["mismatch_max"] = df.apply(worst, axis=1) if len(df) else []
    if "info" in df and "turns" not in df:
        df["turns"] = df["info"].map(lambda i: (i or {}).get("turns") if isinstance(i, dict) else None)
    return df
