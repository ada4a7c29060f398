"""Rollout recording and counterfactual reward replay (`forgelab.rescore` is `rescore` here): what would a new reward have said about these rollouts?

    df = run.rescore(my_reward)                       # recent rollouts of a live run (and its recorded file)
    df = run.rescore({"answer_format": 0.0})          # new weights over the recorded reward parts
    df = forgelab.rescore("runs/my-run", my_reward)   # a finished run, from rollouts/*.parquet
    df.attrs["correlation"], df.attrs["flipped_groups"]

**Recording.** Every run writes each episode to ``<run dir>/rollouts/`` when the
replay buffer closes it (trained, evicted or dropped: `RolloutRecorder`, a close
listener of the buffer), as parquet parts written every `FLUSH_EVERY` trained
steps, whenever `MAX_PENDING` rows wait, and when the run stops: id, group id,
prompt, completion, target, token ids, generator, reference and teacher logprobs, per-token advantages
(distillation), loss mask, reward and its parts,
advantage, policy version, status, drop reason, finish reason and the problem's
info (JSON). Nothing is capped: an episode still buffered when the run stops is
not closed, and is not in the log (a resume may train it).
Read them all with `read_rollouts(run_dir)`.

**Rescoring** touches no process and trains nothing. The new reward is a
function ``fn(prompt, completion, target, **info) -> float``, or a dict of
weights over the recorded reward parts (``{"exact_answer": 1.0, "answer_format": 0.0}``),
where a value may also be a function or ``(fn, weight)`` for a new term. Per
episode: old and new reward and advantage (the run's advantage estimator,
recomputed per group over the episodes that were scored), ``flipped`` (the
advantage sign changed); ``df.attrs``: Pearson correlation of old and new reward,
the group ids whose advantage signs flip, and the number of episodes.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypeAlias, TypedDict, cast

if TYPE_CHECKING:
    import pandas as pd

    from forgelab.rewards import RewardFn
    from forgelab.types import Episode

__all__ = ["RolloutRecorder", "read_rollouts", "rescore_frame", "rescore_run", "rescore"]

FLUSH_EVERY = 4
"""Trained steps between parquet parts (and a part when the run stops)."""
MAX_PENDING = 8192
"""Rows waiting in memory that make a part at once (a run whose steps are rare or never come: memory stays bounded)."""

RewardSpec: TypeAlias = "RewardFn | Mapping[str, float | RewardFn | tuple[RewardFn, float]]"
"""What `rescore` takes: a reward function, or a dict of weights over the recorded reward parts where a value may
also be a function or ``(fn, weight)`` for a new term."""


class RolloutRow(TypedDict):
    """One recorded episode: a row of ``rollouts/part-NNNNNN.parquet`` (`RolloutRecorder`), in column order."""

    id: int
    group_id: int
    task: str
    prompt: str
    completion: str
    target: str
    prompt_ids: list[int]
    completion_ids: list[int]
    generator_logprobs: list[float]
    reward: float
    reward_parts: str
    """JSON of ``{part name: value}`` (`read_rollouts` decodes it)."""
    advantage: float
    policy_version: int
    status: str
    reason: str
    finish_reason: str
    info: str
    """JSON of the problem's info, a value JSON cannot hold as its ``repr`` (`read_rollouts` decodes it)."""
    ref_logprobs: list[float] | None
    loss_mask: list[int] | None
    teacher_logprobs: list[float] | None
    token_advantages: list[float] | None
    trainer_logprobs: list[float] | None
    entropy: list[float] | None
    is_weight: list[float] | None
    clipped: list[bool] | None
    trained_step: int


class RolloutRecord(TypedDict):
    """A row of `read_rollouts`' frame as a rescored reward reads it (``reward_parts`` and ``info`` decoded)."""

    id: int
    prompt: str
    completion: str
    target: str
    reward_parts: dict[str, float]
    info: dict[str, object]
    completion_ids: NotRequired[list[int]]
    policy_version: NotRequired[int]


