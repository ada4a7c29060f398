"""A warm process pool: generator, trainer, reference (and env) processes that outlive one run.

    pool = ProcessPool()
    run = Run(cfg, spawn=pool)          # cold: spawns the parts (as without a pool)
    await run.wait(); await run.shutdown()   # the parts go back to the pool, processes alive
    run2 = Run(cfg2, spawn=pool)        # warm: the same processes, re-initialised from cfg2
    pool.pids()                         # {"generators": [...], "trainer": [...], ...}
    await pool.shutdown()               # frees every process

A set of parts is reusable by a new run when everything that fixes the
*processes and engines* is the same: the model, the generator's engine config
(vLLM settings; sampling is per request), the reference config, the env config
and the placement (replicas, trainer processes, threads). Re-initialising a
reused set (`acquire`): the trainer rebuilds model, optimizer, schedule, loss
and seeds from the new run's trainer config in its process (`Trainer.reinit`),
the generators forget their served version and receive the fresh weights as
version 0. A run resuming or forking from a checkpoint then loads it as usual
(`forgelab.controller.checkpoint.restore`). A config that needs another engine gets new
processes, and the pool says why (log line and `pool.last_note`).

`Run.shutdown()` on a pooled run returns its parts (`PooledParts.shutdown`);
only `pool.shutdown()` stops processes. Parts whose processes failed are not
kept. Runs on a `monarch.job` (hosts.job) are not pooled.

Memory: every idle set holds a generator, a trainer (model and optimizer) and a
reference; `ProcessPool(max_idle=N)` keeps at most N idle sets, closing the one
idle longest when a returned set would exceed it (None: no cap; 0: nothing kept
idle, every returned set is stopped). The test suite keeps one set per worker.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, cast

from forgelab.config.run_config import RunConfig
from forgelab.runtime.startup_cpus import start_shadow_work
from forgelab.engines.spawn import Parts, ServicePart, SpawnedParts, component_configs, reference_process
from forgelab.types import WeightPush

if TYPE_CHECKING:
    from forgelab.engines.generator_service import GeneratorService
    from forgelab.engines.trainer import Trainer
    from forgelab.runtime.mesh import ActorHandle

log = logging.getLogger("forgelab.engines.pool")

__all__ = ["ProcessPool", "PooledParts", "engine_key"]


def _fields(obj: object, drop: tuple[str, ...] = ()) -> str | None:
    if obj is None:
        return None
    d = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else dict(vars(obj))
    return repr(sorted((k, v) for k, v in d.items() if k not in drop))


def engine_key(cfg: RunConfig) -> dict[str, str | None]:
    """What fixes a run's processes and engines, as comparable strings (equal keys: the processes can be reused)."""
    cc = component_configs(cfg)
    t = cc["trainer"]
    return {
        "model": repr((cfg.model.path, cfg.model.dtype, cfg.model.max_model_len)),
        "generator": _fields(cc["generator"], drop=("sampling", "update_mode")),  # both per run (_reinit sets the mode)
        "trainer": repr((t.model_dir, getattr(t, "dtype", None), t.device, t.weight_transport, t.shm_dir)),
        "reference": _fields(cc["reference"]) if reference_process(cfg) else "none",
        "envs": _fields(cc["envs"]) if cfg.rollout.env is not None else "none",
        "teacher": _fields(cfg.teacher, drop=("coef",)) if cfg.teacher.enabled else "none",  # coef: per run
        "placement": _fields(cfg.placement),
    }


@dataclasses.dataclass
class PooledParts(Parts["GeneratorService", "ActorHandle[Trainer]"]):
    """`Parts` lent by a pool: `shutdown()` gives them back (processes stay up)."""

    pool: ProcessPool | None = None
    key: dict[str, str | None] | None = None
    runs: int = 1
    """How many runs these processes have served (1: freshly spawned)."""

    async def shutdown(self) -> None:
        if self.pool is not None:
            await self.pool.release(self)

    async def stop_processes(self) -> None:
        await Parts.shutdown(self)


