"""Dashboard overhead: training throughput with the live lab attached vs not, alternating within one run.

    python -m forgelab.bench dashboard [--quick] [--segment 10] [--pairs 6]

One ``Run`` of the demo configuration (no periodic evaluation) trains in
segments of ``--segment`` steps. In "on" segments a ``forgelab.lab.Dashboard``
is built (``lab.widget``: every panel's ipywidgets view, listening to the run)
and its metrics panel redraws for real (matplotlib Agg -> PNG into the
``Image`` widget, throttled by the panel's own rules) on the run's event loop,
exactly as in a notebook minus the browser; at the end of the segment it is
closed. "Off" segments run bare. The panels share one duty budget
(``forgelab.lab._base.LAB_BUDGET``, 1.5 % of the controller's time for the
whole lab): each waits the sum of the panels' last refresh costs over it (at
least its own minimum interval), so redraws come about every 2-5 s once the
metrics plot's blitted redraw (~20 ms) has settled: segments are long enough
to hold steady-state redraws, which the JSON counts. Segments alternate, the order flipping each
pair (off/on, on/off, ...), so drifting load hits both alike. A segment's
throughput is steps/s between its first and last step (the step during which
the lab is built or closed is not counted in either);
``dashboard_throughput_ratio`` is the median over pairs of on / off, with a
bootstrap 95 % interval over pairs.

The lab's own cost is also measured directly, which the throughput ratio
(noisy: segments differ by more than 2 % among themselves) cannot resolve:
every listener the lab registers on the run and every panel refresh is wrapped
to count the controller thread's CPU time spent in it (``time.thread_time``).
``lab_cpu_fraction`` = lab CPU seconds per training step in "on" segments /
the median wall seconds per step; goal <= 0.02 (the panels' shared budget is
1.5 %; the rest is the listeners' own calls).
Building the lab (first draws) is reported apart (``lab_build_cpu_s``).

``--quick`` measures nothing; it runs one (off, on) pair of 3-step segments at batch 8 (3 steps: the shortest
segment with a timed step after the attach step), without the reference process (the lab's code is the same
with it; leaving it out took the quick mode from 49.8 to 37.4 CPU-s): one bare segment, the lab built (every
panel, a first draw), metered listeners and refreshes in the "on" segment, the lab closed, and every key of the
JSON. Its cost is the run's spawn; the six steps take a few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

from forgelab.bench._stats import bootstrap_median_ci
from forgelab.bench.common import emit_json, print_machine, print_table
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forgelab.run import Run


def segment_rates(times: dict[int, float], segment: int, n_segments: int) -> list[float]:
    """Steps/s of each segment from the wall time of each step's end (first step of a segment excluded).

    >>> segment_rates({1: 0.0, 2: 1.0, 3: 2.0, 4: 3.0, 5: 3.5, 6: 4.0}, 3, 2)
    [1.0, 2.0]
    """
    out = []
    for i in range(n_segments):
        first, last = i * segment + 2, (i + 1) * segment  # step i*segment+1 carries the attach/detach
        out.append((last - first) / (times[last] - times[first]))
    return out


class CpuMeter:
    """Counts the calling thread's CPU seconds inside wrapped callables (the lab's listeners and refreshes).

    >>> m = CpuMeter(); inner = m.wrap(lambda: sum(range(10**5))); outer = m.wrap(lambda: inner())
    >>> _ = outer(); m.calls  # the nested call is inside the outer one's time, not counted twice
    1
    """

    def __init__(self):
        self.cpu_s = 0.0
        self.calls = 0
        self._depth = 0  # a listener may refresh its panel inline: count the outermost call only

    def wrap(self, fn):
        def timed(*a, **kw):
            self._depth += 1
            c0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.cpu_s += time.thread_time() - c0
                    self.calls += 1

        return timed

    def metered(self, run: "Run") -> "MeteredRun":
        """`run` as the lab sees it: every listener the lab adds is wrapped (on the returned view only)."""
        return MeteredRun(run, self)


class MeteredRun:
    """A run whose ``add_listener`` / ``remove_listener`` wrap the listener in a `CpuMeter`; everything else is
    the run's own (the lab reads and commands the run through it, unchanged)."""

    def __init__(self, run: "Run", meter: CpuMeter):
        self._run, self._meter, self._wrapped = run, meter, {}

    def add_listener(self, fn) -> None:
        self._run.add_listener(self._wrapped.setdefault(fn, self._meter.wrap(fn)))

    def remove_listener(self, fn) -> None:
        self._run.remove_listener(self._wrapped.pop(fn, fn))

    def __getattr__(self, name: str):
        return getattr(self._run, name)


