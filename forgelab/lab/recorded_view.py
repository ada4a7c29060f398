"""A run directory in the lab: the metrics panel, the timeline of live changes and the rollout inspector over a
`forgelab.controller.recorded.RecordedRun` (no process, no controls: the run is read from its files).

    view = forgelab.lab.open("runs/demo")     # displays in a notebook; a text summary elsewhere
    view.inspector.filtered()                  # the rollout table, as in the live lab
    view.reload()                              # a run still writing its directory: read it again
"""
from __future__ import annotations

from pathlib import Path

from forgelab.controller.recorded import RecordedRun
from forgelab.lab._base import Composite, Panel
from forgelab.lab.inspector import RolloutInspector
from forgelab.lab.metrics import MetricsPanel
from forgelab.lab.timeline_panel import Timeline


class RecordedView(Composite):
    """Metrics, timeline and rollouts of a run directory; `run` is its `RecordedRun`."""

    def __init__(self, run_dir: str | Path | RecordedRun):
        run = run_dir if isinstance(run_dir, RecordedRun) else RecordedRun(run_dir)
        super().__init__(run)
        self.metrics = MetricsPanel(run)
        self.inspector = RolloutInspector(run)
        self.timeline = Timeline(str(run.out_dir))

    @property
    def panels(self) -> list[Panel]:
        return [self.metrics, self.inspector]

    def reload(self) -> "RecordedView":
        """Read the directory again and refresh the panels."""
        self.run.reload()
        for p in self.panels:
            p.refresh()
        return self

    def _build(self):
        import ipywidgets as W

        snap = self.run.snapshot()
        head = W.HTML(f"<div style='font-size:16px;font-weight:600;margin-bottom:2px'>forgelab · recorded run · "
                      f"{snap.name} ({snap.state}, step {snap.step}/{snap.steps})</div>")
        section = lambda t: W.HTML(f"<div style='font-weight:600;margin:8px 0 2px'>{t}</div>")  # noqa: E731
        return W.VBox([head, section("Learning curves"), self.metrics.widget,
                       section("Live changes"), W.HTML(self.timeline.html()),
                       section("Rollouts"), self.inspector.widget], layout=W.Layout(width="100%"))
