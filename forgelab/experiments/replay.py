"""Exact replay: re-execute a recorded run from its manifest, applying each live change where it took effect.

    report = await forgelab.replay("runs/my-run")     # or: await Run.replay("runs/my-run")
    report.ok, report.first_mismatch                  # (step, metric, original, replayed) or None
    forgelab replay runs/my-run --until 10            # the same from a shell
    await forgelab.replay("runs/a-fork", trusted=True)   # code from the directory may run (--trust)

What makes it exact is the deterministic synchronous mode (`train.max_policy_age`
0): every sample is seeded from the run seed and its episode id (`episode_seed`),
episode and group ids are fixed when a rollout is admitted, batches are taken in
group order, and a reward change lands between rollouts, never inside one. The
original run's event log says where each change took effect: a loss swap at a
step boundary (``applies_at_step``), a reward change at the first episode scored
with it (``reward_effective.first_episode``). The replay applies the same change
through the same public call (`Run.set_loss`, `Run.set_reward_weights`,
`Run.add_reward`, `Run.remove_reward`, `Run.set_distill_coef`) at that point, so
its own event log records it again.

Compared: the per-step learning metrics (loss, rewards, KL, entropy, gradient
norm, clip fractions, accuracy, lr, ...) for exact equality, as written to
metrics.csv; timings, throughput and the episode counters (which count work
still in flight when the row was written) are not. A run with
`max_policy_age` > 0, or one on a multi-turn environment, replays its changes
too, but its metrics are not expected to match and the manifest and the report
say why (``nondeterministic_reason``; see `forgelab.controller.rollout.determinism`).

A run that was resumed or forked (``manifest.resume_from``) is replayed from that
checkpoint, i.e. a fork from its fork point with the parent's state, and only the
changes recorded after the restore are re-applied (a fork's lr override among them).

Before anything spawns, the replay checks what it is about to run against the
manifest (`forgelab.controller.provenance.check_replay`): package versions and the
code of every built-in loss and reward (SHA-256). A difference raises
`ReplayRefused` unless ``allow_mismatch=True`` (``--allow-mismatch``), which the
report's notes then list. Custom code recorded in the directory (pickles in the
event log, a checkpoint's trainer state) is run only with ``trusted=True``
(``--trust``), and a pickle that does not match its recorded hash is refused even
then (`forgelab.controller.function_code`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from forgelab.controller.events import EventLog
from forgelab.controller.facade import RunFacade, SpawnParts
from forgelab.controller.rollout import episode_seed  # noqa: F401 -- one owner: the rollout part
from forgelab.controller.function_code import UntrustedCodeError, restore_fn

if TYPE_CHECKING:
    import pandas as pd

    from forgelab.algos.losses import LossFn
    from forgelab.experiments.fork import RunClass
    from forgelab.rewards.library import RewardFn

__all__ = ["episode_seed", "Replayer", "ReplayReport", "ReplayRefused", "replay", "compare_metrics",
           "learning_columns"]

#: One event of a run's log (`forgelab.controller.events.EventLog`): ``kind``, ``step``, ``time`` and its fields.
Event = dict[str, object]
#: (step, metric, original value, replayed value)
Mismatch = tuple[int, str, object, object]


class ReplayRefused(RuntimeError):
    """The recorded run would run on other package versions or other built-in code here, and the caller did not
    allow it (``allow_mismatch=True``)."""

#: changes that land at the first episode scored with them (``reward_effective``); on-policy distillation's live
#: coefficient is one (`Run.set_distill_coef` records it as a reward revision)
REWARD_CHANGES = ("reward_weights", "reward_added", "reward_removed", "distill_coef")

#: Columns that measure time, throughput or in-flight work, not learning: never compared.
NOT_LEARNING = ("time", "tokens_per_s", "step_time_s", "train_time_s", "weight_sync_ms", "loss_name")
NOT_LEARNING_PREFIXES = ("episodes_", "gc", "generator/", "time/", "perf/")
NOT_LEARNING_SUFFIXES = ("_ms", "_time_s", "_s")


def learning_columns(columns: Iterable[str]) -> list[str]:
    """The metric columns a replay must reproduce exactly."""
    out = []
    for c in columns:
        if c in NOT_LEARNING or c.startswith(NOT_LEARNING_PREFIXES) or c.endswith(NOT_LEARNING_SUFFIXES):
            continue
        out.append(c)
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def unrecorded_final_eval(original: "pd.DataFrame", replayed: "pd.DataFrame") -> str | None:
    """A note when the original's last row has no ``heldout_accuracy`` and the replay's same step has one.

    Runs recorded before 2026-11-28 evaluated the policy once more at the end but never wrote that value into
    metrics.csv (it was set on the in-memory row after the row was written); their replays do write it. Nothing
    recorded can be compared with it, so it is a note, not a difference. None when this does not apply.
    """
    if "heldout_accuracy" not in replayed.columns or not len(original):
        return None
    last = int(original["step"].max())
    a = original[original["step"] == last]
    b = replayed[replayed["step"] == last]
    va = a["heldout_accuracy"].iloc[-1] if "heldout_accuracy" in a.columns else float("nan")
    vb = b["heldout_accuracy"].iloc[-1] if len(b) else float("nan")
    if not (isinstance(va, float) and math.isnan(va)) or (isinstance(vb, float) and math.isnan(vb)):
        return None
    return (f"step {last}: the original did not record its final held-out evaluation in metrics.csv (forgelab "
            f"before 2026-11-28 did not write it); the replay's ({vb!r}) has nothing to compare with")


def compare_metrics(original: "pd.DataFrame", replayed: "pd.DataFrame", until: int | None = None) -> list[Mismatch]:
    """Every (step, metric, original, replayed) that differs, in step order; [] when the learning metrics agree.

    Both are DataFrames as read from metrics.csv. A step present in one and not the
    other is a mismatch on metric ``"step"``. The final held-out evaluation an older original never recorded
    (`unrecorded_final_eval`) is not compared.
    """
    skip = unrecorded_final_eval(original, replayed) is not None
    last = int(original["step"].max()) if len(original) else None
    cols = [c for c in learning_columns(original.columns) if c != "step"]
    cols += [c for c in learning_columns(replayed.columns) if c not in cols and c != "step"]
    a = {int(r["step"]): r for r in original.to_dict("records")}
    b = {int(r["step"]): r for r in replayed.to_dict("records")}
    steps = sorted(set(a) | set(b))
    if until is not None:
        steps = [s for s in steps if s <= until]
    out: list[Mismatch] = []
    for s in steps:
        if s not in a or s not in b:
            out.append((s, "step", s in a, s in b))
            continue
        for c in cols:
            if skip and s == last and c == "heldout_accuracy":
                continue
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
    deterministic: bool
    mismatches: list[Mismatch] = field(default_factory=list)
    changes_applied: list[Event] = field(default_factory=list)
    nondeterministic_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    """What was overridden or may differ: allowed mismatches (``allow_mismatch``), another forgelab commit."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first_mismatch(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def __str__(self) -> str:
        head = f"replay of {self.original_dir} ({self.steps} steps, {len(self.changes_applied)} changes re-applied) -> {self.replay_dir}: "
        if not self.mismatches:
            return head + "learning metrics identical at every step"
        s, m, a, b = self.mismatches[0]
        note = "" if self.deterministic else (f" (the run is not deterministic: {self.nondeterministic_reason}; "
                                              "no exact match is expected)")
        return head + f"{len(self.mismatches)} differences; first at step {s}, metric {m!r}: original {a!r}, replay {b!r}{note}"


