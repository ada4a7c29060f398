"""Spawning a run's parts: the generator service, the trainer, the reference service and the env service.

    parts = await spawn_parts(cfg)        # the generator first, then the rest; a failure stops the others
    parts.generators, parts.trainer, parts.reference, parts.envs, parts.teacher
    await parts.shutdown()

The component configs each actor receives are built by `component_configs(cfg)`
(pure: no process starts), so what a YAML file sets can be checked without a spawn.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Generic, Protocol, Sequence, TypedDict, TypeVar, cast

from forgelab.config.run_config import RunConfig
from forgelab.generation import Generators
from forgelab.runtime.component import PlacementOptions
from forgelab.runtime.replicas import ReplicaStatus
from forgelab.runtime.startup_cpus import StartRecord, StartWindow, close_unstarted, start_shadow_work

if TYPE_CHECKING:
    from monarch.job import JobTrait

    from forgelab.config.components import GeneratorConfig, ReferenceConfig, TrainerConfig
    from forgelab.envs.episode import EnvActorConfig
    from forgelab.engines.generator_service import GeneratorService
    from forgelab.engines.trainer import Trainer
    from forgelab.runtime.mesh import ActorHandle

log = logging.getLogger("forgelab.engines.spawn")


class Stoppable(Protocol):
    """A part `Parts.shutdown` stops: a service, an actor handle, or a run's view of shared ones."""

    async def shutdown(self) -> None: ...


class ServicePart(Stoppable, Protocol):
    """A service part (reference, envs, teacher; generators too) as the pool reads it."""

    def status(self) -> Sequence[ReplicaStatus]: ...

    def clear_listeners(self) -> None: ...


class TrainerPart(Stoppable, Protocol):
    """The trainer as the pool calls it (an `ActorHandle[Trainer]`, or a run's slot of a shared one)."""

    async def call(self, endpoint: str, /, *args: object, **kwargs: object) -> list[object]: ...

    async def pids(self) -> list[int]: ...


class GeneratorPart(Generators, Stoppable, Protocol):
    """The generator replicas of a run (`GeneratorService`, or `SlotGenerators`: a run's slot of shared ones)."""

    def status(self) -> Sequence[ReplicaStatus]: ...

    def set_replica_info(self, index: int, **fields: object) -> None: ...


G = TypeVar("G", bound=GeneratorPart)
T = TypeVar("T", bound=TrainerPart)


@dataclass
class Parts(Generic[G, T]):
    """The processes of one run. `reference` / `envs` / `teacher` are None when the config asks for none;
    `teacher` is the reference's service itself when both are the run's model (`teacher_service`).

    Generic in the generator part `G` and the trainer part `T`: `spawn_parts` gives a `GeneratorService` and an
    `ActorHandle[Trainer]` (`SpawnedParts`); a run on shared engines gets its slot's views
    (`forgelab.engines.shared_parts.SlotParts`)."""

    generators: G | None
    trainer: T | None
    reference: ServicePart | None = None
    envs: ServicePart | None = None
    teacher: ServicePart | None = None
    job: JobTrait | None = None
    """The `monarch.job` job the parts run on (None: this host); `shutdown` kills it."""
    seconds: float = 0.0
    """Wall time the spawn took."""
    startup: StartRecord | None = None
    """What the start did with CPU affinity (`forgelab.runtime.startup_cpus`); None for parts not spawned here."""

    async def shutdown(self) -> None:
        """Stop every part, all at once, then kill the hosts job. A part that fails to stop is logged and
        the rest still stop; the job is killed whatever happened before (its hosts would outlive the run).

        At once because a part's stop is mostly waiting for its processes to exit (1.5-4 s each on the
        tiny model): one after the other, the waits added up (7.1 s for generator, reference and trainer
        vs 3.7 s together)."""
        try:
            names = [n for n in ("generators", "reference", "envs", "trainer", "teacher") if getattr(self, n) is not None
                     and not (n == "teacher" and self.teacher is self.reference)]
            parts: list[Stoppable] = [getattr(self, n) for n in names]
            results = await asyncio.gather(*(part.shutdown() for part in parts), return_exceptions=True)
            for name, outcome in zip(names, results):  # the other parts and the job still stopped
                if isinstance(outcome, Exception):
                    log.warning("forgelab: stopping the %s failed: %s: %s", name, type(outcome).__name__, outcome)
            for outcome in results:
                if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome
        finally:
            if self.job is not None:
                await _shutdown_job_hosts(self.job)
                try:
                    self.job.kill()
                except Exception as err:  # noqa: BLE001
                    log.warning("forgelab: killing the hosts job failed: %s: %s", type(err).__name__, err)
            self.generators = self.trainer = self.reference = self.envs = self.teacher = self.job = None


class _HostMesh(Protocol):
    def shutdown(self) -> Awaitable[None]: ...


