"""The training side of the loop: buffer -> batch -> trainer.train_step -> weights -> metrics row.

    await train_loop(run)     # until run.config.train.steps, a stop, or a failure

Each step: wait until the buffer holds a batch of fresh-enough episodes
(`ReplayBuffer.ready`: the staleness bound on the training side), `collate` it,
`train_step` on the trainer; a skipped step (non-finite loss, shape error)
drops its episodes with reason ``step_skipped`` and, after
`train.max_consecutive_failures` in a row, pauses the run with a message. A
trained step bumps `run.version`, pushes the weights (`forgelab.weight_sync`),
which frees admission for the next rollouts (`buffer.served_version`), and logs
one metrics row (`metrics_row`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from forgelab.algos.batching import collate
from forgelab.controller.generator_meter import GeneratorMeter
from forgelab.engines.contracts import StepMetrics, TokenValues
from forgelab.types import Episode

log = logging.getLogger("forgelab.controller.training")

__all__ = ["train_loop", "train_on", "metrics_row", "TokenRate", "attach_token_values", "distill_metrics"]


async def train_loop(run: Any) -> None:
    gate, buffer = run.gate, run.buffer
    meter = GeneratorMeter()  # the generators' KV-cache usage and preemptions per step
    while run.step < run.config.train.steps and await gate.running():
        async with gate.changed:
            await gate.changed.wait_for(lambda: gate.stopping or not gate.unpaused.is_set() or buffer.ready(run.version))
            if gate.stopping:
                break
            if not gate.unpaused.is_set():
                continue
            batch_eps = buffer.sample(run.version)
            gate.changed.notify_all()
        if batch_eps is not None:
            await train_on(run, batch_eps, meter)
    await gate.notify()


async def train_on(run: Any, batch_eps: list[Episode], meter: GeneratorMeter | None = None) -> None:
    """One trainer step on `batch_eps` (in flight in the buffer), then weights, metrics, eval and checkpoint;
    `meter` adds the generators' engine counters (``generator/*``) to the row."""
    cfg, gate = run.config, run.gate
    t0 = time.time()
    if run.replayer is not None:  # before last_batch moves on: the recorded swap's dry run saw the previous batch
        await run.replayer.before_step(run, run.step + 1)
    batch = collate(batch_eps, run.pad_id)
    run.last_batch = batch
    run.training_in_flight = True
    try:
        m = await run.trainer.train_step(batch)
        # the trainer's view of each token it trained; fetched while the step still counts as in flight, so a
        # loss swap made meanwhile is promised to the step after this one (no await between here and step += 1)
        token_values = None if m.skipped else await run.trainer.token_values()
    finally:
        run.training_in_flight = False
    if m.skipped:
        reason = m.skip_reason or "skipped"
        async with gate.changed:  # frees admission slots: wake the rollout workers
            run.buffer.mark_dropped(batch_eps, "step_skipped")
            gate.changed.notify_all()
        run.consecutive_failures += 1
        run.emit("step_skipped", reason=reason)
        if run.consecutive_failures >= cfg.train.max_consecutive_failures:
            run.pause(f"paused after {run.consecutive_failures} skipped steps in a row; last reason: {reason}. "
                      "Fix the loss (run.set_loss(...)) or the data, then run.resume()")
        return
    run.consecutive_failures = 0
    if token_values is not None:  # before the buffer closes them: the rollout log records these values
        attach_token_values(batch_eps, token_values, run.step + 1)
    run.buffer.mark_trained(batch_eps)
    run.step += 1
    run.version += 1
    t_train = time.time() - t0
    report = await run.push_weights()
    row = metrics_row(run, batch_eps, m, t_train, report.sync_ms, time.time() - t0)
    if meter is not None:
        row.update(await meter.row(run.generators))
    if cfg.eval.every and run.step % cfg.eval.every == 0:
        row["heldout_accuracy"] = await run.evaluate()
    if cfg.tracking.checkpoint_every and run.step % cfg.tracking.checkpoint_every == 0:
        await run.save_checkpoint()
    run.tracker.log(row)
    run.records.step_done(run.step)  # closed episodes -> <run dir>/rollouts/*.parquet (forgelab.controller.rollout_log)
    run.notify(row)


