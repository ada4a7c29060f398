"""Fork a run at a step boundary: a child that starts from the parent's exact state, then takes overrides.

    child = await run.fork(loss="dapo")                      # parent keeps running; child started
    child = await run.fork(pause_parent=True, lr=5e-5, reward_weights={"answer_format": 0.0})
    child = await Run.fork_from("runs/a/checkpoints/step_000020", loss="dapo", pool=pool)

How: the parent is paused and allowed to reach a quiet step boundary (no rollout
being played, no step in flight, the last step's metrics row written); its state
is saved as a checkpoint under ``<parent dir>/forks/`` (trainer weights, optimizer,
schedule, RNG and loss; step, version, data position, replay buffer, episode and
group counters, reward set with code); then the parent resumes unless
``pause_parent``. The child is a new `Run` (its own run directory, named
``<parent>-fork<N>`` unless ``name=``) with its own processes: from the parent's
`forgelab.engines.pool.ProcessPool` when it has one (idle warm processes, else new), or
spawned. It restores the checkpoint, applies the overrides, records its origin
(``origin.json`` and a ``forked_from`` event; the parent logs ``forked``) and starts.

With ``train.max_policy_age`` 0 and the same seed, a fork with no overrides trains
exactly as the parent does from the fork point (sampling is seeded per episode id,
batches are group-ordered; see `forgelab.experiments.replay`).

Overrides: ``loss`` and ``loss_kwargs`` (from the child's first step, via `Run.set_loss`),
``lr`` (peak LR, schedule position kept), ``reward_weights`` (dict), ``rewards``
({name: fn or (fn, weight)}, added), ``steps``, ``max_policy_age``, ``seed``,
``temperature``, and ``config={"section.field": value}`` for any other config field.
"""
from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack, runtime_checkable

from forgelab.controller.events import as_int
from forgelab.controller.facade import RunFacade, SpawnParts

if TYPE_CHECKING:
    from forgelab.algos.losses import LossFn
    from forgelab.config.run_config import RunConfig
    from forgelab.rewards.library import RewardFn
    from forgelab.engines.shared_parts import SlotParts
    from forgelab.engines.trainer_client import TrainerAPI
    from forgelab.types import TrainBatch

__all__ = ["fork", "fork_from", "quiesce", "child_config", "ForkOverrides", "ForkFromOverrides", "RunClass"]


class ForkFromOverrides(TypedDict, total=False):
    """What a fork of a checkpoint may change (`fork_from`); see the module's docstring."""

    loss: str | LossFn
    loss_kwargs: Mapping[str, object]
    lr: float
    reward_weights: Mapping[str, float]
    rewards: Mapping[str, RewardFn | tuple[RewardFn, float]]
    steps: int
    max_policy_age: int
    seed: int
    temperature: float


class ForkOverrides(ForkFromOverrides, total=False):
    """What a fork of a live run may change (`fork`, `SharedEngines.sweep`): `ForkFromOverrides` and ``config``."""

    config: Mapping[str, object]
    """``{"section.field": value}`` for any other config field."""


class RunClass(Protocol):
    """The run class a child is built as (`forgelab.run.Run`, or the parent's own class)."""

    def __call__(self, config: RunConfig, *, resume_from: str | Path | None = None,
                 spawn: SpawnParts | None = None) -> RunFacade: ...


@runtime_checkable
class _Releasable(Protocol):
    """A spawn that holds something for the child until it attaches (`forgelab.experiments.variants.ReservedSlot`)."""

    async def release(self) -> bool: ...


@runtime_checkable
class _SlotCopier(Protocol):
    """A spawn whose slots can be copied in memory (`forgelab.experiments.variants.SharedEngines`)."""

    async def __call__(self, cfg: RunConfig) -> SlotParts: ...

    async def copy_slot(self, src: str) -> SpawnParts: ...

_SHORTCUTS = {"steps": "train.steps", "max_policy_age": "train.max_policy_age", "seed": "train.seed",
              "temperature": "rollout.temperature"}
_AFTER_RESTORE = ("loss", "loss_kwargs", "lr", "reward_weights", "rewards")


def child_config(cfg: RunConfig, name: str, overrides: Mapping[str, object]) -> RunConfig:
    """A copy of `cfg` named `name` with the config-level overrides applied (validated)."""
    cfg = copy.deepcopy(cfg)
    cfg.name = name
    dotted = dict(_mapping(overrides.get("config") or {}, "config"))
    for short, path in _SHORTCUTS.items():
        if short in overrides:
            dotted[path] = overrides[short]
    if "lr" in overrides:
        dotted["train.lr"] = overrides["lr"]  # the record; the trainer gets it by set_lr after the restore
    for path, value in dotted.items():
        section, _, field = path.partition(".")
        obj = getattr(cfg, section, None)
        if obj is None or not hasattr(obj, field):
            raise ValueError(f"fork override {path!r}: no such config field (use 'section.field', e.g. 'train.lr')")
        setattr(obj, field, value)
    unknown = set(overrides) - set(_SHORTCUTS) - set(_AFTER_RESTORE) - {"config"}
    if unknown:
        raise ValueError(f"fork: unknown override(s) {sorted(unknown)}; known: "
                         f"{sorted([*_SHORTCUTS, *_AFTER_RESTORE, 'config'])}")
    return cfg.validate()


