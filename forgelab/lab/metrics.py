"""Live learning curves: one reused matplotlib figure (Agg, no pyplot) rendered to PNG in an `ipywidgets.Image`.

Refreshing is driven by the run's listener and throttled (see `Throttle`): at
most one redraw per `min_interval_s`, only when there are new metric rows or
new marked events, and never more than 2% of the controller's time. Long runs
are decimated to at most `max_points` points per curve.

A redraw is a blit. The curves are animated `Line2D`s; everything else (frames,
ticks and their labels, titles, grid, legends, event markers: ~90% of a full
Agg draw) is kept as a background bitmap. A redraw restores it, draws the
curves over it and encodes the PNG (~10 ms instead of ~110 ms on this host).
Axis limits are sticky so the background rarely changes: y limits hold until
a curve leaves them, then refit with headroom on the side it left by, and
only that subplot's cell of the background is drawn again; the shared x axis
grows in 1-2-5 steps (capped at the run's planned steps), and a new x range,
curve or event marker draws the whole figure again.
"""
from __future__ import annotations

import io
import time
from typing import Any

from forgelab.lab._base import Panel
from forgelab.lab.summary import MARKED_EVENTS, event_label, events_lines, metrics_line, state_line
from forgelab.controller.view import events_of
from forgelab.controller.facade import RunFacade

