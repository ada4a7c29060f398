"""In-process fakes of a run's parts, with the interfaces the controller uses (fast, exact, no process).

    run = Run(cfg, spawn=fake_spawn)          # or spawn=FakeParts.factory(trainer=FakeTrainer(...))
    await run.start(); await run.until(step=3)
    run.parts.generators.kill(1)              # a replica dies; the fake service respawns it

- `FakeGenerators` is a service (`generate(GenerateRequest)`, `engine_stats`, `route`, `handles`, `status`,
  `set_replica_info`, `add_listener`, `on_respawn`, `wait_healthy`, `shutdown`; it satisfies
  `forgelab.generation.Generators`) over `FakeGenerator` replicas whose `generate(prompt_ids_P, n, sampling,
  seeds)` answers `Completion`s stamped with the weights version the replica serves. Like the real
  service, a `generate` that hits a dead replica is retried on a healthy one.
- `FakeTrainer` implements the trainer's typed API (`forgelab.engines.trainer_client.TrainerAPI`):
  `train_step` (`StepMetrics` with the loss it used; a swap lands between steps),
  `push_weights` (sets each replica's version), `set_loss`, `dry_run_loss`, `save`,
  `load`, `fingerprint`, `info`; `call(endpoint, ...)` answers like an actor handle.
  `hold()` / `release()` keep a step in flight.
- `FakeReference` answers `route("logprobs", tokens_B_L, spans_B_2)` with zeros.

The real actors are tested on real processes (tests/test_generator.py, test_trainer.py, ...).
"""
from __future__ import annotations

import asyncio
import functools
import random
import time
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Awaitable, Callable, cast

import torch

from forgelab.engines.loss_specs import LossSpec
from forgelab.engines.trainer_client import Fingerprint, LossComparison, TrainerAPI, TrainerInfo
from forgelab.generation import CompletionGroups, EngineStats, EnvGroupsRequest, EpisodeGroups, GenerateRequest
from forgelab.runtime.replicas import NoHealthyReplicaError, ReplicaStatus, ServiceEvent
from forgelab.types import (
    AdamParams, Completion, DryRunReport, LossReport, OptimReport, StepMetrics, TokenValues, TrainBatch, WeightPush,
)

__all__ = ["FakeGenerator", "FakeGenerators", "FakeTrainer", "FakeReference", "FakeEnvs", "FakeParts", "fake_generators", "fake_spawn"]


class FakeGenerator:
    """One generator replica: answers a problem's target with probability `p_correct`, else a wrong number."""

    def __init__(self, index: int, p_correct: float = 0.5, seed: int = 0, decode: Callable[[list[int]], str] | None = None):
        self.index, self.p_correct, self.decode = index, p_correct, decode
        self.version = 0
        self.alive = True
        self.rng = random.Random(seed * 7919 + index)
        self.calls: list[tuple[int, int]] = []  # (prompts, n) of each generate call
        self.loaded: list[int] = []  # versions pushed to this replica, in order

    async def generate(self, prompt_ids_P: list[list[int]], n: int = 1, sampling: Any = None,
                       seeds: list[list[int]] | None = None) -> list[list[Completion]]:
        self.calls.append((len(prompt_ids_P), n))
        version = self.version  # read when the requests are taken in, as the engine does
        await asyncio.sleep(0)  # let other rollouts interleave
        if not self.alive:
            raise RuntimeError(f"fake generator replica {self.index} died")
        greedy = sampling is not None and getattr(sampling, "temperature", 1.0) == 0.0
        out = []
        for p, ids in enumerate(prompt_ids_P):
            target = _target_of(self.decode(ids) if self.decode else "")
            row = []
            for g in range(n):
                rng = random.Random(seeds[p][g]) if seeds is not None else self.rng
                right = greedy or rng.random() < self.p_correct
                text = target if right else str(int(target or 0) + 1 + rng.randrange(5))
                cids = [ord(c) for c in text] + [0]
                row.append(Completion(prompt_ids=list(ids), completion_ids=cids, logprobs=[-0.5] * len(cids),
                                      text=text, finish_reason="stop", policy_version=version))
            out.append(row)
        return out