async def _run(segment: int, pairs: int, out_dir: str, prompts: int = 8, reference: bool = True) -> dict:
    from forgelab.bench.e2e import bench_config
    from forgelab.lab import Dashboard
    from forgelab.run import Run

    n_segments = 2 * pairs
    # order of each pair: (off, on) then (on, off), ...
    plan = [bool((i % 2) ^ ((i // 2) % 2)) for i in range(n_segments)]
    cfg = bench_config(steps=n_segments * segment, eval_every=0, out_dir=out_dir, name="dashboard", prompts=prompts,
                       reference=reference)
    run = Run(cfg)
    meter = CpuMeter()
    build = {"cpu_s": 0.0}
    times: dict[int, float] = {}
    state = {"lab": None, "redraw_ms": [], "redraws": 0, "redraw_cpu_ms": [], "first_draw_ms": [], "panels": {}}

    def set_lab(on: bool) -> None:
        lab = state["lab"]
        if on and lab is None:
            c0 = time.thread_time()
            lab = Dashboard(lab_run)
            _ = lab.widget  # builds every panel and starts listening
            build["cpu_s"] += time.thread_time() - c0
            for panel in lab.panels:  # steady-state refreshes (timers and direct pokes) counted from here
                panel.throttle.fn = meter.wrap(panel.throttle.fn)
            state["lab"] = lab
        elif not on and lab is not None:
            m = lab.metrics
            state["redraw_ms"] += m.redraw_ms[1:]  # the first draw builds the figure: not a steady redraw
            state["redraw_cpu_ms"] += m.redraw_cpu_ms[1:]
            state["redraws"] += len(m.redraw_ms)
            state["first_draw_ms"] += m.redraw_ms[:1]
            for panel in lab.panels:  # every panel's own throttled refreshes: where the lab's time goes
                c = state["panels"].setdefault(type(panel).__name__, {"refreshes": 0, "seconds": 0.0})
                c["refreshes"] += panel.throttle.calls
                c["seconds"] = round(c["seconds"] + panel.throttle.total_cost, 3)
            lab.close()
            state["lab"] = None

    def on_row(msg: dict) -> None:
        if "event" in msg:
            return
        step = int(msg["step"])
        times[step] = time.perf_counter()
        if step % segment == 0 and step // segment < n_segments:
            set_lab(plan[step // segment])

    run.add_listener(on_row)
    lab_run = meter.metered(run)  # the lab's view of the run: only the lab's listeners are wrapped
    await run.start()
    set_lab(plan[0])
    try:
        await run.wait()
    finally:
        set_lab(False)
        await run.shutdown()
    rates = segment_rates(times, segment, n_segments)
    on = [r for r, p in zip(rates, plan) if p]
    off = [r for r, p in zip(rates, plan) if not p]
    on_steps = sum(segment for p in plan if p)
    return {"rates": rates, "plan": plan, "on": on, "off": off,
            "ratio": statistics.median(a / b for a, b in zip(on, off)),
            "pair_ratios": [a / b for a, b in zip(on, off)],
            "lab_cpu_s": meter.cpu_s, "lab_calls": meter.calls, "lab_cpu_s_per_step": meter.cpu_s / on_steps,
            "lab_build_cpu_s": build["cpu_s"],
            "redraws": state["redraws"], "first_draw_ms": state["first_draw_ms"], "panels": state["panels"], "redraw_ms": state["redraw_ms"], "redraw_cpu_ms": state["redraw_cpu_ms"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m forgelab.bench dashboard", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="proves the code path: 1 (off, on) pair of 3-step segments (the shortest with a timed "
                         "step), batch 8, no reference process")
    ap.add_argument("--segment", type=int, default=15, help="steps per segment")
    ap.add_argument("--pairs", type=int, default=6, help="(off, on) segment pairs")
    args = ap.parse_args(argv or [])
    prompts = 8
    if args.quick:
        args.segment, args.pairs, prompts = 3, 1, 1

    import torch

    torch.set_num_threads(1)
    start = print_machine("start")
    print(f"dashboard: {args.pairs} pairs of {args.segment}-step segments, lab attached in alternate segments",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="forgelab-dash-") as out_dir:
        r = asyncio.run(_run(args.segment, args.pairs, out_dir, prompts, reference=not args.quick))
    end = print_machine("end")
    rows = [{"segment": i, "lab": "on" if p else "off", "steps/s": rate} for i, (rate, p) in
            enumerate(zip(r["rates"], r["plan"]))]
    print_table(rows, ["segment", "lab", "steps/s"])
    med = lambda xs: round(statistics.median(xs), 1) if xs else None  # noqa: E731
    print(f"metrics panel: {r['redraws']} redraws ({len(r['first_draw_ms'])} first draws when the lab is built, "
          f"median {med(r['first_draw_ms'])} ms, not in either segment); later redraws: median "
          f"{med(r['redraw_ms'])} ms wall, {med(r['redraw_cpu_ms'])} ms CPU", flush=True)
    print_table([{"panel": k, **v} for k, v in r["panels"].items()], ["panel", "refreshes", "seconds"])
    step_s = 1 / statistics.median(r["on"])
    cpu_frac = r["lab_cpu_s_per_step"] / step_s
    print(f"lab CPU time: {r['lab_cpu_s']:.3f} s in {r['lab_calls']} listener calls and refreshes over "
          f"{sum(args.segment for p in r['plan'] if p)} 'on' steps = {1e3 * r['lab_cpu_s_per_step']:.2f} ms/step "
          f"= {cpu_frac:.4f} of a {step_s:.3f} s step; building the lab: {r['lab_build_cpu_s']:.2f} s CPU",
          flush=True)
    result = {
        "suite": "dashboard",
        "quick": args.quick,
        "lab_cpu_fraction": round(cpu_frac, 4),
        "lab_cpu_ms_per_step": round(1e3 * r["lab_cpu_s_per_step"], 3),
        "step_s_on": round(step_s, 4),
        "lab_calls": r["lab_calls"],
        "lab_build_cpu_s": round(r["lab_build_cpu_s"], 3),
        "dashboard_throughput_ratio": round(r["ratio"], 3),
        "ci95": bootstrap_median_ci(r["pair_ratios"]),
        "pair_ratios": [round(x, 3) for x in r["pair_ratios"]],
        "steps_per_s_on": round(statistics.median(r["on"]), 3),
        "steps_per_s_off": round(statistics.median(r["off"]), 3),
        "redraws": r["redraws"],
        "redraw_ms_median": med(r["redraw_ms"]),
        "first_draw_ms_median": med(r["first_draw_ms"]),
        "panel_refresh_s": r["panels"],
        "redraw_cpu_ms_median": med(r["redraw_cpu_ms"]),
        "goal": "lab_cpu_fraction <= 0.02 and dashboard_throughput_ratio >= 0.98",
        "goal_met": cpu_frac <= 0.02 and r["ratio"] >= 0.98,
        "machine": {**start, "loadavg_end": end["loadavg"]},
    }
    emit_json(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