class RolloutRecorder:
    """Writes every episode the replay buffer closes to ``<out_dir>/rollouts/part-NNNNNN.parquet``.

        rec = RolloutRecorder()
        buffer.add_close_listener(rec.on_close)   # a row per closed episode, with its final status
        rec.attach(run_dir)                       # where parts go (rows closed before wait for it)
        rec.step_done(step)                       # after a trained step: a part every FLUSH_EVERY steps
        rec.flush()                               # when the run stops: whatever is waiting
    """

    def __init__(self, out_dir: Path | None = None):
        self.dir: Path | None = None
        self.parts = 0
        self.pending: list[RolloutRow] = []
        self.written = 0
        """Rows written so far by this recorder."""
        if out_dir is not None:
            self.attach(out_dir, append=True)

    def attach(self, out_dir: Path, append: bool = False) -> None:
        """Write parts under ``out_dir/rollouts``; without ``append`` the parts a previous run of the same
        directory left are removed first (as its event log is restarted), so the log holds this run only."""
        self.dir = Path(out_dir) / "rollouts"
        old = sorted(self.dir.glob("part-*.parquet")) if self.dir.is_dir() else []
        if not append:
            for f in old:
                f.unlink()
            old = []
        self.parts = max([int(f.stem.split("-")[1]) for f in old], default=0)

    def on_close(self, episodes: list[Episode], status: str, reason: str = "") -> None:
        """The buffer's close listener: one row per episode, with the status it closed with."""
        self.pending.extend(_row(ep, status, reason) for ep in episodes)
        if len(self.pending) >= MAX_PENDING:
            self.flush()

    def step_done(self, step: int) -> None:
        """After trained step ``step``: write a part every `FLUSH_EVERY` steps."""
        if step % FLUSH_EVERY == 0:
            self.flush()

    def flush(self) -> int:
        """Write the waiting rows as one part; their count (0 with none waiting or no directory attached)."""
        import pandas as pd

        if not self.pending or self.dir is None:
            return 0
        rows, self.pending = self.pending, []
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parts += 1
        pd.DataFrame(rows).to_parquet(self.dir / f"part-{self.parts:06d}.parquet", index=False)
        self.written += len(rows)
        return len(rows)


def _floats(values: list[float] | None) -> list[float] | None:
    return None if values is None else [float(x) for x in values]


def _trained(ep: Episode, key: str) -> list[float] | None:
    """The trainer's per-token `key` for `ep` (None if it never trained, or the value is None)."""
    return None if not ep.train_values or ep.train_values.get(key) is None else list(ep.train_values[key])


def _row(ep: Episode, status: str, reason: str = "") -> RolloutRow:
    return {
        "id": ep.id, "group_id": ep.group_id, "task": ep.task, "prompt": ep.prompt, "completion": ep.completion,
        "target": ep.target, "prompt_ids": list(ep.prompt_ids), "completion_ids": list(ep.completion_ids),
        "generator_logprobs": [float(x) for x in ep.generator_logprobs], "reward": float(ep.reward),
        "reward_parts": json.dumps(ep.reward_parts), "advantage": float(ep.advantage),
        "policy_version": int(ep.policy_version), "status": status, "reason": reason,
        "finish_reason": ep.finish_reason, "info": json.dumps(ep.info, default=repr),
        # the reference's per-token logprobs (None without a reference) and which tokens train (None: all)
        "ref_logprobs": None if ep.ref_logprobs is None else [float(x) for x in ep.ref_logprobs],
        "loss_mask": None if ep.loss_mask is None else [int(x) for x in ep.loss_mask],
        # on-policy distillation: the teacher's per-token logprobs and the per-token advantages they gave
        "teacher_logprobs": _floats(ep.teacher_logprobs), "token_advantages": _floats(ep.token_advantages),
        # the trainer's view of each token when it trained the episode (None if it never trained)
        "trainer_logprobs": _trained(ep, "trainer_logprobs"), "entropy": _trained(ep, "entropy"),
        "is_weight": _trained(ep, "is_weight"), "clipped": _trained_flags(ep),
        "trained_step": int((ep.train_values or {}).get("step", -1)),
    }


def _trained_flags(ep: Episode) -> list[bool] | None:
    """The trainer's per-token ``clipped`` flags for `ep` (None if it never trained, or the loss's rule is unknown)."""
    return None if not ep.train_values or ep.train_values.get("clipped") is None else list(ep.train_values["clipped"])


def read_rollouts(run_dir: str | Path) -> pd.DataFrame:
    """Every recorded rollout of a run directory (a DataFrame; reward_parts and info decoded to dicts)."""
    import pandas as pd

    d = Path(run_dir) / "rollouts"
    files = sorted(d.glob("part-*.parquet")) if d.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{run_dir}: no recorded rollouts (rollouts/part-*.parquet); "
                                "runs record each episode when it is trained, evicted or dropped, in parts "
                                "written every few trained steps and when the run stops")
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).drop_duplicates("id", keep="last")
    df["reward_parts"] = df["reward_parts"].map(json.loads)
    df["info"] = df["info"].map(json.loads)
    return df.sort_values("id").reset_index(drop=True)


def _value(fn: RewardFn, r: RolloutRecord) -> float:
    """One reward on a recorded row (a TRL-style reward also gets its token ids and policy version; its None,
    "does not apply", counts 0 as in TRL's sum); raises what the reward raised."""
    from forgelab.rewards import call_reward

    value, failure = call_reward(getattr(fn, "__name__", "reward"), fn, r["prompt"], r["completion"], r["target"],
                                 r["info"], {"completion_ids": list(r.get("completion_ids", [])),
                                             "policy_version": r.get("policy_version", 0)})
    if failure is not None:
        raise ValueError(f"rescore: reward {failure.name!r} failed on episode {r.get('id')}: {failure.error_text}")
    return 0.0 if value is None else value


