"""The rollout path: problems -> episodes -> rewards -> advantages -> reference logprobs -> replay buffer.

Every rollout is an environment episode. A single-turn task is a one-step
environment played here, in the controller (`SingleTurn`: no extra process;
each prompt is rendered once and its G samples share it, one generator call per
rollout); a multi-turn `rollout.env` is played by the EnvActor service
(`EnvEpisodes`). Both give `list[list[Episode]]` (groups in problem order), and
from there one path scores, normalises and buffers them:

    Rollouts.worker:  buffer.admit(P*G)  (the staleness bound at the source, forgelab.controller.buffer)
                      -> take P problems, number their groups and episodes (at admission: deterministic ids)
                      -> source.play(problems, G)            (forgelab.controller.rollout / forgelab.envs)
                      -> RewardRunner.score                  (forgelab.controller.reward_runner: rollout.rewards, added to
                                                              the environment's own reward)
                      -> drop failed, ADVANTAGES per group    (forgelab.algos.advantages)
                      -> reference logprobs                   (the reference service, if any)
                      -> teacher logprobs, per-token advantages (a `teacher`: on-policy distillation,
                                                              forgelab.algos.advantages.distill_advantages)
                      -> buffer.add                           (forgelab.controller.buffer)

Accounting: an episode is *generated* once it reached the controller (an
`Episode` exists). A rollout that fails or is cancelled after that drops its
not-yet-buffered episodes (``rollout_error:<Type>`` / ``rollout_cancelled``);
episodes lost inside a dead generator or environment replica never existed here, and their admission
slots are given back (their ids stay unused: `Rollouts.ids_unused`; the ``rollout_error`` event says how
many: ``episodes_never_generated``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Callable, Protocol, cast

import torch

from forgelab.algos import ADVANTAGES
from forgelab.controller.buffer import ReplayBuffer
from forgelab.quiet import RepeatLimiter
from forgelab.controller.reward_runner import RewardRunner
from forgelab.controller.events import EventBus
from forgelab.data.tasks import Problem
from forgelab.engines.trainer_client import RoutedService
from forgelab.generation import Envs, GeneratorMesh, Generators, SamplingSettings
from forgelab.rewards.library import RewardComposer
from forgelab.types import Episode

if TYPE_CHECKING:
    import pandas as pd

    from forgelab.config.run_config import RunConfig

log = logging.getLogger("forgelab.controller.rollout")

RECENT = 2000
"""Episodes kept in memory for views (`Rollouts.dataframe`, `run.rollouts`); every closed one is in the rollout log."""

__all__ = ["Gate", "SingleTurn", "EnvEpisodes", "Rollouts", "Admitted", "episode_seed", "determinism"]


async def _wake(gate: "Gate") -> None:
    """Wake whoever waits on a replaced gate; one bound to another (earlier) event loop has nobody waiting here."""
    try:
        await gate.notify()
    except RuntimeError:
        pass


class Gate:
    """What the controller's loops wait on: pause, stop, and "the buffer or the served version changed"."""

    def __init__(self) -> None:
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.changed = asyncio.Condition()
        self.stopping = False
        self.holds = 0
        """Evaluations running now (`hold`): while any runs, rollout workers admit nothing new."""

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Admit no new rollouts while the body runs (an evaluation): its requests then have the generator to
        themselves, beside the rollouts already in flight, instead of queueing behind new ones. Rollouts
        resume when the last hold ends; nothing is dropped."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1
            await self.notify()

    def may_admit(self) -> bool:
        return self.holds == 0

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def running(self) -> bool:
        """Wait while paused; False once stopping."""
        await self.unpaused.wait()
        return not self.stopping


@dataclass
class Admitted:
    """Problems taken from the stream with their group ids and first episode id (assigned at admission)."""

    problems: list[Problem]
    first_group: int
    first_episode: int
    group_size: int
    seeds: list[list[int]] | None = None
    """seeds_P_G: one sampling seed per episode (deterministic runs), else None."""
    created: list[Episode] = field(default_factory=list)

    def number(self, groups: list[list[Episode]]) -> None:
        for g, (prob, eps) in enumerate(zip(self.problems, groups)):
            for k, ep in enumerate(eps):
                ep.id, ep.group_id = self.first_episode + g * self.group_size + k, self.first_group + g
                ep.target, ep.task, ep.info = prob.target, prob.task, {**dict(prob.info), **ep.info}
                self.created.append(ep)


