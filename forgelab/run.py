"""The controller: one `Run` drives asynchronous GRPO from a notebook, a script or the CLI.

    run = Run(RunConfig(train=TrainConfig(steps=50)))
    await run.start()            # spawns generator / trainer / reference, returns at once
    run.metrics                  # pandas DataFrame, one row per step
    run.set_reward_weights({"answer_format": 0.0}); run.remove_reward("answer_format")
    await run.set_loss("dapo")   # dry-run on the last batch, applies at the next step boundary
    await run.until(step=20)     # waits on the run's own notifications, no polling
    await run.wait(); await run.shutdown()

    asyncio.run(Run(cfg).run())  # the same thing from a script

`Run` is a thin facade (lifecycle, live controls, views) over parts, each in its
own module (docs/architecture.md draws the whole data flow):

    rollout.concurrency x Rollouts.worker            forgelab/controller/rollout.py
        buffer.admit -> problems -> SingleTurn | EnvEpisodes -> RewardRunner -> advantages
        -> reference logprobs -> buffer.add          (forgelab/controller/buffer.py, forgelab/controller/reward_runner.py)
    train_loop                                       forgelab/controller/training.py
        buffer.sample -> trainer.train_step -> WeightSync.push -> metrics_row   (forgelab/weights/sync.py)
    evaluate, checkpoint, events, spawn, view, controls: forgelab/<that name>.py

`train.max_policy_age` bounds staleness (0: synchronous on-policy, seeded per episode; k: generation up to k
versions ahead). Every episode ends trained, evicted or dropped with a reason (`run.episodes`). Faults:
docs/reliability.md.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable

from forgelab.controller import checkpoint, controls, provenance
from forgelab.experiments import ops as experiments
from forgelab.algos.loss_checks import loss_label, reference_notes
from forgelab.controller.buffer import ReplayBuffer
from forgelab.config.run_config import ConfigError, RunConfig
from forgelab.data.datasets import ProblemStream, load_split
from forgelab.controller.controls import LossSwapRefused, RewardChangeRefused  # noqa: F401 -- re-exported
from forgelab.controller.evaluate import heldout_reward
from forgelab.controller.events import EventLog
from forgelab.controller.reward_runner import RewardRunner, configured_rewards
from forgelab.rewards.library import RewardComposer
from forgelab.controller.rollout import EnvEpisodes, Gate, Rollouts, SingleTurn
from forgelab.controller.rollout_log import RolloutRecorder
from forgelab.controller.tracking import Tracker, plot_learning_curve
from forgelab.controller.training import TokenRate, train_loop
from forgelab.controller.view import RunSnapshot, snapshot_of, status_of
from forgelab.weights.sync import PushReport, WeightSync

log = logging.getLogger("forgelab.run")


def _as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    if isinstance(config, RunConfig):
        return config.validate()
    if isinstance(config, dict):
        return RunConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return RunConfig.from_yaml(config)
    raise ConfigError(f"Run(config): expected a RunConfig, a dict or a YAML path, got {type(config).__name__}")


_TOKENIZER_LOAD = threading.Lock()
"""One lock for every Run's tokenizer load: `spawn` loads it in a thread, and transformers' lazy first import is
not thread-safe (two Runs starting at once in a fresh process could fail with ImportError)."""


class Run(experiments.Experiments):
    """One training run: its parts, its background tasks, its metrics and its controls.

    `spawn` (default `forgelab.engines.spawn.spawn_parts`) starts the parts from the config; the controller's
    unit tests pass in-process fakes (`forgelab.testing.fakes.fake_spawn`).
    """

    def __init__(self, config: RunConfig | dict | str | Path, *, resume_from: str | Path | None = None,
                 spawn: Callable[[RunConfig], Awaitable[Any]] | None = None):
        self.config = cfg = _as_config(config)  # raises ConfigError before anything spawns
        self._tokenizer: Any = None  # loaded on first use; `spawn` loads it while the processes start
        self.out_dir = Path(cfg.tracking.out_dir) / cfg.name
        self.rewards: RewardComposer = configured_rewards(cfg.rollout)
        self.reward_runner = RewardRunner(self.rewards, cfg.rollout.reward_timeout_s, self.emit)
        self.loss_name: str = loss_label(cfg.train.loss)  # a name, or the function's name
        self.buffer = ReplayBuffer(cfg.train.batch_size, cfg.train.max_policy_age, cfg.train.max_buffer)
        self.records = RolloutRecorder()  # every episode the buffer closes -> out_dir/rollouts/*.parquet
        self.buffer.add_close_listener(self.records.on_close)
        self.data = load_split(cfg.rollout.task, heldout=cfg.rollout.heldout, max_train=cfg.rollout.max_train_problems,
                               eval_n=cfg.eval.n, seed=cfg.train.seed, split=cfg.rollout.split,
                               system_prompt=cfg.rollout.system_prompt)  # explicit limits, reported at spawn
        self.stream = ProblemStream(self.data.train, seed=cfg.train.seed)
        self.heldout = self.data.heldout
        self._task_reward = heldout_reward(cfg.rollout)
        self.resume_from = Path(resume_from) if resume_from else None
        self._spawn_parts = spawn
        self.step = self.version = 0
        self.state, self.message = "created", ""
        self.events = EventLog()  # mirrored to out_dir/events.jsonl once the run directory exists
        self.accuracy_history: list[tuple[int, float]] = []
        self.parts = self.tracker = self.rollout = self.weights = None
        self.gate = Gate()
        self.token_rate = TokenRate()
        self.last_batch: dict | None = None
        self.training_in_flight = False
        self.consecutive_failures = 0
        self.reward_revisions = controls.RewardRevisions()  # reward changes made / in effect (see rewards_for)
        self.distill_coef = float(cfg.teacher.coef)  # the distillation term's weight now (run.set_distill_coef)
        self.replayer = None  # a forgelab.experiments.replay.Replayer re-applying a recorded run's changes
        self._listeners: list[Callable[[dict], None]] = []
        self._tasks: list[asyncio.Task] = []
        self._main: asyncio.Task | None = None

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (`transformers.AutoTokenizer` of ``model.path``), loaded on first use: importing
        transformers costs the controller 1-2.5 s, which `spawn` spends while the processes start."""
        with _TOKENIZER_LOAD:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
            return self._tokenizer

    @property
    def pad_id(self) -> int:
        """The token id padding batches: the tokenizer's pad token, else 0."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0

    # the parts' processes (None before start and after shutdown)
    generators = property(lambda self: self.parts.generators if self.parts else None)
    trainer = property(lambda self: self.parts.trainer if self.parts else None)
    reference = property(lambda self: self.parts.reference if self.parts else None)
    teacher = property(lambda self: getattr(self.parts, "teacher", None) if self.parts else None)
    envs = property(lambda self: self.parts.envs if self.parts else None)
    reward_failures = property(lambda self: self.reward_runner.failures)
    main_task = property(lambda self: self._main, doc="The training task (None before `start`).")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "Run":
        """Spawn the processes (if not yet) and start training in the background. Returns at once."""
        if self._main is not None and not self._main.done():
            return self
        self.gate = Gate()  # asyncio primitives belong to the loop that starts the run
        if self.rollout is not None:
            self.rollout.gate = self.gate
        if self.parts is None:
            self.state = "starting"
            await self.spawn()
        self.state = "running"
        self._main = asyncio.ensure_future(self._run_main())
        return self

    async def run(self) -> "Run":
        """Start, train to the end, shut down: the whole run for scripts (`asyncio.run(run.run())`)."""
        await self.start()
        try:
            await self.wait()
        finally:
            await self.shutdown()
        return self

    async def wait(self) -> None:
        """Until the training task ends (steps done, stopped or failed); re-raises a failure."""
        if self._main is not None:
            await asyncio.shield(self._main)

    async def until(self, step: int | None = None, predicate: Callable[["Run"], bool] | None = None,
                    timeout: float | None = None) -> "Run":
        """Wait until `run.step >= step` and `predicate(run)` hold (re-checked on each step and event, no polling)."""
        return await controls.until(self, step, predicate, timeout)

    def pause(self, message: str | None = None) -> None:
        """Finish the current step, then hold rollouts and training (`message` says why, for people)."""
        if self.state == "running":
            if message is not None:
                self.message = message
                log.warning("forgelab: %s", message)
            self.gate.unpaused.clear()
            self.state = "paused"
            self.emit("paused", message=self.message)

    def resume(self) -> None:
        if self.state == "paused":
            self.message, self.consecutive_failures, self.state = "", 0, "running"
            self.gate.unpaused.set()
            self.emit("resumed")

    async def stop(self) -> None:
        """Stop after the current step; processes stay up until `shutdown()`."""
        self.gate.stopping = True
        self.gate.unpaused.set()
        await self.gate.notify()  # the train loop and rollout workers wait on it
        if self._main is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._main), timeout=300)
            except Exception:
                pass
        if self.state not in ("failed", "finished", "stopped", "created"):
            self.state = "stopped"
            self.emit("stopped")

    async def shutdown(self) -> None:
        """Stop training and free every process."""
        await self.stop()
        if self.parts is not None:
            await self.parts.shutdown()  # and the hosts job, if the config has one
            self.parts = None
        if self.tracker is not None:
            self.tracker.finish()

    async def spawn(self) -> None:
        """Spawn the processes (and restore `resume_from`) without starting training; `start` calls it."""
        from forgelab.engines.spawn import spawn_parts
        from forgelab.engines.trainer_client import as_trainer

        cfg = self.config
        # the controller's own start-up (importing transformers, the tokenizer) in a thread, beside the processes'
        tokenizer = asyncio.ensure_future(asyncio.to_thread(lambda: self.tokenizer))
        try:
            self.parts = parts = await (self._spawn_parts or spawn_parts)(cfg)
            parts.trainer = as_trainer(parts.trainer)  # typed calls (forgelab.engines.trainer_client)
        finally:
            await asyncio.gather(tokenizer, return_exceptions=True)
        if tokenizer.exception() is not None:
            await self.parts.shutdown()
            self.parts = None
            raise tokenizer.exception()
        self.weights = WeightSync(parts.trainer, parts.generators, self.emit, lambda: self.version)
        parts.generators.on_respawn = self.weights.catch_up
        teacher = getattr(parts, "teacher", None)
        for svc in (parts.generators, parts.reference, None if teacher is parts.reference else teacher):
            if svc is not None and hasattr(svc, "add_listener"):
                svc.add_listener(lambda ev: self.emit(str(getattr(ev, "kind", "service")), replica=getattr(ev, "replica", None),
                                                        detail=str(getattr(ev, "detail", ev))))
        source = EnvEpisodes(parts.envs, parts.generators, cfg) if cfg.rollout.env is not None else SingleTurn(parts.generators, self.tokenizer)
        self.rollout = Rollouts(cfg, source, self.buffer, self.reward_runner, parts.reference, self.stream, self.gate,
                                self.emit, self.pause, self.pad_id, rewards_for=self._rewards_for,
                                teacher=getattr(parts, "teacher", None), distill_coef=lambda: self.distill_coef)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        resumed_here = self.resume_from is not None and self.out_dir.resolve() in self.resume_from.resolve().parents
        self.events.attach(self.out_dir, append=resumed_here)
        self.records.attach(self.out_dir, append=resumed_here)
        provenance.write_manifest(self)  # config, versions, git state, hardware, model and data hashes
        self.tracker = Tracker(self.out_dir, use_wandb=cfg.tracking.wandb, run_name=cfg.name, config=cfg.to_dict())
        self.emit("spawned", seconds=round(parts.seconds, 1))
        self.emit("data", message=self.data.description, **self.data.info)
        for note in reference_notes(cfg.train.loss, cfg.train.loss_kwargs, cfg.placement.reference):  # grpo's kl_coef
            log.warning("forgelab: %s", note)
            self.emit("config_note", message=note)
        if self.resume_from is not None:
            await checkpoint.restore(self, self.resume_from)

    async def _run_main(self) -> None:
        try:
            if self.step == 0 and not self.accuracy_history:
                self.emit("eval", accuracy=await self.evaluate())
            self._tasks = [asyncio.ensure_future(self.rollout.worker()) for _ in range(self.config.rollout.concurrency)]
            await train_loop(self)
            if not self.accuracy_history or self.accuracy_history[-1][0] != self.step:
                acc = await self.evaluate()
                if self.tracker and self.tracker.rows:
                    self.tracker.rows[-1]["heldout_accuracy"] = acc
            self.state = "stopped" if self.gate.stopping else "finished"
            self.emit(self.state, message=self.message)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as e:
            self.state, self.message = "failed", f"{type(e).__name__}: {e}"
            self.emit("failed", message=self.message)
            log.exception("forgelab: run failed")
            raise
        finally:
            self.gate.stopping = True
            for t in self._tasks:  # in-flight rollouts drop their not-yet-buffered episodes (rollout_cancelled)
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks = []
            self.records.flush()  # every episode closed so far, the cancelled rollouts' included
            if self.tracker is not None and self.tracker.rows:
                try:
                    plot_learning_curve(self.tracker.dataframe(), self.out_dir / "learning_curve.png", self.events,
                                        accuracy=self.accuracy_history)
                except Exception as e:
                    log.warning("forgelab: plot failed (%s)", e)

    async def push_weights(self) -> PushReport:
        """Trainer -> every healthy generator replica, as version `self.version`; frees admission for it."""
        report = await self.weights.push(self.version)
        async with self.gate.changed:
            self.buffer.served_version = self.version
            self.gate.changed.notify_all()
        return report

    async def evaluate(self, n: int | None = None) -> float:
        """Held-out greedy accuracy (the task's exact-answer reward) with the generator's current weights,
        each problem played as one episode of the run's environment (single-turn: one completion)."""
        from forgelab.controller.evaluate import heldout_accuracy
        from forgelab.engines.generator import SamplingConfig

        greedy = SamplingConfig(temperature=0.0, max_tokens=self.config.rollout.max_tokens)
        async with self.gate.hold():  # its requests first: new rollouts wait until it is scored
            acc = await heldout_accuracy(self.rollout.source, self.heldout[: n or len(self.heldout)], self.tokenizer,
                                         greedy, self._task_reward)
        self.accuracy_history.append((self.step, acc))
        return acc

    # ------------------------------------------------------------------ live controls
    def set_reward_weights(self, weights: dict[str, float]) -> None:
        """Change reward weights; applies from the next scored rollout. Unknown names raise KeyError."""
        old = self.rewards.weights
        self.rewards.set_weights(weights)
        self.reward_changed("reward_weights", old=old, new=self.rewards.weights)

    def add_reward(self, name: str, fn: Callable[..., float], weight: float = 1.0, *, replace: bool = False) -> None:
        """Register a reward function from a cell; validated on recent rollouts first (`RewardChangeRefused`)."""
        controls.add_reward(self, name, fn, weight, replace)

    def remove_reward(self, name: str) -> None:
        """Remove a reward; applies from the next scored rollout. Unknown names raise KeyError."""
        self.rewards.remove(name)
        self.reward_changed("reward_removed", name=name)

    def set_distill_coef(self, coef: float) -> None:
        """Change the distillation term's weight (a ``teacher`` run); applies from the next scored rollout, like a
        reward weight, and is on the timeline (``distill_coef`` event, then ``reward_effective``)."""
        controls.set_distill_coef(self, coef)

    def reward_changed(self, kind: str, **fields: Any) -> None:
        """Record a change to the reward set (the event carries its revision number)."""
        self.emit(kind, **fields, rev=self.reward_revisions.bump())

    def _rewards_for(self, flat: list) -> RewardComposer:
        return controls.rewards_for(self, flat)

    def set_loss(self, loss: str | Callable, **loss_kwargs: Any) -> controls.Command:
        """Hot-swap the loss: dry-run it on the last batch, then apply at the next step boundary. Starts at once
        (even if not awaited); `await` it for ``{"loss", "applies_at_step"}`` or its `LossSwapRefused`."""
        return controls.Command(controls.swap_loss(self, loss, loss_kwargs), f"run.set_loss({loss_label(loss)!r})")

    async def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Trainer state (DCP) + controller state (step, version, data position, counters, rewards with their code)."""
        return await checkpoint.save(self, path)

    # ------------------------------------------------------------------ views
    def emit(self, kind: str, **fields: Any) -> None:
        """Record an event (kind, this step, fields) in the run's event log and tell the listeners."""
        self.notify({"event": self.events.emit(kind, **{"step": self.step, **fields})})

    def notify(self, msg: dict) -> None:
        """Tell every listener (widgets, `until`) about a metrics row or an event; a failing listener is logged."""
        for fn in list(self._listeners):
            try:
                fn(msg)
            except Exception:
                log.exception("forgelab: run listener failed")

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """fn(row) after every step and fn({"event": ev}) on every event (widgets use this)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    @property
    def metrics(self):
        """Per-step metrics as a pandas DataFrame."""
        import pandas as pd

        return self.tracker.dataframe() if self.tracker else pd.DataFrame()

    @property
    def rollouts(self):
        """The newest 2000 episodes (newest last) with token ids, logprobs, rewards, advantages and status;
        ``attrs["older"]`` counts the earlier ones, which are in the rollout log (`read_rollouts(run.out_dir)`)."""
        import pandas as pd

        return self.rollout.dataframe() if self.rollout else pd.DataFrame()

    @property
    def episodes(self) -> dict:
        """Episode accounting: generated = trained + evicted + dropped + buffered + in_flight."""
        return self.buffer.counts()

    def status(self) -> dict:
        return status_of(self)

    def snapshot(self) -> RunSnapshot:
        """A typed, read-only copy of the run's state (what widgets read)."""
        return snapshot_of(self)

    def dashboard(self):
        """The live lab: metrics, rollout inspector, reward and loss panels, controls."""
        from forgelab.lab import dashboard

        return dashboard(self)

    def __repr__(self) -> str:
        return f"<Run {self.config.name} {self.state} step {self.step}/{self.config.train.steps} version {self.version}>"


async def replay(run_dir: str | Path, **kwargs: Any):
    """`forgelab.replay(run_dir, until=None, out_dir=None, name=None, spawn=None, trusted=False,
    allow_mismatch=False)`: `Run.replay` (see `forgelab.experiments.replay`)."""
    return await Run.replay(run_dir, **kwargs)