def _new_reward_fn(spec: object) -> Callable[[RolloutRecord], float]:
    """row -> new reward, from a function or a dict of weights / functions / (fn, weight)."""
    from forgelab.rewards import as_reward

    if callable(spec):
        spec = as_reward(spec)
        return lambda r: _value(spec, r)
    if not isinstance(spec, dict) or not spec:
        raise TypeError("rescore: give a reward function fn(prompt, completion, target, **info) or a dict of "
                        f"weights over the recorded reward parts, not {spec!r}")
    terms: list[tuple[str, RewardFn | None, float]] = []
    for name, v in spec.items():
        if isinstance(v, tuple):
            terms.append((name, as_reward(v[0]), float(v[1])))
        elif callable(v):
            terms.append((name, as_reward(v), 1.0))
        else:
            terms.append((name, None, float(v)))

    def total(r: RolloutRecord) -> float:
        out = 0.0
        for name, fn, w in terms:
            if fn is not None:
                value = _value(fn, r)
            elif name in r["reward_parts"]:
                value = float(r["reward_parts"][name])
            else:
                raise KeyError(f"rescore: episode {r['id']} has no recorded reward part {name!r} "
                               f"(it has {sorted(r['reward_parts'])}); give a function for a new term")
            out += w * value
        return out

    return total


def _sign(x: pd.Series[float]) -> pd.Series[int]:
    """-1, 0 or 1 per value (0 within 1e-12 of zero)."""
    return (x > 1e-12).astype(int) - (x < -1e-12).astype(int)


def rescore_frame(df: pd.DataFrame, reward: RewardSpec, advantage: str = "grpo",
                  episodes: list[int] | None = None) -> pd.DataFrame:
    """Old/new reward and advantage per episode of `df` (recorded rollouts); see the module docstring."""
    import pandas as pd
    import torch

    from forgelab.algos import ADVANTAGES

    if episodes is not None:
        df = df[df["id"].isin(list(episodes))]
    df = df[df["reward_parts"].map(bool)].copy()  # scored episodes only
    if df.empty:
        raise ValueError("rescore: no scored episodes to rescore")
    fn = _new_reward_fn(reward)
    df["old_reward"] = df["reward"].astype(float)
    # a frame of recorded rollouts (`read_rollouts`): its records have RolloutRecord's keys and value types
    df["new_reward"] = [fn(cast(RolloutRecord, r)) for r in df.to_dict("records")]
    df["old_advantage"] = df["advantage"].astype(float)
    new_adv = pd.Series(float("nan"), index=df.index)
    for _, g in df.groupby("group_id"):
        if len(g) < 2:
            continue
        rewards_1_G = torch.tensor([g["new_reward"].tolist()], dtype=torch.float64)
        new_adv.loc[g.index] = ADVANTAGES[advantage](rewards_1_G)[0].tolist()  # type: ignore[call-overload]  # pandas-stubs: a list is valid, stubs take arrays
    df["new_advantage"] = new_adv
    df["flipped"] = (_sign(df["old_advantage"]) * _sign(df["new_advantage"])) < 0
    out = df[["id", "group_id", "policy_version", "prompt", "completion", "target", "old_reward", "new_reward",
              "old_advantage", "new_advantage", "flipped"]].reset_index(drop=True)
    a, b = out["old_reward"], out["new_reward"]
    corr = float(a.corr(b)) if a.std() > 0 and b.std() > 0 else float("nan")
    out.attrs.update(correlation=corr, flipped_groups=sorted(int(x) for x in out[out["flipped"]]["group_id"].unique()),
                     n_episodes=len(out), advantage=advantage)
    return out


def rescore_run(out_dir: Path, recent: list[Episode], status: Callable[[int], str | None], name: str,
                advantage: str, reward: RewardSpec, episodes: list[int] | None = None) -> pd.DataFrame:
    """`Run.rescore`: a run's recorded rollouts (in `out_dir`) plus the `recent` ones in memory (their buffer
    `status` by id), rescored with the run's `advantage` (`name`: the run's, for the error message)."""
    import pandas as pd

    frames = []
    try:
        frames.append(read_rollouts(out_dir))
    except FileNotFoundError:
        pass
    if recent:
        live = pd.DataFrame([_row(ep, status(ep.id) or "") for ep in recent])
        live["reward_parts"] = live["reward_parts"].map(json.loads)
        live["info"] = live["info"].map(json.loads)
        frames.append(live)
    if not frames:
        raise ValueError(f"rescore: run {name} has no rollouts yet")
    df = pd.concat(frames, ignore_index=True).drop_duplicates("id", keep="last").sort_values("id")
    return rescore_frame(df, reward, advantage, episodes)


def rescore(run_dir: str | Path, reward: RewardSpec, episodes: list[int] | None = None,
            advantage: str | None = None) -> pd.DataFrame:
    """`forgelab.rescore`: a finished run's recorded rollouts, rescored (advantage: the run's, from its manifest)."""
    if advantage is None:
        m = Path(run_dir) / "manifest.json"
        cfg = json.loads(m.read_text()).get("config", {}) if m.is_file() else {}
        advantage = (cfg.get("rollout") or {}).get("advantage", "grpo")
    return rescore_frame(read_rollouts(run_dir), reward, advantage, episodes)