def _target_of(text: str) -> str:
    """The fakes' task: the answer of the last 'a+b' in the rendered prompt (the addition task)."""
    import re

    m = re.findall(r"(\d+)\s*\+\s*(\d+)", text)
    return str(int(m[-1][0]) + int(m[-1][1])) if m else "0"


@dataclass
class _Handle:
    actor: FakeGenerator
    replica_index: int


class FakeGenerators:
    """A service over `FakeGenerator` replicas (round-robin routing, retry on a dead replica, respawn)."""

    def __init__(self, n: int = 1, p_correct: float = 0.5, seed: int = 0, decode: Callable[[list[int]], str] | None = None):
        self.decode = decode
        self.replicas = [FakeGenerator(i, p_correct, seed, decode) for i in range(n)]
        self.info: list[dict] = [{} for _ in range(n)]
        self.restarts = [0] * n
        self.on_respawn: Callable[[Any], Awaitable[None]] | None = None
        self.listeners: list[Callable[[ServiceEvent], None]] = []
        self.respawns: list[dict] = []  # {"replica", "served", "run_version_hook"} after each respawn
        self._next = 0
        self._tasks: list[asyncio.Task] = []
        self._healthy = asyncio.Event()
        self._healthy.set()

    def handles(self) -> list[_Handle | None]:
        return [_Handle(r, i) if r.alive else None for i, r in enumerate(self.replicas)]

    async def generate(self, request: GenerateRequest) -> CompletionGroups:
        """`request` on the next live replica (round robin; retried on another if that one died)."""
        if request.lora_slot is not None:
            raise ValueError(f"fake generators: no LoRA slots (lora_slot={request.lora_slot!r})")
        return await self.route("generate", list(request.prompts_P), request.n, request.sampling,
                                None if request.seeds_P_G is None else [list(s) for s in request.seeds_P_G])

    async def engine_stats(self) -> list[EngineStats]:
        """The fakes keep no engine counters: none (the generator meter adds no columns)."""
        return []

    async def abort(self, abort_key: str) -> list[int]:
        """The fakes answer at once: nothing is ever left to abort."""
        return [0 for r in self.replicas if r.alive]

    async def route(self, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        """The string form (the typed `generate` goes through it): ``endpoint`` on the next live replica."""
        for _ in range(2 * len(self.replicas) + 1):
            live = [r for r in self.replicas if r.alive]
            if not live:
                raise NoHealthyReplicaError("fake generators: no healthy replica")
            rep = live[self._next % len(live)]
            self._next += 1
            try:
                return await getattr(rep, endpoint)(*args, **kwargs)
            except RuntimeError:
                if rep.alive:
                    raise
        raise NoHealthyReplicaError("fake generators: replicas kept dying")

    def kill(self, index: int) -> asyncio.Task:
        """Replica `index` dies now; a fresh one (version 0) is caught up by `on_respawn`, then serves."""
        self.replicas[index].alive = False
        self._emit("replica_failed", index, "killed by the test")
        task = asyncio.ensure_future(self._respawn(index))
        self._tasks.append(task)
        return task

    async def _respawn(self, index: int) -> None:
        fresh = FakeGenerator(index, self.replicas[index].p_correct, len(self.respawns) + 1, self.decode)
        fresh.alive = False
        self.replicas[index] = fresh
        if self.on_respawn is not None:
            await self.on_respawn(_Handle(fresh, index))
        fresh.alive = True
        self.restarts[index] += 1
        self.respawns.append({"replica": index, "served": fresh.version, "loaded": list(fresh.loaded)})
        self._emit("replica_restarted", index, "respawned")

    def _emit(self, kind: str, index: int, detail: str) -> None:
        for fn in list(self.listeners):
            fn(ServiceEvent(kind, index, time.time(), detail))

    def add_listener(self, fn: Callable[[ServiceEvent], None]) -> None:
        self.listeners.append(fn)

    def set_replica_info(self, index: int, **fields: Any) -> None:
        self.info[index].update(fields)

    def status(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(index=i, healthy=r.alive, state="healthy" if r.alive else "respawning", in_flight=0,
                              restarts=self.restarts[i], pids=(), last_error=None, info=dict(self.info[i]))
                for i, r in enumerate(self.replicas)]

    async def wait_healthy(self, count: int | None = None, timeout: float | None = None) -> None:
        await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass(frozen=True, kw_only=True)
class FakeStepMetrics(StepMetrics):
    """The fake's step answer: the real type, with the fake's flat metrics as they have always been (loss,
    grad norm and loss name; a skipped step's reason), so fake runs' metrics.csv columns stay what they were
    (run directories written by earlier fakes replay and resume equal)."""

    def as_row(self) -> dict[str, float | int | str]:
        if self.skipped:
            return {"skipped": True, "skip_reason": self.skip_reason, "loss_name": self.loss_name}
        return {"loss": self.loss, "grad_norm": self.grad_norm, "loss_name": self.loss_name}


class FakeTrainer(TrainerAPI):
    """The trainer's typed endpoints (`forgelab.engines.trainer_client.TrainerAPI`), in process.

    A step's loss is ``-mean|advantage|``; a loss named in ``skip_losses`` skips its steps. ``call(endpoint, ...)``
    answers like an actor handle (one result per rank) for callers that still name endpoints."""

    def __init__(self, loss: str = "grpo", skip_losses: tuple[str, ...] = ()):
        self.loss: LossSpec = loss
        self.loss_kwargs: dict[str, object] = {}
        self._pending: tuple[LossSpec, dict[str, object]] | None = None
        self.skip_losses = skip_losses
        self.steps: list[dict[str, object]] = []  # per train_step: the loss used and the batch's episode count
        self.pushes: list[tuple[int, list[int]]] = []  # (version, replica indices)
        self.restored_steps = 0
        self.in_step = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()

    def hold(self) -> None:
        """The next train_step waits (in flight) until `release()`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    async def call(self, endpoint: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [await getattr(self, endpoint)(*args, **kwargs)]

    def _loss_name(self) -> str:
        return self.loss if isinstance(self.loss, str) else getattr(self.loss, "name", "custom")

    async def train_step(self, batch: TrainBatch) -> StepMetrics:
        if self._pending is not None:  # a swap lands between steps
            self.loss, self.loss_kwargs = self._pending
            self._pending = None
        self.in_step.set()
        try:
            await self._gate.wait()
        finally:
            self.in_step.clear()
        batch = TrainBatch.coerce(batch)
        name = self._loss_name()
        self.steps.append({"loss": name, "episodes": int(batch.tokens_B_L.shape[0])})
        step = self.restored_steps + len([s for s in self.steps if s["loss"] not in self.skip_losses])
        if name in self.skip_losses:
            return FakeStepMetrics(step=step, lr=0.0, step_time_s=0.0, skipped=True,
                               skip_reason=f"loss {name} is non-finite", loss_name=name)
        adv = batch.advantages_B.float()
        return FakeStepMetrics(step=step, lr=0.0, step_time_s=0.0, loss=float(-adv.abs().mean()), grad_norm=1.0,
                           loss_name=name)

    async def forward_backward(self, batch: TrainBatch, loss: LossSpec | None = None,
                               loss_kwargs: Mapping[str, object] | None = None) -> LossReport:
        adv = TrainBatch.coerce(batch).advantages_B.float()
        return LossReport(loss=float(-adv.abs().mean()), loss_name=self._loss_name(), grad_norm=1.0, accumulated=1)

    async def optim_step(self, adam: AdamParams | None = None) -> OptimReport:
        return OptimReport(step=self.restored_steps + len(self.steps), lr=0.0 if adam is None else adam.lr,
                           grad_norm=1.0, scheduled=adam is None)

    async def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.zeros_like(TrainBatch.coerce(batch).mask_B_T)

    async def logprobs(self, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(tokens_B_L.shape, dtype=torch.float32)

    async def push_weights(self, version: int, generators: Sequence[Any], transport: str | None = None) -> WeightPush:
        failed: dict[int, str] = {}
        for g in generators:
            g.version = int(version)
            g.loaded.append(int(version))
        self.pushes.append((int(version), [getattr(g, "index", -1) for g in generators]))
        return WeightPush(version=int(version), gather_ms=1.0, write_ms=0.5, send_ms=2.0, bytes=1024,
                          sent=len(generators) - len(failed), failed=failed, transport="shm")

    async def set_loss(self, loss: LossSpec, loss_kwargs: Mapping[str, object] | None = None) -> str:
        self._pending = (loss, dict(loss_kwargs or {}))
        return loss if isinstance(loss, str) else "custom"

    async def dry_run_loss(self, loss: LossSpec, batch: TrainBatch,
                           loss_kwargs: Mapping[str, object] | None = None) -> DryRunReport:
        ok = "fail" not in (loss_kwargs or {})
        return DryRunReport(ok=ok, reason="" if ok else "asked to fail")

    async def info(self) -> TrainerInfo:
        return TrainerInfo(loss=self.loss if isinstance(self.loss, str) else "custom",
                           loss_kwargs=dict(self.loss_kwargs))

    async def token_values(self) -> TokenValues | None:
        return None  # the fake computes no logprobs: no per-token view

    async def set_lr(self, lr: float) -> float:
        self.lr = float(lr)  # the fake has no schedule: the peak is the lr
        return self.lr

    async def compare_losses(self, specs: Sequence[object], batch: TrainBatch) -> LossComparison:
        raise NotImplementedError("FakeTrainer computes no gradients: compare_losses needs a real trainer")

    async def fingerprint(self) -> list[Fingerprint]:
        # the fake's own format since 893000f ({"steps": N}): run directories written by it still compare equal
        return [cast(Fingerprint, {"steps": self.restored_steps + len(self.steps)})]

    async def save(self, path: str) -> str:
        """Write the fake's state (its step count) as the real trainer writes its DCP directory."""
        import json
        import os

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "fake_trainer.json"), "w") as f:
            json.dump({"steps": self.restored_steps + len(self.steps)}, f)
        return path

    async def load(self, path: str) -> TrainerInfo:
        import json
        import os

        with open(os.path.join(path, "fake_trainer.json")) as f:
            self.restored_steps = int(json.load(f)["steps"]) - len(self.steps)
        return await self.info()

    async def shutdown(self) -> None:
        pass


