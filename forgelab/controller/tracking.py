"""Metrics tracking: an in-memory table, a CSV that grows step by step, Parquet and wandb.

wandb runs offline unless the user is logged in and sets WANDB_MODE=online;
the offline run directory can be synced later with `wandb sync`. Each `Tracker`
(each run: a parent, its forks, a replay) has its own wandb run under its run
directory, and several can be alive in one process.
"""
from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from forgelab.controller.events import Event, as_int

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("forgelab.controller.tracking")


class Tracker:
    """Rows of per-step metrics, mirrored to out_dir/metrics.csv and (optionally) wandb."""

    def __init__(self, out_dir: str | Path, *, use_wandb: bool = True, run_name: str = "forgelab",
                 config: dict[str, object] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[Event] = []
        self.csv_path = self.out_dir / "metrics.csv"
        self._columns: list[str] = []
        self._wandb = None
        self.wandb_dir: str | None = None
        if use_wandb:
            try:
                os.environ.setdefault("WANDB_MODE", "offline")
                os.environ.setdefault("WANDB_SILENT", "true")
                import wandb

                # "create_new": a fork (or a second run in one notebook) gets its own wandb run while the
                # parent keeps logging to its own; "finish_previous" would end the parent's run at the fork.
                # This class logs through its own run object only, never the global wandb.run.
                self._wandb = wandb.init(
                    project="forgelab", name=run_name, dir=str(self.out_dir), config=config or {},
                    reinit="create_new",
                )
                self.wandb_dir = str(Path(self._wandb.dir).parent)
            except Exception as e:  # tracking must never take the run down
                log.warning("forgelab: wandb disabled (%s: %s)", type(e).__name__, e)
                self._wandb = None

    def log(self, row: Event) -> None:
        self.rows.append(row)
        new_cols = [k for k in row if k not in self._columns]
        if new_cols:
            self._columns += new_cols
            self._rewrite_csv()
        else:
            with self.csv_path.open("a", newline="") as f:
                csv.DictWriter(f, self._columns).writerow(row)
        if self._wandb is not None:
            try:
                clean = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
                self._wandb.log(clean, step=as_int(row.get("step", len(self.rows))))
            except Exception as e:
                log.warning("forgelab: wandb log failed (%s)", e)

    def annotate(self, step: int, values: Mapping[str, float]) -> None:
        """Add ``values`` (an evaluation's scores, say) at ``step``: into the last row when it is that step's,
        else as a new row; mirrored to metrics.csv and wandb like a logged row."""
        if self.rows and as_int(self.rows[-1].get("step", -1)) == step:
            row = self.rows[-1]
            row.update(values)
            self._columns += [k for k in values if k not in self._columns]
            self._rewrite_csv()
            if self._wandb is not None:
                try:
                    self._wandb.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)
                except Exception as e:
                    log.warning("forgelab: wandb log failed (%s)", e)
        else:
            self.log({"step": step, **values})

    def _rewrite_csv(self) -> None:
        with self.csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, self._columns)
            w.writeheader()
            for r in self.rows:
                w.writerow(r)

    def dataframe(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.rows, columns=self._columns or None)

    def finish(self) -> None:
        try:
            if self.rows:
                self.dataframe().to_parquet(self.out_dir / "metrics.parquet")
        except Exception as e:
            log.warning("forgelab: parquet export failed (%s)", e)
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass
            self._wandb = None


MARKED_EVENTS = ("loss_swapped", "reward_weights", "reward_added", "replica_failed", "replica_restarted",
                 "step_skipped", "paused", "resumed_from_checkpoint")


def plot_learning_curve(df: pd.DataFrame, path: str | Path, events: Iterable[Event] | None = None,
                        accuracy: list[tuple[int, float]] | None = None) -> Path:
    """Reward, held-out accuracy (`accuracy`: (step, acc) pairs, step 0 included) and loss against step, as a PNG.

    Events that change the run (loss swaps, reward changes, replica restarts, skipped steps) are dotted lines.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("reward_mean", "reward (mean)"), ("heldout_accuracy", "held-out greedy accuracy"), ("loss", "loss")]
    for ax, (col, title) in zip(axes, panels):
        if col == "heldout_accuracy" and accuracy:
            ax.plot([a[0] for a in accuracy], [a[1] for a in accuracy], marker="o", ms=3)
        elif col in df and df[col].notna().any():
            d = df[["step", col]].dropna()
            ax.plot(d["step"], d[col], marker="o" if col == "heldout_accuracy" else None, ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        for ev in events or []:
            if ev.get("kind") in MARKED_EVENTS and ev.get("step") is not None:
                ax.axvline(ev["step"], color="grey", ls=":", lw=0.8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
