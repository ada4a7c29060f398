"""Save and restore a run: trainer state (DCP) plus everything the controller was given.

    path = await save(run)                 # runs/NAME/checkpoints/step_000020/{trainer/, controller.json}
    await restore(run, path)               # in a fresh Run(config, resume_from=path), after spawning

A checkpoint holds what a resumed run needs to train exactly as the saved one
would have: the trainer's weights, optimizer, schedule, RNG and loss (built-in
or custom, serialised by the trainer, with its kwargs); the controller's step,
policy version, data position, replay buffer, episode/group counters, held-out
accuracy history; and the reward set, each reward with its weight and its code
(`forgelab.controller.fncode`: a built-in by name, a custom function by value with its
source and hash). Restoring replaces the run's rewards with the saved set (the
config's rewards describe how the run *started*), and a reward that cannot be
rebuilt raises `FunctionRestoreError` naming it.
"""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from forgelab.controller.fncode import FunctionRestoreError, loss_record, restore_fn, reward_record

log = logging.getLogger("forgelab.controller.checkpoint")

__all__ = ["save", "restore", "restore_metrics", "resolve", "code_records", "FunctionRestoreError"]


def resolve(path: str | Path) -> Path:
    """A checkpoint directory: `path` itself, or the one its LATEST file names."""
    path = Path(path)
    if (path / "LATEST").is_file():
        path = path / (path / "LATEST").read_text().strip()
    if not (path / "controller.json").is_file():
        raise FileNotFoundError(f"{path} is not a forgelab checkpoint (no controller.json); "
                                "pass a checkpoints/step_NNNNNN directory or the checkpoints folder holding LATEST")
    return path


def code_records(path: str | Path) -> list[tuple[str, dict | None]]:
    """(label, code record) of the loss and every reward a checkpoint restores (read, never unpickled)."""
    state = json.loads((resolve(path) / "controller.json").read_text())
    out: list[tuple[str, dict | None]] = [(f"loss {state.get('loss')!r}", state.get("loss_code"))]
    out += [(f"reward {r['name']!r}", r.get("fn")) for r in state.get("rewards", [])]
    return out


def reward_state(rewards) -> list[dict[str, Any]]:
    """The reward set as data: name, weight and code record of each reward, in order."""
    terms = rewards.terms  # one read: a consistent snapshot even while a cell changes it
    return [{"name": n, "weight": w, "fn": reward_record(fn)} for n, (fn, w) in terms.items()]


def rewards_from_state(saved: list[dict[str, Any]]):
    """A `RewardComposer` rebuilt from `reward_state` output."""
    from forgelab.rewards.library import REWARDS, RewardComposer

    terms = {}
    for r in saved:
        # resuming from a checkpoint trusts it (its trainer state is a pickle too: docs/security.md);
        # the pickle's recorded sha256 still catches an edited or corrupted payload
        terms[r["name"]] = (restore_fn(r["fn"], REWARDS, what=f"reward {r['name']!r}", trusted=True),
                            float(r["weight"]))
    return RewardComposer(terms)


async def save(run, path: str | Path | None = None, *, trainer: bool = True) -> Path:
    """Trainer state (DCP) + controller state (step, version, data position, counters, rewards, loss).

    ``trainer=False``: the controller state only (a fork into a slot of shared engines copies the trainer's
    state in memory); `restore` then requires the trainer to hold exactly the saved state (fingerprints)."""
    path = Path(path) if path else run.out_dir / "checkpoints" / f"step_{run.step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    if trainer:
        await run.trainer.save(str(path / "trainer"))
    info = await run.trainer.info()
    state = {
        "step": run.step, "version": run.version, "stream": run.stream.state_dict(),
        "buffer": run.buffer.state_dict(), "reward_weights": run.rewards.weights,
        "rewards": reward_state(run.rewards),
        "distill_coef": getattr(run, "distill_coef", None),  # on-policy distillation's live coefficient
        # the trainer keeps the loss itself (custom ones serialised); this copy is for people and diffs
        "loss": run.loss_name if isinstance(run.loss_name, str) else None,
        "loss_kwargs": (info or {}).get("loss_kwargs"),
        "loss_code": _loss_code(run),
        "next_episode_id": run.rollout.next_episode_id, "next_group_id": run.rollout.next_group_id,
        "zero_variance_kept": run.rollout.zero_variance_kept,  # a teacher run's kept equal-reward episodes
        "accuracy_history": run.accuracy_history,
        # per-rank SHA-256 of parameters and optimizer state: a restore is checked against it
        "trainer_fingerprint": await run.trainer.fingerprint(),
    }
    (path / "controller.json").write_text(json.dumps(state))
    (path.parent / "LATEST").write_text(path.name)
    run.emit("checkpoint", path=str(path), loss=state["loss"], loss_kwargs=state["loss_kwargs"],
               rewards={r["name"]: r["weight"] for r in state["rewards"]})
    return path