class FakeReference:
    """The reference service: `route("logprobs", tokens_B_L, spans_B_2)` -> zeros_B_L (spans checked as the real one
    checks them); with `scale`, the logprob of token y is ``-scale * (y % 5)`` instead (a teacher whose logprobs
    vary by token)."""

    def __init__(self, scale: float = 0.0) -> None:
        self.calls = 0
        self.scale = scale

    async def route(self, endpoint: str, tokens_B_L: torch.Tensor, spans_B_2: torch.Tensor | None = None
                    ) -> torch.Tensor:
        from forgelab.engines.contracts import check_spans

        check_spans(spans_B_2, tokens_B_L)
        self.calls += 1
        await asyncio.sleep(0)
        if not self.scale:
            return torch.zeros(tokens_B_L.shape, dtype=torch.float32)
        # target-aligned like the real service: position t holds the logprob of token t + 1 (the last is unused)
        return -self.scale * (torch.roll(tokens_B_L, -1, dims=1) % 5).float()

    async def wait_healthy(self, count: int | None = None, timeout: float | None = None) -> None:
        return None

    def status(self) -> list:
        return []

    async def shutdown(self) -> None:
        pass


class FakeEnvs:
    """The EnvActor service in process: `run_groups(EnvGroupsRequest)` (or the string form `route("run_groups",
    ...)`) plays the episodes with the real episode loop (`forgelab.envs.actor.run_groups_local`, the real
    environments) against the fake generator replicas. Satisfies `forgelab.generation.Envs`."""

    def __init__(self, model_dir: str, max_concurrent: int = 64):
        from transformers import AutoTokenizer

        from forgelab.envs.episode import ChatFormat

        self.fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
        self.max_concurrent = max_concurrent
        self.calls = 0

    async def run_groups(self, request: EnvGroupsRequest) -> EpisodeGroups:
        return await self.route("run_groups", request.env, list(request.tasks_P), request.n, list(request.generators),
                                request.sampling, None if request.env_kwargs is None else dict(request.env_kwargs),
                                request.max_turns, request.max_total_tokens, request.step_timeout_s)

    async def route(self, endpoint: str, env: Any, tasks: list, n: int, generators: list, sampling: Any,
                    env_kwargs: dict | None = None, max_turns: int | None = None, max_total_tokens: int | None = None,
                    step_timeout_s: float | None = None) -> list:
        from forgelab.envs.actor import run_groups_local
        from forgelab.envs.episode import EpisodeLimits

        if endpoint != "run_groups":
            raise ValueError(f"FakeEnvs: no endpoint {endpoint!r}")
        self.calls += 1
        limits = EpisodeLimits(max_turns=max_turns or 4, max_total_tokens=max_total_tokens or 256,
                               step_timeout_s=step_timeout_s or 10.0)
        picks = iter(range(10**9))

        def generate_for():
            g = generators[next(picks) % len(generators)]

            async def generate(ids: list[int], sampling: Any) -> Completion:
                return (await g.generate([ids], 1, sampling))[0][0]
            return generate

        return await run_groups_local(env, tasks, n, generate_for, self.fmt, sampling, limits,
                                      asyncio.Semaphore(self.max_concurrent), env_kwargs)

    def status(self) -> list:
        return []

    async def shutdown(self) -> None:
        pass