def _mapping(value: object, what: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise TypeError(f"fork override {what!r}: a dict, got {type(value).__name__}")
    return value


def _quiet(run: RunFacade) -> bool:
    rows = run.tracker.rows if run.tracker is not None else []
    logged = run.step == 0 or (rows and as_int(rows[-1].get("step", -1)) == run.step)
    return run.buffer.reserved == 0 and not run.buffer.in_flight() and not run.training_in_flight and bool(logged)


async def quiesce(run: RunFacade, timeout: float = 600.0) -> None:
    """Wait (run paused or done) until no rollout is being played, no step is in flight and the row is written.

    Woken by the run's notifications (rows, events) and the controller's gate; a one-second re-check
    covers a change that lands between a check and the wait.
    """
    woke = asyncio.Event()
    loop = asyncio.get_running_loop()

    def listener(_msg: dict[str, object]) -> None:  # service events may arrive on other threads
        loop.call_soon_threadsafe(woke.set)

    async def gate_changed() -> None:
        async with run.gate.changed:
            await run.gate.changed.wait()

    run.add_listener(listener)
    deadline = loop.time() + timeout
    try:
        while not _quiet(run):
            if loop.time() > deadline:
                raise TimeoutError(f"fork: run {run.config.name} did not reach a quiet step boundary in {timeout:.0f} s "
                                   f"(reserved {run.buffer.reserved}, in flight {len(run.buffer.in_flight())}, "
                                   f"training {run.training_in_flight})")
            woke.clear()
            waits = [asyncio.ensure_future(gate_changed()), asyncio.ensure_future(woke.wait())]
            await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
    finally:
        run.remove_listener(listener)


def _child_name(base_dir: Path, parent: str) -> str:
    n = 1
    while (base_dir / f"{parent}-fork{n}").exists():
        n += 1
    return f"{parent}-fork{n}"


def _describe(overrides: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in overrides.items():
        if callable(v):
            v = getattr(v, "__name__", "custom")
        elif k == "rewards":
            v = {n: getattr(f[0] if isinstance(f, tuple) else f, "__name__", "custom")
                 for n, f in _mapping(v, k).items()}
        out[k] = v if isinstance(v, (int, float, str, bool, type(None), dict, list)) else repr(v)
    described: dict[str, object] = json.loads(json.dumps(out, default=repr))
    return described


async def _start_child(run_cls: RunClass | type[RunFacade], cfg: RunConfig, ckpt: Path, spawn: SpawnParts | None,
                       overrides: ForkFromOverrides, origin: dict[str, object], last_batch: "TrainBatch | None",
                       start: bool) -> RunFacade:
    child: RunFacade | None = None
    try:
        child = run_cls(cfg, resume_from=ckpt, spawn=spawn)
        await child.spawn()  # spawn + restore now: the overrides land before the first step
        child.use_last_batch(last_batch)  # a loss override is dry-run on the batch the parent trained last
        if "lr" in overrides:
            await _trainer(child).set_lr(float(overrides["lr"]))
        if "reward_weights" in overrides:
            child.set_reward_weights(dict(overrides["reward_weights"]))
        for name, fn in (overrides.get("rewards") or {}).items():
            fn, weight = fn if isinstance(fn, tuple) else (fn, 1.0)
            child.add_reward(name, fn, weight, replace=name in child.rewards.weights)
        if "loss" in overrides or "loss_kwargs" in overrides:
            await child.set_loss(overrides.get("loss", child.loss_name), **dict(overrides.get("loss_kwargs") or {}))
        (child.out_dir / "origin.json").write_text(json.dumps(origin, indent=1, default=repr))
        child.emit("forked_from", **origin)
        if start:
            await child.start()
    except BaseException:
        if child is not None and child.parts is not None:
            await child.shutdown()  # its processes (or its slot of shared engines) are freed
        elif isinstance(reserved := _as_object(spawn), _Releasable):  # a slot reserved for it, never attached to
            await reserved.release()
        raise
    return child


def _as_object(spawn: SpawnParts | None) -> object:
    """`spawn` as a plain object, so that a check for what else it is (`_Releasable`) reads as possible."""
    return spawn


def _trainer(run: RunFacade) -> "TrainerAPI":
    if run.trainer is None:
        raise RuntimeError(f"fork: run {run.config.name} has no trainer (its processes are down)")
    return run.trainer


async def fork(run: RunFacade, *, name: str | None = None, pause_parent: bool = False, start: bool = True,
               pool: SpawnParts | None = None, through_disk: bool = False,
               **overrides: Unpack[ForkOverrides]) -> RunFacade:
    """`Run.fork`: the child `Run` (started unless ``start=False``) forked from `run` at its next quiet step boundary.

    A run on shared engines (`forgelab.experiments.variants.SharedEngines`) forks into a free slot of them: the
    trainer's state (adapter, optimizer, schedule, loss) is copied in memory, only the controller's goes
    through the fork checkpoint (``through_disk=True``: the trainer's too, as for other runs)."""
    from forgelab.engines.shared_parts import SlotParts

    if run.parts is None or run.trainer is None:
        raise RuntimeError(f"fork: run {run.config.name} has no processes (never started, or shut down); "
                           "fork from one of its checkpoints with Run.fork_from(path, ...)")
    name = name or _child_name(run.out_dir.parent, run.config.name)
    cfg = child_config(run.config, name, overrides)  # a bad override fails before the parent pauses
    was_running = run.state == "running"
    spawn: SpawnParts | None = pool or getattr(run.parts, "pool", None)
    copier = spawn if isinstance(spawn, _SlotCopier) and isinstance(run.parts, SlotParts) else None
    in_memory = (not through_disk and copier is not None and getattr(run.parts, "pool", None) is spawn)
    run.pause()
    try:
        await quiesce(run)
        path = run.out_dir / "forks" / f"{name}_step_{run.step:06d}"
        if in_memory and copier is not None and isinstance(run.parts, SlotParts):
            # the slot copy is taken now, at the same quiet boundary as the controller state
            ckpt = await run.save_checkpoint(path, trainer=False)
            spawn = await copier.copy_slot(run.parts.slot)
        else:
            ckpt = await run.save_checkpoint(path)
    finally:
        if was_running and not pause_parent:
            run.resume()
    origin: dict[str, object] = {
        "parent": run.config.name, "parent_dir": str(run.out_dir), "step": run.step, "version": run.version,
        "checkpoint": str(ckpt), "overrides": _describe(overrides),
        "trainer_state": "copied in memory (shared-engines slot)" if in_memory else "checkpoint"}
    run.emit("forked", child=name, child_dir=str(Path(cfg.tracking.out_dir) / name), checkpoint=str(ckpt),
               overrides=origin["overrides"], parent_paused=bool(pause_parent and was_running))
    return await _start_child(type(run), cfg, ckpt, spawn, overrides, origin, run.last_batch, start)


async def fork_from(checkpoint: str | Path, config: RunConfig | dict[str, object] | str | Path | None = None, *,
                    run_cls: RunClass, name: str | None = None, pool: SpawnParts | None = None, start: bool = True,
                    **overrides: Unpack[ForkFromOverrides]) -> RunFacade:
    """`Run.fork_from`: a child of a saved checkpoint (config: the saved run's manifest unless given), built as
    `run_cls` (`Run.fork_from` passes its own class)."""
    from forgelab.controller.checkpoint import resolve
    from forgelab.config.run_config import RunConfig

    ckpt = resolve(checkpoint)
    run_dir = ckpt.parent.parent
    if config is None:
        manifest = run_dir / "manifest.json"
        if not manifest.is_file():
            raise FileNotFoundError(f"fork_from: no manifest.json in {run_dir}; pass config=")
        config = RunConfig.from_dict(json.loads(manifest.read_text())["config"])
    elif not isinstance(config, RunConfig):
        config = RunConfig.from_dict(config) if isinstance(config, dict) else RunConfig.from_yaml(config)
    state = json.loads((ckpt / "controller.json").read_text())
    name = name or _child_name(Path(config.tracking.out_dir), config.name)
    cfg = child_config(config, name, overrides)
    origin: dict[str, object] = {"parent": run_dir.name, "parent_dir": str(run_dir), "step": state["step"],
                                 "version": state["version"], "checkpoint": str(ckpt),
                                 "overrides": _describe(overrides)}
    from forgelab.controller.events import EventLog

    if (run_dir / "events.jsonl").is_file():  # the parent's log records the fork too
        log = EventLog()
        log.attach(run_dir, append=True)
        log.emit("forked", step=state["step"], child=name, child_dir=str(Path(cfg.tracking.out_dir) / name),
                 checkpoint=str(ckpt), overrides=origin["overrides"])
    return await _start_child(run_cls, cfg, ckpt, pool, overrides, origin, None, start)
