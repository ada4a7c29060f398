"""Many LoRA runs on one set of engines: variants that share the generator and the trainer, forked live.

    engines = SharedEngines(cfg, slots=4)            # processes start with the first run attached
    run = Run(cfg, spawn=engines); await run.start() # a LoRA run in slot 0
    kids = await engines.sweep(run, {"lr_hi": {"lr": 4e-3}, "dapo": {"loss": "dapo"}})   # forks into slots
    child = await run.fork(loss="dapo")             # also into a slot: run.parts.pool is the engines
    await kids["dapo"].shutdown()                    # detaches it: its slot is freed, the processes stay
    engines.status(); await engines.shutdown()

What is shared and what is not. The processes: one generator service (`SlotGenerator`: one vLLM engine,
``max_loras`` = 2 x slots adapters, so a replaced adapter can finish its running requests beside the new one)
and one trainer (`SlotTrainer`), plus the reference service when the config has one. Each attached `Run`
keeps everything else of its own (buffer, rewards, loss, schedule, data position, event log, run
directory, tracker), and in the processes its own slot: adapter weights, optimizer state, schedule and
loss in the trainer (`forgelab.engines.trainer_slots`), adapter and version in the generator
(`forgelab.weights.adapter_slots`). The generator batches all runs' requests together; a run's weight push
replaces its own adapter only and stops no one's generation. The trainer steps one run's batch at a time
(N runs: N trainer steps, the base forward/backward is not shared between runs).

A fork of a run on shared engines (`run.fork`, `sweep`) goes into a free slot: no process starts; the
trainer's state (adapter, optimizer, schedule, loss) is copied in memory into the slot (`copy_slot`), only the
controller's state (step, data position, buffer, counters, rewards) goes through the fork checkpoint
(``run.fork(through_disk=True)``: the trainer's too). What cannot share (a full-parameter run, an environment
run, another model or engine setting) is refused with the reason.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, cast

from forgelab.controller.facade import RunFacade

if TYPE_CHECKING:
    from forgelab.config.run_config import RunConfig
    from forgelab.engines.generator_service import GeneratorService, ReplicaActor
    from forgelab.engines.shared_parts import SlotParts
    from forgelab.engines.spawn import Parts
    from forgelab.engines.trainer_slots import SlotTrainer
    from forgelab.runtime.mesh import ActorHandle
    from forgelab.engines.trainer_client import TrainerClient
    from forgelab.experiments.fork import ForkOverrides

__all__ = ["SharedEngines"]

_ids = itertools.count(1)


class SharedEngines:
    """Processes shared by up to ``slots`` LoRA runs; pass it as ``Run(cfg, spawn=engines)``.

    Args:
        config: a `RunConfig` (or dict / YAML path) with ``lora.enabled``; it fixes the model, the engine
            settings and the placement every attached run must share.
        slots: how many runs can be attached at once.
    """

    def __init__(self, config: "RunConfig | dict[str, object] | str | Path", *, slots: int = 4):
        from forgelab.config.run_config import RunConfig

        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"SharedEngines(slots=...): a positive integer, got {slots!r}")
        cfg = config if isinstance(config, RunConfig) else (
            RunConfig.from_dict(config) if isinstance(config, dict) else RunConfig.from_yaml(config))
        self.slots = slots
        self.config = self._shared_config(cfg.validate())
        self._check(self.config)
        self.name = f"engines{next(_ids)}"
        self.parts: Parts[GeneratorService, ActorHandle[SlotTrainer]] | None = None
        self.attached: dict[str, SlotParts | None] = {}  # slot -> SlotParts (None: reserved)
        self.run_names: dict[str, str] = {}  # slot -> the attached run's name
        self.spawn_s = 0.0
        self.last_note = ""
        self.watched: list[RunFacade] = []
        self._lock = asyncio.Lock()

    def _shared_config(self, cfg: "RunConfig") -> "RunConfig":
        cfg = copy.deepcopy(cfg)
        # the generator section's class is derived at run time (forgelab/config/sections.py): read by name
        gen = cfg.generator
        setattr(gen, "max_loras", max(int(getattr(gen, "max_loras")), 2 * self.slots))
        return cfg

    def _check(self, cfg: "RunConfig") -> None:
        who = f"run {cfg.name!r}"
        if not cfg.lora.enabled:
            raise ValueError(f"{who} is a full-parameter run (lora.enabled false): shared engines hold LoRA runs "
                             "only (each a slot). Give it its own processes (Run(cfg) without spawn=engines), "
                             "or enable lora")
        if cfg.rollout.env is not None:
            raise ValueError(f"{who} plays environment episodes (rollout.env {cfg.rollout.env!r}): its turns reach "
                             "the generator from env processes, which do not carry a LoRA slot; run it on its own "
                             "processes")
        if cfg.hosts.job is not None:
            raise ValueError(f"{who} runs on a monarch.job (hosts.job): shared engines run on this host")

    # ------------------------------------------------------------------ processes
    async def start(self) -> "SharedEngines":
        """Spawn the shared processes (if not yet): SlotGenerator service, SlotTrainer, reference if configured."""
        async with self._lock:
            if self.parts is None:
                await self._spawn()
        return self

    async def _spawn(self) -> None:
        from forgelab.engines.trainer_slots import SlotTrainer
        from forgelab.engines.generator_slots import SlotGenerator
        from forgelab.engines.generator_service import GeneratorService
        from forgelab.engines.spawn import Parts, ServicePart, Stoppable, component_configs, reference_process, start_all
        from forgelab.engines.trainer import ReferenceModel
        from forgelab.engines.pool import engine_key
        from forgelab.runtime.mesh import ActorHandle

        cfg, p = self.config, self.config.placement
        cc = component_configs(cfg)
        threads, gpus = p.threads, p.with_gpus
        jobs: list[Awaitable[Stoppable]] = [SlotGenerator.options(num_replicas=p.generator_replicas, threads=threads, with_gpus=gpus)
                .as_service(cc["generator"]),
                SlotTrainer.options(procs=p.trainer_procs, threads=threads, with_gpus=gpus).as_actor(cc["trainer"])]
        if reference_process(cfg):
            jobs.append(ReferenceModel.options(num_replicas=p.reference_replicas, threads=threads, with_gpus=gpus)
                        .as_service(cc["reference"]))
        t0 = time.time()
        results = await start_all(jobs, critical=0, critical_cores=p.generator_replicas)  # the generator first
        self.spawn_s = time.time() - t0
        generators, trainer, services = results[0], results[1], cast("list[ServicePart]", results[2:])
        # as_service answers the component's SERVICE class; as_actor an ActorHandle of it
        if not isinstance(generators, GeneratorService) or not isinstance(trainer, ActorHandle):
            raise TypeError(f"{self.name}: got {type(generators).__name__} and {type(trainer).__name__}, not a "
                            "GeneratorService and an ActorHandle")
        self.parts = Parts(generators=generators, trainer=cast("ActorHandle[SlotTrainer]", trainer),
                           reference=services[0] if services else None, seconds=self.spawn_s)
        generators.on_respawn = self._respawned
        self.key = engine_key(cfg)

    async def _respawned(self, handle: "ReplicaActor") -> None:
        """A generator replica came back empty: every attached run pushes its adapter to it (its catch_up)."""
        for parts in list(self.attached.values()):
            if parts is None or parts.generators is None:  # a slot reserved for a fork's child: no run, no adapter
                continue
            hook = parts.generators.on_respawn
            if hook is not None:
                await hook(handle)

    # ------------------------------------------------------------------ runs
    def free_slots(self) -> list[str]:
        return [s for s in (f"slot{i}" for i in range(self.slots)) if s not in self.attached]

    async def __call__(self, cfg: "RunConfig") -> "SlotParts":
        return await self.attach(cfg)

    def _handles(self) -> "tuple[ActorHandle[SlotTrainer], GeneratorService]":
        """The shared trainer actor and generator service; raises when the processes are down."""
        parts = self.parts
        if parts is None or parts.trainer is None or parts.generators is None:
            raise RuntimeError(f"{self.name}: its processes are not running (await engines.start())")
        return parts.trainer, parts.generators

    def _processes(self) -> "tuple[TrainerClient, GeneratorService]":
        """The shared trainer (typed calls) and generator service; raises when the processes are down."""
        from forgelab.engines.trainer_client import TrainerClient

        trainer, generators = self._handles()
        return TrainerClient(trainer), generators

    async def copy_slot(self, src: str) -> "ReservedSlot":
        """Reserve a free slot holding an exact copy of slot ``src``'s trainer state (adapter, optimizer,
        schedule, loss, step, version: in memory); returns the ``spawn`` a fork's child attaches with
        (`forgelab.experiments.fork`)."""
        slot = await self._reserve()
        try:
            trainer, generators = self._processes()
            await generators.drop_slot(slot)
            await trainer.slot_copy(src, slot)
        except BaseException:
            self.attached.pop(slot, None)
            raise
        return ReservedSlot(self, slot)

    async def release(self, slot: str) -> bool:
        """Give back slot ``slot`` if it is still only reserved (no run attached to it); True if it was."""
        if slot not in self.attached or self.attached[slot] is not None:
            return False
        try:
            await self._processes()[0].slot_free(slot)
        finally:
            self.attached.pop(slot, None)
        return True

    async def _reserve(self) -> str:
        async with self._lock:
            free = self.free_slots()
            if not free:
                raise RuntimeError(f"{self.name}: all {self.slots} slots are in use ("
                                   + ", ".join(f"{s}: {n}" for s, n in sorted(self.run_names.items()))
                                   + "); detach a run (await run.shutdown()) or make SharedEngines(slots=...) larger")
            self.attached[free[0]] = None  # reserved
            return free[0]

    async def attach(self, cfg: "RunConfig", reserved: str | None = None) -> "SlotParts":
        """A run's parts on these engines (`SlotParts`): a free slot with fresh adapters and `cfg`'s trainer
        settings (loss, lr, schedule), or the ``reserved`` slot `copy_slot` filled. Refuses a config that
        cannot share the engines, naming why."""
        from forgelab.engines.pool import engine_key
        from forgelab.engines.shared_parts import SlotGenerators, SlotParts, SlotTrainerHandle
        from forgelab.engines.spawn import component_configs

        try:
            self._check(cfg)
            await self.start()
            key = engine_key(self._shared_config(cfg))
            diff = sorted(k for k in key if key[k] != self.key.get(k))
            if diff:
                raise ValueError(f"run {cfg.name!r} cannot share {self.name}: it differs in {', '.join(diff)} (the "
                                 "model, engine, lora shape and placement are the engines'); give it its own processes")
        except BaseException:
            if reserved is not None:  # a fork's copy: give it back
                await self.release(reserved)
            raise
        t0 = time.time()
        if reserved is not None:
            if reserved not in self.attached or self.attached[reserved] is not None:
                raise ValueError(f"{self.name}: slot {reserved!r} is not reserved (copy_slot reserves one)")
            slot = reserved
        else:
            slot = await self._reserve()
            try:
                trainer, generators = self._processes()
                await generators.drop_slot(slot)  # nothing left from a detached run
                await trainer.slot_new(slot, component_configs(cfg)["trainer"])
            except BaseException:
                self.attached.pop(slot, None)
                raise
        if self.parts is None:
            raise RuntimeError(f"{self.name}: its processes stopped while {cfg.name!r} attached")
        shared_trainer, shared_generators = self._handles()
        parts = SlotParts(generators=SlotGenerators(shared_generators, slot),
                          trainer=SlotTrainerHandle(shared_trainer, slot), reference=self.parts.reference,
                          seconds=time.time() - t0, pool=self, slot=slot)
        self.attached[slot], self.run_names[slot] = parts, cfg.name
        self.last_note = f"{cfg.name} attached to {slot} in {parts.seconds:.2f} s"
        return parts

    async def detach(self, target: "RunFacade | SlotParts | str") -> None:
        """Free a slot: ``target`` is an attached `Run` (stopped and shut down: its `shutdown` detaches it), its
        `SlotParts`, or a slot name. The processes and the other runs go on."""
        from forgelab.engines.shared_parts import SlotParts

        if not isinstance(target, str) and hasattr(target, "shutdown") and hasattr(target, "config"):
            await target.shutdown()
            return
        parts = (self.attached.get(target) if isinstance(target, str) else
                 target if isinstance(target, SlotParts) else None)
        if parts is None or self.attached.get(parts.slot) is not parts:
            return  # detached already (the slot may hold another run now)
        slot = parts.slot
        if parts.generators is not None:  # always set on attach; SlotParts.shutdown detaches, never clears it
            parts.generators.detach()
        self.attached[slot] = None  # still reserved while the processes forget it
        try:
            if self.parts is not None:
                trainer, generators = self._processes()
                await trainer.slot_free(slot)
                await generators.drop_slot(slot)
        finally:
            self.attached.pop(slot, None)
            self.last_note = f"{self.run_names.pop(slot, '?')} detached from {slot}"

    def watch(self, run: RunFacade, rollouts: int = 2) -> None:
        """Pause ``run`` alone when its reward fails on every episode of ``rollouts`` rollouts in a row (no step
        between): a variant whose reward raises would otherwise keep the shared generator busy for nothing.
        `sweep` watches the parent and every child; ``run.resume()`` after fixing the reward."""
        limit = rollouts * run.config.rollout.prompts_per_rollout * run.config.rollout.group_size
        failed, reason = 0, ""  # reward failures in a row, the last one's reason

        def listener(msg: dict[str, object]) -> None:
            nonlocal failed, reason
            ev = msg.get("event")
            if ev is None:
                failed = 0 if "step" in msg else failed  # a metrics row: a step trained
            elif isinstance(ev, dict) and ev.get("kind") == "reward_error":
                failed, reason = failed + 1, str(ev.get("reason", ""))
                if failed >= limit and run.state == "running":
                    run.pause(f"paused by {self.name}: the last {failed} episodes all failed their reward "
                              f"({reason}; see run.reward_failures); the other runs on these engines go "
                              "on. Fix the reward (run.add_reward(name, fn, replace=True)), then run.resume()")
                    failed = 0

        run.add_listener(listener)

    async def sweep(self, parent: RunFacade, variants: "Mapping[str, ForkOverrides]", *,
                    start: bool = True) -> dict[str, RunFacade]:
        """Fork ``parent`` (a run on these engines) into one slot per entry of ``variants`` ({name: overrides},
        overrides as for `Run.fork`), all from the same parent state; ``{name: child Run}``, started."""
        from forgelab.experiments.fork import fork

        if getattr(parent.parts, "pool", None) is not self:
            raise ValueError(f"sweep: run {parent.config.name!r} is not attached to {self.name}; start it with "
                             "Run(cfg, spawn=engines)")
        if len(variants) > len(self.free_slots()):
            raise RuntimeError(f"sweep: {len(variants)} variants but {len(self.free_slots())} free slots of "
                               f"{self.slots}; detach runs or make SharedEngines(slots=...) larger")
        was_running = parent.state == "running"
        if parent not in self.watched:
            self.watched.append(parent)
            self.watch(parent)
        children: dict[str, RunFacade] = {}
        try:
            # the parent stays paused: every child starts at its step; the children start together at the end
            # (a fork's trainer calls would otherwise wait behind the steps of the children started before it)
            for name, overrides in variants.items():
                children[name] = child = await fork(parent, name=name, pause_parent=True, start=False, pool=self,
                                                    **overrides)
                self.watch(child)
            if start:
                await asyncio.gather(*(c.start() for c in children.values()))
        except BaseException:  # no half sweep: the children made so far free their slots
            await asyncio.gather(*(c.shutdown() for c in children.values()), return_exceptions=True)
            raise
        finally:
            if was_running:
                parent.resume()
        return children

    # ------------------------------------------------------------------ views
    def status(self) -> list[dict[str, object]]:
        """One row per slot: the run in it (or free) and its state, step and version."""
        rows: list[dict[str, object]] = []
        for i in range(self.slots):
            slot = f"slot{i}"
            parts = self.attached.get(slot)
            rows.append({"engines": self.name, "slot": slot, "run": self.run_names.get(slot),
                         "versions": (dict(parts.generators.versions)
                                      if parts is not None and parts.generators is not None else {})})
        return rows

    def line(self, parts: object = None) -> str:
        """One line for the services panel: which runs use which slots (``parts``: a run's parts; its ``slot``
        is named when it has one)."""
        used = ", ".join(f"{s}: {n}" for s, n in sorted(self.run_names.items())) or "none"
        slot: str = getattr(parts, "slot", "") if parts is not None else ""
        here = f"this run in {slot}; " if slot else ""
        return f"shared engines {self.name}: {here}{len(self.run_names)}/{self.slots} slots used ({used})"

    def provenance(self, slot: str) -> dict[str, object]:
        """What a variant's manifest records of the engines it ran on."""
        return {"engines": self.name, "slot": slot, "slots": self.slots,
                "runs_attached": dict(sorted(self.run_names.items())),
                "replay": "this run shared generator batches with the other runs on these engines: a sample's "
                          "float results may depend on the batch it was generated in, so a replay of this run "
                          "alone may draw other samples; replay the whole sweep for an exact rerun"}

    async def slot_stats(self) -> dict[str, object]:
        """The trainer's slot table (slots, active, swaps and their time) and the generator's adapters per slot."""
        trainer, generators = self._processes()
        t = await trainer.slot_stats()
        g = await generators.slot_status()
        return {"trainer": t, "generators": g}

    async def shutdown(self) -> None:
        """Detach every run and stop the processes. Stop or shut the runs down first: a run still training
        when its processes stop fails (its slot is gone)."""
        for parts in list(self.attached.values()):
            if parts is not None:
                await self.detach(parts)
        if self.parts is not None:
            processes, self.parts = self.parts, None
            await processes.shutdown()

    def __repr__(self) -> str:
        state = "up" if self.parts else "not started"
        return f"<SharedEngines {self.name} {len(self.run_names)}/{self.slots} slots {state}>"


class ReservedSlot:
    """What `SharedEngines.copy_slot` returns: the ``spawn`` a fork's child attaches to its reserved slot with
    (``await reserved(cfg)``), and ``await reserved.release()`` to give the slot back if the child never
    attaches (its constructor or spawn failed before)."""

    def __init__(self, engines: SharedEngines, slot: str):
        self.engines, self.slot = engines, slot

    async def __call__(self, cfg: "RunConfig") -> "SlotParts":
        return await self.engines.attach(cfg, reserved=self.slot)

    async def release(self) -> bool:
        return await self.engines.release(self.slot)

    def __repr__(self) -> str:
        return f"<ReservedSlot {self.slot} of {self.engines.name}>"


def __getattr__(name: str) -> type[SharedEngines]:
    if name == "Engines":  # the old name read as the package forgelab.engines (issue #38); goes next release
        import warnings

        warnings.warn("forgelab.experiments.variants.Engines is renamed SharedEngines; the old name goes in the "
                      "next release", DeprecationWarning, stacklevel=2)
        return SharedEngines
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