def events_since_restore(events: list[Event]) -> list[Event]:
    """The events a replay re-applies: those after the last ``resumed_from_checkpoint`` (what came before it is
    in the checkpoint's state), or all of them for a run that started from its config."""
    last = max((i for i, e in enumerate(events) if e["kind"] == "resumed_from_checkpoint"), default=-1)
    return list(events[last + 1:])


class Replayer:
    """Re-applies a recorded run's live changes where they took effect; a `Run` calls it at its hook points.

    Every recorded function is rebuilt here, before anything runs: code that may not run (``trusted`` False)
    or whose pickle does not match its recorded hash is refused at once (`forgelab.controller.function_code`).
    """

    def __init__(self, events: list[Event], *, trusted: bool = False):
        events = events_since_restore(events)
        forked = [e for e in events if e["kind"] == "forked_from"]
        #: a fork's lr override (the trainer's set_lr after the restore: no event of its own)
        self.lr: float | None = _lr(_fields(forked[-1].get("overrides") or {}).get("lr")) if forked else None
        self.loss_changes = [e for e in events if e["kind"] == "loss_swapped"]
        effective = [e for e in events if e["kind"] == "reward_effective"]
        self.reward_changes: list[Event] = []
        for e in events:
            if e["kind"] in REWARD_CHANGES:
                rev = e.get("rev")
                at = next((x["first_episode"] for x in effective if rev is not None and _int(x["rev"]) >= _int(rev)),
                          None)
                self.reward_changes.append({**e, "first_episode": at})
        self.applied: list[Event] = []
        self.run: RunFacade | None = None  # the run it re-applies the changes to (`bind`)
        self.losses: dict[int, str | LossFn] = {}  # id(loss event) -> the loss it records (a built-in by name)
        self.rewards: dict[int, RewardFn] = {}  # id(reward_added event) -> the function it records
        for e in self.loss_changes:
            self.losses[id(e)] = (str(e["loss"]) if _fields(e.get("code") or {}).get("builtin") else
                                  restore_fn(_fields(e["code"]), what=f"loss {e['loss']!r}", trusted=trusted))
        for e in self.reward_changes:
            if e["kind"] == "reward_added":
                self.rewards[id(e)] = restore_fn(_fields(e["code"]), _reward_registry(), what=f"reward {e['name']!r}",
                                                 trusted=trusted)

    def code_records(self) -> list[tuple[str, dict[str, object] | None]]:
        """(label, code record) of every function this replay re-applies (`provenance.check_replay` input)."""
        return ([(f"loss {e['loss']!r}", _code(e)) for e in self.loss_changes]
                + [(f"reward {e['name']!r}", _code(e)) for e in self.reward_changes if e["kind"] == "reward_added"])

    def bind(self, run: RunFacade) -> None:
        """The run whose public commands re-apply the changes (`Run.attach_replayer` calls this)."""
        self.run = run

    def _bound(self) -> RunFacade:
        if self.run is None:
            raise RuntimeError("Replayer: not attached to a run (Run.attach_replayer(replayer) binds it)")
        return self.run

    async def before_step(self, step: int) -> None:
        """Before the trainer runs `step`: a fork's lr override (first), then every loss recorded to apply at `step`."""
        run = self._bound()
        if self.lr is not None and not any(e.get("kind") == "lr_set" for e in self.applied):
            if run.trainer is None:
                raise RuntimeError("Replayer: the run has no trainer (its processes are down)")
            await run.trainer.set_lr(float(self.lr))
            self.applied.append({"kind": "lr_set", "lr": float(self.lr), "step": step})
        for e in self.loss_changes:
            if e["applies_at_step"] == step and e not in self.applied:
                # not in flight here, so it applies at `step`, exactly as recorded
                await run.set_loss(self.losses[id(e)], **_fields(e.get("kwargs") or {}))
                self.applied.append(e)

    def before_scoring(self, first_episode: int) -> None:
        """Before the rollout whose first episode is `first_episode` is scored: apply the reward changes due."""
        run = self._bound()
        for e in self.reward_changes:
            if e["first_episode"] is None or _int(e["first_episode"]) > first_episode or e in self.applied:
                continue
            if e["kind"] == "reward_weights":
                run.set_reward_weights(cast("dict[str, float]", _fields(e["new"])))  # checked: a dict
            elif e["kind"] == "reward_added":
                run.add_reward(str(e["name"]), self.rewards[id(e)], _number(e["weight"]),
                               replace=bool(e.get("replace", False)))
            elif e["kind"] == "reward_removed":
                run.remove_reward(str(e["name"]))
            elif e["kind"] == "distill_coef":
                run.set_distill_coef(_number(e["new"]))
            self.applied.append(e)