@dataclass
class FakeParts:
    """`forgelab.engines.spawn.Parts` with fakes in it."""

    generators: FakeGenerators = field(default_factory=FakeGenerators)
    trainer: FakeTrainer = field(default_factory=FakeTrainer)
    reference: FakeReference | None = None
    envs: Any = None
    teacher: FakeReference | None = None
    job: Any = None
    seconds: float = 0.0

    async def shutdown(self) -> None:
        await self.generators.shutdown()

    def factory(self) -> Callable[[Any], Awaitable["FakeParts"]]:
        """A `spawn` for `Run(cfg, spawn=...)` that hands over these parts."""
        async def spawn(cfg: Any) -> "FakeParts":
            return self
        return spawn


@functools.lru_cache(maxsize=4)
def _decoder(model_dir: str) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode


def fake_generators(cfg: Any, n: int | None = None, p_correct: float = 0.5) -> FakeGenerators:
    """`FakeGenerators` for a run config (`placement.generator_replicas` replicas unless `n`)."""
    return FakeGenerators(n or cfg.placement.generator_replicas, p_correct, cfg.train.seed, _decoder(cfg.model.path))


async def fake_spawn(cfg: Any) -> FakeParts:
    """Fakes sized from the config: `placement.generator_replicas` replicas, a reference if asked for."""
    from forgelab.engines.spawn import component_configs

    gens = fake_generators(cfg)
    envs = FakeEnvs(cfg.model.path) if cfg.rollout.env is not None else None
    return FakeParts(generators=gens, envs=envs,
                     trainer=FakeTrainer(component_configs(cfg)["trainer"].loss),  # the loss as the trainer gets it
                     reference=FakeReference() if cfg.placement.reference else None,
                     teacher=FakeReference(scale=0.1) if cfg.teacher.enabled else None)
