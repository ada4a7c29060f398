"""The training side of the loop: buffer -> batch -> trainer.train_step -> weights -> metrics row.

    loop = TrainingLoop(config, lifecycle, buffer, bus)    # owns step, version, loss name, the last batch
    loop.bind(engines, rollouts, evaluator, tracker, records, rewards)   # once the processes are up
    await loop.run()          # until config.train.steps, a stop, or a failure

`TrainingLoop` is the one writer of the training fields (`step`, `version`, `loss_name`, `last_batch`,
`training_in_flight`, `consecutive_failures`): everyone else reads them, and a restore or a loss swap goes
through its methods (`restore_position`, `swap_loss`). Each step: wait until the buffer holds a batch of
fresh-enough episodes (`ReplayBuffer.ready`: the staleness bound on the training side), `collate` it,
`train_step` on the trainer; a skipped step (non-finite loss, shape error) drops its episodes with reason
``step_skipped`` and, after `train.max_consecutive_failures` in a row, pauses the run with a message. A
trained step bumps `version`, pushes the weights (`forgelab.weights.sync.WeightSync`), which frees admission
for the next rollouts (`buffer.served_version`), evaluates and checkpoints when due, and logs one metrics row
(`metrics_row`) that goes to the tracker and the listeners (`EventBus.notify`). A run in a LoRA slot of shared
engines makes one trainer call per step (`train_export`: the step, its token values and the adapter, a
`SlotStep`) and its weight sync hands the adapter to the generators (`WeightSync.deliver_adapter`), so the
trainer steps the other slots meanwhile; admission opens for the new version once the generators hold it.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, Protocol, runtime_checkable

from forgelab.algos.batching import collate
from forgelab.controller.buffer import EpisodeCounts, ReplayBuffer
from forgelab.controller.events import Event, EventBus
from forgelab.controller.generator_meter import GeneratorMeter
from forgelab.controller.lifecycle import Lifecycle
from forgelab.engines.contracts import SlotStep, StepMetrics, TokenValues, TrainBatch
from forgelab.engines.loss_specs import LossSpec
from forgelab.engines.trainer_client import ExportsSteps, TrainerAPI
from forgelab.generation import Generators
from forgelab.types import Episode

if TYPE_CHECKING:
    from forgelab.config.run_config import RolloutConfig, RunConfig
    from forgelab.weights.sync import PushReport

log = logging.getLogger("forgelab.controller.training")

__all__ = ["TrainingLoop", "metrics_row", "TokenRate", "attach_token_values", "distill_metrics"]


class StepHook(Protocol):
    """Called before each trained step (a replay re-applies its recorded loss swaps here)."""

    async def before_step(self, step: int) -> None: ...


class WeightPusher(Protocol):
    """Sends the trainer's weights to the generators (`forgelab.weights.sync.WeightSync`)."""

    async def push(self, version: int) -> PushReport: ...


@runtime_checkable
class AdapterDelivery(Protocol):
    """A weight sync that hands a LoRA slot's exported adapter to the generators itself
    (`forgelab.weights.sync.WeightSync` of a run on shared engines: ``adapter_slot`` set)."""

    @property
    def adapter_slot(self) -> str | None: ...

    async def deliver_adapter(self, step: SlotStep) -> PushReport: ...


class StepTokens(Protocol):
    """What a step reads of the rollouts (`forgelab.controller.rollout.Rollouts`): its row's counts, and whether
    a rollout worker is playing one (a checkpoint waits for none)."""

    playing: int

    def take_tokens(self) -> int: ...
    def zero_variance_count(self, config: RunConfig) -> int | None: ...


class StepEvaluator(Protocol):
    """Held-out accuracy when due (`forgelab.controller.evaluate.Evaluator`)."""

    async def evaluate(self, step: int, n: int | None = None) -> float: ...


class RowLog(Protocol):
    """Where metrics rows go (`forgelab.controller.tracking.Tracker`)."""

    def log(self, row: Event) -> None: ...


