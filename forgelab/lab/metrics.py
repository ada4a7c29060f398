"""Live learning curves: one reused matplotlib figure (Agg, no pyplot) rendered to PNG in an `ipywidgets.Image`.

Refreshing is driven by the run's listener and throttled (see `Throttle`): at
most one redraw per `min_interval_s`, only when there are new metric rows or
new marked events, and never more than 2% of the controller's time. A redraw
updates existing `Line2D` data and adds only the new event markers, so its
cost grows with the number of points, not with the number of redraws; long
runs are decimated to at most `max_points` points per curve.
"""
from __future__ import annotations

import io
import time
from typing import Any

from forgelab.lab._base import Panel
from forgelab.lab.summary import MARKED_EVENTS, event_label, events_lines, metrics_line, state_line
from forgelab.view import events_of

#: (title, metric columns) per subplot; "reward/*" expands to every reward function's column.
DEFAULT_PLOTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "reward/*")),
    ("held-out accuracy", ("heldout_accuracy",)),
    ("loss", ("loss",)),
    ("KL to reference (k3)", ("kl_ref",)),
    ("entropy", ("entropy",)),
    ("policy age (versions)", ("policy_age_mean",)),
    ("tokens / s", ("tokens_per_s",)),
    ("step time (s)", ("step_time_s",)),
)

#: Events drawn as vertical lines, with their colour.
EVENT_COLOURS = {
    "loss_swapped": "#7b3294", "reward_weights": "#e66101", "reward_added": "#e66101",
    "replica_restarted": "#d7191c", "replica_failed": "#d7191c", "step_skipped": "#636363",
}
_CURVE_COLOURS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


