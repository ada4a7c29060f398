"""Run controls (pause, resume, stop, save checkpoint, state line) and the services table.

Both refresh on every step and event (throttled). Buttons call the run's
public methods; the async ones (`stop`, `save_checkpoint`) are scheduled on
the run's loop so the click returns at once.
"""
from __future__ import annotations

import asyncio
from typing import Any

from forgelab.lab._base import Panel, esc
from forgelab.lab.summary import cpu_line, loss_name_of, pool_line, services_lines, services_rows, state_line, stuck_rows
from forgelab.controller.facade import RunFacade

_STATE_COLOURS = {"running": "#1b7a1b", "paused": "#b36b00", "failed": "#b00020", "finished": "#1f4e99",
                  "stopped": "#555", "starting": "#777", "created": "#777"}


class Controls(Panel):
    """Pause / resume / stop / save-checkpoint buttons and a state label (state, step/steps, message)."""

    min_interval_s = 0.5

    def __init__(self, run: RunFacade, *, min_interval_s: float | None = None):
        super().__init__(run, min_interval_s=min_interval_s)
        self.pending: asyncio.Future | None = None

    def _build(self):
        import ipywidgets as W

        def button(desc, icon, style, fn):
            b = W.Button(description=desc, icon=icon, button_style=style, layout=W.Layout(width="auto"))
            b.on_click(lambda _: self._do(fn))
            return b

        self.pause_button = button("pause", "pause", "", self.pause)
        self.resume_button = button("resume", "play", "success", self.resume)
        self.stop_button = button("stop", "stop", "danger", self.stop)
        self.save_button = button("save checkpoint", "save", "", self.save_checkpoint)
        self.state = W.HTML()
        self.message = W.HTML()
        buttons = W.HBox([self.pause_button, self.resume_button, self.stop_button, self.save_button])
        return W.VBox([W.HBox([self.state], layout=W.Layout(margin="0 0 4px 0")), buttons, self.message])

    def _do(self, fn) -> None:
        try:
            fn()
        except Exception as e:
            self.message.value = f"<span style='color:#b00020'>{esc(type(e).__name__)}: {esc(e)}</span>"

    def pause(self) -> None:
        self.run.pause()
        self.refresh()

    def resume(self) -> None:
        self.run.resume()
        self.refresh()

    def stop(self) -> asyncio.Future:
        self.message.value = "<span style='color:#777'>stopping after the current step…</span>"
        self.pending = self.schedule(self._after(self.run.stop(), "stopped"))
        return self.pending

    def save_checkpoint(self, path: str | None = None) -> asyncio.Future:
        self.message.value = "<span style='color:#777'>saving a checkpoint…</span>"
        self.pending = self.schedule(self._after(self.run.save_checkpoint(path), "checkpoint saved to {}"))
        return self.pending

    async def _after(self, coro, done: str):
        try:
            res = await coro
        except Exception as e:
            self.message.value = f"<span style='color:#b00020'>{esc(type(e).__name__)}: {esc(e)}</span>"
            return None
        self.message.value = f"<span style='color:#1b7a1b'>✓ {esc(done.format(res))}</span>"
        self.refresh()
        return res

    def refresh(self) -> None:
        if self._widget is None:
            return
        st = self.run.status()
        state = st.get("state", "?")
        steps = max(1, int(st.get("steps") or 1))
        pct = min(100, int(100 * int(st.get("step") or 0) / steps))
        colour = _STATE_COLOURS.get(state, "#333")
        bar = (f"<span style='display:inline-block;width:110px;height:8px;background:#e5e7eb;border-radius:4px;"
               f"vertical-align:middle;margin:0 8px'><span style='display:block;width:{pct}%;height:8px;"
               f"background:{colour};border-radius:4px'></span></span>")
        msg = st.get("message") or ""
        self.state.value = (
            f"<span style='font-size:14px'><b style='color:{colour};text-transform:uppercase'>{esc(state)}</b>"
            f"{bar}step <b>{st.get('step')}</b>/{st.get('steps')} · version {st.get('version')} · "
            f"loss <b>{esc(loss_name_of(st.get('loss')))}</b></span>"
            + (f"<div style='color:#b36b00;margin-top:3px'>⚠ {esc(msg)}</div>" if msg else "")
        )
        live = state in ("running", "paused", "starting")
        self.pause_button.disabled = state != "running"
        self.resume_button.disabled = state != "paused"
        self.stop_button.disabled = not live
        self.save_button.disabled = state in ("created", "starting")

    def summary(self) -> str:
        return "Controls: " + state_line(self.run)


class ServicesPanel(Panel):
    """A table of each replica: health, in-flight requests, calls, failures, latency percentiles, restarts,
    weight version, pid, last error; under it the cores busy over the steady state with CPU-s per episode."""

    min_interval_s = 1.0

    def _build(self):
        import ipywidgets as W

        self.table = W.HTML()
        return W.VBox([W.HTML("<b>Services</b>"), self.table])

    def refresh(self) -> None:
        if self._widget is None:
            return
        rows = services_rows(self.run)
        if not rows:
            self.table.value = "<i style='color:#777'>no services running</i>"
            return
        body = []
        for r in rows:
            dot = "#1b7a1b" if r["healthy"] else "#b00020"
            err = esc(str(r["last_error"])[:120])
            body.append(
                f"<tr><td>{esc(r['service'])}</td><td>{esc(r['index'])}</td>"
                f"<td><span style='color:{dot}'>●</span> {'healthy' if r['healthy'] else 'down'}</td>"
                f"<td>{esc(r['in_flight'])}</td><td>{esc(r['calls'])}</td><td>{esc(r['failures'])}</td>"
                f"<td>{esc(r['latency'])}</td><td>{esc(r['restarts'])}</td><td>{esc(r['version'])}</td>"
                f"<td>{esc(r['pid'])}</td><td title='{err}' style='color:#b00020'>{err[:40]}</td></tr>")
        self.table.value = (
            "<table class='fl-table fl-services' style='border-collapse:collapse;font-size:12px'><thead><tr>"
            + "".join(f"<th style='text-align:left;padding:2px 8px;background:#f3f4f6'>{h}</th>" for h in
                      ("service", "replica", "health", "in flight", "calls", "failures", "latency p50/p95/p99",
                       "restarts", "version", "pid", "last error"))
            + "</tr></thead><tbody>" + "".join(body).replace("<td", "<td style='padding:2px 8px'")
            + "</tbody></table>"
            + (f"<div class='fl-pool' style='font-size:11px;color:#555'>{esc(pool_line(self.run))}</div>" if pool_line(self.run) else "")
            + (f"<div class='fl-cpu' style='font-size:11px;color:#555'>{esc(cpu_line(self.run))}</div>" if cpu_line(self.run) else "")
            + "".join(f"<div class='fl-stuck' style='font-size:11px;color:#b00020'>stuck: {esc(r['part'])} in "
                      f"{esc(r['call'])} after {esc(r['waited_s'])} s; stacks: <a href='file://{esc(r['path'])}' "
                      f"target='_blank'>{esc(r['path'] or '(not written)')}</a></div>" for r in stuck_rows(self.run)))

    def summary(self) -> str:
        return "\n".join(["ServicesPanel: " + state_line(self.run).splitlines()[0], *services_lines(self.run)])
