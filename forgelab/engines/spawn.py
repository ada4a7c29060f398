"""Spawning a run's parts: the generator service, the trainer, the reference service and the env service.

    parts = await spawn_parts(cfg)        # all started in parallel; a failure stops the others
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
from typing import Any

from forgelab.config.run_config import RunConfig

log = logging.getLogger("forgelab.engines.spawn")


@dataclass
class Parts:
    """The processes of one run. `reference` / `envs` / `teacher` are None when the config asks for none;
    `teacher` is the reference's service itself when both are the run's model (`teacher_service`)."""

    generators: Any
    trainer: Any
    reference: Any = None
    envs: Any = None
    teacher: Any = None
    job: Any = None
    """The `monarch.job` job the parts run on (None: this host); `shutdown` kills it."""
    seconds: float = 0.0
    """Wall time the spawn took."""

    async def shutdown(self) -> None:
        """Stop every part, all at once, then kill the hosts job. A part that fails to stop is logged and
        the rest still stop; the job is killed whatever happened before (its hosts would outlive the run).

        At once because a part's stop is mostly waiting for its processes to exit (1.5-4 s each on the
        tiny model): one after the other, the waits added up (7.1 s for generator, reference and trainer
        vs 3.7 s together)."""
        try:
            names = [n for n in ("generators", "reference", "envs", "trainer", "teacher") if getattr(self, n) is not None
                     and not (n == "teacher" and self.teacher is self.reference)]
            results = await asyncio.gather(*(getattr(self, n).shutdown() for n in names), return_exceptions=True)
            for name, err in zip(names, results):  # the other parts and the job still stopped
                if isinstance(err, Exception):
                    log.warning("forgelab: stopping the %s failed: %s: %s", name, type(err).__name__, err)
            for err in results:
                if isinstance(err, BaseException) and not isinstance(err, Exception):
                    raise err
        finally:
            if self.job is not None:
                await _shutdown_job_hosts(self.job)
                try:
                    self.job.kill()
                except Exception as err:  # noqa: BLE001
                    log.warning("forgelab: killing the hosts job failed: %s: %s", type(err).__name__, err)
            self.generators = self.trainer = self.reference = self.envs = self.teacher = self.job = None


async def _shutdown_job_hosts(job: Any, timeout: float = 30.0) -> None:
    """Stop the job's host workers through Monarch (`HostMesh.shutdown`) before the job is killed.

    `job.kill()` ends what the job started on this machine; for an SSH job that is the local `ssh` client,
    and the worker it started on the node outlives it (no tty, no hangup). Shutting the host meshes down
    ends the workers themselves, wherever they run. Failures are logged: the kill still follows."""
    from forgelab.runtime.placement import job_mesh_names

    try:
        state = job.state(cached_path=None)
        meshes = [getattr(state, name) for name in job_mesh_names(job)]
    except Exception as err:  # noqa: BLE001 -- a job that cannot report its state is still killed
        log.warning("forgelab: the hosts job's state is unavailable (%s: %s); killing it", type(err).__name__, err)
        return
    results = await asyncio.gather(*(asyncio.wait_for(m.shutdown(), timeout) for m in meshes),
                                   return_exceptions=True)
    for err in results:
        if isinstance(err, BaseException):
            log.warning("forgelab: shutting down a host mesh failed: %s: %s", type(err).__name__, err)


def component_configs(cfg: RunConfig) -> dict[str, Any]:
    """The config object each component is spawned with: {"generator", "trainer", "reference", "envs"}."""
    from forgelab.algos.loss_checks import completion_budget, with_completion_budget, without_reference
    from forgelab.engines.loss_specs import shipped_loss

    cc = {section: cfg.component(section) for section in ("generator", "trainer", "reference", "envs")}
    t = cc["trainer"]  # dr_grpo normalises by the completion budget unless loss_kwargs set max_tokens
    t.loss_kwargs = with_completion_budget(t.loss, t.loss_kwargs, completion_budget(cfg.rollout))
    if not cfg.placement.reference:  # grpo's default kl_coef cannot apply: 0, written in (Run says so)
        t.loss_kwargs, _ = without_reference(t.loss, t.loss_kwargs)
    t.loss = shipped_loss(t.loss)  # a function, or a LOSSES entry the trainer process lacks, travels by value
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


def _where(job: Any, mesh: str | None) -> dict[str, Any]:
    """Placement keywords putting a part on host mesh `mesh` of `job` (this host when either is None)."""
    return {"job": job, "mesh": mesh} if job is not None and mesh is not None else {}


async def start_all(jobs: list) -> list:
    """Await every part's start together; if any fails, shut down the ones that started and raise the first
    error (no process is left behind)."""
    results = await asyncio.gather(*jobs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r.shutdown()
        raise failed[0]
    return list(results)


async def spawn_parts(cfg: RunConfig) -> Parts:
    """Start every part of `cfg` in parallel; if one fails, stop the others (and the job) and raise its error."""
    from forgelab.engines.generator import Generator
    from forgelab.engines.trainer import ReferenceModel, Trainer

    p, h = cfg.placement, cfg.hosts
    cc = component_configs(cfg)
    job = None
    if h.job is not None:
        from forgelab.runtime.placement import job_from_config

        job = job_from_config(h.job)
    common = dict(threads=p.threads, with_gpus=p.with_gpus)
    trainer_hosts = {"hosts": h.trainer_hosts} if h.trainer_hosts > 1 else {}
    jobs = [
        Generator.options(num_replicas=p.generator_replicas, **common, **_where(job, h.generator)).as_service(cc["generator"]),
        Trainer.options(procs=p.trainer_procs, **common, **trainer_hosts, **_where(job, h.trainer)).as_actor(cc["trainer"]),
    ]
    with_reference = reference_process(cfg)
    if with_reference:
        jobs.append(ReferenceModel.options(num_replicas=p.reference_replicas, **common,
                                           **_where(job, h.reference)).as_service(cc["reference"]))
    with_teacher = cfg.teacher.enabled and not teacher_shares_reference(cfg)
    if with_teacher:  # on-policy distillation: the teacher is a logprob service like the reference
        jobs.append(ReferenceModel.options(num_replicas=cfg.teacher.replicas, **common, **_where(job, h.reference))
                    .as_service(cfg.teacher.reference_config(cfg.model.dtype)))
    if cfg.rollout.env is not None:  # multi-turn: episodes are played in EnvActor processes
        from forgelab.envs.actor import EnvActor

        jobs.append(EnvActor.options(num_replicas=p.env_replicas, threads=p.threads,
                                     **_where(job, h.envs)).as_service(cc["envs"]))
    t0 = time.time()
    try:
        results = await start_all(jobs)
    except BaseException:
        if job is not None:
            job.kill()
        raise
    reference = results[2] if with_reference else None
    teacher = results[2 + with_reference] if with_teacher else reference if cfg.teacher.enabled else None
    return Parts(
        generators=results[0], trainer=results[1], reference=reference, teacher=teacher,
        envs=results[-1] if cfg.rollout.env is not None else None,
        job=job, seconds=time.time() - t0,
    )