def _takes_seeds(fn: object) -> bool:
    if not callable(fn):  # what inspect.signature refuses with TypeError
        return False
    try:
        return "seeds" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def determinism(config: RunConfig) -> tuple[bool, str | None]:
    """``(True, None)`` when a run with `config` seeds every sample for an exact replay, else ``(False, why)``.

    Deterministic mode is the synchronous one (`train.max_policy_age` 0) on single-turn tasks: each rollout is
    one generate call whose samples are seeded by `episode_seed`. Multi-turn environment episodes are not
    covered: their turns reach the generator batched by arrival time (float results vary with the batch) and
    an environment may draw its own randomness, so the manifest says so instead of promising an exact replay.
    """
    if config.train.max_policy_age != 0:
        return False, (f"train.max_policy_age is {config.train.max_policy_age} (> 0): rollouts race the trainer "
                       "and samples are not seeded")
    if config.door.enabled:
        return False, ("door.enabled: agent sessions take episode ids (and so the native episodes' seeds) in the "
                       "order their calls arrive, and their turns reach the generator batched by arrival time")
    if config.rollout.env is not None:
        return False, (f"rollout.env {config.rollout.env!r}: environment episodes are not seeded (their turns "
                       "reach the generator batched by arrival time, and an environment may draw its own "
                       "randomness); a replay re-applies the changes but its metrics may differ")
    return True, None


def check_seeded_generate() -> None:
    """Raise unless the generator's `generate` takes per-sample ``seeds`` (deterministic mode depends on it)."""
    try:
        from forgelab.engines.generator import VLLMEngine
    except Exception as e:  # noqa: BLE001 -- any import failure: the seeds cannot be checked
        raise RuntimeError(
            "deterministic mode (train.max_policy_age 0) seeds every sample, but the generator's seeded generate "
            f"cannot be checked: importing forgelab.engines.generator failed ({type(e).__name__}: {e}). Fix the "
            "installation (`forgelab check`), or set train.max_policy_age > 0 to train unseeded") from e
    if not _takes_seeds(VLLMEngine.generate):
        raise RuntimeError("deterministic mode (train.max_policy_age 0) seeds every sample, but "
                           "forgelab.engines.generator.VLLMEngine.generate takes no `seeds`: this forgelab is "
                           "inconsistent; reinstall it, or set train.max_policy_age > 0 to train unseeded")


