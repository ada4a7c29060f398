"""Save and restore a run: trainer state (DCP) plus everything the controller was given.

    path = await save(parts)               # runs/NAME/checkpoints/step_000020/{trainer/, controller.json}
    await restore(parts, path)             # in a fresh Run(config, resume_from=path), after spawning

`parts` is a `CheckpointParts`: the run's parts a checkpoint reads and restores, each through its own methods.

A checkpoint holds what a resumed run needs to train exactly as the saved one
would have: the trainer's weights, optimizer, schedule, RNG and loss (built-in
or custom, serialised by the trainer, with its kwargs); the controller's step,
policy version, data position, replay buffer, episode/group counters, held-out
accuracy history; and the reward set, each reward with its weight and its code
(`forgelab.controller.function_code`: a built-in by name, a custom function by value with its
source and hash). Restoring replaces the run's rewards with the saved set (the
config's rewards describe how the run *started*), and a reward that cannot be
rebuilt raises `FunctionRestoreError` naming it.
"""
from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, TypedDict, cast

from forgelab.controller.function_code import FunctionRestoreError, loss_record, restore_fn, reward_record
from forgelab.controller.events import Event, as_int

if TYPE_CHECKING:
    from forgelab.controller.buffer import ReplayBuffer
    from forgelab.controller.controls import RewardControls
    from forgelab.controller.evaluate import Evaluator
    from forgelab.controller.events import EventBus
    from forgelab.controller.rollout import Rollouts
    from forgelab.controller.tracking import Tracker
    from forgelab.controller.training import TrainingLoop
    from forgelab.data.datasets import ProblemStream
    from forgelab.engines.trainer_client import TrainerAPI
    from forgelab.rewards.library import RewardComposer, RewardFn

log = logging.getLogger("forgelab.controller.checkpoint")

__all__ = ["CheckpointParts", "save", "restore", "restore_metrics", "resolve", "code_records", "FunctionRestoreError"]


def resolve(path: str | Path) -> Path:
    """A checkpoint directory: `path` itself, or the one its LATEST file names."""
    path = Path(path)
    if (path / "LATEST").is_file():
        path = path / (path / "LATEST").read_text().strip()
    if not (path / "controller.json").is_file():
        raise FileNotFoundError(f"{path} is not a forgelab checkpoint (no controller.json); "
                                "pass a checkpoints/step_NNNNNN directory or the checkpoints folder holding LATEST")
    return path


def code_records(path: str | Path) -> list[tuple[str, dict[str, object] | None]]:
    """(label, code record) of the loss and every reward a checkpoint restores (read, never unpickled)."""
    state = json.loads((resolve(path) / "controller.json").read_text())
    out: list[tuple[str, dict[str, object] | None]] = [(f"loss {state.get('loss')!r}", state.get("loss_code"))]
    out += [(f"reward {r['name']!r}", r.get("fn")) for r in state.get("rewards", [])]
    return out


class RewardRecord(TypedDict):
    """One reward of a checkpoint's reward set: its name, weight and code record (`reward_record`)."""

    name: str
    weight: float
    fn: dict[str, object]


def reward_state(rewards: RewardComposer) -> list[RewardRecord]:
    """The reward set as data: name, weight and code record of each reward, in order."""
    terms = rewards.terms  # one read: a consistent snapshot even while a cell changes it
    return [RewardRecord(name=n, weight=w, fn=reward_record(fn)) for n, (fn, w) in terms.items()]


def rewards_from_state(saved: list[RewardRecord]) -> RewardComposer:
    """A `RewardComposer` rebuilt from `reward_state` output."""
    from forgelab.rewards.library import REWARDS, RewardComposer

    terms: dict[str, tuple[RewardFn, float]] = {}
    for r in saved:
        # resuming from a checkpoint trusts it (its trainer state is a pickle too: docs/security.md);
        # the pickle's recorded sha256 still catches an edited or corrupted payload
        terms[r["name"]] = (restore_fn(r["fn"], REWARDS, what=f"reward {r['name']!r}", trusted=True),
                            float(r["weight"]))
    return RewardComposer(terms)


@dataclass
class CheckpointParts:
    """The parts a checkpoint reads and restores (each through its own methods).

    Attributes:
        trainer: the trainer actor handle (``save`` / ``load`` / ``info`` / ``fingerprint``).
        loop: the `TrainingLoop` (step, version, loss name; ``restore_position``, ``push_weights``).
        stream: the `ProblemStream` (data position).
        buffer: the `ReplayBuffer`.
        rewards: the `RewardControls` (reward set with its code, distillation coefficient).
        rollouts: the `Rollouts` (episode and group counters).
        evaluator: the `Evaluator` (held-out accuracy history).
        bus: the `EventBus` (its log holds the loss swaps; ``checkpoint`` / ``resumed_from_checkpoint`` events).
        tracker: the `Tracker` (rows up to the restored step come back from metrics.csv).
        out_dir: the run directory (``checkpoints/step_NNNNNN`` by default).
    """

    trainer: TrainerAPI
    loop: TrainingLoop
    stream: ProblemStream
    buffer: ReplayBuffer
    rewards: RewardControls
    rollouts: Rollouts
    evaluator: Evaluator
    bus: EventBus
    tracker: Tracker
    out_dir: Path


