"""The controller's parts: each owns its state behind typed methods; `forgelab.run.Run` composes them.

    ReplayBuffer   buffer.py       admission, the staleness bound, episode accounting
    Rollouts       rollout.py      problems -> episodes -> rewards -> advantages -> buffer
    RewardRunner   reward_runner   rewards in threads, timeouts
    TrainingLoop   training.py     buffer -> trainer -> weight push -> metrics row; owns step and version
    RewardControls controls.py     the live reward set, its revisions, the distillation coefficient
    Evaluator      evaluate.py     held-out accuracy and its history
    Lifecycle      lifecycle.py    the run's state, message and gate
    EventLog       events.py       the run's history of live changes (one owner); EventBus: log + listeners
    Tracker        tracking.py     metrics.csv, wandb
    RunFacade      facade.py       what experiments and the lab may use of a run (a Protocol)
    JobReports     job_reports.py  a hosts job's lost workers and time limit as the run's events, message, checkpoint
    checkpoint, provenance, rollout_log, timeline, view: one module each
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "ReplayBuffer": "forgelab.controller.buffer",
    "Rollouts": "forgelab.controller.rollout",
    "RewardRunner": "forgelab.controller.reward_runner",
    "EventLog": "forgelab.controller.events",
    "Tracker": "forgelab.controller.tracking",
    "TrainingLoop": "forgelab.controller.training",
    "RewardControls": "forgelab.controller.controls",
    "Evaluator": "forgelab.controller.evaluate",
    "Lifecycle": "forgelab.controller.lifecycle",
    "EventBus": "forgelab.controller.events",
    "RunFacade": "forgelab.controller.facade",
    "LossSwapRefused": "forgelab.controller.controls",
    "RewardChangeRefused": "forgelab.controller.controls",
    "RunSnapshot": "forgelab.controller.view",
    "read_rollouts": "forgelab.controller.rollout_log",
    "rescore": "forgelab.controller.rollout_log",
    "read_manifest": "forgelab.controller.provenance",
    "diff_runs": "forgelab.controller.provenance",
    "format_timeline": "forgelab.controller.timeline",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
