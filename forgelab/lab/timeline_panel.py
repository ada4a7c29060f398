"""A run's timeline in a notebook: config summary, then each change at its step, code diffs folded.

    forgelab.lab.timeline_panel(run)             # a live Run: re-read each time it is displayed
    forgelab.lab.timeline_panel("runs/my-run")   # a finished run's directory (manifest + events.jsonl)

A view over `forgelab.controller.timeline.timeline_entries` (the same lines `forgelab show`
prints): HTML in a notebook, plain text elsewhere (`repr`).
"""
from __future__ import annotations

import html
from typing import Any

from forgelab.controller.timeline import change_source, config_summary, format_timeline, timeline_entries

#: colour per category (matches the metrics panel's markers in spirit: changes stand out, faults are red)
COLOURS = {"loss": "#7b3294", "reward": "#1a9641", "control": "#666666", "checkpoint": "#2c7bb6",
           "fork": "#e66101", "fault": "#d7191c", "eval": "#444444"}


class Timeline:
    """The timeline of a run or run directory; `entries` is the data, `_repr_html_` the view."""

    def __init__(self, run_or_dir: Any, *, diffs: bool = True):
        self.source = run_or_dir
        self.diffs = diffs

    @property
    def entries(self) -> list[dict[str, Any]]:
        return timeline_entries(self.source)

    def _repr_html_(self) -> str:
        return self.html()

    def html(self) -> str:
        """The timeline as an HTML table (what a notebook shows)."""
        cfg, _ = change_source(self.source)
        rows = []
        for e in self.entries:
            colour = COLOURS.get(e["category"], "#000")
            diff = ""
            if self.diffs and e["diff"]:
                diff = (f"<details><summary>code diff</summary><pre style='font-size:11px;margin:2px 0'>"
                        f"{html.escape(e['diff'])}</pre></details>")
            rows.append(f"<tr><td style='text-align:right;padding-right:8px'>{e['step']}</td>"
                        f"<td style='color:{colour};padding-right:8px'>{html.escape(e['category'])}</td>"
                        f"<td>{html.escape(e['text'])}{diff}</td></tr>")
        return (f"<div><b>{html.escape(config_summary(cfg))}</b>"
                f"<table style='font-family:monospace;font-size:12px'>"
                f"<tr><th>step</th><th>what</th><th>change</th></tr>{''.join(rows)}</table></div>")

    def __repr__(self) -> str:
        return format_timeline(self.source, diffs=self.diffs)


def timeline(run_or_dir: Any, *, diffs: bool = True) -> Timeline:
    """The timeline view of a live `Run` or a run directory."""
    return Timeline(run_or_dir, diffs=diffs)