class TextTokenizer(Protocol):
    """What the controller calls on the model's tokenizer (a ``transformers`` tokenizer; `format_prompt` and
    `forgelab.envs.episode.final_answer` also use its chat template and ``decode``)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class EpisodeSource(Protocol):
    """Plays problems as episodes: `SingleTurn` or `EnvEpisodes` (the rollouts and the evaluator use it)."""

    async def play(self, problems: list[Problem], n: int, sampling: SamplingSettings | None = None,
                   seeds: list[list[int]] | None = None) -> list[list[Episode]]: ...


class LogprobService(RoutedService, Protocol):
    """The reference or teacher service: ``route("logprobs", ...)`` and, after a replica died, ``wait_healthy``."""

    async def wait_healthy(self, count: int | None = None, timeout: float | None = None) -> None: ...


class Pausable(Protocol):
    """The run's lifecycle as the rollouts use it (`forgelab.controller.lifecycle.Lifecycle`): its gate and
    ``pause(message)``."""

    @property
    def gate(self) -> Gate: ...
    def pause(self, message: str | None = None) -> None: ...


class Problems(Protocol):
    """Where rollouts take their problems (`forgelab.data.datasets.ProblemStream`)."""

    def next(self, k: int) -> list[Problem]: ...


class ScoringControls(Protocol):
    """The live reward set a rollout is scored with and the distillation coefficient now (`RewardControls`)."""

    @property
    def distill_coef(self) -> float: ...
    def rewards_for(self, flat: list[Episode]) -> RewardComposer: ...


class SingleTurn:
    """A single-turn task as a one-step environment played in the controller: one generate call per rollout,
    the prompt rendered once for its G samples; the episode's reward comes from `rollout.rewards` alone."""

    #: Rendered prompts kept (`prompt_ids`); past this the oldest are forgotten (re-rendered if met again).
    PROMPT_CACHE = 65536

    def __init__(self, generators: Generators, tokenizer: TextTokenizer, sampling: SamplingSettings | None = None):
        self.generators, self.tokenizer, self.sampling = generators, tokenizer, sampling
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt (text, or a chat-format problem's messages) rendered by the chat template.

        Cached by the prompt's content: the held-out set is rendered once, not at every evaluation."""
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=repr)
        ids = self._prompt_cache.get(key)
        if ids is None:
            from forgelab.data.prompts import format_prompt

            ids = self.tokenizer.encode(format_prompt(self.tokenizer, prompt), add_special_tokens=False)
            if len(self._prompt_cache) >= self.PROMPT_CACHE:
                del self._prompt_cache[next(iter(self._prompt_cache))]
            self._prompt_cache[key] = ids
        return list(ids)

    async def play(self, problems: list[Problem], n: int, sampling: SamplingSettings | None = None,
                   seeds: list[list[int]] | None = None) -> list[list[Episode]]:
        from forgelab.data.prompts import problem_chat
        from forgelab.generation import GenerateRequest

        groups = await self.generators.generate(GenerateRequest(
            prompts_P=[self.prompt_ids(problem_chat(p)) for p in problems], n=n, sampling=sampling, seeds_P_G=seeds))
        return [[Episode(id=0, group_id=0, prompt_ids=list(c.prompt_ids), completion_ids=list(c.completion_ids),
                         generator_logprobs=list(c.logprobs), policy_version=c.policy_version, prompt=p.prompt,
                         completion=c.text, finish_reason=c.finish_reason,
                         # tokens of several versions (generator.update_mode inflight): where each took over
                         info={"token_versions": [list(r) for r in c.token_versions]} if len(c.token_versions) > 1
                         else {}) for c in comps]
                for p, comps in zip(problems, groups)]


class EnvEpisodes:
    """Multi-turn episodes of `rollout.env`, played by the EnvActor service against the healthy generator replicas
    (the env actors call them directly: no turn passes through the controller)."""

    def __init__(self, envs: Envs, generators: Generators, config: RunConfig):
        self.envs, self.generators, self.config = envs, generators, config

    async def play(self, problems: list[Problem], n: int, sampling: SamplingSettings | None = None,
                   seeds: list[list[int]] | None = None) -> list[list[Episode]]:
        from forgelab.engines.generator import SamplingConfig

        r = self.config.rollout
        if r.env is None:
            raise ValueError("EnvEpisodes: the run's config names no rollout.env (single-turn runs use SingleTurn)")
        sampling = sampling or SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
        from forgelab.generation import EnvGroupsRequest

        # each healthy replica's generator actor (a GeneratorMesh: the env actors call its ``generate``)
        gens = [cast(GeneratorMesh, h.actor) for h in self.generators.handles() if h is not None]
        return await self.envs.run_groups(EnvGroupsRequest(
            env=r.env, tasks_P=problems, n=n, generators=gens, sampling=sampling, env_kwargs=dict(r.env_kwargs),
            max_turns=r.max_turns, max_total_tokens=self.config.model.max_model_len,
            step_timeout_s=r.env_step_timeout_s,
        ))