class StepRecords(Protocol):
    """The rollout log, told when a step is done (`forgelab.controller.rollout_log.RolloutRecorder`)."""

    def step_done(self, step: int) -> None: ...


class RewardNames(Protocol):
    """The reward set's names, in order (`forgelab.controller.controls.RewardControls`)."""

    @property
    def names(self) -> list[str]: ...


class TrainingLoop:
    """The training loop and the one owner of the training fields.

    Args:
        config: the run's `RunConfig` (``train``, ``eval``, ``tracking``, ``rollout.env`` are read).
        lifecycle: the run's `forgelab.controller.lifecycle.Lifecycle` (its gate; ``pause`` after too many
            skipped steps).
        buffer: the run's replay buffer.
        bus: the run's `EventBus` (events; metrics rows to the listeners).
        loss_name: the configured loss's label.
    """

    trainer: TrainerAPI
    weights: WeightPusher
    generators: Generators
    rollouts: StepTokens
    evaluator: StepEvaluator
    tracker: RowLog
    records: StepRecords
    rewards: RewardNames
    pad_id: int
    checkpoint: Callable[[], Awaitable[Path]]

    def __init__(self, config: RunConfig, lifecycle: Lifecycle, buffer: ReplayBuffer, bus: EventBus,
                 loss_name: str) -> None:
        self.config, self.lifecycle, self.buffer, self.bus = config, lifecycle, buffer, bus
        self.step = 0
        self.version = 0
        self.loss_name = loss_name
        self.last_batch: TrainBatch | None = None
        self.training_in_flight = False
        self.consecutive_failures = 0
        self.token_rate = TokenRate()
        self.hook: StepHook | None = None
        self._bound = False
        self._row_sources: list[Callable[[], Mapping[str, float]]] = []

    def bind(self, *, trainer: TrainerAPI, weights: WeightPusher, generators: Generators, rollouts: StepTokens,
             evaluator: StepEvaluator, tracker: RowLog, records: StepRecords, rewards: RewardNames, pad_id: int,
             checkpoint: Callable[[], Awaitable[Path]]) -> None:
        """The parts a step uses once the processes are up: trainer handle, `WeightSync`, generator service
        (engine counters), `Rollouts` (token counts), `Evaluator`, `Tracker`, `RolloutRecorder`, the reward
        controls (reward names), the pad id and the checkpoint writer."""
        self.trainer, self.weights, self.generators, self.rollouts = trainer, weights, generators, rollouts
        self.evaluator, self.tracker, self.records, self.rewards = evaluator, tracker, records, rewards
        self.pad_id, self.checkpoint = pad_id, checkpoint
        self._bound = True

    def add_row_source(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Add ``source()``'s numbers to every metrics row from now on (a part's counters, e.g. the agent door's
        ``agent/*``)."""
        self._row_sources.append(source)

    # -- the owner's writes ---------------------------------------------------------------------------------
    def restore_position(self, step: int, version: int, loss_name: str | None) -> None:
        """A checkpoint's step, policy version and (when the trainer restored one) loss name."""
        self.step, self.version = int(step), int(version)
        if loss_name:
            self.loss_name = loss_name

    def set_hook(self, hook: StepHook | None) -> None:
        """Called before each trained step (a replay's `Replayer`)."""
        self.hook = hook

    def use_last_batch(self, batch: TrainBatch | None) -> None:
        """A forked child's first loss swap is dry-run on the batch its parent trained last."""
        self.last_batch = batch

    def reset_failures(self) -> None:
        """A resume after a pause: the count of skipped steps in a row starts again."""
        self.consecutive_failures = 0

    async def swap_loss(self, name: str, packed: LossSpec, loss_kwargs: dict[str, object]) -> int:
        """Dry-run the loss on the last batch (if any), then set it on the trainer; returns the step it applies
        at (a step in flight finishes with the old loss). Raises `LossSwapRefused` when the dry run fails."""
        from forgelab.controller.controls import LossSwapRefused

        if not self._bound:
            raise RuntimeError("set_loss: the run has no processes yet (await run.start() or run.spawn() first)")
        if self.last_batch is not None:
            report = await self.trainer.dry_run_loss(packed, self.last_batch, loss_kwargs)
            if not report.ok:
                self.bus.emit("loss_refused", loss=name, reason=report.reason)
                raise LossSwapRefused(f"loss {name!r} refused on the last batch: {report.reason}; "
                                      "the old loss keeps training")
        applies_at = self.step + (2 if self.training_in_flight else 1)
        await self.trainer.set_loss(packed, loss_kwargs)
        self.loss_name = name
        return applies_at

    def _exporter(self) -> tuple[ExportsSteps, AdapterDelivery] | None:
        """The trainer and weight sync when a step is one trainer call (a LoRA slot of shared engines: the
        trainer exports the adapter, the weight sync delivers it); None: train_step, token_values, push."""
        trainer, weights = self.trainer, self.weights
        if isinstance(weights, AdapterDelivery) and weights.adapter_slot is not None and isinstance(trainer, ExportsSteps):
            return trainer, weights
        return None

    async def push_weights(self, exported: SlotStep | None = None) -> PushReport:
        """Trainer -> every healthy generator replica, as version `self.version`; frees admission for it.
        ``exported``: the adapter a one-call step exported (`SlotStep`), handed to the generators from here."""
        exporter = self._exporter() if exported is not None else None
        if exported is not None and exporter is not None:
            report = await exporter[1].deliver_adapter(exported)
        else:
            report = await self.weights.push(self.version)
        gate = self.lifecycle.gate
        async with gate.changed:
            self.buffer.served_version = self.version
            gate.changed.notify_all()
        return report

    # -- the loop --------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until ``train.steps`` (read each step: a replay may lower it), a stop, or a failure."""
        gate, buffer = self.lifecycle.gate, self.buffer
        meter = GeneratorMeter()  # the generators' KV-cache usage and preemptions per step
        while self.step < self.config.train.steps and await gate.running():
            async with gate.changed:
                await gate.changed.wait_for(lambda: gate.stopping or not gate.unpaused.is_set()
                                            or buffer.ready(self.version))
                if gate.stopping:
                    break
                if not gate.unpaused.is_set():
                    continue
                batch_eps = buffer.sample(self.version)
                gate.changed.notify_all()
            if batch_eps is not None:
                await self.train_on(batch_eps, meter)
        await gate.notify()

    async def train_on(self, batch_eps: list[Episode], meter: GeneratorMeter | None = None) -> Event | None:
        """One trainer step on `batch_eps` (in flight in the buffer), then weights, metrics, eval and checkpoint;
        `meter` adds the generators' engine counters (``generator/*``) to the row. Returns the metrics row, or
        None for a skipped step."""
        cfg, gate = self.config, self.lifecycle.gate
        t0 = time.time()
        if self.hook is not None:  # before last_batch moves on: the recorded swap's dry run saw the previous batch
            await self.hook.before_step(self.step + 1)
        batch = collate(batch_eps, self.pad_id)
        self.last_batch = batch
        self.training_in_flight = True
        exporter, exported = self._exporter(), None
        try:
            if exporter is not None:  # one call: the step, its token values, the adapter as the next version
                exported = await exporter[0].train_export(batch, self.version + 1)
                m, token_values = exported.metrics, exported.token_values
            else:
                m = await self.trainer.train_step(batch)
                # the trainer's view of each token it trained; fetched while the step still counts as in flight,
                # so a loss swap made meanwhile is promised to the step after this one (no await between here
                # and step += 1)
                token_values = None if m.skipped else await self.trainer.token_values()
        finally:
            self.training_in_flight = False
        if m.skipped:
            reason = m.skip_reason or "skipped"
            async with gate.changed:  # frees admission slots: wake the rollout workers
                self.buffer.mark_dropped(batch_eps, "step_skipped")
                gate.changed.notify_all()
            self.consecutive_failures += 1
            self.bus.emit("step_skipped", reason=reason)
            if self.consecutive_failures >= cfg.train.max_consecutive_failures:
                self.lifecycle.pause(f"paused after {self.consecutive_failures} skipped steps in a row; last reason: "
                                     f"{reason}. Fix the loss (run.set_loss(...)) or the data, then run.resume()")
            return None
        self.consecutive_failures = 0
        if token_values is not None:  # before the buffer closes them: the rollout log records these values
            attach_token_values(batch_eps, token_values, self.step + 1)
        self.buffer.mark_trained(batch_eps)
        self.step += 1
        self.version += 1
        t_train = time.time() - t0
        due = bool(cfg.tracking.checkpoint_every) and self.step % cfg.tracking.checkpoint_every == 0
        # A checkpoint keeps the data position and the next episode and group ids, and the buffered episodes; a
        # rollout being played has taken its prompts and ids but is not in the buffer yet, so a resume would never
        # play it. On a checkpoint step nothing new is admitted from this push until the checkpoint is written,
        # and the rollouts already being played land in the buffer first (on a loaded machine they may not have
        # landed while the trainer saved).
        async with gate.hold() if due else contextlib.nullcontext():
            report = await self.push_weights(exported)
            row = metrics_row(StepFacts(self.step, self.version, self.loss_name, self.rewards.names,
                                        cfg.rollout.env is not None, self.rollouts.take_tokens(), self.buffer.counts(),
                                        self.rollouts.zero_variance_count(cfg)),
                              batch_eps, m, self.token_rate, t_train, report.sync_ms, time.time() - t0)
            if meter is not None:
                row.update(await meter.row(self.generators))
            for source in self._row_sources:
                row.update({k: float(v) for k, v in source().items()})
            if cfg.eval.every and self.step % cfg.eval.every == 0:
                row["heldout_accuracy"] = await self.evaluator.evaluate(self.step)
            if due:
                async with gate.changed:  # each rollout's release notifies; the agent door's sessions are not waited on
                    await gate.changed.wait_for(lambda: gate.stopping or self.rollouts.playing == 0)
                await self.checkpoint()
        self.tracker.log(row)
        self.records.step_done(self.step)  # closed episodes -> <run dir>/rollouts/*.parquet (rollout_log)
        self.bus.notify(row)
        return row




def attach_token_values(episodes: list[Episode], token_values: TokenValues, step: int) -> None:
    """Each episode's slice of the trainer's per-token values (rows in batch order, as `collate` built them),
    and the step that trained it."""
    from forgelab.algos.token_truth import per_episode

    P = [len(ep.prompt_ids) for ep in episodes]
    C = [len(ep.completion_ids) for ep in episodes]
    columns = {"trainer_logprobs": token_values.trainer_logprobs_B_T, "entropy": token_values.entropy_B_T,
               "is_weight": token_values.is_weights_B_T, "clipped": token_values.clipped_B_T}
    per = {k: None if v is None else per_episode(v, P, C) for k, v in columns.items()}
    for b, ep in enumerate(episodes):
        ep.train_values = {k: None if vals is None else vals[b] for k, vals in per.items()}
        ep.train_values["step"] = step


class TokenRate:
    """Generated tokens per second over a window of recent steps (a single step may see no rollout finish)."""

    def __init__(self, window: int = 11):
        self._window: deque[tuple[float, int]] = deque(maxlen=window)
        self._t_last = time.time()

    def add(self, tokens: int, now: float) -> float:
        self._window.append((now, tokens))
        w = list(self._window)
        dt = now - (w[0][0] if len(w) > 1 else self._t_last)
        total = sum(n for _, n in w[1:]) if len(w) > 1 else w[-1][1]
        self._t_last = now
        return total / dt if dt > 0 else float("nan")


class StepFacts:
    """What a metrics row reads besides the batch and the trainer's metrics: the training loop's position, the
    reward names, whether the run plays an environment, the generated tokens counted since the last row, the
    buffer's counters and (a teacher run keeping zero-variance groups) how many such episodes it kept."""

    __slots__ = ("step", "version", "loss_name", "reward_names", "env", "tokens", "counts", "zero_variance_kept")

    def __init__(self, step: int, version: int, loss_name: str, reward_names: list[str], env: bool, tokens: int,
                 counts: EpisodeCounts, zero_variance_kept: int | None) -> None:
        self.step, self.version, self.loss_name, self.reward_names = step, version, loss_name, reward_names
        self.env, self.tokens, self.counts, self.zero_variance_kept = env, tokens, counts, zero_variance_kept


def metrics_row(f: StepFacts, eps: list[Episode], m: StepMetrics, token_rate: TokenRate, t_train: float, sync_ms: float,
                t_step: float) -> Event:
    """The per-step metrics row: rewards (total and per part), policy age, lengths, the trainer's metrics,
    throughput, times and the episode counters. Columns are stable: widgets, CSVs and tests read them."""
    now = time.time()
    row: Event = {"step": f.step, "time": now, "version": f.version,
                           "reward_mean": sum(ep.reward for ep in eps) / len(eps)}
    names = f.reward_names
    for name in [*names, *sorted({k for ep in eps for k in ep.reward_parts} - set(names))]:
        vals = [ep.reward_parts[name] for ep in eps if name in ep.reward_parts]
        if vals:
            row[f"reward/{name}"] = sum(vals) / len(vals)
    if f.env:  # environment counters (e.g. tool calls) per episode
        from forgelab.envs.episode import env_metric_means, latency_percentiles

        row.update({f"env/{k}": v for k, v in env_metric_means(eps).items()})
        row.update({f"latency/{k}": v for k, v in latency_percentiles(eps).items()})
    ages = [f.version - 1 - ep.policy_version for ep in eps]
    row["policy_age_mean"] = sum(ages) / len(ages)
    row["policy_age_max"] = max(ages)
    row["completion_len"] = sum(len(ep.completion_ids) for ep in eps) / len(eps)
    row.update(distill_metrics(eps))
    for k, v in m.scalars().items():
        row[k if k not in row else f"train/{k}"] = v
    # the loss the trainer actually used for this step (a swap applies at a step boundary)
    row["loss_name"] = str(m.loss_name or f.loss_name)
    row["tokens_per_s"] = token_rate.add(f.tokens, now)
    row["step_time_s"] = t_step
    row["train_time_s"] = t_train
    row["weight_sync_ms"] = sync_ms
    c = f.counts
    row.update({"episodes_generated": c["generated"], "episodes_trained": c["trained"], "episodes_evicted": c["evicted"],
                "episodes_dropped": c["dropped"], "episodes_buffered": c["buffered"]})
    if f.zero_variance_kept is not None:
        row["episodes_zero_variance_kept"] = f.zero_variance_kept  # not dropped: they distil
    return row


def distill_metrics(eps: list[Episode]) -> dict[str, float]:
    """With a teacher: ``distill/reverse_kl``, the mean over the batch's trained tokens of student logprob minus
    teacher logprob on the student's own samples (a k1 estimate of KL(student || teacher), the quantity on-policy
    distillation lowers). Empty without a teacher."""
    diffs = [g - t for ep in eps if ep.teacher_logprobs is not None
             for g, t, m in zip(ep.generator_logprobs, ep.teacher_logprobs, ep.loss_mask or [1] * len(ep.teacher_logprobs))
             if m]
    return {"distill/reverse_kl": sum(diffs) / len(diffs)} if diffs else {}