#: (title, metric columns) per subplot; "reward/*" expands to every reward function's column.
DEFAULT_PLOTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "reward/*")),
    ("held-out accuracy", ("heldout_accuracy", "lm_eval/*")),  # lm-eval's scores through the agent door too
    ("loss", ("loss",)),
    ("KL to reference (k3)", ("kl_ref",)),
    ("entropy", ("entropy",)),
    ("sampler vs trainer |Δ logprob|", ("mismatch/abs_mean", "mismatch/max")),
    ("policy age (versions)", ("policy_age_mean",)),
    ("tokens / s", ("tokens_per_s",)),
    ("step time (s)", ("step_time_s",)),
    ("generator KV cache: used, preemptions / request", ("generator/kv_cache_usage", "generator/preemptions_per_request")),
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

    def __init__(self, run: RunFacade, *, min_interval_s: float | None = None, plots=DEFAULT_PLOTS,
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
        self._bg = None  # the figure without its curves (H x W x 4 uint8), or None: draw everything again
        self._cells: list[tuple[slice, slice]] = []  # each subplot's rectangle of pixels (rows, columns)
        self._ylims: list = []
        self._xlim = None
        self._legend_px: dict[int, tuple[slice, slice]] = {}  # subplot -> its legend box's pixels
        self.full_draws = 0
        """Redraws that drew the whole figure (first draw, new x range, curve or event marker)."""
        self.cell_draws = 0
        """Subplots drawn again alone because a curve left their y limits."""
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
                # y=1 and fixed label coords: the automatic positions measure every tick label on every draw
                ax.set_title(self.plots[i][0], fontsize=10, loc="left", color="#333", y=1.0)
                ax.xaxis.set_label_coords(0.5, -0.1)
                ax.yaxis.set_label_coords(-0.1, 0.5)
                ax.set_autoscale_on(False)  # limits are set by `sticky_limits` / `x_limit`
                ax.tick_params(labelsize=8, labelbottom=i + cols >= len(self.plots), length=2)
                ax.yaxis.set_major_locator(MaxNLocator(4))  # fewer tick labels: text is most of the draw time
                ax.grid(True, lw=0.4, alpha=0.5)
                ax.spines[["top", "right"]].set_visible(False)
            self._axes[0].xaxis.set_major_locator(MaxNLocator(6, integer=True))
            self._lines = [{} for _ in self.plots]
            self._ylims = [None for _ in self.plots]
            self._cells = _cells(self._fig, self._axes[: len(self.plots)], cols)
            self._bg, self._xlim, self._legend_px = None, None, {}
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
        events = [e for e in events_of(self.run.events) if e.kind in EVENT_COLOURS]
        snap = self.run.snapshot()
        acc_hist = list(snap.accuracy_history)
        if not force and len(df) == self._n_rows_drawn and len(events) == self._n_events_drawn \
                and len(acc_hist) == self._acc_drawn:
            return False
        fig = self._figure()
        import numpy as np

        step = df["step"].to_numpy(dtype=float) if "step" in df.columns else np.arange(1, len(df) + 1, dtype=float)
        dirty = set()  # subplots whose background (limits, legend) must be drawn again
        for i, (ax, lines, (title, cols)) in enumerate(zip(self._axes, self._lines, self.plots)):
            names = self._columns(cols, df.columns)
            if "heldout_accuracy" in cols and acc_hist and "heldout_accuracy" not in names:
                names.append("heldout_accuracy")
            lo, hi = np.inf, -np.inf
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
                                      marker="o" if sparse or len(x) < 3 else "", ms=3.5, label=label, animated=True)
                    lines[col] = line
                    if len(names) > 1:  # an opaque box in the background; the blit lays it over the curves
                        ax.legend(fontsize=7, loc="best", frameon=True, framealpha=1.0, edgecolor="#e5e7eb")
                    dirty.add(i)
                line.set_data(x, y)
                if len(x) >= 3 and col != "heldout_accuracy":
                    line.set_marker("")
                fin = y[np.isfinite(y)]
                if len(fin):
                    lo, hi = min(lo, float(fin.min())), max(hi, float(fin.max()))
            if lo <= hi:
                lim = sticky_limits(self._ylims[i], lo, hi)
                if lim != self._ylims[i]:
                    self._ylims[i] = lim
                    ax.set_ylim(lim)
                    dirty.add(i)
        if len(step):  # x is shared by every subplot
            xlim = (min(0.0, float(step.min())) - 0.2, x_limit(float(step.max()), snap.steps) + 0.2)
            if xlim != self._xlim:
                self._xlim = xlim
                self._axes[0].set_xlim(xlim)
                self._bg = None
        for ev in events[self._n_events_drawn:]:
            self._mark(ev)
            self._bg = None
        self._blit(dirty)
        buf = io.BytesIO()
        self._png(buf)
        self.image.value = buf.getvalue()
        self._n_rows_drawn, self._n_events_drawn, self._acc_drawn = len(df), len(events), len(acc_hist)
        ms = (time.perf_counter() - t0) * 1e3
        self.redraw_ms.append(ms)
        self.redraw_cpu_ms.append((time.thread_time() - c0) * 1e3)
        self.caption.value = (f"<span style='color:#666;font-size:11px'>x: step · {len(df)} steps · redraw {ms:.0f} ms · "
                              f"at most every {self.throttle.interval_s:.1f} s</span>")
        return True

    def _blit(self, dirty: set[int]) -> None:
        """Bring the background up to date (all of it, or the `dirty` subplots' cells), then draw the curves on it."""
        import numpy as np

        canvas = self._fig.canvas
        if self._bg is None or len(dirty) == len(self._cells):
            canvas.draw()  # animated curves are left out: this is the background
            self._bg = np.asarray(canvas.buffer_rgba()).copy()
            self.full_draws += 1
            dirty = set(range(len(self._cells)))
        else:
            px = np.asarray(canvas.buffer_rgba())
            renderer = canvas.get_renderer()
            face = np.round(255 * np.array(self._fig.get_facecolor())).astype(np.uint8)
            for i in sorted(dirty):
                rows, cols = self._cells[i]
                px[rows, cols] = face
                self._axes[i].draw(renderer)  # frame, ticks, title, legend, markers: not the animated curves
                self._bg[rows, cols] = px[rows, cols]  # what spilled outside the cell is dropped just below
            self.cell_draws += len(dirty)
        for i in dirty:  # where each redrawn subplot's legend now sits ('best' follows the data)
            leg = self._axes[i].get_legend()
            self._legend_px.pop(i, None)
            if leg is not None:
                self._legend_px[i] = _pixels(leg.get_window_extent(), self._bg.shape[0], self._cells[i])
        px = np.asarray(canvas.buffer_rgba())
        px[...] = self._bg
        for ax, lines in zip(self._axes, self._lines):
            for line in lines.values():
                ax.draw_artist(line)
        for rows, cols in self._legend_px.values():
            # A legend over the curves as matplotlib draws it (a box of alpha 0.8, then its text), without drawing
            # its text again (~5 ms): the background holds box and text, the curves show through at 20%.
            px[rows, cols] = (0.8 * self._bg[rows, cols] + 0.2 * px[rows, cols]).astype(np.uint8)

    def _png(self, buf: io.BytesIO) -> None:
        from PIL import Image

        px = self._fig.canvas.buffer_rgba()
        h, w = px.shape[:2]
        # RGB: the figure is opaque, and a fourth channel is 15% more to compress
        Image.frombuffer("RGBA", (w, h), px, "raw", "RGBA", 0, 1).convert("RGB").save(buf, format="png", compress_level=1)

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
        self._fig, self._bg = None, None

    def summary(self) -> str:
        return "\n".join(["MetricsPanel: " + state_line(self.run), metrics_line(self.run), *events_lines(self.run)])


