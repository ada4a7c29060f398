"""Spawning a run's parts: the generator service, the trainer, the reference service and the env service.

    parts = await spawn_parts(cfg)        # all started in parallel; a failure stops the others
    parts.generators, parts.trainer, parts.reference, parts.envs
    await parts.shutdown()

The component configs each actor receives are built by `component_configs(cfg)`
(pure: no process starts), so what a YAML file sets can be checked without a spawn.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from forgelab.config import RunConfig


@dataclass
class Parts:
    """The processes of one run. `reference` / `envs` are None when the config asks for none."""

    generators: Any
    trainer: Any
    reference: Any = None
    envs: Any = None
    job: Any = None
    """The `monarch.job` job the parts run on (None: this host); `shutdown` kills it."""
    seconds: float = 0.0
    """Wall time the spawn took."""

    async def shutdown(self) -> None:
        for svc in (self.generators, self.reference, self.envs):
            if svc is not None:
                await svc.shutdown()
        if self.trainer is not None:
            await self.trainer.shutdown()
        if self.job is not None:
            try:
                self.job.kill()
            except Exception:
                pass
        self.generators = self.trainer = self.reference = self.envs = self.job = None


def component_configs(cfg: RunConfig) -> dict[str, Any]:
    """The config object each component is spawned with: {"generator", "trainer", "reference", "env"}."""
    from forgelab.envs.actor import EnvActorConfig
    from forgelab.generator import GeneratorConfig, SamplingConfig
    from forgelab.trainer import ReferenceConfig, TrainerConfig

    p = cfg.placement
    gcfg = GeneratorConfig(
        model_dir=cfg.model.path, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
        kv_cache_gib=p.kv_cache_gib,
        sampling=SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_tokens=cfg.rollout.max_tokens),
    )
    tcfg = TrainerConfig(
        model_dir=cfg.model.path, lr=cfg.train.lr, warmup_steps=cfg.train.warmup_steps,
        total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio, weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.max_grad_norm, loss=cfg.train.loss, loss_kwargs=dict(cfg.train.loss_kwargs),
        is_cap=cfg.train.is_cap, seed=cfg.train.seed,
    )
    rcfg = ReferenceConfig(model_dir=cfg.model.path)
    ecfg = EnvActorConfig(model_dir=cfg.model.path, max_concurrent=p.env_max_concurrent)
    return {"generator": gcfg, "trainer": tcfg, "reference": rcfg, "env": ecfg}


async def spawn_parts(cfg: RunConfig) -> Parts:
    """Start every part of `cfg` in parallel; if one fails, stop the others and raise its error."""
    from forgelab.generator import Generator
    from forgelab.trainer import ReferenceModel, Trainer

    p = cfg.placement
    cc = component_configs(cfg)
    common = dict(threads=p.threads, with_gpus=p.with_gpus)
    jobs = [
        Generator.options(num_replicas=p.generator_replicas, **common).as_service(cc["generator"]),
        Trainer.options(procs=p.trainer_procs, **common).as_actor(cc["trainer"]),
    ]
    if p.reference:
        jobs.append(ReferenceModel.options(num_replicas=p.reference_replicas, **common).as_service(cc["reference"]))
    if cfg.rollout.env is not None:  # multi-turn: episodes are played in EnvActor processes
        from forgelab.envs.actor import EnvActor

        jobs.append(EnvActor.options(num_replicas=p.env_replicas, threads=p.threads).as_service(cc["env"]))
    t0 = time.time()
    results = await asyncio.gather(*jobs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r.shutdown()
        raise failed[0]
    return Parts(
        generators=results[0], trainer=results[1],
        reference=results[2] if p.reference else None,
        envs=results[-1] if cfg.rollout.env is not None else None,
        seconds=time.time() - t0,
    )
