"""Exact replay: re-execute a recorded run from its manifest, applying each live change where it took effect.

    report = await replay("runs/my-run")              # or: await Run.replay("runs/my-run")
    report.ok, report.first_mismatch                  # (step, metric, original, replayed) or None
    forgelab replay runs/my-run --until 10            # the same from a shell

What makes it exact is the deterministic synchronous mode (`train.max_policy_age`
0): every sample is seeded from the run seed and its episode id (`episode_seed`),
episode and group ids are fixed when a rollout is admitted, batches are taken in
group order, and a reward change lands between rollouts, never inside one. The
original run's event log says where each change took effect: a loss swap at a
step boundary (``applies_at_step``), a reward change at the first episode scored
with it (``reward_effective.first_episode``). The replay applies the same change
through the same public call (`Run.set_loss`, `Run.set_reward_weights`,
`Run.add_reward`, `Run.remove_reward`) at that point, so its own event log
records it again.

Compared: the per-step learning metrics (loss, rewards, KL, entropy, gradient
norm, clip fractions, accuracy, lr, ...) for exact equality, as written to
metrics.csv; timings, throughput and the episode counters (which count work
still in flight when the row was written) are not. A run with
`max_policy_age` > 0 replays its changes too, but its metrics are not expected
to match (rollouts race the trainer) and the report says so.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgelab.controller.events import EventLog
from forgelab.controller.fncode import restore_fn

__all__ = ["episode_seed", "Replayer", "ReplayReport", "replay", "compare_metrics", "learning_columns"]

REWARD_CHANGES = ("reward_weights", "reward_added", "reward_removed")

#: Columns that measure time, throughput or in-flight work, not learning: never compared.
NOT_LEARNING = ("time", "tokens_per_s", "step_time_s", "train_time_s", "weight_sync_ms", "loss_name")
NOT_LEARNING_PREFIXES = ("episodes_", "gc", "generator/", "time/", "perf/")
NOT_LEARNING_SUFFIXES = ("_ms", "_time_s", "_s")


def episode_seed(run_seed: int, episode_id: int) -> int:
    """The vLLM seed of one sample: a hash of (run seed, episode id), 31 bits.

    Different for every episode (so samples within a group differ, unlike one
    fixed seed for all), the same for the same episode in a replay or a fork.

    >>> episode_seed(0, 5) == episode_seed(0, 5), episode_seed(0, 5) != episode_seed(0, 6) != episode_seed(1, 5)
    (True, True)
    """
    digest = hashlib.sha256(f"{int(run_seed)}:{int(episode_id)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def learning_columns(columns) -> list[str]:
    """The metric columns a replay must reproduce exactly."""
    out = []
    for c in columns:
        if c in NOT_LEARNING or c.startswith(NOT_LEARNING_PREFIXES) or c.endswith(NOT_LEARNING_SUFFIXES):
            continue
        out.append(c)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_metrics(original, replayed, until: int | None = None) -> list[tuple[int, str, Any, Any]]:
    """Every (step, metric, original, replayed) that differs, in step order; [] when the learning metrics agree.

    Both are DataFrames as read from metrics.csv. A step present in one and not the
    other is a mismatch on metric ``"step"``.
    """
    cols = [c for c in learning_columns(original.columns) if c != "step"]
    cols += [c for c in learning_columns(replayed.columns) if c not in cols and c != "step"]
    a = {int(r["step"]): r for r in original.to_dict("records")}
    b = {int(r["step"]): r for r in replayed.to_dict("records")}
    steps = sorted(set(a) | set(b))
    if until is not None:
        steps = [s for s in steps if s <= until]
    out = []
    for s in steps:
        if s not in a or s not in b:
            out.append((s, "step", s in a, s in b))
            continue
        for c in cols:
            va, vb = a[s].get(c, float("nan")), b[s].get(c, float("nan"))
            if not _same(va, vb):
                out.append((s, c, va, vb))
    return out


@dataclass
class ReplayReport:
    """What a replay reproduced: `ok` when every learning metric of every replayed step is equal."""

    original_dir: Path
    replay_dir: Path
    steps: int
    synchronous: bool
    mismatches: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    changes_applied: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first_mismatch(self) -> tuple[int, str, Any, Any] | None:
        return self.mismatches[0] if self.mismatches else None

    def __str__(self) -> str:
        head = f"replay of {self.original_dir} ({self.steps} steps, {len(self.changes_applied)} changes re-applied) -> {self.replay_dir}: "
        if self.ok:
            return head + "learning metrics identical at every step"
        s, m, a, b = self.first_mismatch
        note = "" if self.synchronous else " (the run was asynchronous, max_policy_age > 0: no exact match is expected)"
        return head + f"{len(self.mismatches)} differences; first at step {s}, metric {m!r}: original {a!r}, replay {b!r}{note}"


class Replayer:
    """Re-applies a recorded run's live changes where they took effect; a `Run` calls it at its hook points."""

    def __init__(self, events: list[dict[str, Any]]):
        self.loss_changes = [e for e in events if e["kind"] == "loss_swapped"]
        effective = [e for e in events if e["kind"] == "reward_effective"]
        self.reward_changes = []
        for e in events:
            if e["kind"] in REWARD_CHANGES:
                rev = e.get("rev")
                at = next((x["first_episode"] for x in effective if rev is not None and x["rev"] >= rev), None)
                self.reward_changes.append({**e, "first_episode": at})
        self.applied: list[dict] = []

    async def before_step(self, run, step: int) -> None:
        """Before the trainer runs `step`: set every loss recorded to apply at `step`."""
        for e in self.loss_changes:
            if e["applies_at_step"] == step and e not in self.applied:
                fn = e["loss"] if e["code"].get("builtin") else restore_fn(e["code"], what=f"loss {e['loss']!r}")
                # not in flight here, so it applies at `step`, exactly as recorded
                await run.set_loss(fn, **(e.get("kwargs") or {}))
                self.applied.append(e)

    def before_scoring(self, run, first_episode: int) -> None:
        """Before the rollout whose first episode is `first_episode` is scored: apply the reward changes due."""
        for e in self.reward_changes:
            if e["first_episode"] is None or e["first_episode"] > first_episode or e in self.applied:
                continue
            if e["kind"] == "reward_weights":
                run.set_reward_weights(e["new"])
            elif e["kind"] == "reward_added":
                fn = restore_fn(e["code"], _reward_registry(), what=f"reward {e['name']!r}")
                run.add_reward(e["name"], fn, e["weight"], replace=e.get("replace", False))
            elif e["kind"] == "reward_removed":
                run.remove_reward(e["name"])
            self.applied.append(e)