async def save(p: CheckpointParts, path: str | Path | None = None, *, trainer: bool = True) -> Path:
    """Trainer state (DCP) + controller state (step, version, data position, counters, rewards, loss).

    ``trainer=False``: the controller state only (a fork into a slot of shared engines copies the trainer's
    state in memory); `restore` then requires the trainer to hold exactly the saved state (fingerprints)."""
    loop = p.loop
    path = Path(path) if path else p.out_dir / "checkpoints" / f"step_{loop.step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    if trainer:
        await p.trainer.save(str(path / "trainer"))
    info = await p.trainer.info()
    rewards = reward_state(p.rewards.composer)
    state = {
        "step": loop.step, "version": loop.version, "stream": p.stream.state_dict(),
        "buffer": p.buffer.state_dict(), "reward_weights": p.rewards.composer.weights,
        "rewards": rewards,
        "distill_coef": p.rewards.distill_coef,  # on-policy distillation's live coefficient
        # the trainer keeps the loss itself (custom ones serialised); this copy is for people and diffs
        "loss": loop.loss_name if isinstance(loop.loss_name, str) else None,
        "loss_kwargs": (info or {}).get("loss_kwargs"),
        "loss_code": _loss_code(p.bus.log, loop.loss_name),
        **p.rollouts.counters(),  # next episode/group ids; a teacher run's kept equal-reward episodes
        "accuracy_history": p.evaluator.history,
        # per-rank SHA-256 of parameters and optimizer state: a restore is checked against it
        "trainer_fingerprint": await p.trainer.fingerprint(),
    }
    (path / "controller.json").write_text(json.dumps(state))
    (path.parent / "LATEST").write_text(path.name)
    p.bus.emit("checkpoint", path=str(path), loss=state["loss"], loss_kwargs=state["loss_kwargs"],
               rewards={r["name"]: r["weight"] for r in rewards})
    return path


async def restore(p: CheckpointParts, path: str | Path) -> None:
    """Put a saved run back: trainer, controller counters, rewards (with their code) and loss (with its kwargs)."""
    path = resolve(path)
    state = json.loads((path / "controller.json").read_text())
    # rebuild the rewards first: a reward that cannot be restored fails before the trainer is touched
    rewards = rewards_from_state(state["rewards"]) if "rewards" in state else None
    on_disk = (path / "trainer").is_dir()
    info = await (p.trainer.load(str(path / "trainer")) if on_disk else p.trainer.info())
    # the trainer restored its own loss (name, function, kwargs); the controller only mirrors the name
    loss = info.get("loss") if isinstance(info, dict) else None
    p.loop.restore_position(state["step"], state["version"], loss or None)
    p.stream.load_state_dict(state["stream"])
    p.buffer.load_state_dict(state["buffer"])
    p.rewards.restore(rewards, state.get("reward_weights"), state.get("distill_coef"))
    p.rollouts.restore_counters(state["next_episode_id"], state["next_group_id"],
                                state.get("zero_variance_kept", 0))  # 0: saved before it was kept
    p.evaluator.restore(state.get("accuracy_history", []))
    if p.loop.version > 0:
        await p.loop.push_weights()
    saved_fp, fp = state.get("trainer_fingerprint"), await p.trainer.fingerprint()
    # world size may differ on resume (shards differ then): compare only like with like
    match = fp == saved_fp if saved_fp is not None and len(saved_fp) == len(fp) else None
    if not on_disk and not match:
        raise ValueError(f"{path} holds no trainer state (a fork into a shared-engines slot copies it in memory), "
                         "and this trainer's state is not the saved one; restore from a checkpoint with a trainer/ "
                         "directory (run.save_checkpoint)")
    if match is False:
        log.warning("forgelab: trainer state after restore differs from the one saved in %s", path)
    restore_metrics(p.tracker, path.parent.parent / "metrics.csv", p.loop.step)
    p.bus.emit("resumed_from_checkpoint", path=str(path), fingerprint_match=match,
               trainer_fingerprint=fp, stream=p.stream.state_dict(), loss=p.loop.loss_name,
               loss_kwargs=info.get("loss_kwargs") if isinstance(info, dict) else None,
               loss_code=_no_pickle(state.get("loss_code")),
               rewards={n: w for n, w in p.rewards.composer.weights.items()},
               rewards_code={r["name"]: _no_pickle(r["fn"]) for r in state.get("rewards", [])})


def _no_pickle(rec: dict[str, object] | None) -> dict[str, object] | None:
    return None if rec is None else {k: v for k, v in rec.items() if k != "pickle"}


def _loss_code(events: Iterable[Event], loss_name: str) -> dict[str, object] | None:
    """Code record of the run's current loss: the last swap's (it holds custom code), else the built-in's."""
    swaps = [e for e in events if e["kind"] == "loss_swapped" and e.get("code")]
    if swaps:
        code = swaps[-1]["code"]
        return _no_pickle(code if isinstance(code, dict) else None)
    try:
        return _no_pickle(loss_record(loss_name))
    except KeyError:
        return None


def restore_metrics(tracker: Tracker | None, csv_path: Path, step: int) -> None:
    """Put the rows up to the restored `step` back in the tracker, so the learning curve continues."""
    if tracker is None or tracker.rows or not csv_path.is_file():
        return
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for raw in rows:
        row: Event = {}
        for k, v in raw.items():
            if v in ("", None):
                continue
            try:
                row[k] = float(v)
            except ValueError:
                row[k] = v
        for k in ("step", "version"):
            if k in row:
                row[k] = as_int(row[k])
        # int() above converted step (or raised): a number here
        if 0 < cast(int, row.get("step", 0)) <= step:
            tracker.log(row)