# --- reading recorded fields (JSON from the event log; a field of another type is a corrupt log) ----------------


def _fields(value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"replay: expected a dict in the event log, got {type(value).__name__}: {value!r}")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise ValueError(f"replay: expected an integer in the event log, got {type(value).__name__}: {value!r}")
    return value


def _number(value: object) -> float:
    if not isinstance(value, (int, float)):
        raise ValueError(f"replay: expected a number in the event log, got {type(value).__name__}: {value!r}")
    return value  # an int stays an int (the call records it as it was recorded)


def _lr(value: object) -> float | None:
    return None if value is None else float(_number(value))


def _code(e: Event) -> dict[str, object] | None:
    """An event's code record (`forgelab.controller.function_code.fn_record`), or None where it has none."""
    code = e.get("code")
    return None if code is None else _fields(code)


def _reward_registry() -> "Mapping[str, RewardFn]":
    from forgelab.rewards.library import REWARDS

    return REWARDS


async def replay(run_dir: str | Path, *, until: int | None = None, out_dir: str | Path | None = None,
                 name: str | None = None, spawn: SpawnParts | None = None, run_cls: "RunClass | None" = None,
                 trusted: bool = False,
                 allow_mismatch: bool = False) -> ReplayReport:
    """Re-run `run_dir` from its manifest (and ``resume_from`` checkpoint) with its recorded changes; compare the
    learning metrics step by step.

    `spawn` is passed to `Run` (e.g. a `forgelab.engines.pool.ProcessPool`: the replay runs on its idle processes).
    `run_cls` is the run class to build (`Run.replay` passes its own; this layer does not import `forgelab.run`).
    ``trusted``: the directory's recorded code (pickles) may run. ``allow_mismatch``: run even where package
    versions or built-in code differ from the manifest's (listed in ``report.notes``).
    """
    if run_cls is None:
        raise TypeError("replay: pass run_cls= (or call forgelab.replay / Run.replay, which pass forgelab.Run)")
    import pandas as pd

    from forgelab.config.run_config import RunConfig
    from forgelab.controller.provenance import read_manifest

    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    ckpt, replayer, notes = _check_before_running(run_dir, manifest, trusted, allow_mismatch)
    cfg = RunConfig.from_dict(_fields(manifest["config"]))
    cfg.name = name or f"{cfg.name}-replay"
    if out_dir is not None:
        cfg.tracking.out_dir = str(out_dir)
    original = pd.read_csv(run_dir / "metrics.csv")
    run = run_cls(cfg, spawn=spawn, resume_from=ckpt)  # its own wandb run, as the config says
    run.attach_replayer(replayer)
    await run.start()
    if until is not None:
        # the loop reads the config each step; the trainer's schedule keeps the original length
        run.limit_steps(until)
    try:
        await run.wait()
    finally:
        await run.shutdown()
    replayed = pd.read_csv(run.out_dir / "metrics.csv")
    done = int(replayed["step"].max()) if len(replayed) else 0
    mismatches = compare_metrics(original, replayed, until=done)
    unrecorded = unrecorded_final_eval(original, replayed)
    if unrecorded is not None:
        notes.append(unrecorded)
    recorded = manifest.get("deterministic", cfg.train.max_policy_age == 0)
    deterministic = recorded if isinstance(recorded, bool) else bool(recorded)
    reason = manifest.get("nondeterministic_reason")
    return ReplayReport(run_dir, run.out_dir, done, deterministic, mismatches, replayer.applied,
                        None if reason is None else str(reason), notes)


