"""The whole lab in one view: controls and services on top, curves, reward and loss panels, the inspector.

    run.dashboard()          # in a notebook: the widgets; elsewhere: a text summary
    lab = dashboard(run); lab.metrics.redraw_ms; lab.close()
"""
from __future__ import annotations

from typing import Any

from forgelab.lab._base import Composite, Panel
from forgelab.lab.controls_panel import Controls, ServicesPanel
from forgelab.lab.inspector import RolloutInspector
from forgelab.lab.loss_panel import LossPanel
from forgelab.lab.metrics import MetricsPanel
from forgelab.lab.rewards_panel import RewardPanel
from forgelab.controller.facade import RunFacade


class Dashboard(Composite):
    """All panels of one run; each stays reachable (`lab.rewards.register(...)`, `lab.loss.register(...)`)."""

    def __init__(self, run: RunFacade, *, metrics_interval_s: float | None = None):
        super().__init__(run)
        self.controls = Controls(run)
        self.services = ServicesPanel(run)
        self.metrics = MetricsPanel(run, min_interval_s=metrics_interval_s)
        self.rewards = RewardPanel(run)
        self.loss = LossPanel(run)
        self.inspector = RolloutInspector(run)

    @property
    def panels(self) -> list[Panel]:
        return [self.controls, self.services, self.metrics, self.rewards, self.loss, self.inspector]

    def _build(self):
        import ipywidgets as W

        name = self.run.snapshot().name
        card = dict(border="1px solid #e5e7eb", padding="8px", margin="4px 0")
        head = W.HTML(f"<div style='font-size:16px;font-weight:600;margin-bottom:2px'>forgelab · live lab · {name}</div>")
        top = W.HBox([
            W.Box([self.controls.widget], layout=W.Layout(flex="1 1 45%", **card)),
            W.Box([self.services.widget], layout=W.Layout(flex="1 1 55%", margin="4px 0 4px 8px",
                                                           border=card["border"], padding=card["padding"])),
        ])
        knobs = W.HBox([
            W.Box([self.rewards.widget], layout=W.Layout(flex="1 1 55%", **card)),
            W.Box([self.loss.widget], layout=W.Layout(flex="1 1 45%", margin="4px 0 4px 8px",
                                                       border=card["border"], padding=card["padding"])),
        ])
        section = lambda t: W.HTML(f"<div style='font-weight:600;margin:8px 0 2px'>{t}</div>")  # noqa: E731
        return W.VBox([head, top, section("Learning curves"), self.metrics.widget, knobs,
                       section("Rollouts"), W.Box([self.inspector.widget], layout=W.Layout(**card))],
                      layout=W.Layout(width="100%"))


def dashboard(run: RunFacade, **kwargs: Any) -> Dashboard:
    """The live lab for `run`; displays as widgets in a notebook and as a text summary elsewhere."""
    return Dashboard(run, **kwargs)