def _reward_registry():
    from forgelab.rewards.library import REWARDS

    return REWARDS


async def replay(run_dir: str | Path, *, until: int | None = None, out_dir: str | Path | None = None,
                 name: str | None = None, spawn: Any = None) -> ReplayReport:
    """Re-run `run_dir` from its manifest with its recorded changes; compare the learning metrics step by step.

    `spawn` is passed to `Run` (e.g. a `forgelab.engines.pool.ProcessPool`: the replay runs on its idle processes).
    """
    import pandas as pd

    from forgelab.config.run_config import RunConfig
    from forgelab.controller.provenance import read_manifest
    from forgelab.run import Run

    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    events = EventLog.read(run_dir)
    cfg = RunConfig.from_dict(manifest["config"])
    cfg.name = name or f"{cfg.name}-replay"
    if out_dir is not None:
        cfg.tracking.out_dir = str(out_dir)
    cfg.tracking.wandb = False
    original = pd.read_csv(run_dir / "metrics.csv")
    run = Run(cfg, spawn=spawn)
    replayer = run._replay = Replayer(events)
    await run.start()
    if until is not None:
        # the loop reads the config each step; the trainer's schedule keeps the original length
        run.config.train.steps = min(until, run.config.train.steps)
    try:
        await run.wait()
    finally:
        await run.shutdown()
    replayed = pd.read_csv(run.out_dir / "metrics.csv")
    done = int(replayed["step"].max()) if len(replayed) else 0
    mismatches = compare_metrics(original, replayed, until=done)
    return ReplayReport(run_dir, run.out_dir, done, cfg.train.max_policy_age == 0, mismatches, replayer.applied)


def replay_sync(run_dir: str | Path, **kwargs: Any) -> ReplayReport:
    """`replay` for scripts and the CLI (runs its own event loop)."""
    return asyncio.run(replay(run_dir, **kwargs))
