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
own module and each the one owner of its state (docs/architecture.md draws the whole data flow):

    rollout.concurrency x Rollouts.worker            forgelab/controller/rollout.py
        buffer.admit -> problems -> SingleTurn | EnvEpisodes -> RewardRunner -> advantages
        -> reference logprobs -> buffer.add          (forgelab/controller/buffer.py, forgelab/controller/reward_runner.py)
    TrainingLoop.run                                 forgelab/controller/training.py
        buffer.sample -> trainer.train_step -> WeightSync.push -> metrics_row   (forgelab/weights/sync.py)
        -> Evaluator.evaluate, checkpoint.save (when due) -> Tracker.log, EventBus.notify

    part              owns                                              module
    Lifecycle         state, message, the gate                          forgelab/controller/lifecycle.py
    TrainingLoop      step, version, loss name, last batch, failures    forgelab/controller/training.py
    RewardControls    reward set, revisions, distillation coefficient   forgelab/controller/controls.py
    Evaluator         held-out problems and accuracy history            forgelab/controller/evaluate.py
    EventBus          the event log and the listeners                   forgelab/controller/events.py
    ReplayBuffer      every episode's status and the accounting         forgelab/controller/buffer.py
    Rollouts          episode/group ids, recent episodes                forgelab/controller/rollout.py

Each part receives the narrow collaborators it uses at construction, never the `Run`; `Run` composes them,
reads them for its views, and changes them only through their methods.

`train.max_policy_age` bounds staleness (0: synchronous on-policy, seeded per episode; k: generation up to k
versions ahead). Every episode ends trained, evicted or dropped with a reason (`run.episodes`). Faults:
docs/reliability.md.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from forgelab.algos.loss_checks import loss_label, reference_notes
from forgelab.config.run_config import ConfigError, RunConfig
from forgelab.controller import checkpoint, controls, provenance
from forgelab.controller.buffer import ReplayBuffer
from forgelab.controller.controls import LossSwapRefused, RewardChangeRefused, RewardControls  # noqa: F401 -- re-exported
from forgelab.controller.buffer import EpisodeCounts
from forgelab.controller.evaluate import Evaluator
from forgelab.controller.facade import RunHook
from forgelab.controller.job_reports import JobReports, parts_on_meshes
from forgelab.controller.events import EventBus, EventLog, as_int
from forgelab.controller.lifecycle import Lifecycle
from forgelab.controller.reward_runner import RewardRunner, configured_rewards
from forgelab.controller.rollout import EnvEpisodes, Gate, Rollouts, SingleTurn
from forgelab.controller.rollout_log import RolloutRecorder
from forgelab.controller.tracking import Tracker, plot_learning_curve
from forgelab.controller.training import TokenRate, TrainingLoop
from forgelab.controller.view import RunSnapshot
from forgelab.data.datasets import ProblemStream, load_split
from forgelab.data.tasks import Problem
from forgelab.engines.contracts import TrainBatch
from forgelab.engines.loss_specs import LossSpec
from forgelab.rewards.library import RewardComposer, RewardFn
from forgelab.weights.sync import PushReport, WeightSync
from forgelab.runtime.liveness import liveness_dir  # noqa: F401 -- the heartbeat files' directory
from forgelab.runtime import liveness, startup_cpus
from forgelab.runtime.cpu_use import CpuMeter, CpuUse
from forgelab.runtime.watchdog import StackDump, Watchdog

if TYPE_CHECKING:
    from forgelab.serve.door import AgentDoor
    from forgelab.serve.lm_eval_door import LmEvalResult

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