class Rollouts:
    """The rollout workers and everything between a problem and the replay buffer.

    Args:
        config: the run's `RunConfig`.
        source: `SingleTurn` or `EnvEpisodes` (anything with `play(problems, n, sampling=None, seeds=None)`).
        buffer: the run's replay buffer (admission, staleness, accounting).
        rewards: the `RewardRunner` over the run's rewards.
        reference: the reference service (`route("logprobs", tokens_B_L, spans_B_2)`) or None.
        stream: the `ProblemStream` problems come from.
        lifecycle: the run's `Lifecycle`: its gate (pause, stop, "the buffer changed") and ``pause(message)``
            (too many hung reward calls).
        bus: the run's `EventBus` (``rollout_error``, ``env_dropped``, ``*_wait`` events).
        controls: the run's `RewardControls`: ``rewards_for(episodes)`` is the reward set one rollout is scored
            with (fixed for all its episodes) and ``distill_coef`` the distillation coefficient now (read once per
            rollout, when its reward set is taken: a live change lands between rollouts like a reward weight's).
            None scores with the runner's composer and a coefficient of 1.
        pad_id: token id padding reference inputs.
        teacher: the teacher's logprob service (on-policy distillation; may be `reference` itself) or None.
    """

    def __init__(self, config: RunConfig, source: EpisodeSource, buffer: ReplayBuffer, rewards: RewardRunner,
                 reference: LogprobService | None, stream: Problems, lifecycle: Pausable, bus: EventBus,
                 controls: ScoringControls | None = None, pad_id: int = 0, teacher: LogprobService | None = None):
        self.config, self.source, self.buffer, self.rewards = config, source, buffer, rewards
        self.reference, self.stream, self.lifecycle, self.bus, self.pad_id = reference, stream, lifecycle, bus, pad_id
        self.controls, self.teacher = controls, teacher
        self.gate: Gate = lifecycle.gate
        self.recent: deque[Episode] = deque(maxlen=RECENT)  # a view: buffered, trained or dropped, newest last
        self.recent_total = 0  # episodes ever put in `recent` (the older ones are in the rollout log)
        #: episodes of zero-variance groups kept (not dropped) because they carry a distillation signal
        self.zero_variance_kept = 0
        self.next_group_id = 0
        self.next_episode_id = 0
        self.ids_unused = 0  # ids admitted for episodes that were never generated (the rollout failed first)
        self.playing = 0  # rollouts the workers admitted and have not released yet (a checkpoint waits for none)
        self.failure_log = RepeatLimiter(log)  # a respawn fails every retry the same way: one line and a count
        self.tokens = 0  # generated tokens not yet counted by a metrics row
        r = config.rollout
        self.per_call = r.prompts_per_rollout * r.group_size
        # deterministic synchronous mode: max_policy_age 0 seeds every sample from (train.seed, episode id);
        # a generator that cannot take the seeds is an error here, never a silent unseeded run
        self.deterministic, self.nondeterministic_reason = determinism(config)
        if self.deterministic:
            check_seeded_generate()

    # -- the owner's counters -----------------------------------------------------------------------------
    def use_gate(self, gate: Gate) -> None:
        """The gate of the event loop that (re)starts the run; whoever waits on the old one is woken (to wait on
        the new one)."""
        old, self.gate = self.gate, gate
        if old is not gate:
            try:
                asyncio.get_running_loop().create_task(_wake(old))
            except RuntimeError:  # no running loop: nobody can be waiting on the old gate
                pass

    def recent_episodes(self) -> list[Episode]:
        """The newest episodes kept in memory (a view: buffered, trained or dropped), newest last."""
        return list(self.recent)

    def take_tokens(self) -> int:
        """Generated tokens counted since the last call (a metrics row's throughput), and start counting again."""
        tokens, self.tokens = self.tokens, 0
        return tokens

    def zero_variance_count(self, config: RunConfig) -> int | None:
        """Episodes of zero-variance groups kept for their distillation signal, when this run keeps them."""
        if self.teacher is not None and config.rollout.drop_zero_variance_groups:
            return self.zero_variance_kept
        return None

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the rollouts: the next ids and the zero-variance count."""
        return {"next_episode_id": self.next_episode_id, "next_group_id": self.next_group_id,
                "zero_variance_kept": self.zero_variance_kept}

    def restore_counters(self, next_episode_id: int, next_group_id: int, zero_variance_kept: int = 0) -> None:
        """A checkpoint's counters (`counters`)."""
        self.next_episode_id, self.next_group_id = int(next_episode_id), int(next_group_id)
        self.zero_variance_kept = int(zero_variance_kept)

    # -- episodes played elsewhere (the agent door) ---------------------------------------------------------
    def take_ids(self, episodes: int, groups: int = 0) -> tuple[int, int]:
        """Fresh ids for episodes played outside the rollout workers (the agent door, `forgelab.controller.
        agent_sessions`): ``(first episode id, first group id)`` of ``episodes`` and ``groups`` consecutive ids."""
        first = self.next_episode_id, self.next_group_id
        self.next_episode_id += episodes
        self.next_group_id += groups
        return first

    async def add_played(self, groups: list[list[Episode]], failed: dict[int, str] | None = None) -> None:
        """Episodes played outside the rollout workers, numbered and rewarded by the caller (ids from `take_ids`,
        admitted in the buffer by the caller): the same path as a rollout's from there (failed ones dropped with
        their reason, group advantages, reference and teacher logprobs, the buffer, `recent`)."""
        flat = [ep for g in groups for ep in g]
        self.tokens += sum(sum(ep.loss_mask) if ep.loss_mask is not None else len(ep.completion_ids) for ep in flat)
        coef = self.controls.distill_coef if self.teacher is not None and self.controls is not None else 1.0
        await self._advantages_and_buffer(groups, dict(failed or {}), coef)

    def drop_played(self, episodes: list[Episode], reason: str) -> None:
        """Drop episodes played outside the rollout workers (never buffered) with ``reason``; they are counted."""
        self._drop(episodes, reason)

    # -- admission ----------------------------------------------------------------------------------------
    def admit(self) -> Admitted:
        """Take the next problems and number them (group ids, episode ids, seeds): the order is fixed here."""
        r = self.config.rollout
        problems = self.stream.next(r.prompts_per_rollout)
        a = Admitted(problems, self.next_group_id, self.next_episode_id, r.group_size)
        self.next_group_id += len(problems)
        self.next_episode_id += len(problems) * r.group_size
        if self.deterministic:
            a.seeds = [[episode_seed(self.config.train.seed, a.first_episode + p * r.group_size + g)
                        for g in range(r.group_size)] for p in range(len(problems))]
        return a

    async def worker(self) -> None:
        """One rollout task: admit, play, score, buffer, until the run stops."""
        while await self.gate.running():
            async with self.gate.changed:
                # back-pressure: generate no more than the trainer can use before the episodes go stale
                await self.gate.changed.wait_for(
                    lambda: self.gate.stopping or (self.gate.may_admit() and self.buffer.may_admit(self.per_call)))
                if self.gate.stopping:
                    return
                self.buffer.admit(self.per_call, first_id=self.next_episode_id)  # ids bound the buffer's bookkeeping
                self.playing += 1
                admitted = self.admit()
            try:
                await self.one(admitted)
                self.failure_log.flush()
            except asyncio.CancelledError:
                self._drop_unaccounted(admitted, "rollout_cancelled")
                self.ids_unused += self.per_call - len(admitted.created)
                raise
            except Exception as e:
                lost = self._drop_unaccounted(admitted, f"rollout_error:{type(e).__name__}")
                never = self.per_call - len(admitted.created)
                self.ids_unused += never
                self.bus.emit("rollout_error", message=f"{type(e).__name__}: {e}", episodes_dropped=lost,
                          episodes_never_generated=never)
                self.failure_log.warning("forgelab: rollout failed: %s", e)
                await asyncio.sleep(0.5)  # back off before the next attempt (a dying replica, a respawn)
            finally:
                async with self.gate.changed:
                    self.buffer.release(self.per_call, first_id=admitted.first_episode)
                    self.playing -= 1
                    self.gate.changed.notify_all()

    def _drop_unaccounted(self, admitted: Admitted, reason: str) -> int:
        lost = [ep for ep in admitted.created if self.buffer.status(ep.id) is None]
        if lost:
            self.buffer.drop(lost, reason)
            self._remember(lost)  # never buffered or dropped before: not in `recent` yet
        return len(lost)

    # -- one rollout --------------------------------------------------------------------------------------
    async def one(self, admitted: Admitted | None = None) -> None:
        """Play, score and buffer one rollout's P*G episodes (admitting them first if not given)."""
        admitted = admitted or self.admit()
        groups = await self.source.play(admitted.problems, admitted.group_size, seeds=admitted.seeds)
        admitted.number(groups)
        flat = [ep for g in groups for ep in g]
        self.tokens += sum(sum(ep.loss_mask) if ep.loss_mask is not None else len(ep.completion_ids) for ep in flat)
        failed = self._env_failures(groups)
        scored = [ep for ep in flat if ep.id not in failed]
        composer = self.controls.rewards_for(scored) if self.controls is not None else None
        coef = self.controls.distill_coef if self.teacher is not None and self.controls is not None else 1.0
        failed.update(await self.rewards.score(scored, composer))
        hung = self.rewards.hung_message()
        if hung is not None:
            self.lifecycle.pause(hung)  # logs it
        await self._advantages_and_buffer(groups, failed, coef)

    def _env_failures(self, groups: list[list[Episode]]) -> dict[int, str]:
        from forgelab.envs import DROP_OUTCOMES

        failed = {ep.id: ep.info["outcome"] for g in groups for ep in g if ep.info.get("outcome") in DROP_OUTCOMES}
        if failed:
            reasons: dict[str, int] = {}
            for v in failed.values():
                reasons[v] = reasons.get(v, 0) + 1
            first = next(ep for g in groups for ep in g if ep.id in failed)
            self.bus.emit("env_dropped", reasons=reasons, error=str(first.info.get("error", ""))[:300])
        return failed

    async def _advantages_and_buffer(self, groups: list[list[Episode]], failed: dict[int, str],
                                     distill_coef: float = 1.0) -> None:
        """Drop failed episodes, compute group advantages, add reference (and teacher) logprobs, buffer the rest."""
        r = self.config.rollout
        # with a teacher (coefficient not 0) a group whose rewards are all equal still teaches per token
        distils = self.teacher is not None and distill_coef != 0.0
        keep: list[Episode] = []
        for g in groups:
            ok = [ep for ep in g if ep.id not in failed]
            for ep in g:
                if ep.id in failed:
                    self._drop([ep], failed[ep.id])
            if len(ok) < 2:
                self._drop(ok, "group_too_small")
                continue
            rewards_1_G = torch.tensor([[ep.reward for ep in ok]], dtype=torch.float64)
            if r.drop_zero_variance_groups and float(rewards_1_G.std()) == 0.0:
                if not distils:
                    self._drop(ok, "zero_variance_group")
                    continue
                self.zero_variance_kept += len(ok)  # equal rewards, but each token still has a teacher's signal
            for ep, a in zip(ok, ADVANTAGES[r.advantage](rewards_1_G)[0].tolist()):
                ep.advantage = float(a)
            keep += ok
        if not keep:
            return
        if self.reference is not None:
            for ep, lps in zip(keep, await self._service_logprobs(self.reference, keep, "reference")):
                ep.ref_logprobs = lps
        if self.teacher is not None:
            await self._distill(self.teacher, keep, distill_coef)
        async with self.gate.changed:
            self.buffer.add(keep)
            self._remember(keep)
            self.gate.changed.notify_all()

    def _drop(self, eps: list[Episode], reason: str) -> None:
        if eps:
            self.buffer.drop(eps, reason)
            self._remember(eps)

    def _remember(self, eps: list[Episode]) -> None:
        self.recent.extend(eps)
        self.recent_total += len(eps)

    async def _distill(self, teacher: LogprobService, eps: list[Episode], coef: float) -> None:
        """The teacher's logprob of every sampled token, and each token's advantage moved toward it."""
        from forgelab.algos.advantages import distill_advantages

        shared = teacher is self.reference  # the teacher is the run's model in the reference's process
        # shared: the reference's logprobs were set on every kept episode just before (`_score`)
        lps_E = ([cast("list[float]", ep.ref_logprobs) for ep in eps] if shared
                 else await self._service_logprobs(teacher, eps, "teacher"))
        for ep, lps in zip(eps, lps_E):
            ep.teacher_logprobs = list(lps)
            ep.token_advantages = distill_advantages(ep.advantage, ep.teacher_logprobs, ep.generator_logprobs, coef,
                                                     ep.loss_mask)

    async def _service_logprobs(self, service: LogprobService, eps: list[Episode], what: str) -> list[list[float]]:
        """Each episode's completion-token logprobs under `service` (the reference or the teacher)."""
        from forgelab.engines.trainer_client import ReferenceClient
        from forgelab.runtime.service import NoHealthyReplicaError, ReplicaFailedError

        rows = [ep.prompt_ids + ep.completion_ids for ep in eps]
        tokens_B_L = torch.full((len(rows), max(len(x) for x in rows)), self.pad_id, dtype=torch.long)
        for i, x in enumerate(rows):
            tokens_B_L[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        # (prompt length, length): only completion logprobs are computed, a group's prompt once
        spans_B_2 = torch.tensor([[len(ep.prompt_ids), len(x)] if ep.completion_ids else [0, 0]
                                  for ep, x in zip(eps, rows)], dtype=torch.long)
        try:
            lp = await ReferenceClient(service).logprobs(tokens_B_L, spans_B_2)
        except (NoHealthyReplicaError, ReplicaFailedError) as e:
            # the service died and is being respawned: wait for it rather than lose these episodes
            self.bus.emit(f"{what}_wait", message=f"{type(e).__name__}: {str(e)[:300]}")
            await service.wait_healthy(count=1, timeout=600)
            lp = await ReferenceClient(service).logprobs(tokens_B_L, spans_B_2)
        lp_B_L = torch.as_tensor(lp)
        return [lp_B_L[i, len(ep.prompt_ids) - 1: len(ep.prompt_ids) - 1 + len(ep.completion_ids)].tolist()
                for i, ep in enumerate(eps)]

    # -- views --------------------------------------------------------------------------------------------
    def dataframe(self) -> pd.DataFrame:
        """The newest `RECENT` episodes (newest last) with token ids, logprobs, rewards, advantages and buffer
        status; ``df.attrs``: ``shown``, ``older`` (how many earlier ones are not shown) and where they are."""
        import pandas as pd

        rows = []
        for ep in list(self.recent):
            status = self.buffer.status(ep.id) or ""
            if status == "dropped":
                status = "dropped:" + self.buffer.drop_reason(ep.id)
            row = {
                "id": ep.id, "group_id": ep.group_id, "task": ep.task, "prompt": ep.prompt,
                "completion": ep.completion, "target": ep.target, "reward": ep.reward, "advantage": ep.advantage,
                "policy_version": ep.policy_version, "finish_reason": ep.finish_reason, "status": status,
                "prompt_ids": ep.prompt_ids, "completion_ids": ep.completion_ids,
                "generator_logprobs": ep.generator_logprobs, "ref_logprobs": ep.ref_logprobs,
                "teacher_logprobs": ep.teacher_logprobs, "token_advantages": ep.token_advantages,
                "loss_mask": ep.loss_mask, "turns": ep.info.get("turns"),
                **{k: (ep.train_values or {}).get(k) for k in ("trainer_logprobs", "entropy", "is_weight", "clipped")},
                "mismatch_max": mismatch_max(ep),
            }
            row.update({f"reward/{k}": v for k, v in ep.reward_parts.items()})
            rows.append(row)
        df = pd.DataFrame(rows)
        df.attrs.update(shown=len(rows), older=self.recent_total - len(rows),
                        older_in="the rollout log: read_rollouts(run.out_dir), once the buffer closed them")
        return df


def mismatch_max(ep: Episode) -> float:
    """The largest |trainer logprob - generator logprob| over the episode's trained tokens (NaN before it is
    trained): the inspector's "largest mismatch" sort."""
    lps = (ep.train_values or {}).get("trainer_logprobs")
    if not lps:
        return float("nan")
    mask = ep.loss_mask or [1] * len(lps)
    diffs = [abs(t - g) for t, g, m in zip(lps, ep.generator_logprobs, mask) if m]
    return max(diffs) if diffs else 0.0


def episode_seed(run_seed: int, episode_id: int) -> int:
    """The vLLM seed of one sample: a hash of (run seed, episode id), 31 bits.

    Different for every episode (so samples within a group differ, unlike one
    fixed seed for all), the same for the same episode in a replay or a fork.

    >>> episode_seed(0, 5) == episode_seed(0, 5), episode_seed(0, 5) != episode_seed(0, 6) != episode_seed(1, 5)
    (True, True)
    """
    digest = hashlib.sha256(f"{int(run_seed)}:{int(episode_id)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