class MetricsPanel(Panel):
    """Reward (total and per reward), held-out accuracy, loss, KL, entropy, policy age, tokens/s vs step.

    Args:
        run: a `forgelab.run.Run` (or anything with `.metrics`, `.events`, `.add_listener`).
        min_interval_s: redraw at most this often (seconds).
        plots: (title, columns) per subplot; default `DEFAULT_PLOTS`.
        max_points: curves longer than this are decimated (every k-th point, last point kept).
    """

    min_interval_s = 2.0

    def __init__(self, run: Any, *, min_interval_s: float | None = None, plots=DEFAULT_PLOTS,
                 max_points: int = 400, width_in: float = 12.0, dpi: int = 72):
        super().__init__(run, min_interval_s=min_interval_s)
        self.plots = tuple(plots)
        self.max_points = max_points
        self.width_in, self.dpi = width_in, dpi
        self._fig = None
        self._axes: list = []
        self._lines: list[dict[str, Any]] = []
        self._n_rows_drawn = -1
        self._n_events_drawn = 0
        self._acc_drawn = -1
        self.redraw_ms: list[float] = []
        """Wall time of each actual redraw (ms), for measuring the dashboard's cost."""
        self.redraw_cpu_ms: list[float] = []
        """CPU time of the drawing thread per redraw (ms): the share taken from training on a busy host."""

    # ------------------------------------------------------------------ widget
    def _build(self):
        import threading

        import ipywidgets as W

        # The first Agg draw of a process loads fonts and builds caches (3-5 s on a busy 2-core host); do
        # that in a thread now, so the first real redraw doesn't stall the run's event loop that long.
        threading.Thread(target=_warm_matplotlib, name="forgelab-mpl-warmup", daemon=True).start()

        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width=f"{int(self.width_in * 96)}px"))
        self.caption = W.HTML()
        return W.VBox([self.image, self.caption], layout=W.Layout(width="100%"))

    def _wants(self, msg: dict) -> bool:
        ev = msg.get("event")
        return ev is None or ev.get("kind") in MARKED_EVENTS or ev.get("kind") == "eval"

    def _figure(self):
        if self._fig is None:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            from matplotlib.ticker import MaxNLocator

            cols = 4
            rows = -(-len(self.plots) // cols)
            # Fixed margins instead of constrained layout: the layout solver costs more than drawing the curves.
            self._fig = Figure(figsize=(self.width_in, 2.2 * rows + 0.3), dpi=self.dpi)
            FigureCanvasAgg(self._fig)
            self._fig.subplots_adjust(left=0.045, right=0.99, top=1 - 0.32 / (2.2 * rows + 0.3), bottom=0.45 / (2.2 * rows + 0.3),
                                      wspace=0.24, hspace=0.38)
            self._axes = list(self._fig.subplots(rows, cols, squeeze=False, sharex=True).ravel())
            for i, ax in enumerate(self._axes):
                if i >= len(self.plots):
                    ax.set_visible(False)
                    continue
                ax.set_title(self.plots[i][0], fontsize=10, loc="left", color="#333")
                ax.tick_params(labelsize=8, labelbottom=i + cols >= len(self.plots), length=2)
                ax.yaxis.set_major_locator(MaxNLocator(4))  # fewer tick labels: text is most of the draw time
                ax.grid(True, lw=0.4, alpha=0.5)
                ax.spines[["top", "right"]].set_visible(False)
            self._axes[0].xaxis.set_major_locator(MaxNLocator(6, integer=True))
            self._lines = [{} for _ in self.plots]
        return self._fig

    def _columns(self, cols: tuple[str, ...], df_columns) -> list[str]:
        out = []
        for c in cols:
            if c.endswith("/*"):
                out += sorted(x for x in df_columns if x.startswith(c[:-1]))
            elif c in df_columns:
                out.append(c)
        return out

    def _decimate(self, x, y):
        n = len(x)
        if n <= self.max_points:
            return x, y
        k = -(-n // self.max_points)
        idx = list(range(0, n - 1, k)) + [n - 1]
        return x[idx], y[idx]

    # ------------------------------------------------------------------ drawing
    def refresh(self, force: bool = False) -> bool:
        """Redraw if there are new rows or events (or `force`); returns whether it drew."""
        if self._widget is None:
            return False
        t0, c0 = time.perf_counter(), time.thread_time()
        df = self.run.metrics
        events = [e for e in events_of(self.run) if e.kind in EVENT_COLOURS]
        acc_hist = list(self.run.snapshot().accuracy_history)
        if not force and len(df) == self._n_rows_drawn and len(events) == self._n_events_drawn \
                and len(acc_hist) == self._acc_drawn:
            return False
        fig = self._figure()
        import numpy as np

        step = df["step"].to_numpy(dtype=float) if "step" in df.columns else np.arange(1, len(df) + 1, dtype=float)
        for ax, lines, (title, cols) in zip(self._axes, self._lines, self.plots):
            names = self._columns(cols, df.columns)
            if "heldout_accuracy" in cols and acc_hist and "heldout_accuracy" not in names:
                names.append("heldout_accuracy")
            for j, col in enumerate(names):
                y = df[col].to_numpy(dtype=float, na_value=np.nan) if col in df.columns else np.full(len(step), np.nan)
                ok = ~np.isnan(y)
                x, y = step[ok], y[ok]
                if col == "heldout_accuracy" and acc_hist:
                    # the step-0 evaluation happens before the first metrics row: it lives in accuracy_history
                    pts = dict(zip(x.tolist(), y.tolist()))
                    pts.update({float(s): float(a) for s, a in acc_hist})
                    x, y = np.array(sorted(pts)), np.array([pts[k] for k in sorted(pts)])
                x, y = self._decimate(x, y)
                line = lines.get(col)
                if line is None:
                    sparse = col == "heldout_accuracy"
                    label = "total" if col == "reward_mean" else col.split("/", 1)[-1]
                    (line,) = ax.plot([], [], lw=1.6 if j == 0 else 1.1, color=_CURVE_COLOURS[j % len(_CURVE_COLOURS)],
                                      marker="o" if sparse or len(x) < 3 else "", ms=3.5, label=label)
                    lines[col] = line
                    if len(names) > 1:
                        ax.legend(fontsize=7, loc="best", frameon=False)
                line.set_data(x, y)
                if len(x) >= 3 and col != "heldout_accuracy":
                    line.set_marker("")
            ax.relim()
            ax.autoscale_view()
        if len(step):  # x is shared by every subplot
            self._axes[0].set_xlim(min(0.0, float(step.min())) - 0.2, max(float(step.max()), 1.0) + 0.2)
        for ev in events[self._n_events_drawn:]:
            self._mark(ev)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=self.dpi, pil_kwargs={"compress_level": 1})
        self.image.value = buf.getvalue()
        self._n_rows_drawn, self._n_events_drawn, self._acc_drawn = len(df), len(events), len(acc_hist)
        ms = (time.perf_counter() - t0) * 1e3
        self.redraw_ms.append(ms)
        self.redraw_cpu_ms.append((time.thread_time() - c0) * 1e3)
        self.caption.value = (f"<span style='color:#666;font-size:11px'>x: step · {len(df)} steps · redraw {ms:.0f} ms · "
                              f"at most every {self.throttle.interval_s:.1f} s</span>")
        return True

    def _mark(self, ev: dict) -> None:
        colour = EVENT_COLOURS.get(ev.get("kind"), "#636363")
        x = float(ev.get("step", 0)) + 0.5  # an event between step s and s+1: it acts from step s+1
        for i, ax in enumerate(self._axes[: len(self.plots)]):
            ax.axvline(x, color=colour, ls="--", lw=0.9, alpha=0.8)
            if i % 4 == 0:  # one label per row of subplots keeps the plots readable
                ax.text(x, 0.98, " " + event_label(ev), transform=ax.get_xaxis_transform(), rotation=90,
                        va="top", ha="left", fontsize=7, color=colour, clip_on=True)

    def close(self) -> None:
        super().close()
        self._fig = None

    def summary(self) -> str:
        return "\n".join(["MetricsPanel: " + state_line(self.run), metrics_line(self.run), *events_lines(self.run)])


def _warm_matplotlib() -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(2, 1), dpi=50)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.plot([0, 1], [0, 1], label="warm")
        ax.set_title("warm")
        ax.legend()
        fig.savefig(io.BytesIO(), format="png")
    except Exception:  # a warm-up must never break the panel
        pass