def sticky_limits(lim: tuple[float, float] | None, lo: float, hi: float) -> tuple[float, float]:
    """Y limits showing data in [lo, hi]: `lim` while it holds them, else refit with headroom.

    Keeping the limits keeps the drawn ticks, so a redraw is a blit; a side the
    data left by gets 30% of the data's span as headroom (trends leave the same
    way again), the other side 5% (matplotlib's default margin).

    >>> sticky_limits(None, 0.0, 1.0)
    (-0.05, 1.05)
    >>> sticky_limits((-0.05, 1.05), 0.0, 1.04)  # inside: unchanged
    (-0.05, 1.05)
    >>> sticky_limits((-0.05, 1.05), 0.0, 2.0)   # left by the top
    (-0.1, 2.6)
    """
    if lim is not None and lim[0] <= lo and hi <= lim[1]:
        return lim
    span = hi - lo
    if span <= 0:  # a flat curve: a band around it
        span = abs(hi) * 0.5 or 1.0
    below = 0.3 if lim is not None and lo < lim[0] else 0.05
    above = 0.3 if lim is not None and hi > lim[1] else 0.05
    return (round(lo - below * span, 12), round(hi + above * span, 12))


def x_limit(last_step: float, planned_steps: int | None = None) -> float:
    """The right end of the step axis: the next of 1, 2, 5, 10, 20, 50, ... at or past `last_step`,
    at most the run's planned steps (so the x ticks, and the background, change a few times per decade).

    >>> [x_limit(s, 180) for s in (1, 3, 7, 20, 21, 51, 101, 180, 190)]
    [1, 5, 10, 20, 50, 100, 180, 180, 200]
    """
    last = max(1.0, float(last_step))
    nice, k = 1, 0
    while nice < last:
        k += 1
        nice = (1, 2, 5)[k % 3] * 10 ** (k // 3)
    if planned_steps and last <= planned_steps:  # past the plan (a run that goes on): the 1-2-5 steps again
        nice = min(nice, planned_steps)
    return nice if nice != int(nice) else int(nice)


def _cells(fig, axes: list, cols: int) -> list[tuple[slice, slice]]:
    """Each subplot's rectangle of the figure's pixels (numpy rows, columns): the grid split between subplots.

    A subplot's cell runs from just right of its left neighbour's frame to just right of its own (its y tick
    labels sit on its left), and from halfway up the gap above it (its title) to halfway down the gap below.
    """
    w, h = (int(round(v)) for v in fig.canvas.get_width_height())
    boxes = [ax.get_position() for ax in axes]  # figure fractions; y up
    out = []
    for i, b in enumerate(boxes):
        r, c = divmod(i, cols)
        left = 0 if c == 0 else int(boxes[i - 1].x1 * w) + 2
        right = w if c == cols - 1 or i == len(boxes) - 1 else int(b.x1 * w) + 2
        above = [boxes[j] for j in range(len(boxes)) if j // cols == r - 1]
        below = [boxes[j] for j in range(len(boxes)) if j // cols == r + 1]
        top = 0 if not above else int((1 - (above[0].y0 + b.y1) / 2) * h)
        bottom = h if not below else int((1 - (b.y0 + below[0].y1) / 2) * h)
        out.append((slice(top, bottom), slice(left, right)))
    return out


def _pixels(bbox, height: int, cell: tuple[slice, slice]) -> tuple[slice, slice]:
    """A display-space bbox (pixels, y up) as numpy (rows, columns) slices, inside `cell`."""
    import math

    rows, cols = cell
    r0, r1 = max(rows.start, height - math.ceil(bbox.y1)), min(rows.stop, height - math.floor(bbox.y0))
    c0, c1 = max(cols.start, math.floor(bbox.x0)), min(cols.stop, math.ceil(bbox.x1))
    return slice(r0, max(r0, r1)), slice(c0, max(c0, c1))


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