async def _shutdown_job_hosts(job: JobTrait, timeout: float = 30.0) -> None:
    """Stop the job's host workers through Monarch (`HostMesh.shutdown`) before the job is killed.

    `job.kill()` ends what the job started on this machine; for an SSH job that is the local `ssh` client,
    and the worker it started on the node outlives it (no tty, no hangup). Shutting the host meshes down
    ends the workers themselves, wherever they run. Failures are logged: the kill still follows."""
    from forgelab.runtime.placement import job_mesh_names

    try:
        state = job.state(cached_path=None)
        meshes: list[_HostMesh] = [getattr(state, name) for name in job_mesh_names(job)]
    except Exception as err:  # noqa: BLE001 -- a job that cannot report its state is still killed
        log.warning("forgelab: the hosts job's state is unavailable (%s: %s); killing it", type(err).__name__, err)
        return
    results = await asyncio.gather(*(asyncio.wait_for(m.shutdown(), timeout) for m in meshes),
                                   return_exceptions=True)
    for outcome in results:
        if isinstance(outcome, BaseException):
            log.warning("forgelab: shutting down a host mesh failed: %s: %s", type(outcome).__name__, outcome)


class ComponentConfigs(TypedDict):
    """The config each component is spawned with (`component_configs`)."""

    generator: GeneratorConfig
    trainer: TrainerConfig
    reference: ReferenceConfig
    envs: EnvActorConfig


def component_configs(cfg: RunConfig) -> ComponentConfigs:
    """The config object each component is spawned with: {"generator", "trainer", "reference", "envs"}."""
    from forgelab.algos.loss_checks import completion_budget, with_completion_budget, without_reference
    from forgelab.engines.loss_specs import as_loss_spec, shipped_loss

    cc = cast(ComponentConfigs, {section: cfg.component(section) for section in ("generator", "trainer", "reference", "envs")})
    t = cc["trainer"]  # dr_grpo normalises by the completion budget unless loss_kwargs set max_tokens
    t.loss_kwargs = with_completion_budget(t.loss, t.loss_kwargs, completion_budget(cfg.rollout))
    if not cfg.placement.reference:  # grpo's default kl_coef cannot apply: 0, written in (Run says so)
        t.loss_kwargs, _ = without_reference(t.loss, t.loss_kwargs)
    t.loss = shipped_loss(as_loss_spec(t.loss))  # a function, or a LOSSES entry the trainer process lacks, travels by value
    if t.lora.enabled and not cfg.placement.reference:  # no reference at all: the trainer computes none either
        t.lora = dataclasses.replace(t.lora, reference="process")
    return cc


def reference_process(cfg: RunConfig) -> bool:
    """Whether `cfg` runs a reference process: ``placement.reference``, unless LoRA takes the reference from the
    base for free (``lora.reference: base``: the trainer computes it with the adapters off)."""
    return cfg.placement.reference and not (cfg.lora.enabled and cfg.lora.reference == "base")


def teacher_shares_reference(cfg: RunConfig) -> bool:
    """Whether the teacher is the run's own model served by its reference process (no teacher process)."""
    import os

    t = cfg.teacher
    return (t.enabled and reference_process(cfg)
            and os.path.realpath(str(t.model_dir)) == os.path.realpath(cfg.model.path))


def _where(common: PlacementOptions, job: JobTrait | None, mesh: str | None, *, num_replicas: int | None = None,
           procs: int | None = None) -> PlacementOptions:
    """`common` with the placement keywords putting a part on host mesh `mesh` of `job` (this host when either is
    None)."""
    out = common.copy()
    if num_replicas is not None:
        out["num_replicas"] = num_replicas
    if procs is not None:
        out["procs"] = procs
    if job is not None and mesh is not None:
        out["job"], out["mesh"] = job, mesh
    return out


S = TypeVar("S", bound=Stoppable)


