"""The controller: one `Run` object drives asynchronous GRPO from a notebook, a script or the CLI.

    run = Run(RunConfig(train=TrainConfig(steps=50)))
    await run.start()            # spawns generator / trainer / reference, returns at once
    run.metrics                  # pandas DataFrame, one row per step
    run.set_reward_weights({"answer_format": 0.0})
    await run.set_loss("dapo")   # dry-run on the last batch, applies at the next step boundary
    await run.wait(); await run.shutdown()

    asyncio.run(Run(cfg).run())  # the same thing from a script

Inside, everything is asyncio tasks on the caller's event loop (the kernel's
loop in Jupyter, so other cells stay usable):

- N rollout tasks: problems -> generator service (`generate`, n = group size)
  -> rewards (in threads, with a timeout) -> reference logprobs -> group
  advantages -> replay buffer;
- one training task: buffer.sample -> trainer.train_step -> trainer.push_weights
  to every healthy generator replica (version + 1) -> metrics row.

`train.max_policy_age` bounds staleness: 0 is synchronous on-policy training
(rollouts wait for the new weights), k lets generation run up to k versions
ahead. Every episode ends trained, evicted (stale) or dropped with a reason;
`run.episodes` holds the counters.

Faults (docs/reliability.md has the tested numbers):

- An episode is *generated* once its completion reached the controller (an
  `Episode` object exists). From then on it is accounted for: a rollout that
  fails or is cancelled after that point drops its not-yet-buffered episodes
  with reason ``rollout_error:<ExceptionType>`` / ``rollout_cancelled``.
  Completions lost inside a dead generator never reached the controller: the
  service retries `generate` (idempotent) on another replica, or the rollout
  fails before anything was generated and its admission slots are given back.
- A respawned generator replica gets the run's current weights (pushed again
  if a step landed meanwhile) before it serves; a push that fails fails the
  respawn, which the service retries.
- A dead reference replica: the rollout waits for its respawn and retries.
- Reward calls run each in their own daemon thread under
  `rollout.reward_timeout_s`. A call that outlives it is abandoned (episode
  dropped, reason ``reward_timeout``); it cannot starve the others, which get
  fresh threads. Abandoned calls still running are counted; at
  `MAX_HUNG_REWARD_CALLS` the run pauses with a message naming the reward.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from forgelab.algos import ADVANTAGES, LOSSES
from forgelab.algos.batching import collate
from forgelab.buffer import ReplayBuffer
from forgelab.config import ConfigError, RunConfig
from forgelab.events import EventLog
from forgelab.data import ProblemStream, load_problems
from forgelab.rewards import REWARDS, RewardComposer, RewardFailure, validate
from forgelab.tasks import TASKS, get_task
from forgelab.tracking import Tracker, plot_learning_curve
from forgelab.types import Episode

log = logging.getLogger("forgelab.run")

MAX_HUNG_REWARD_CALLS = 32
"""Abandoned (timed-out) reward calls still running before the run pauses: each holds a thread."""


class LossSwapRefused(ValueError):
    """A loss failed its dry run on the last batch; the old loss keeps training."""


class RewardChangeRefused(ValueError):
    """A reward failed validation on recent rollouts; the old rewards stay."""


def _as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    if isinstance(config, RunConfig):
        return config.validate()
    if isinstance(config, dict):
        return RunConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return RunConfig.from_yaml(config)
    raise ConfigError(f"Run(config): expected a RunConfig, a dict or a YAML path, got {type(config).__name__}")


class Run:
    """One training run: its processes, its background tasks, its metrics and its controls."""

    def __init__(self, config: RunConfig | dict | str | Path, *, resume_from: str | Path | None = None):
        self.config = _as_config(config)  # raises ConfigError before anything spawns
        cfg = self.config
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.out_dir = Path(cfg.tracking.out_dir) / cfg.name
        self.rewards = RewardComposer({name: (REWARDS[name], w) for name, w in cfg.rollout.rewards.items()})
        self.loss_name: str = cfg.train.loss
        self.buffer = ReplayBuffer(cfg.train.batch_size, cfg.train.max_policy_age, cfg.train.max_buffer)
        train = load_problems(cfg.rollout.task, "train", 4000, cfg.train.seed)
        self.stream = ProblemStream(train, seed=cfg.train.seed)
        self.heldout = load_problems(cfg.rollout.task, "test", cfg.eval.n, cfg.train.seed)
        self._task_reward = get_task(cfg.rollout.task).reward if cfg.rollout.task in TASKS else REWARDS["exact_answer"]
        self.resume_from = Path(resume_from) if resume_from else None

        self.step = 0
        self.version = 0
        self.state = "created"
        self.message = ""
        self.events = EventLog()  # mirrored to out_dir/events.jsonl once the run directory exists
        self.reward_failures: deque[RewardFailure] = deque(maxlen=200)
        self._recent: deque[Episode] = deque(maxlen=2000)
        self._episode_status: dict[int, str] = {}
        self._next_episode_id = 0
        self._next_group_id = 0
        self._last_batch: dict | None = None
        self._tokens_since = 0
        self._tok_window: deque[tuple[float, int]] = deque(maxlen=11)
        self._t_last = time.time()
        self._consecutive_failures = 0
        self._pending_reward_weights: dict | None = None
        self._listeners: list[Callable[[dict], None]] = []
        self.tracker: Tracker | None = None
        self.generators = self.trainer = self.reference = None
        self.envs = None  # EnvActor service (multi-turn rollouts, rollout.env)
        self._tasks: list[asyncio.Task] = []
        self._main: asyncio.Task | None = None
        self._unpaused: asyncio.Event | None = None
        self._buffer_changed: asyncio.Condition | None = None
        self._stopping = False
        self._hung_rewards: list[threading.Thread] = []  # timed-out reward calls, abandoned but maybe still running
        self._inflight_rollout = 0
        self._admitted = 0  # episodes whose generation was started
        self._pushed_version = 0  # version the generators serve (last completed push)
        self._training_in_flight = False
        self.accuracy_history: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "Run":
        """Spawn the processes (if not yet) and start training in the background. Returns at once."""
        if self._main is not None and not self._main.done():
            return self
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._buffer_changed = asyncio.Condition()
        self._stopping = False
        if self.generators is None:
            self.state = "starting"
            await self._spawn()
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

    def pause(self) -> None:
        """Finish the current step, then hold rollouts and training."""
        if self._unpaused is not None and self.state == "running":
            self._unpaused.clear()
            self.state = "paused"
            self._event("paused", message=self.message)

    def resume(self) -> None:
        if self._unpaused is not None and self.state == "paused":
            self.message = ""
            self._consecutive_failures = 0
            self.state = "running"
            self._unpaused.set()
            self._event("resumed")

    async def stop(self) -> None:
        """Stop after the current step; processes stay up until `shutdown()`."""
        self._stopping = True
        if self._unpaused is not None:
            self._unpaused.set()
        if self._buffer_changed is not None:  # the train loop and rollout workers wait on it
            async with self._buffer_changed:
                self._buffer_changed.notify_all()
        if self._main is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._main), timeout=300)
            except Exception:
                pass
        if self.state not in ("failed", "finished", "stopped", "created"):
            self.state = "stopped"
            self._event("stopped")

    async def shutdown(self) -> None:
        """Stop training and free every process."""
        await self.stop()
        for svc in (self.generators, self.reference, self.envs):
            if svc is not None:
                await svc.shutdown()
        if self.trainer is not None:
            await self.trainer.shutdown()
        self.generators = self.trainer = self.reference = self.envs = None
        if getattr(self, "parts", None) is not None:
            await self.parts.shutdown()  # and the hosts job, if the config has one
        if self.tracker is not None:
            self.tracker.finish()

    # ------------------------------------------------------------------ spawning
    async def _spawn(self) -> None:
        from forgelab.spawn import spawn_parts

        cfg = self.config
        self.parts = parts = await spawn_parts(cfg)
        self.generators, self.trainer, self.reference, self.envs = parts.generators, parts.trainer, parts.reference, parts.envs
        self.generators.on_respawn = self._on_generator_respawn
        for svc in (self.generators, self.reference):
            if svc is not None and hasattr(svc, "add_listener"):
                svc.add_listener(self._on_service_event)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.events.attach(self.out_dir, append=self.resume_from is not None and self.out_dir.resolve() in self.resume_from.resolve().parents)
        self.tracker = Tracker(self.out_dir, use_wandb=cfg.tracking.wandb, run_name=cfg.name, config=cfg.to_dict())
        self._event("spawned", seconds=round(parts.seconds, 1))
        if self.resume_from is not None:
            await self._restore(self.resume_from)

    async def _on_generator_respawn(self, handle) -> None:
        # A fresh replica starts from the checkpoint on disk: give it the current weights before it serves.
        # A step may land while we push (it pushes only to healthy replicas): push again until caught up.
        pushed = 0
        while self.trainer is not None and self.version > pushed:
            version = self.version
            timing = (await self.trainer.call("push_weights", version, [handle.actor]))[0] or {}
            if timing.get("failed"):
                # raising fails this respawn attempt: the service tears the replica down and tries again
                raise RuntimeError(f"weights v{version} could not be pushed to the respawned generator: {timing['failed']}")
            pushed = version
        index = getattr(handle, "replica_index", None)
        if index is not None and self.generators is not None:
            self.generators.set_replica_info(index, version=pushed)

    def _on_service_event(self, event: Any) -> None:
        # ServiceEvent(kind="replica_failed"|"replica_restarted", replica, time, detail)
        self._event(str(getattr(event, "kind", "service")), replica=getattr(event, "replica", None),
                    detail=str(getattr(event, "detail", event)))

    # ------------------------------------------------------------------ main loop
    async def _run_main(self) -> None:
        cfg = self.config
        try:
            if self.step == 0 and not self.accuracy_history:
                acc = await self.evaluate()
                self._event("eval", accuracy=acc)
            self._tasks = [asyncio.ensure_future(self._rollout_worker(i)) for i in range(cfg.rollout.concurrency)]
            await self._train_loop()
            if self.state != "failed":
                if not self.accuracy_history or self.accuracy_history[-1][0] != self.step:
                    acc = await self.evaluate()
                    if self.tracker and self.tracker.rows:
                        self.tracker.rows[-1]["heldout_accuracy"] = acc
                self.state = "stopped" if self._stopping else "finished"
                self._event(self.state, message=self.message)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except Exception as e:
            self.state = "failed"
            self.message = f"{type(e).__name__}: {e}"
            self._event("failed", message=self.message)
            log.exception("forgelab: run failed")
            raise
        finally:
            self._stopping = True
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks = []
            # in-flight rollout groups that never reached the buffer are counted as dropped
            self._finish_tracking()

    def _finish_tracking(self) -> None:
        if self.tracker is None or not self.tracker.rows:
            return
        try:
            plot_learning_curve(self.tracker.dataframe(), self.out_dir / "learning_curve.png", self.events,
                                accuracy=self.accuracy_history)
        except Exception as e:
            log.warning("forgelab: plot failed (%s)", e)

    async def _wait_unpaused(self) -> bool:
        await self._unpaused.wait()
        return not self._stopping

    def _may_admit(self, n: int) -> bool:
        """Staleness control at the source: admit n more episodes only if they can be trained in time.

        Episodes started while the generators serve version v can be used up to
        step v + max_policy_age, so at most (v + max_policy_age + 1) * batch_size
        episodes may ever have been started (minus those that left without being
        trained: evicted or dropped, whose slots are given back). With
        max_policy_age = 0 this is synchronous on-policy RL.
        """
        t = self.config.train
        c = self.buffer.counts()
        live = self._admitted - c["evicted"] - c["dropped"]
        return live + n <= (self._pushed_version + t.max_policy_age + 1) * t.batch_size

    async def _rollout_worker(self, wid: int) -> None:
        r = self.config.rollout
        per_call = r.prompts_per_rollout * r.group_size
        while not self._stopping:
            if not await self._wait_unpaused():
                return
            async with self._buffer_changed:
                # Back-pressure: generate no more than the trainer can use before the episodes go stale.
                await self._buffer_changed.wait_for(lambda: self._stopping or self._may_admit(per_call))
                if self._stopping:
                    return
                self._inflight_rollout += per_call
                self._admitted += per_call
            created: list[Episode] = []
            try:
                await self._one_rollout(created)
            except asyncio.CancelledError:
                self._drop_unaccounted(created, "rollout_cancelled")
                raise
            except Exception as e:
                # episodes it generated are dropped (and their slots freed by that); the rest are given back
                lost = self._drop_unaccounted(created, f"rollout_error:{type(e).__name__}")
                self._admitted -= per_call - len(created)
                self._event("rollout_error", message=f"{type(e).__name__}: {e}", episodes_dropped=lost)
                log.warning("forgelab: rollout failed: %s", e)
                await asyncio.sleep(0.5)
            finally:
                async with self._buffer_changed:
                    self._inflight_rollout -= per_call
                    self._buffer_changed.notify_all()

    def _drop_unaccounted(self, created: list[Episode], reason: str) -> int:
        """Drop the episodes of a failed rollout that the buffer has not seen yet; returns how many."""
        lost = [ep for ep in created if self.buffer.status(ep.id) is None]
        if lost:
            self.buffer.drop(lost, reason)
            for ep in lost:
                self._note(ep, "dropped:" + reason)
        return len(lost)

    def _prompt_ids(self, prompt: str) -> list[int]:
        from forgelab.evaluate import format_prompt

        return self.tokenizer.encode(format_prompt(self.tokenizer, prompt), add_special_tokens=False)

    async def _one_rollout(self, created: list[Episode] | None = None) -> None:
        """One rollout call; every Episode made is appended to `created` (so a failure can account for it)."""
        r = self.config.rollout
        problems = self.stream.next(r.prompts_per_rollout)
        if r.env is not None:
            episodes_by_group, failed = await self._env_groups(problems, created)
            await self._advantages_and_buffer(episodes_by_group, failed)
            return
        prompt_ids = [self._prompt_ids(p.prompt) for p in problems]
        groups = await self.generators.route("generate", prompt_ids, n=r.group_size)
        episodes_by_group: list[list[Episode]] = []
        for prob, comps in zip(problems, groups):
            gid = self._next_group_id
            self._next_group_id += 1
            eps = []
            for c in comps:
                ep = Episode(
                    id=self._next_episode_id, group_id=gid, prompt_ids=list(c.prompt_ids),
                    completion_ids=list(c.completion_ids), generator_logprobs=list(c.logprobs),
                    policy_version=c.policy_version, prompt=prob.prompt, completion=c.text,
                    target=prob.target, task=prob.task, info=dict(prob.info), finish_reason=c.finish_reason,
                )
                self._next_episode_id += 1
                self._tokens_since += len(c.completion_ids)
                eps.append(ep)
                if created is not None:
                    created.append(ep)
            episodes_by_group.append(eps)

        # rewards, each call in its own thread with a timeout (a reward is user code: it may hang)
        flat = [ep for g in episodes_by_group for ep in g]
        results = await asyncio.gather(*(self._score(ep, r.reward_timeout_s) for ep in flat), return_exceptions=True)
        self._check_hung_rewards()
        failed: dict[int, str] = {}
        for ep, res in zip(flat, results):
            if isinstance(res, asyncio.TimeoutError):
                fail = RewardFailure("timeout", ep.prompt, ep.completion, ep.target, f"reward took longer than rollout.reward_timeout_s={r.reward_timeout_s}s")
                self._reward_failed(ep, fail, "reward_timeout")
                failed[ep.id] = "reward_timeout"
            elif isinstance(res, BaseException):
                fail = RewardFailure("composer", ep.prompt, ep.completion, ep.target, f"{type(res).__name__}: {res}")
                self._reward_failed(ep, fail, fail.drop_reason)
                failed[ep.id] = fail.drop_reason
            elif res.failed:
                for f in res.errors:
                    self.reward_failures.append(f)
                self._reward_failed(ep, res.errors[0], res.drop_reason)
                failed[ep.id] = res.drop_reason
            else:
                ep.reward = res.total
                ep.reward_parts = dict(res.parts)
        await self._advantages_and_buffer(episodes_by_group, failed)

    async def _env_groups(self, problems: list, created: list[Episode] | None) -> tuple[list[list[Episode]], dict[int, str]]:
        """G multi-turn episodes per problem, played by the EnvActor service against the generators.

        The env actors call the generator replicas directly (they get the healthy replicas' actor meshes),
        so no turn passes through this process. Episodes whose outcome is in DROP_OUTCOMES (env_timeout,
        env_error, generator_error) are returned in `failed` with the outcome as drop reason.
        """
        from forgelab.envs import DROP_OUTCOMES
        from forgelab.generator import SamplingConfig

        r = self.config.rollout
        gens = [h.actor for h in self.generators.handles() if h is not None]
        sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
        groups = await self.envs.route(
            "run_groups", r.env, problems, r.group_size, gens, sampling, env_kwargs=dict(r.env_kwargs),
            max_turns=r.max_turns, max_total_tokens=self.config.model.max_model_len, step_timeout_s=r.env_step_timeout_s,
        )
        episodes_by_group: list[list[Episode]] = []
        failed: dict[int, str] = {}
        for prob, eps in zip(problems, groups):
            gid = self._next_group_id
            self._next_group_id += 1
            for ep in eps:
                ep.id, ep.group_id = self._next_episode_id, gid
                self._next_episode_id += 1
                ep.target, ep.task, ep.info = prob.target, prob.task, {**dict(prob.info), **ep.info}
                self._tokens_since += sum(ep.loss_mask or ())
                if ep.info.get("outcome") in DROP_OUTCOMES:
                    failed[ep.id] = ep.info["outcome"]
                if created is not None:
                    created.append(ep)
            episodes_by_group.append(eps)
        if failed:
            reasons: dict[str, int] = {}
            for v in failed.values():
                reasons[v] = reasons.get(v, 0) + 1
            first = next(ep for g in episodes_by_group for ep in g if ep.id in failed)
            self._event("env_dropped", reasons=reasons, error=str(first.info.get("error", ""))[:300])
        return episodes_by_group, failed

    async def _advantages_and_buffer(self, episodes_by_group: list[list[Episode]], failed: dict[int, str]) -> None:
        """Drop failed episodes, compute group advantages, add reference logprobs, buffer the rest."""
        r = self.config.rollout
        keep: list[list[Episode]] = []
        for g in episodes_by_group:
            ok = [ep for ep in g if ep.id not in failed]
            bad = [ep for ep in g if ep.id in failed]
            for ep in bad:
                self.buffer.drop([ep], failed[ep.id])
                self._note(ep, "dropped:" + failed[ep.id])
            if len(ok) < 2:
                if ok:
                    self.buffer.drop(ok, "group_too_small")
                    for ep in ok:
                        self._note(ep, "dropped:group_too_small")
                continue
            rewards = torch.tensor([[ep.reward for ep in ok]], dtype=torch.float64)
            if r.drop_zero_variance_groups and float(rewards.std()) == 0.0:
                self.buffer.drop(ok, "zero_variance_group")
                for ep in ok:
                    self._note(ep, "dropped:zero_variance_group")
                continue
            adv = ADVANTAGES[r.advantage](rewards)[0].tolist()
            for ep, a in zip(ok, adv):
                ep.advantage = float(a)
            keep.append(ok)

        kept = [ep for g in keep for ep in g]
        if kept and self.reference is not None:
            await self._add_ref_logprobs(kept)
        if kept:
            async with self._buffer_changed:
                overflow = self.buffer.add(kept)
                for ep in kept:
                    self._note(ep, "buffered")
                for ep in overflow:
                    self._note(ep, "dropped:buffer_full")
                self._buffer_changed.notify_all()

    async def _score(self, ep: Episode, timeout: float):
        """`rewards.score` for one episode in a fresh daemon thread; abandoned (not awaited) after `timeout` s.

        A thread per call, not a pool: a hung call then holds only its own
        thread, never a worker that other episodes queue behind (which would
        also make their timeouts count queueing time).
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(value, error) -> None:
            if not fut.done():  # already cancelled by the timeout
                fut.set_exception(error) if error is not None else fut.set_result(value)

        def work() -> None:
            try:
                value, error = self.rewards.score(ep.prompt, ep.completion, ep.target, **ep.info), None
            except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine
                value, error = None, e
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop closed while this call hung
                pass

        thread = threading.Thread(target=work, name=f"forgelab-reward-{ep.id}", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._hung_rewards.append(thread)
            raise

    def _check_hung_rewards(self) -> None:
        self._hung_rewards = [t for t in self._hung_rewards if t.is_alive()]
        if len(self._hung_rewards) >= MAX_HUNG_REWARD_CALLS and self.state == "running":
            last = self.reward_failures[-1] if self.reward_failures else None
            self.message = (
                f"paused: {len(self._hung_rewards)} reward calls exceeded rollout.reward_timeout_s="
                f"{self.config.rollout.reward_timeout_s}s and are still running (each holds a thread); "
                f"rewards: {self.rewards.names}; last input: {getattr(last, 'completion', '')[:80]!r}. "
                "Fix or remove the hanging reward (run.rewards.remove / run.add_reward(..., replace=True)), then run.resume()"
            )
            log.warning("forgelab: %s", self.message)
            self.pause()

    async def _add_ref_logprobs(self, eps: list[Episode]) -> None:
        rows = [ep.prompt_ids + ep.completion_ids for ep in eps]
        L = max(len(x) for x in rows)
        tokens = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        for i, x in enumerate(rows):
            tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        from forgelab.runtime.service import NoHealthyReplicaError, ReplicaFailedError

        try:
            lp = await self.reference.route("logprobs", tokens)
        except (NoHealthyReplicaError, ReplicaFailedError) as e:
            # the reference died and is being respawned: wait for it rather than lose these episodes
            self._event("reference_wait", message=f"{type(e).__name__}: {str(e)[:300]}")
            await self.reference.wait_healthy(count=1, timeout=600)
            lp = await self.reference.route("logprobs", tokens)
        lp = torch.as_tensor(lp)
        for i, ep in enumerate(eps):
            p, c = len(ep.prompt_ids), len(ep.completion_ids)
            ep.ref_logprobs = lp[i, p - 1 : p - 1 + c].tolist()

    def _reward_failed(self, ep: Episode, failure: RewardFailure, reason: str) -> None:
        self.reward_failures.append(failure)
        self._event("reward_error", reason=reason, prompt=ep.prompt, completion=ep.completion, target=ep.target,
                    error=failure.error_text[-500:])

    def _note(self, ep: Episode, status: str) -> None:
        self._episode_status[ep.id] = status
        if status in ("buffered",) or status.startswith("dropped"):
            if status == "buffered" or ep not in self._recent:
                self._recent.append(ep)

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> None:
        cfg = self.config
        while self.step < cfg.train.steps and not self._stopping:
            if not await self._wait_unpaused():
                break
            async with self._buffer_changed:
                await self._buffer_changed.wait_for(
                    lambda: self._stopping or not self._unpaused.is_set() or self._sample_ready()
                )
                if self._stopping:
                    break
                if not self._unpaused.is_set():
                    continue
                batch_eps = self.buffer.sample(self.version)
                self._buffer_changed.notify_all()
            if batch_eps is None:
                continue
            await self._train_on(batch_eps)
        async with self._buffer_changed:
            self._buffer_changed.notify_all()

    def _sample_ready(self) -> bool:
        self.buffer.evict_stale(self.version)
        return len(self.buffer) >= self.config.train.batch_size

    async def _train_on(self, batch_eps: list[Episode]) -> None:
        cfg = self.config
        t0 = time.time()
        batch = collate(batch_eps, self.pad_id)
        self._last_batch = batch
        self._training_in_flight = True
        try:
            results = await self.trainer.call("train_step", batch)
        finally:
            self._training_in_flight = False
        m = dict(results[0])
        if m.get("skipped"):
            reason = str(m.get("skip_reason", "skipped"))
            async with self._buffer_changed:  # frees admission slots: wake the rollout workers
                self.buffer.mark_dropped(batch_eps, "step_skipped")
                self._buffer_changed.notify_all()
            for ep in batch_eps:
                self._note(ep, "dropped:step_skipped")
            self._consecutive_failures += 1
            self._event("step_skipped", reason=reason)
            if self._consecutive_failures >= cfg.train.max_consecutive_failures:
                self.message = (
                    f"paused after {self._consecutive_failures} skipped steps in a row; last reason: {reason}. "
                    "Fix the loss (run.set_loss(...)) or the data, then run.resume()"
                )
                log.warning("forgelab: %s", self.message)
                self.pause()
            return
        self._consecutive_failures = 0
        self.buffer.mark_trained(batch_eps)
        for ep in batch_eps:
            self._episode_status[ep.id] = "trained"
        self.step += 1
        self.version += 1
        t_train = time.time() - t0
        sync = await self.push_weights()
        row = self._metrics_row(batch_eps, m, t_train, sync, time.time() - t0)
        if cfg.eval.every and self.step % cfg.eval.every == 0:
            row["heldout_accuracy"] = await self.evaluate()
        if cfg.tracking.checkpoint_every and self.step % cfg.tracking.checkpoint_every == 0:
            await self.save_checkpoint()
        self.tracker.log(row)
        for fn in list(self._listeners):
            try:
                fn(row)
            except Exception:
                log.exception("forgelab: metrics listener failed")

    async def push_weights(self) -> dict:
        """Trainer -> every healthy generator replica, as version `self.version`."""
        live = [(i, h) for i, h in enumerate(self.generators.handles()) if h is not None]
        timing = (await self.trainer.call("push_weights", self.version, [h.actor for _, h in live]))[0]
        failed = (timing or {}).get("failed") or {}
        for k, (i, _) in enumerate(live):
            if k in failed or str(k) in failed:
                # a replica that died meanwhile is respawned and caught up by on_respawn
                self._event("weight_push_failed", replica=i, version=self.version, error=str(failed.get(k, failed.get(str(k))))[:300])
            else:
                self.generators.set_replica_info(i, version=self.version)
        async with self._buffer_changed:
            self._pushed_version = self.version
            self._buffer_changed.notify_all()
        return timing or {}

    def _metrics_row(self, eps: list[Episode], m: dict, t_train: float, sync: dict, t_step: float) -> dict:
        now = time.time()
        # generated tokens/s over a window of recent steps (a single step may see no rollout finish)
        self._tok_window.append((now, self._tokens_since))
        self._tokens_since = 0
        dt = now - (self._tok_window[0][0] if len(self._tok_window) > 1 else self._t_last)
        tokens = sum(n for _, n in list(self._tok_window)[1:]) if len(self._tok_window) > 1 else self._tok_window[-1][1]
        self._t_last = now
        counts = self.buffer.counts()
        row: dict[str, Any] = {
            "step": self.step, "time": now, "version": self.version,
            "reward_mean": sum(ep.reward for ep in eps) / len(eps),
        }
        env_parts = sorted({k for ep in eps for k in ep.reward_parts} - set(self.rewards.names))
        for name in [*self.rewards.names, *env_parts]:
            vals = [ep.reward_parts[name] for ep in eps if name in ep.reward_parts]
            if vals:
                row[f"reward/{name}"] = sum(vals) / len(vals)
        if self.config.rollout.env is not None:  # environment counters (e.g. tool calls) per episode
            from forgelab.envs.episode import env_metric_means

            row.update({f"env/{k}": v for k, v in env_metric_means(eps).items()})
        ages = [self.version - 1 - ep.policy_version for ep in eps]
        row["policy_age_mean"] = sum(ages) / len(ages)
        row["policy_age_max"] = max(ages)
        row["completion_len"] = sum(len(ep.completion_ids) for ep in eps) / len(eps)
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k if k not in row else f"train/{k}"] = float(v)
        # the loss the trainer actually used for this step (a swap applies at a step boundary)
        row["loss_name"] = str(m.get("loss_name") or self.loss_name)
        row["tokens_per_s"] = tokens / dt if dt > 0 else float("nan")
        row["step_time_s"] = t_step
        row["train_time_s"] = t_train
        row["weight_sync_ms"] = sum(float(sync.get(k, 0.0)) for k in ("gather_ms", "write_ms", "send_ms"))
        for k in ("generated", "trained", "evicted", "dropped", "buffered"):
            row[f"episodes_{k}"] = counts[k]
        return row

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, n: int | None = None) -> float:
        """Held-out greedy accuracy (the task's exact-answer reward) with the generator's current weights.

        With `rollout.env` set, each problem is played as a greedy episode in that
        environment (tool calls, hints) and the answer scored is the last assistant
        turn's text; otherwise it is the single completion's text.
        """
        probs = self.heldout[: n or len(self.heldout)]
        from forgelab.generator import SamplingConfig

        greedy = SamplingConfig(temperature=0.0, max_tokens=self.config.rollout.max_tokens)
        if self.envs is not None:
            answers = await self._env_final_answers(probs, greedy)
        else:
            ids = [self._prompt_ids(p.prompt) for p in probs]
            groups = await self.generators.route("generate", ids, n=1, sampling=greedy)
            answers = [g[0].text for g in groups]
        correct = 0
        for p, text in zip(probs, answers):
            try:
                correct += float(self._task_reward(p.prompt, text, p.target, **p.info)) > 0.5
            except Exception:
                pass
        acc = correct / max(1, len(probs))
        self.accuracy_history.append((self.step, acc))
        return acc

    async def _env_final_answers(self, probs: list, sampling: Any) -> list[str]:
        """One episode per problem in `rollout.env`; the text of each episode's last assistant turn
        ("" for an episode that failed: it counts as wrong)."""
        from forgelab.envs import DROP_OUTCOMES

        r = self.config.rollout
        gens = [h.actor for h in self.generators.handles() if h is not None]
        groups = await self.envs.route(
            "run_groups", r.env, probs, 1, gens, sampling, env_kwargs=dict(r.env_kwargs), max_turns=r.max_turns,
            max_total_tokens=self.config.model.max_model_len, step_timeout_s=r.env_step_timeout_s,
        )
        answers = []
        for (ep,) in groups:
            turns = [t for t in ep.info.get("turns", []) if t[2] == "assistant"]
            if not turns or ep.info.get("outcome") in DROP_OUTCOMES:
                answers.append("")
                continue
            start, end, _ = turns[-1]
            answers.append(self.tokenizer.decode(ep.completion_ids[start:end], skip_special_tokens=True))
        return answers

    # ------------------------------------------------------------------ live controls
    def set_reward_weights(self, weights: dict[str, float]) -> None:
        """Change reward weights; applies from the next scored rollout. Unknown names raise KeyError."""
        old = self.rewards.weights
        self.rewards.set_weights(weights)
        self._event("reward_weights", old=old, new=self.rewards.weights)

    def add_reward(self, name: str, fn: Callable[..., float], weight: float = 1.0, *, replace: bool = False) -> None:
        """Register a reward function from a cell; validated on recent rollouts first."""
        samples = [(ep.prompt, ep.completion, ep.target, ep.info) for ep in list(self._recent)[-64:]]
        if samples:
            report = validate(fn, samples, name=name)
            if not report.ok:
                raise RewardChangeRefused(f"reward {name!r} refused, the old rewards stay:\n{report}")
        self.rewards.add(name, fn, weight, replace=replace)
        self._event("reward_added", name=name, weight=weight)

    async def set_loss(self, loss: str | Callable, **loss_kwargs: Any) -> dict:
        """Hot-swap the loss: dry-run it on the last batch, then apply at the next step boundary."""
        if isinstance(loss, str) and loss not in LOSSES:
            raise LossSwapRefused(f"unknown loss {loss!r}; known: {', '.join(sorted(LOSSES))}; or pass your own function")
        if not isinstance(loss, str) and not callable(loss):
            raise LossSwapRefused(f"set_loss expects a loss name or a function, got {loss!r}")
        from forgelab.trainer import pack_loss

        packed = loss if isinstance(loss, str) else pack_loss(loss)
        if self._last_batch is not None:
            report = (await self.trainer.call("dry_run_loss", packed, self._last_batch, loss_kwargs))[0]
            if not report.get("ok"):
                name = loss if isinstance(loss, str) else getattr(loss, "__name__", "loss")
                self._event("loss_refused", loss=name, reason=report.get("reason"))
                raise LossSwapRefused(f"loss {name!r} refused on the last batch: {report.get('reason')}; the old loss keeps training")
        # A train_step already running finishes with the old loss (the trainer swaps between steps).
        applies_at = self.step + (2 if self._training_in_flight else 1)
        await self.trainer.call("set_loss", packed, loss_kwargs)
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
        self.loss_name = name
        self._event("loss_swapped", loss=name, kwargs=loss_kwargs, applies_at_step=applies_at)
        return {"loss": name, "applies_at_step": applies_at}

    async def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Trainer state (DCP) + controller state (step, version, data position, counters, rewards)."""
        path = Path(path) if path else self.out_dir / "checkpoints" / f"step_{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        await self.trainer.call("save", str(path / "trainer"))
        state = {
            "step": self.step, "version": self.version, "stream": self.stream.state_dict(),
            "buffer": self.buffer.state_dict(), "reward_weights": self.rewards.weights,
            "loss": self.loss_name if isinstance(self.loss_name, str) else None,
            "next_episode_id": self._next_episode_id, "next_group_id": self._next_group_id,
            "accuracy_history": self.accuracy_history,
            # per-rank SHA-256 of parameters and optimizer state: a restore is checked against it
            "trainer_fingerprint": await self.trainer.call("fingerprint"),
        }
        (path / "controller.json").write_text(json.dumps(state))
        (path.parent / "LATEST").write_text(path.name)
        self._event("checkpoint", path=str(path))
        return path

    async def _restore(self, path: Path) -> None:
        if (path / "LATEST").is_file():
            path = path / (path / "LATEST").read_text().strip()
        state = json.loads((path / "controller.json").read_text())
        await self.trainer.call("load", str(path / "trainer"))
        self.step, self.version = state["step"], state["version"]
        self.stream.load_state_dict(state["stream"])
        self.buffer.load_state_dict(state["buffer"])
        self.rewards.set_weights({k: v for k, v in state["reward_weights"].items() if k in self.rewards.weights})
        self._next_episode_id, self._next_group_id = state["next_episode_id"], state["next_group_id"]
        self.accuracy_history = [tuple(x) for x in state.get("accuracy_history", [])]
        if state.get("loss") and state["loss"] != self.loss_name:
            await self.trainer.call("set_loss", state["loss"], {})
            self.loss_name = state["loss"]
        if self.version > 0:
            await self.push_weights()
        saved_fp, fp = state.get("trainer_fingerprint"), await self.trainer.call("fingerprint")
        # world size may differ on resume (shards differ then): compare only like with like
        match = fp == saved_fp if saved_fp is not None and len(saved_fp) == len(fp) else None
        if match is False:
            log.warning("forgelab: trainer state after restore differs from the one saved in %s", path)
        self._restore_metrics(path.parent.parent / "metrics.csv")
        self._event("resumed_from_checkpoint", path=str(path), step=self.step, fingerprint_match=match,
                    trainer_fingerprint=fp, stream=self.stream.state_dict())

    def _restore_metrics(self, csv_path: Path) -> None:
        """Put the rows up to the restored step back in the tracker, so the learning curve continues."""
        import csv

        if self.tracker is None or self.tracker.rows or not csv_path.is_file():
            return
        with csv_path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for raw in rows:
            row: dict[str, Any] = {}
            for k, v in raw.items():
                if v in ("", None):
                    continue
                try:
                    row[k] = float(v)
                except ValueError:
                    row[k] = v
            for k in ("step", "version"):
                if k in row:
                    row[k] = int(row[k])
            if 0 < row.get("step", 0) <= self.step:
                self.tracker.log(row)

    # ------------------------------------------------------------------ views
    def _event(self, kind: str, **fields: Any) -> None:
        ev = self.events.emit(kind, step=self.step, **fields)
        for fn in list(self._listeners):
            try:
                fn({"event": ev})
            except Exception:
                pass

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
        """Recent episodes (newest last) with token ids, logprobs, rewards, advantages and status."""
        import pandas as pd

        rows = []
        for ep in list(self._recent):
            row = {
                "id": ep.id, "group_id": ep.group_id, "task": ep.task, "prompt": ep.prompt,
                "completion": ep.completion, "target": ep.target, "reward": ep.reward, "advantage": ep.advantage,
                "policy_version": ep.policy_version, "finish_reason": ep.finish_reason,
                "status": self._episode_status.get(ep.id, ""), "prompt_ids": ep.prompt_ids,
                "completion_ids": ep.completion_ids, "generator_logprobs": ep.generator_logprobs,
                "ref_logprobs": ep.ref_logprobs, "loss_mask": ep.loss_mask, "turns": ep.info.get("turns"),
            }
            for k, v in ep.reward_parts.items():
                row[f"reward/{k}"] = v
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def episodes(self) -> dict:
        """Episode accounting: generated = trained + evicted + dropped + buffered + in_flight."""
        return self.buffer.counts()

    def status(self) -> dict:
        return {
            "state": self.state, "step": self.step, "steps": self.config.train.steps, "version": self.version,
            "loss": self.loss_name, "reward_weights": self.rewards.weights, "message": self.message,
            "episodes": self.episodes,
            "services": {
                "generator": self.generators.status() if self.generators else [],
                "reference": self.reference.status() if self.reference else [],
                **({"env": self.envs.status()} if self.envs else {}),
            },
        }

    def dashboard(self):
        """The live lab: metrics, rollout inspector, reward and loss panels, controls."""
        from forgelab.lab import dashboard

        return dashboard(self)

    def __repr__(self) -> str:
        return f"<Run {self.config.name} {self.state} step {self.step}/{self.config.train.steps} version {self.version}>"
