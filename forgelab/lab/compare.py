"""Compare runs: overlaid learning curves, fork points and live changes marked, a best/final table.

    view = forgelab.lab.compare([parent, child_a, child_b])     # live Runs: redraws as they train
    view = forgelab.lab.compare(["runs/a", "runs/a-fork1"])      # finished run directories (metrics.csv, events.jsonl)
    view                                                         # a notebook cell: image + table; text elsewhere
    view.table()                                                 # best / final per run (pandas)
    view.save("compare.png")

A source is a `Run` (its `metrics` and `events`, read on each redraw) or a run
directory (read once). Fork points (``forked_from``: the child's first step is
the one after it) are dashed vertical lines in the run's colour; live changes
(loss swaps, reward changes) are dotted ones. Redraws are throttled like the
lab's panels (`forgelab.lab._base.Throttle`, at most one per `min_interval_s`).
A view, nothing more: it reads runs and never acts on them.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from forgelab.lab._base import LAB_BUDGET, Throttle, View, esc

__all__ = ["compare", "Compare", "COMPARED"]

#: (title, column, best is "max" | "min" | None) per subplot.
COMPARED = (
    ("reward", "reward_mean", "max"),
    ("held-out accuracy", "heldout_accuracy", "max"),
    ("KL to reference", "kl_ref", "min"),
    ("entropy", "entropy", None),
    ("loss", "loss", None),
    ("tokens / s", "tokens_per_s", "max"),
)
MARKED = {"forked_from": "--", "loss_swapped": ":", "reward_weights": ":", "reward_added": ":",
          "reward_removed": ":"}
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


class _Source:
    def __init__(self, src: Any):
        self.run = None if isinstance(src, (str, Path)) else src
        if self.run is None:
            d = Path(src)
            if not (d / "metrics.csv").is_file():
                raise FileNotFoundError(f"compare: {d} has no metrics.csv (not a forgelab run directory)")
            import pandas as pd

            self.name = d.name
            self._metrics = pd.read_csv(d / "metrics.csv")
            ev = d / "events.jsonl"
            self._events = [json.loads(x) for x in ev.read_text().splitlines() if x.strip()] if ev.is_file() else []
        else:
            self.name = src.config.name

    def metrics(self):
        return self.run.metrics if self.run is not None else self._metrics

    def events(self) -> list[dict]:
        return list(self.run.events) if self.run is not None else self._events


class Compare(View):
    """Overlaid curves of several runs (live or finished) and a best/final table."""

    def __init__(self, sources: list, *, min_interval_s: float = 2.0, width_in: float = 12.0, dpi: int = 72):
        if not sources:
            raise ValueError("compare: give at least one Run or run directory")
        self.sources = [_Source(s) for s in sources]
        self.width_in, self.dpi = width_in, dpi
        self.throttle = Throttle(self.refresh, min_interval_s=min_interval_s, budget=LAB_BUDGET)
        self._widget = None
        self._listening = False

    # ------------------------------------------------------------------ data
    def marks(self) -> list[tuple[str, int, str]]:
        """(run name, step, event kind) of each fork point and live change."""
        out = []
        for s in self.sources:
            for e in s.events():
                if e.get("kind") in MARKED:
                    step = int(e.get("applies_at_step", e.get("step", 0)) or 0)
                    out.append((s.name, step, e["kind"]))
        return out

    def table(self):
        """Per run: steps done, final and best of each compared metric (best: max or min as the metric says)."""
        import pandas as pd

        rows = []
        for s in self.sources:
            df = s.metrics()
            row: dict[str, Any] = {"run": s.name, "steps": int(df["step"].max()) if len(df) else 0}
            for _, col, best in COMPARED:
                if col in df.columns and df[col].notna().any():
                    vals = df[col].dropna()
                    row[f"{col} final"] = float(vals.iloc[-1])
                    if best:
                        row[f"{col} best"] = float(vals.max() if best == "max" else vals.min())
            rows.append(row)
        return pd.DataFrame(rows).set_index("run")

    # ------------------------------------------------------------------ drawing
    def figure(self):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(self.width_in, 4.8), dpi=self.dpi)
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 3, squeeze=False, sharex=True).ravel()
        marks = self.marks()
        for i, (s, colour) in enumerate(zip(self.sources, _COLOURS * 4)):
            df = s.metrics()
            for ax, (title, col, _) in zip(axes, COMPARED):
                if i == 0:
                    ax.set_title(title, fontsize=10, loc="left")
                    ax.grid(True, lw=0.4, alpha=0.5)
                if col in df.columns and df[col].notna().any():
                    d = df[["step", col]].dropna()
                    ax.plot(d["step"], d[col], color=colour, lw=1.3, label=s.name, marker="." if len(d) < 30 else None)
                for name, step, kind in marks:
                    if name == s.name:
                        ax.axvline(step, color=colour, ls=MARKED[kind], lw=0.9, alpha=0.8)
        axes[0].legend(fontsize=8, loc="best")
        fig.subplots_adjust(left=0.05, right=0.99, top=0.93, bottom=0.08, wspace=0.25, hspace=0.35)
        return fig

    def save(self, path: str | Path) -> Path:
        self.figure().savefig(path)
        return Path(path)

    def _png(self) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png")
        return buf.getvalue()

    # ------------------------------------------------------------------ widget
    @property
    def widget(self):
        if self._widget is None:
            import ipywidgets as W

            self.image = W.Image(format="png", layout=W.Layout(width="100%"))
            self.table_html = W.HTML()
            self._widget = W.VBox([self.image, self.table_html])
            self.refresh()
            self.listen()
        return self._widget

    def listen(self) -> None:
        if self._listening:
            return
        for s in self.sources:
            if s.run is not None:
                s.run.add_listener(self._on_run)
        self._listening = True

    def _on_run(self, msg: dict) -> None:
        ev = msg.get("event")
        if ev is None or ev.get("kind") in MARKED:
            self.throttle.poke()

    def refresh(self) -> None:
        if self._widget is None:
            return
        self.image.value = self._png()
        self.table_html.value = self.table().to_html(float_format=lambda x: f"{x:.4g}", classes="fl-table")

    def close(self) -> None:
        self.throttle.cancel()
        for s in self.sources:
            if s.run is not None and self._listening:
                s.run.remove_listener(self._on_run)
        self._listening = False
        if self._widget is not None:
            self._widget.close()
            self._widget = None

    def summary(self) -> str:
        marks = ", ".join(f"{n}@{st} {k}" for n, st, k in self.marks()) or "none"
        return (f"Compare {len(self.sources)} runs: {', '.join(esc(s.name) for s in self.sources)}\n"
                f"marks: {marks}\n{self.table().to_string(float_format=lambda x: f'{x:.4g}')}")


def compare(sources: list, **kwargs: Any) -> Compare:
    """`Compare(sources)`: the view over `sources` (Runs and/or run directories)."""
    return Compare(sources, **kwargs)
