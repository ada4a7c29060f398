"""The live lab: Jupyter widgets over a running `forgelab.run.Run`.

Widgets are views: they read the run's typed view (`run.snapshot()`, a
`forgelab.controller.view.RunSnapshot`), `run.metrics`, `run.rollouts`, `run.events` and
`run.status()`, and act only through the run's public methods (`pause`,
`set_loss`, `set_reward_weights`, `add_reward`, `remove_reward`, ...). Nothing here imports
Monarch or talks to an actor.

    lab = run.dashboard()                 # or forgelab.lab.dashboard(run)
    lab                                   # last expression of a cell: displays the widgets
    MetricsPanel(run)                     # any panel alone
    lab.rewards.register("brevity", brevity, 0.1)
    lab.loss.register(my_loss); lab.loss.apply(my_loss)
    timeline(run)                         # each live change at its step, with code diffs

Outside a notebook every panel's repr() is a plain-text summary.
"""
from forgelab.lab._base import Panel, Throttle, in_notebook
from forgelab.lab.compare import Compare, compare  # the function shadows the submodule's name here
from forgelab.lab.controls_panel import Controls, ServicesPanel
from forgelab.lab.dashboard import Dashboard, dashboard
from forgelab.lab.inspector import RolloutInspector
from forgelab.lab.loss_panel import LossPanel
from forgelab.lab.metrics import MetricsPanel
from forgelab.lab.rewards_panel import RewardPanel
from forgelab.lab.recorded_view import RecordedView
from forgelab.lab.summary import text_summary
from forgelab.lab.timeline_panel import Timeline, timeline

__all__ = [
    "compare", "Compare", "dashboard", "Dashboard", "MetricsPanel", "RolloutInspector", "RewardPanel", "LossPanel", "Controls",
    "ServicesPanel", "Panel", "Throttle", "in_notebook", "text_summary", "timeline", "Timeline", "open",
    "RecordedView",
]


def open(run_dir):  # noqa: A001 -- `forgelab.lab.open(RUN_DIR)` reads like `open(path)` on purpose
    """A finished run (or one still running in another kernel) in the lab, read from its directory: metrics,
    the timeline of live changes and the rollout table with the token view; no process is spawned.

        view = forgelab.lab.open("runs/demo")   # view.metrics, view.inspector, view.timeline; view.run.reload()
    """
    return RecordedView(run_dir)