class ProcessPool:
    """Keeps parts alive between runs in one kernel or script; pass it as `Run(cfg, spawn=pool)`."""

    def __init__(self, max_idle: int | None = None) -> None:
        if max_idle is not None and max_idle < 0:
            raise ValueError(f"ProcessPool(max_idle={max_idle}): give a count of idle process sets to keep, "
                             "0 or more (None: no cap)")
        self.max_idle = max_idle
        """At most this many idle sets are kept (the oldest idle one is closed first); None: no cap."""
        self.idle: list[PooledParts] = []
        """Idle sets, the longest idle first."""
        self.busy: list[PooledParts] = []
        self.last_note = ""
        self.spawned = 0
        """Sets of parts spawned so far (each one a cold start)."""
        self.reused = 0
        self._lock = asyncio.Lock()

    async def __call__(self, cfg: RunConfig) -> SpawnedParts:
        return await self.acquire(cfg)

    async def acquire(self, cfg: RunConfig) -> SpawnedParts:
        """Idle parts with the same engine key, re-initialised from `cfg`; otherwise newly spawned ones."""
        from forgelab.engines.spawn import spawn_parts

        if cfg.hosts.job is not None:
            self._note(f"{cfg.name}: runs on a monarch.job (hosts.job): not pooled, new processes")
            return await spawn_parts(cfg)
        key = engine_key(cfg)
        async with self._lock:
            match = next((p for p in self.idle if p.key == key), None)
            if match is not None:
                self.idle.remove(match)
                self.busy.append(match)
        if match is not None:
            start_shadow_work()  # nothing to launch: the controller's own start-up runs beside the re-initialisation
            t0 = time.time()
            try:
                await self._reinit(match, cfg)
            except Exception:
                self.busy.remove(match)
                await match.stop_processes()
                raise
            match.runs += 1
            match.seconds = time.time() - t0
            self.reused += 1
            self._note(f"{cfg.name}: reusing warm processes (re-initialised in {match.seconds:.1f} s)")
            return match
        if self.idle:
            idle_key = self.idle[0].key or {}
            diff = sorted(k for k in key if k not in idle_key or idle_key[k] != key[k])
            self._note(f"{cfg.name}: new processes: the idle ones differ in {', '.join(diff)} "
                       "(another model or engine setting needs another engine)")
        elif self.busy:
            self._note(f"{cfg.name}: new processes: every pooled set is in use by a run")
        else:
            self._note(f"{cfg.name}: new processes (the pool is empty)")
        parts = await spawn_parts(cfg)
        pooled = PooledParts(**{f.name: getattr(parts, f.name) for f in dataclasses.fields(Parts)}, pool=self, key=key)
        self.spawned += 1
        self.busy.append(pooled)
        return pooled

    async def _reinit(self, parts: PooledParts, cfg: RunConfig) -> None:
        cc = component_configs(cfg)
        trainer, generators = parts.trainer, parts.generators
        if trainer is None or generators is None:  # idle parts are never shut down
            raise RuntimeError("pool: a pooled set without its trainer or generators")
        # the process group (and its port) is kept: the new config's rendezvous fields are not used
        await trainer.call("reinit", cc["trainer"])
        await generators.reset_version(-1)
        # the update mode is the new run's (a respawned replica's config too): it fixes no engine, only how a push loads
        await generators.fanout("set_update_mode", cc["generator"].update_mode)
        generators.args = (cc["generator"], *generators.args[1:])
        # the fresh weights as version 0 (the model's own unless the trainer config changed them: it does not)
        live = [h for h in generators.handles() if h is not None]
        raw = cast(WeightPush, (await trainer.call("push_weights", 0, [h.actor for h in live]))[0])  # rank 0's report
        failed = cast("dict[int, str]", raw.get("failed") or {})  # WeightPush.failed: generator index -> error
        if failed:
            raise RuntimeError(f"pool: the fresh weights did not reach generators {sorted(failed)}: {failed}")
        for i, h in enumerate(generators.handles()):
            if h is not None:
                generators.set_replica_info(i, version=0)

    async def release(self, parts: PooledParts) -> None:
        """A run is done with `parts`: keep them idle (healthy) or stop them (a process failed)."""
        services: tuple[ServicePart | None, ...] = (parts.generators, parts.reference, parts.envs, parts.teacher)
        for svc in services:
            if svc is not None:  # the finished run's listeners must not hear the next run's events
                svc.clear_listeners()
                if hasattr(svc, "on_respawn"):
                    setattr(svc, "on_respawn", None)
        async with self._lock:
            if parts in self.busy:
                self.busy.remove(parts)
        if not await self._healthy(parts):
            self._note("pool: a returned set had failed processes: stopped, not kept")
            await parts.stop_processes()
            return
        async with self._lock:
            self.idle.append(parts)
            over = self.idle[:max(0, len(self.idle) - self.max_idle)] if self.max_idle is not None else []
            del self.idle[:len(over)]
        for old in over:  # the memory cap: the sets idle longest go first
            self._note(f"pool: an idle set closed (max_idle={self.max_idle}; it served {old.runs} runs)")
            await old.stop_processes()

    @staticmethod
    async def _healthy(parts: PooledParts) -> bool:
        if parts.trainer is None or getattr(parts.trainer, "failed", False) or not getattr(parts.trainer, "alive", True):
            return False
        try:
            await asyncio.wait_for(parts.trainer.call("info"), timeout=60)
        except Exception:
            return False
        services: tuple[ServicePart | None, ...] = (parts.generators, parts.reference, parts.envs, parts.teacher)
        for svc in services:
            if svc is not None and any(s.state != "healthy" for s in svc.status()):
                return False
        return True

    async def pids(self, parts: PooledParts | None = None) -> dict[str, list[int]]:
        """Process ids of `parts` (default: every pooled set, idle and busy) by part."""
        out: dict[str, list[int]] = {"generators": [], "trainer": [], "reference": [], "envs": []}
        for p in [parts] if parts is not None else [*self.busy, *self.idle]:
            if p.trainer is not None:  # None only after its processes stopped
                out["trainer"] += await p.trainer.pids()
            for name in ("generators", "reference", "envs"):
                svc: ServicePart | None = getattr(p, name)
                if svc is not None:
                    out[name] += [pid for s in svc.status() for pid in s.pids]
        return out

    def status(self) -> list[dict[str, object]]:
        """One row per pooled set: state (idle/busy), runs served, and its key's model (the services panel shows it)."""
        rows: list[dict[str, object]] = []
        for state, sets in (("busy", self.busy), ("idle", self.idle)):
            for p in sets:
                rows.append({"state": state, "runs_served": p.runs, "model": (p.key or {}).get("model", ""),
                             "generator_replicas": len(p.generators.status()) if p.generators is not None else 0})
        return rows

    async def close_idle(self) -> int:
        """Stop the idle process sets (their memory back before something big); busy ones stay. Returns how many."""
        async with self._lock:
            sets, self.idle = self.idle, []
        for p in sets:
            await p.stop_processes()
        return len(sets)

    async def shutdown(self) -> None:
        """Stop every idle process set (and busy ones: their runs lose their processes)."""
        async with self._lock:
            sets, self.idle, self.busy = [*self.idle, *self.busy], [], []
        for p in sets:
            await p.stop_processes()

    def _note(self, text: str) -> None:
        self.last_note = text
        (log.warning if "differ" in text or "failed" in text else log.info)("forgelab pool: %s", text)

    def __repr__(self) -> str:
        return f"<ProcessPool max_idle {self.max_idle} idle {len(self.idle)} busy {len(self.busy)} spawned {self.spawned} reused {self.reused}>"