def _check_before_running(run_dir: Path, manifest: dict[str, object], trusted: bool,
                          allow_mismatch: bool) -> tuple[Path | None, Replayer, list[str]]:
    """``(checkpoint or None, Replayer, notes)``; raises before anything spawns when the replay may not run."""
    from forgelab.controller.checkpoint import code_records, resolve
    from forgelab.controller.provenance import check_replay, git_state

    ckpt: Path | None = None
    resume_from = manifest.get("resume_from")
    if resume_from:
        try:
            ckpt = resolve(str(resume_from))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"replay of {run_dir}: it started from checkpoint {manifest['resume_from']} "
                                    f"(manifest.resume_from), which is gone: {e}") from None
        if not trusted:
            raise UntrustedCodeError(
                f"replay of {run_dir}: it started from checkpoint {ckpt} (a fork's fork point or a resume), whose "
                "trainer state is a pickle, i.e. code (docs/security.md). If you (or someone you trust) wrote it, "
                "pass trusted=True (CLI: --trust)")
    replayer = Replayer(EventLog.read(run_dir), trusted=trusted)  # refuses code that may not run, now
    problems = check_replay(manifest, replayer.code_records() + (code_records(ckpt) if ckpt else []))
    if problems and not allow_mismatch:
        raise ReplayRefused(f"replay of {run_dir} would not run what was recorded:\n  " + "\n  ".join(problems)
                            + "\nInstall the recorded versions, or pass allow_mismatch=True (CLI: --allow-mismatch) "
                            "to replay anyway (its metrics may then differ).")
    notes = [f"allowed mismatch: {p}" for p in problems]
    commit = _fields(_fields(manifest.get("forgelab") or {}).get("git") or {}).get("commit")
    recorded = None if commit is None else str(commit)
    state = git_state()
    here = state["commit"] if state else None
    if recorded and here and recorded != here:
        notes.append(f"forgelab commit {here[:12]} here, {recorded[:12]} when recorded")
    return ckpt, replayer, notes