async def start_all(jobs: Sequence[Awaitable[S]], *, critical: int | None = 0, critical_cores: int = 1,
                    pin: bool = True, why_not: str = "", record: list[StartRecord] | None = None) -> list[S]:
    """Await every part's start; if any fails, shut down the ones that started and raise the first error (no
    process is left behind).

    The critical path first (`forgelab.runtime.startup_cpus`): ``jobs[critical]`` (the generator) is launched
    first and keeps `critical_cores` cores to itself; the other parts are launched once its processes exist,
    restricted (like the controller's own threads) to the other cores until it is ready, and the controller's
    start-up work (`startup_cpus.ShadowWork`) starts once it is launched. Affinity is restored whatever happens.
    ``pin=False`` (parts on other hosts) keeps the order and restricts nothing (`why_not` says why in the log);
    ``critical=None`` starts everything at once. The window's `StartRecord` is appended to `record`."""
    if critical is None or not jobs:
        start_shadow_work()
        results = await asyncio.gather(*jobs, return_exceptions=True)
        return await _all_or_none(results)
    window = StartWindow(critical_cores, enabled=pin, why_not=why_not)
    if record is not None:
        record.append(window.record)
    others = [job for i, job in enumerate(jobs) if i != critical]
    window.open()
    try:
        first = asyncio.ensure_future(window.critical(jobs[critical]))
        try:
            await window.critical_launched()
        except BaseException:  # cancelled while waiting: nothing may go on starting
            first.cancel()
            close_unstarted(others)
            raise
        start_shadow_work()  # the controller's own start-up, in the generator's shadow
        if first.done() and (first.cancelled() or first.exception() is not None):
            close_unstarted(others)  # it failed before launching: the others never start
            await first  # raises its error
        rest = [asyncio.ensure_future(window.other(job)) for job in others]
        gathered = await asyncio.gather(first, *rest, return_exceptions=True)
    finally:
        window.close()
    results = list(gathered[1:])
    results.insert(critical, gathered[0])
    return await _all_or_none(results)


async def _all_or_none(results: Sequence[S | BaseException]) -> list[S]:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r.shutdown()
        raise failed[0]
    return [r for r in results if not isinstance(r, BaseException)]  # all of them: none failed


SpawnedParts = Parts["GeneratorService", "ActorHandle[Trainer]"]
"""What `spawn_parts` gives: a run's own processes."""


async def spawn_parts(cfg: RunConfig) -> SpawnedParts:
    """Start every part of `cfg` in parallel; if one fails, stop the others (and the job) and raise its error."""
    from forgelab.engines.generator import Generator
    from forgelab.engines.generator_service import GeneratorService
    from forgelab.engines.trainer import ReferenceModel, Trainer
    from forgelab.runtime.mesh import ActorHandle

    p, h = cfg.placement, cfg.hosts
    cc = component_configs(cfg)
    job: JobTrait | None = None
    if h.job is not None:
        from forgelab.runtime.placement import job_from_config

        job = job_from_config(h.job)
    common: PlacementOptions = {"threads": p.threads, "with_gpus": p.with_gpus}
    trainer_at = _where(common, job, h.trainer, procs=p.trainer_procs)
    if h.trainer_hosts > 1:
        trainer_at["hosts"] = h.trainer_hosts
    jobs: list[Awaitable[Stoppable]] = [
        Generator.options(**_where(common, job, h.generator, num_replicas=p.generator_replicas)).as_service(cc["generator"]),
        Trainer.options(**trainer_at).as_actor(cc["trainer"]),
    ]
    with_reference = reference_process(cfg)
    if with_reference:
        jobs.append(ReferenceModel.options(**_where(common, job, h.reference, num_replicas=p.reference_replicas))
                    .as_service(cc["reference"]))
    with_teacher = cfg.teacher.enabled and not teacher_shares_reference(cfg)
    if with_teacher:  # on-policy distillation: the teacher is a logprob service like the reference
        jobs.append(ReferenceModel.options(**_where(common, job, h.reference, num_replicas=cfg.teacher.replicas))
                    .as_service(cfg.teacher.reference_config(cfg.model.dtype)))
    if cfg.rollout.env is not None:  # multi-turn: episodes are played in EnvActor processes
        from forgelab.envs.actor import EnvActor

        jobs.append(EnvActor.options(**_where({"threads": p.threads}, job, h.envs, num_replicas=p.env_replicas))
                    .as_service(cc["envs"]))
    t0 = time.time()
    record: list[StartRecord] = []
    try:  # the generator first, on core(s) of its own while the others start (forgelab.runtime.startup_cpus)
        results = await start_all(jobs, critical=0, critical_cores=p.generator_replicas, pin=job is None,
                                  why_not="the parts run on a monarch.job's hosts (hosts.job)", record=record)
    except BaseException:
        if job is not None:
            job.kill()
        raise
    generators, trainer, services = results[0], results[1], cast("list[ServicePart]", results[2:])
    # as_service answers the component's SERVICE class; as_actor an ActorHandle of it
    if not isinstance(generators, GeneratorService) or not isinstance(trainer, ActorHandle):
        raise TypeError(f"spawn_parts: got {type(generators).__name__} and {type(trainer).__name__}, not a "
                        "GeneratorService and an ActorHandle")
    reference = services[0] if with_reference else None
    teacher = services[int(with_reference)] if with_teacher else reference if cfg.teacher.enabled else None
    return Parts(
        generators=generators, trainer=cast("ActorHandle[Trainer]", trainer), reference=reference, teacher=teacher,
        envs=services[-1] if cfg.rollout.env is not None else None,
        job=job, seconds=time.time() - t0, startup=record[0] if record else None,
    )