class Run:
    """One training run: its parts, its background tasks, its metrics and its controls.

    `spawn` (default `forgelab.engines.spawn.spawn_parts`) starts the parts from the config; the controller's
    unit tests pass in-process fakes (`forgelab.testing.fakes.fake_spawn`).
    """

    def __init__(self, config: RunConfig | dict | str | Path, *, resume_from: str | Path | None = None,
                 spawn: Callable[[RunConfig], Awaitable[Any]] | None = None):
        self.config = cfg = _as_config(config)  # raises ConfigError before anything spawns
        self._tokenizer: Any = None  # loaded on first use; `spawn` loads it while the processes start
        self.out_dir = Path(cfg.tracking.out_dir) / cfg.name
        self.bus = EventBus()  # the event log (mirrored to out_dir/events.jsonl once it exists) and listeners
        self.lifecycle = Lifecycle(self.bus)
        self.buffer = ReplayBuffer(cfg.train.batch_size, cfg.train.max_policy_age, cfg.train.max_buffer)
        self.records = RolloutRecorder()  # every episode the buffer closes -> out_dir/rollouts/*.parquet
        self.buffer.add_close_listener(self.records.on_close)
        self.controls = RewardControls(configured_rewards(cfg.rollout), self.bus, teacher_enabled=cfg.teacher.enabled,
                                       distill_coef=float(cfg.teacher.coef))
        self.rewards: RewardComposer = self.controls.composer
        self.reward_runner = RewardRunner(self.rewards, cfg.rollout.reward_timeout_s, self.bus.emit)
        self.loop = loop = TrainingLoop(cfg, self.lifecycle, self.buffer, self.bus, loss_label(cfg.train.loss))
        self.bus.read_step_from(lambda: loop.step)
        self.data = load_split(cfg.rollout.task, heldout=cfg.rollout.heldout, max_train=cfg.rollout.max_train_problems,
                               eval_n=cfg.eval.n, seed=cfg.train.seed, split=cfg.rollout.split,
                               system_prompt=cfg.rollout.system_prompt, reasoning_gym=cfg.rollout.reasoning_gym)  # explicit limits, reported at spawn
        self.stream = ProblemStream(self.data.train, seed=cfg.train.seed)
        self.evaluator = Evaluator(cfg.rollout, self.data.heldout, self.lifecycle)
        self.resume_from = Path(resume_from) if resume_from else None
        self._spawn_parts = spawn
        self.parts: Any = None
        self.tracker: Tracker | None = None
        self.rollout: Rollouts | None = None
        self.weights: WeightSync | None = None
        self._checkpoint_parts: checkpoint.CheckpointParts | None = None
        self.replayer: Any = None  # a forgelab.experiments.replay.Replayer re-applying a recorded run's changes
        self._tasks: list[asyncio.Task] = []
        self._main: asyncio.Task | None = None
        self.door: AgentDoor | None = None  # while the run serves the agent door (door.enabled; docs/agents.md)
        self.watchdog = Watchdog(cfg.watchdog, out_dir=self.out_dir, emit=self.bus.emit)
        """Declares a stuck call or weight push and dumps every process's stacks (`forgelab.runtime.watchdog`)."""
        self.job_reports: JobReports | None = None
        """The hosts job's lost workers and time limit, as the run's events and message (a Slurm job)."""
        self.cpu = CpuMeter(lambda: process_ids(self.parts), lambda: self.buffer.counts()["trained"])
        """The processes' CPU time at each step's end: cores busy over the steady state (`forgelab.runtime.cpu_use`)."""
        loop.add_row_source(self.cpu.on_step)

    # the parts' state, read here and written by its owner (forgelab/controller/*.py)
    step = property(lambda self: self.loop.step, doc="Trained steps so far (`TrainingLoop`).")
    version = property(lambda self: self.loop.version, doc="The policy version the trainer holds (`TrainingLoop`).")
    loss_name = property(lambda self: self.loop.loss_name, doc="The loss training uses now (`TrainingLoop`).")
    last_batch = property(lambda self: self.loop.last_batch, doc="The batch the trainer stepped on last.")
    training_in_flight = property(lambda self: self.loop.training_in_flight, doc="A trainer step is running.")
    consecutive_failures = property(lambda self: self.loop.consecutive_failures, doc="Skipped steps in a row.")
    token_rate = property(lambda self: self.loop.token_rate)
    state = property(lambda self: self.lifecycle.state,
                     doc="created, starting, running, paused, stopped, finished or failed (`Lifecycle`).")
    message = property(lambda self: self.lifecycle.message, doc="Why the run paused, stopped or failed.")
    gate = property(lambda self: self.lifecycle.gate)
    events = property(lambda self: self.bus.log, doc="The run's event log (`EventLog`: a list of dicts).")
    accuracy_history = property(lambda self: list(self.evaluator.history),
                                doc="``[(step, held-out accuracy)]`` (`Evaluator`); a copy.")
    heldout = property(lambda self: self.evaluator.heldout, doc="The held-out problems (`Evaluator`).")
    distill_coef = property(lambda self: self.controls.distill_coef,
                            doc="The distillation term's weight now (`run.set_distill_coef`).")
    reward_revisions = property(lambda self: self.controls.revisions)

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
    openai_base_url = property(lambda self: self.door.base_url if self.door else None,
                               doc="The agent door's OpenAI base URL (``door.enabled``; None before spawn).")
    door_key = property(lambda self: self.door.key if self.door else None,
                        doc="The agent door's key (the SDK's api_key; ``f'{key}.{session}'`` names a session).")

    async def play_agents(self, agent: Callable[..., Any], tasks: Sequence[Any], **kw: Any) -> Any:
        """Run ``async def agent(client, task) -> reward`` as rollouts through the agent door (`AgentRunner.play`:
        ``group_size``, ``concurrency``, ``timeout_s``, ``task_key``, ``wait_for_admission``); its `AgentReport`.
        Each session waits until the run admits its episode (as native rollouts do), so a play may be started
        at any time: it paces itself to training."""
        if self.door is None:
            raise RuntimeError("Run.play_agents needs the agent door: set door.enabled and spawn or start the run")
        return await self.door.runner(self.bus.emit).play(agent, tasks, **kw)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "Run":
        """Spawn the processes (if not yet) and start training in the background. Returns at once."""
        if self._main is not None and not self._main.done():
            return self
        gate = self.lifecycle.renew_gate()  # asyncio primitives belong to the loop that starts the run
        if self.rollout is not None:
            self.rollout.use_gate(gate)
        if self.parts is None:
            self.lifecycle.set("starting")
            await self.spawn()
        self.lifecycle.set("running")
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
        """Wait until step `step` is done (its metrics row logged: ``run.metrics`` has it) and ``predicate(run)``
        holds, re-checked on each step and event and each time episodes close in the buffer (no polling).
        Raises `RuntimeError` if the run ends first (its own failure if it failed) and `asyncio.TimeoutError`
        after `timeout` seconds."""
        def logged() -> int:  # the step moves first; the row is logged after the weight push
            rows = self.tracker.rows if self.tracker is not None else []
            return as_int(rows[-1]["step"]) if rows else 0

        def met() -> bool:
            return ((step is None or (self.step >= step and logged() >= step))
                    and (predicate is None or bool(predicate(self))))

        await controls.wait_until(met, bus=self.bus, buffer=self.buffer, main_task=lambda: self._main,
                                  describe=lambda: f"{self.state}, step {self.step}", timeout=timeout)
        return self

    def pause(self, message: str | None = None) -> None:
        """Finish the current step, then hold rollouts and training (`message` says why, for people)."""
        self.lifecycle.pause(message)

    def resume(self) -> None:
        if self.lifecycle.resume():
            self.loop.reset_failures()

    async def stop(self) -> None:
        """Stop after the current step; processes stay up until `shutdown()`."""
        gate = self.lifecycle.gate
        gate.stopping = True
        gate.unpaused.set()
        await gate.notify()  # the train loop and rollout workers wait on it
        if self._main is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._main), timeout=300)
            except Exception:
                pass
        if self.state not in ("failed", "finished", "stopped", "created"):
            self.lifecycle.set("stopped")
            self.emit("stopped")

    async def shutdown(self) -> None:
        """Stop training and free every process."""
        await self.stop()
        if self.job_reports is not None:  # a checkpoint before the time limit needs the parts
            await self.job_reports.settled()
        if self.door is not None:
            await self.door.close()
            self.door = None
        if self.parts is not None:
            await self.parts.shutdown()  # and the hosts job, if the config has one
            self.parts = None
        if self.tracker is not None:
            self.tracker.finish()

    async def spawn(self) -> None:
        """Spawn the processes (and restore `resume_from`) without starting training; `start` calls it."""
        from forgelab.engines.spawn import spawn_parts
        from forgelab.engines.trainer_client import as_trainer

        cfg, loop = self.config, self.loop
        # the controller's own start-up (the tokenizer and transformers' import, the manifest's hashes and git
        # calls) in a thread in the generator's shadow: a spawn starts it once the generator is launched, on the
        # cores the generator does not need (forgelab.runtime.startup_cpus); a spawn that launches nothing (a
        # warm pool, a fake) leaves it to be started here
        work = startup_cpus.ShadowWork(self._startup_work)
        shadow = startup_cpus.SHADOW.set(work)
        liveness.HEARTBEAT_S[0] = cfg.watchdog.heartbeat_s  # the processes spawned now beat this often
        try:
            self.parts = parts = await (self._spawn_parts or spawn_parts)(cfg)  # Parts, or a slot's (pool, slot)
            parts.trainer = as_trainer(parts.trainer)  # typed calls (forgelab.engines.trainer_client)
        except BaseException:
            if work.future is not None:  # started: let its thread finish; never started: not worth starting now
                await asyncio.gather(work.future, return_exceptions=True)
            raise
        finally:
            startup_cpus.SHADOW.reset(shadow)
        done = work.start()
        await asyncio.gather(done, return_exceptions=True)
        failure = done.exception()
        if failure is not None:
            await self.parts.shutdown()
            self.parts = None
            raise failure
        manifest = done.result()
        self.weights = WeightSync(parts.trainer, parts.generators, self.bus.emit, lambda: loop.version,
                                  watchdog=self.watchdog)
        parts.generators.on_respawn = self.weights.catch_up
        teacher = getattr(parts, "teacher", None)
        for svc in (parts.generators, parts.reference, None if teacher is parts.reference else teacher, parts.envs,
                    parts.trainer):
            if svc is not None and hasattr(svc, "watchdog"):
                svc.watchdog = self.watchdog  # its calls' deadlines (forgelab.runtime.watchdog)
        if parts.envs is not None and hasattr(parts.envs, "progress_from"):  # a rollout waits on the generators
            gens = parts.generators
            parts.envs.progress_from = lambda: [pid for st in gens.status() for pid in st.pids]
        for svc in (parts.generators, parts.reference, None if teacher is parts.reference else teacher):
            if svc is not None and hasattr(svc, "add_listener"):
                svc.add_listener(lambda ev: self.bus.emit(str(getattr(ev, "kind", "service")),
                                                          replica=getattr(ev, "replica", None),
                                                          detail=str(getattr(ev, "detail", ev))))
        source = (EnvEpisodes(parts.envs, parts.generators, cfg) if cfg.rollout.env is not None
                  else SingleTurn(parts.generators, self.tokenizer))
        self.rollout = Rollouts(cfg, source, self.buffer, self.reward_runner, parts.reference, self.stream,
                                self.lifecycle, self.bus, self.controls, self.pad_id, teacher=teacher)
        self.controls.validate_on(self.rollout.recent_episodes)
        self.evaluator.bind(source, self.tokenizer)
        if cfg.door.enabled and self.door is None:  # the agent door (docs/agents.md): its own part
            from forgelab.serve.door import AgentDoor

            self.door = await AgentDoor.open(cfg.door, name=cfg.name, generators=parts.generators,
                                             tokenizer=self.tokenizer, rollouts=self.rollout, buffer=self.buffer,
                                             max_model_len=cfg.model.max_model_len, group_size=cfg.rollout.group_size)
            loop.add_row_source(self.door.counters)  # agent/* columns in the metrics rows
        self.out_dir.mkdir(parents=True, exist_ok=True)
        resumed_here = self.resume_from is not None and self.out_dir.resolve() in self.resume_from.resolve().parents
        self.events.attach(self.out_dir, append=resumed_here)
        self.records.attach(self.out_dir, append=resumed_here)
        # config, versions, git state, hardware, model and data hashes
        slot = getattr(parts, "slot", "")  # a LoRA variant's parts: a slot of the pool's shared engines
        shared = getattr(parts, "pool").provenance(slot) if slot else None
        provenance.save_manifest({**manifest, "shared_engines": shared}, self.out_dir, resume_from=self.resume_from)
        self.tracker = Tracker(self.out_dir, use_wandb=cfg.tracking.wandb, run_name=cfg.name, config=cfg.to_dict())
        self._checkpoint_parts = ckpt = checkpoint.CheckpointParts(
            trainer=parts.trainer, loop=loop, stream=self.stream, buffer=self.buffer, rewards=self.controls,
            rollouts=self.rollout, evaluator=self.evaluator, bus=self.bus, tracker=self.tracker, out_dir=self.out_dir)
        loop.bind(trainer=parts.trainer, weights=self.weights, generators=parts.generators, rollouts=self.rollout,
                  evaluator=self.evaluator, tracker=self.tracker, records=self.records, rewards=self.controls,
                  pad_id=self.pad_id, checkpoint=functools.partial(checkpoint.save, ckpt))
        self.emit("spawned", seconds=round(parts.seconds, 1))
        self.emit("data", message=self.data.description, **self.data.info)
        for note in reference_notes(cfg.train.loss, cfg.train.loss_kwargs, cfg.placement.reference):  # grpo's kl_coef
            log.warning("forgelab: %s", note)
            self.emit("config_note", message=note)
        if self.resume_from is not None:
            await checkpoint.restore(ckpt, self.resume_from)
        self.job_reports = JobReports.attach(getattr(parts, "job", None), self.lifecycle, self.bus,
                                             parts_on=parts_on_meshes(cfg.hosts), stop=self.stop,
                                             save=self.save_checkpoint)

    def _startup_work(self) -> dict[str, object]:
        """The controller's own start-up, run in a thread while the processes start: the tokenizer, and the
        manifest (config, versions, git state, hardware, model and data hashes) `spawn` writes once they are up."""
        _ = self.tokenizer
        return provenance.build_manifest(
            self.config, train_problems=getattr(self.stream, "problems", None), heldout_problems=self.heldout,
            extra={"resume_from": str(self.resume_from) if self.resume_from else None, "shared_engines": None,
                   "data_split": {"description": self.data.description, **self.data.info}})

    async def _run_main(self) -> None:
        try:
            if self.step == 0 and not self.evaluator.history:
                self.emit("eval", accuracy=await self.evaluate())
            self._tasks = [asyncio.ensure_future(self.rollout.worker()) for _ in range(self.config.rollout.concurrency)]
            await self.loop.run()
            if not self.evaluator.history or self.evaluator.history[-1][0] != self.step:
                acc = await self.evaluate()
                if self.tracker and self.tracker.rows:  # through annotate: a new column reaches metrics.csv
                    self.tracker.annotate(as_int(self.tracker.rows[-1]["step"]), {"heldout_accuracy": acc})
            self.lifecycle.set("stopped" if self.gate.stopping else "finished")
            self.emit(self.state, message=self.message)
        except asyncio.CancelledError:
            self.lifecycle.set("stopped")
            raise
        except Exception as e:
            lost = self.job_reports.failure_note() if self.job_reports is not None else ""
            if lost:  # a worker the job lost is likely why: the error names its host, parts and reason
                e.add_note(lost.removeprefix("; "))
            self.lifecycle.set("failed", f"{type(e).__name__}: {e}{lost}")
            self.emit("failed", message=self.message)
            log.exception("forgelab: run failed")
            raise
        finally:
            self.gate.stopping = True
            await self.gate.notify()  # whoever waits for admission (an agent play's sessions) stops waiting
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
        return await self.loop.push_weights()

    def stacks(self) -> StackDump:
        """Every process's Python stacks now (py-spy, or the faulthandler dump where ptrace is denied), also
        written to ``out_dir/stacks/`` (`forgelab.runtime.watchdog.Watchdog.stacks`)."""
        return self.watchdog.stacks("run.stacks()")

    async def evaluate(self, n: int | None = None) -> float:
        """Held-out greedy accuracy (the task's exact-answer reward) with the generator's current weights,
        each problem played as one episode of the run's environment (single-turn: one completion)."""
        return await self.evaluator.evaluate(self.step, n)

    async def lm_eval(self, tasks: Sequence[str] | None = None, **kw: Any) -> LmEvalResult:
        """lm-eval through the agent door on local tasks (default: forgelab's addition tasks over the held-out
        problems); scores recorded as ``lm_eval/<task>/<metric>`` metrics (`forgelab.serve.lm_eval_door.lm_eval_run`)."""
        from forgelab.serve.lm_eval_door import ADDITION_TASKS, lm_eval_run

        return await lm_eval_run(self, tasks or ADDITION_TASKS, **kw)

    # ------------------------------------------------------------------ live controls
    def set_reward_weights(self, weights: dict[str, float]) -> None:
        """Change reward weights; applies from the next scored rollout. Unknown names raise KeyError."""
        self.controls.set_weights(weights)

    def add_reward(self, name: str, fn: Callable[..., float], weight: float = 1.0, *, replace: bool = False) -> None:
        """Register a reward function from a cell; validated on recent rollouts first (`RewardChangeRefused`)."""
        self.controls.add(name, fn, weight, replace)

    def remove_reward(self, name: str) -> None:
        """Remove a reward; applies from the next scored rollout. Unknown names raise KeyError."""
        self.controls.remove(name)

    def set_distill_coef(self, coef: float) -> None:
        """Change the distillation term's weight (a ``teacher`` run); applies from the next scored rollout, like a
        reward weight, and is on the timeline (``distill_coef`` event, then ``reward_effective``)."""
        self.controls.set_distill_coef(coef)

    def reward_changed(self, kind: str, **fields: Any) -> None:
        """Record a change to the reward set (the event carries its revision number)."""
        self.controls.changed(kind, **fields)

    def set_loss(self, loss: LossSpec, **loss_kwargs: object) -> controls.Command[dict[str, object]]:
        """Hot-swap the loss: dry-run it on the last batch, then apply at the next step boundary. Starts at once
        (even if not awaited); `await` it for ``{"loss", "applies_at_step"}`` or its `LossSwapRefused`."""
        return controls.Command(self._swap_loss(loss, loss_kwargs), f"run.set_loss({loss_label(loss)!r})")

    async def _swap_loss(self, loss: LossSpec, loss_kwargs: dict[str, object]) -> dict[str, object]:
        name, packed, loss_kwargs = controls.prepare_loss(self.config, loss, loss_kwargs)
        from forgelab.controller.function_code import loss_record

        applies_at = await self.loop.swap_loss(name, packed, loss_kwargs)
        self.emit("loss_swapped", loss=name, kwargs=loss_kwargs, applies_at_step=applies_at, code=loss_record(loss))
        return {"loss": name, "applies_at_step": applies_at}

    async def save_checkpoint(self, path: str | Path | None = None, *, trainer: bool = True) -> Path:
        """Trainer state (DCP) + controller state (step, version, data position, counters, rewards with their code).

        ``trainer=False``: the controller state only (a fork into a slot of shared engines copies the trainer's
        state in memory: `forgelab.experiments.fork`)."""
        if self._checkpoint_parts is None:
            raise RuntimeError("save_checkpoint: the run has no processes yet (await run.start() or run.spawn())")
        return await checkpoint.save(self._checkpoint_parts, path, trainer=trainer)

    # ------------------------------------------------------------------ experiments (forgelab/experiments/*)
    async def fork(self, **overrides: Any) -> "Run":
        """A child run from this run's state at the next step boundary, then `overrides` (forgelab.experiments.fork)."""
        from forgelab.experiments.fork import fork

        return await fork(self, **overrides)

    @classmethod
    async def fork_from(cls, checkpoint: str | Path, config: Any = None, **overrides: Any) -> "Run":
        """A child run from a saved checkpoint (see forgelab.experiments.fork.fork_from)."""
        from forgelab.experiments.fork import fork_from

        return await fork_from(checkpoint, config, run_cls=cls, **overrides)

    @classmethod
    async def replay(cls, run_dir: str | Path, *, until: int | None = None, **kwargs: Any) -> Any:
        """Re-execute a recorded run with its live changes; a `ReplayReport` (see forgelab.experiments.replay)."""
        from forgelab.experiments.replay import replay

        return await replay(run_dir, until=until, run_cls=cls, **kwargs)

    def rescore(self, reward: RewardFn | Mapping[str, float], episodes: list[int] | None = None) -> Any:
        """Old/new reward and advantage of recorded and recent rollouts under `reward`; no process touched."""
        from forgelab.controller.rollout_log import rescore_run

        recent = self.rollout.recent_episodes() if self.rollout is not None else []
        return rescore_run(self.out_dir, recent, self.buffer.status, self.config.name, self.config.rollout.advantage,
                           reward, episodes)

    async def compare_losses(self, losses: Sequence[LossSpec], batch: TrainBatch | None = None) -> Any:
        """Each loss on one frozen batch (default: the last trained one); trainer state untouched."""
        from forgelab.experiments.loss_ab import compare_losses

        return await compare_losses(self, losses, batch)

    def attach_replayer(self, replayer: RunHook) -> None:
        """Re-apply a recorded run's changes where they took effect (`forgelab.experiments.replay.Replayer`)."""
        self.replayer = replayer
        replayer.bind(self)
        self.loop.set_hook(replayer)
        self.controls.set_hook(replayer)

    def limit_steps(self, steps: int) -> None:
        """Train at most `steps` steps (the loop reads it each step; the trainer's schedule keeps its length)."""
        self.config.train.steps = min(int(steps), self.config.train.steps)

    def use_last_batch(self, batch: TrainBatch | None) -> None:
        """The batch a first loss swap is dry-run on (a fork's: the one its parent trained last)."""
        self.loop.use_last_batch(batch)

    # ------------------------------------------------------------------ views
    def emit(self, kind: str, **fields: Any) -> None:
        """Record an event (kind, this step, fields) in the run's event log and tell the listeners."""
        self.bus.emit(kind, **fields)

    def notify(self, msg: dict) -> None:
        """Tell every listener (widgets, `until`) about a metrics row or an event; a failing listener is logged."""
        self.bus.notify(msg)

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """fn(row) after every step and fn({"event": ev}) on every event (widgets use this)."""
        self.bus.add_listener(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        self.bus.remove_listener(fn)

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
    def episodes(self) -> EpisodeCounts:
        """Episode accounting: generated = trained + evicted + dropped + buffered + in_flight."""
        return self.buffer.counts()

    def status(self) -> dict[str, object]:
        """State, progress, loss, rewards, message, episode counters, each service's replicas and the cores busy
        (`cpu_use`, as a dict; None before two steps)."""
        use = self.cpu_use()
        return {"state": self.state, "step": self.step, "steps": self.config.train.steps, "version": self.version,
                "loss": self.loss_name, "reward_weights": self.rewards.weights, "message": self.message,
                "episodes": self.buffer.counts(), "services": self._services(),
                "cpu_use": use.as_dict() if use is not None else None}

    def cpu_use(self) -> CpuUse | None:
        """Cores busy and CPU seconds per trained episode over the steady state (`forgelab.runtime.cpu_use`)."""
        return self.cpu.use()

    def _services(self) -> dict[str, Any]:
        """Each service's replicas (`status()`): generator, reference and, on an environment run, env."""
        g, r, e = self.generators, self.reference, self.envs
        return {"generator": g.status() if g else [], "reference": r.status() if r else [],
                **({"env": e.status()} if e else {})}

    def snapshot(self) -> RunSnapshot:
        """A typed, read-only copy of the run's state (what widgets read)."""
        return RunSnapshot(name=self.config.name, state=self.state, step=self.step, steps=self.config.train.steps,
                           version=self.version, loss=str(self.loss_name), message=self.message,
                           reward_weights=self.rewards.weights, episodes=self.buffer.counts(),
                           accuracy_history=tuple((s, a) for s, a in self.evaluator.history),
                           services=self._services(), events=len(self.events))

    def dashboard(self):
        """The live lab: metrics, rollout inspector, reward and loss panels, controls."""
        from forgelab.lab import dashboard

        return dashboard(self)

    def __repr__(self) -> str:
        return f"<Run {self.config.name} {self.state} step {self.step}/{self.config.train.steps} version {self.version}>"


def process_ids(parts: Any) -> dict[str, list[int]]:
    """The run's processes by part, for `CpuMeter`: the controller, and each part's pids while it has parts (the
    services' replicas as they are now, the trainer's ranks as spawned)."""
    out = {"controller": [os.getpid()]}
    if parts is None:
        return out
    teacher = getattr(parts, "teacher", None)
    for name, svc in (("generator", parts.generators), ("reference", parts.reference), ("envs", parts.envs),
                      ("teacher", None if teacher is parts.reference else teacher)):
        if svc is not None:
            out[name] = [pid for r in svc.status() for pid in r.pids]
    out["trainer"] = list(getattr(parts.trainer, "pids_list", None) or [])
    return out


async def replay(run_dir: str | Path, **kwargs: Any):
    """`forgelab.replay(run_dir, until=None, out_dir=None, name=None, spawn=None, trusted=False,
    allow_mismatch=False)`: `Run.replay` (see `forgelab.experiments.replay`)."""
    return await Run.replay(run_dir, **kwargs)