async def restore(run, path: str | Path) -> None:
    """Put a saved run back: trainer, controller counters, rewards (with their code) and loss (with its kwargs)."""
    path = resolve(path)
    state = json.loads((path / "controller.json").read_text())
    # rebuild the rewards first: a reward that cannot be restored fails before the trainer is touched
    rewards = rewards_from_state(state["rewards"]) if "rewards" in state else None
    on_disk = (path / "trainer").is_dir()
    info = await (run.trainer.load(str(path / "trainer")) if on_disk else run.trainer.info())
    run.step, run.version = state["step"], state["version"]
    run.stream.load_state_dict(state["stream"])
    run.buffer.load_state_dict(state["buffer"])
    if rewards is not None:
        run.rewards.replace_all(rewards)  # same composer object: widgets and the scorer hold it
    else:  # a checkpoint from before reward code was saved: weights of the rewards this run knows
        run.rewards.set_weights({k: v for k, v in state["reward_weights"].items() if k in run.rewards.weights})
    run.rollout.next_episode_id, run.rollout.next_group_id = state["next_episode_id"], state["next_group_id"]
    run.rollout.zero_variance_kept = int(state.get("zero_variance_kept", 0))  # 0: saved before it was kept
    if state.get("distill_coef") is not None:  # the coefficient as the run had changed it, not the config's
        run.distill_coef = float(state["distill_coef"])
    run.accuracy_history = [tuple(x) for x in state.get("accuracy_history", [])]
    # the trainer restored its own loss (name, function, kwargs); the controller only mirrors the name
    if isinstance(info, dict) and info.get("loss"):
        run.loss_name = info["loss"]
    if run.version > 0:
        await run.push_weights()
    saved_fp, fp = state.get("trainer_fingerprint"), await run.trainer.fingerprint()
    # world size may differ on resume (shards differ then): compare only like with like
    match = fp == saved_fp if saved_fp is not None and len(saved_fp) == len(fp) else None
    if not on_disk and not match:
        raise ValueError(f"{path} holds no trainer state (a fork into a shared-engines slot copies it in memory), "
                         "and this trainer's state is not the saved one; restore from a checkpoint with a trainer/ "
                         "directory (run.save_checkpoint)")
    if match is False:
        log.warning("forgelab: trainer state after restore differs from the one saved in %s", path)
    restore_metrics(run, path.parent.parent / "metrics.csv")
    run.emit("resumed_from_checkpoint", path=str(path), fingerprint_match=match,
               trainer_fingerprint=fp, stream=run.stream.state_dict(), loss=run.loss_name,
               loss_kwargs=info.get("loss_kwargs") if isinstance(info, dict) else None,
               loss_code=_no_pickle(state.get("loss_code")), rewards={n: w for n, w in run.rewards.weights.items()},
               rewards_code={r["name"]: _no_pickle(r["fn"]) for r in state.get("rewards", [])})


def _no_pickle(rec: dict | None) -> dict | None:
    return None if rec is None else {k: v for k, v in rec.items() if k != "pickle"}


def _loss_code(run) -> dict | None:
    """Code record of the run's current loss: the last swap's (it holds custom code), else the built-in's."""
    swaps = [e for e in run.events if e["kind"] == "loss_swapped" and e.get("code")]
    if swaps:
        return _no_pickle(swaps[-1]["code"])
    try:
        return _no_pickle(loss_record(run.loss_name))
    except KeyError:
        return None


def restore_metrics(run, csv_path: Path) -> None:
    """Put the rows up to the restored step back in the tracker, so the learning curve continues."""
    if run.tracker is None or run.tracker.rows or not csv_path.is_file():
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
        if 0 < row.get("step", 0) <= run.step:
            run.tracker.log(row)