_TOKEN_COLUMNS = {"trainer_logprobs": "trainer_logprobs_B_T", "entropy": "entropy_B_T", "is_weight": "is_weights_B_T",
                  "clipped": "clipped_B_T"}


def attach_token_values(episodes: list[Episode], token_values: TokenValues, step: int) -> None:
    """Each episode's slice of the trainer's per-token values (rows in batch order, as `collate` built them),
    and the step that trained it."""
    from forgelab.algos.token_truth import per_episode

    P = [len(ep.prompt_ids) for ep in episodes]
    C = [len(ep.completion_ids) for ep in episodes]
    per = {k: None if token_values.get(v) is None else per_episode(token_values[v], P, C)
           for k, v in _TOKEN_COLUMNS.items()}
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


def metrics_row(run: Any, eps: list[Episode], m: StepMetrics, t_train: float, sync_ms: float, t_step: float) -> dict:
    """The per-step metrics row: rewards (total and per part), policy age, lengths, the trainer's metrics,
    throughput, times and the episode counters. Columns are stable: widgets, CSVs and tests read them."""
    now = time.time()
    tokens, run.rollout.tokens = run.rollout.tokens, 0
    counts = run.buffer.counts()
    row: dict[str, Any] = {"step": run.step, "time": now, "version": run.version,
                           "reward_mean": sum(ep.reward for ep in eps) / len(eps)}
    names = run.rewards.names
    for name in [*names, *sorted({k for ep in eps for k in ep.reward_parts} - set(names))]:
        vals = [ep.reward_parts[name] for ep in eps if name in ep.reward_parts]
        if vals:
            row[f"reward/{name}"] = sum(vals) / len(vals)
    if run.config.rollout.env is not None:  # environment counters (e.g. tool calls) per episode
        from forgelab.envs.episode import env_metric_means, latency_percentiles

        row.update({f"env/{k}": v for k, v in env_metric_means(eps).items()})
        row.update({f"latency/{k}": v for k, v in latency_percentiles(eps).items()})
    ages = [run.version - 1 - ep.policy_version for ep in eps]
    row["policy_age_mean"] = sum(ages) / len(ages)
    row["policy_age_max"] = max(ages)
    row["completion_len"] = sum(len(ep.completion_ids) for ep in eps) / len(eps)
    row.update(distill_metrics(eps))
    for k, v in m.scalars().items():
        row[k if k not in row else f"train/{k}"] = v
    # the loss the trainer actually used for this step (a swap applies at a step boundary)
    row["loss_name"] = str(m.loss_name or run.loss_name)
    row["tokens_per_s"] = run.token_rate.add(tokens, now)
    row["step_time_s"] = t_step
    row["train_time_s"] = t_train
    row["weight_sync_ms"] = sync_ms
    for k in ("generated", "trained", "evicted", "dropped", "buffered"):
        row[f"episodes_{k}"] = counts[k]
    if run.rollout.teacher is not None and run.config.rollout.drop_zero_variance_groups:
        row["episodes_zero_variance_kept"] = run.rollout.zero_variance_kept  # not dropped: they distil
    return row


def distill_metrics(eps: list[Episode]) -> dict[str, float]:
    """With a teacher: ``distill/reverse_kl``, the mean over the batch's trained tokens of student logprob minus
    teacher logprob on the student's own samples (a k1 estimate of KL(student || teacher), the quantity on-policy
    distillation lowers). Empty without a teacher."""
    diffs = [g - t for ep in eps if ep.teacher_logprobs is not None
             for g, t, m in zip(ep.generator_logprobs, ep.teacher_logprobs, ep.loss_mask or [1] * len(ep.teacher_logprobs))
             if m]
    return {"distill/reverse_kl": sum(diffs) / len(diffs)} if diffs else {}
