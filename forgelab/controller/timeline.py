"""A run's timeline: config summary, then each change at its step, with code diffs between versions.

    print(format_timeline("runs/my-run"))      # what `forgelab show runs/my-run` prints
    entries = timeline_entries(run)            # a live Run or a run directory; the lab widget draws these

Read from the run's manifest (config) and event log; nothing else.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from forgelab.controller.events import Event, EventLog
from forgelab.controller.provenance import code_diff, json_object, read_manifest
from forgelab.controller.reward_runner import reward_weights

if TYPE_CHECKING:
    from forgelab.config.run_config import RunConfig

#: event kinds shown on a timeline (others, e.g. per-episode reward errors, are counted, not listed)
SHOWN = {
    "loss_swapped": "loss", "loss_refused": "loss", "reward_weights": "reward", "reward_added": "reward",
    "reward_removed": "reward", "reward_effective": "reward", "distill_coef": "reward", "paused": "control", "resumed": "control",
    "stopped": "control", "finished": "control", "failed": "control", "checkpoint": "checkpoint",
    "resumed_from_checkpoint": "checkpoint", "forked": "fork", "forked_from": "fork",
    "replica_failed": "fault", "replica_restarted": "fault", "replica_respawned": "fault", "spawned": "control",
    "eval": "eval", "step_skipped": "fault",
}


class RunSource(Protocol):
    """What a timeline reads of a live run (`forgelab.run.Run`): its config and its events."""

    @property
    def config(self) -> "RunConfig": ...
    @property
    def events(self) -> Iterable[Event]: ...


class TimelineEntry(TypedDict):
    """One shown event (`timeline_entries`)."""

    step: object
    kind: str
    category: str
    text: str
    diff: str
    time: object


def _text(value: object) -> str:
    """A recorded source text; ``TypeError`` for anything else (as `code_diff` would raise on it)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a source text, got {type(value).__name__}")
    return value


def change_source(run_or_dir: str | Path | RunSource) -> tuple[dict[str, object], list[Event]]:
    """(config dict, events) of a live Run or of a run directory."""
    if isinstance(run_or_dir, (str, Path)):
        return json_object(read_manifest(run_or_dir)["config"]), EventLog.read(run_or_dir)
    return run_or_dir.config.to_dict(), list(run_or_dir.events)


def config_summary(cfg: Mapping[str, object]) -> str:
    t, r, m = json_object(cfg["train"]), json_object(cfg["rollout"]), json_object(cfg["model"])
    kw = f" {t['loss_kwargs']}" if t.get("loss_kwargs") else ""
    return (f"{cfg['name']}: task {r['task']}, model {Path(_text(m['path'])).name}, loss {t['loss']}{kw}, "
            f"rewards {reward_weights(r)}, {t['steps']} steps x batch {t['batch_size']} (G={r['group_size']}), "
            f"lr {t['lr']}, max_policy_age {t['max_policy_age']}, seed {t['seed']}")


def timeline_entries(run_or_dir: str | Path | RunSource) -> list[TimelineEntry]:
    """One dict per shown event: step, kind, category, text, diff (a unified diff of code, or '')."""
    from forgelab.controller.function_code import loss_record, reward_record
    from forgelab.rewards.library import REWARDS

    cfg, events = change_source(run_or_dir)
    train = json_object(cfg["train"])
    loss_src: str
    try:
        loss = train["loss"]
        if not isinstance(loss, str):  # a config's loss is saved by name
            raise KeyError(loss)
        loss_src = _text(loss_record(loss)["source"])
    except KeyError:
        loss_src = ""
    loss_name = str(train["loss"])
    reward_src = {n: _text(reward_record(REWARDS[n])["source"])
                  for n in reward_weights(json_object(cfg["rollout"])) if n in REWARDS}
    out: list[TimelineEntry] = []
    for e in events:
        kind = e["kind"]
        if not isinstance(kind, str) or kind not in SHOWN:  # SHOWN's keys are the kinds (str)
            continue
        step, diff = e.get("step", 0), ""
        if kind == "loss_swapped":
            code = json_object(e.get("code") or {})
            text = (f"loss {loss_name} -> {e['loss']} {e.get('kwargs') or {}} applies at step {e.get('applies_at_step')} "
                    f"(sha256 {str(code.get('sha256'))[:12]}{', built-in' if code.get('builtin') else ''})")
            diff = code_diff(loss_src, _text(code.get("source", "")), loss_name, str(e["loss"]))
            loss_src, loss_name = _text(code.get("source", "")), str(e["loss"])
        elif kind == "reward_added":
            code = json_object(e.get("code") or {})
            name = str(e["name"])
            old = reward_src.get(name, "")
            verb = "replaced" if e.get("replace") and name in reward_src else "added"
            text = f"reward {name} {verb}, weight {e['weight']} (sha256 {str(code.get('sha256'))[:12]})"
            diff = code_diff(old, _text(code.get("source", "")), f"{name} (before)", name)
            reward_src[name] = _text(code.get("source", ""))
        elif kind == "reward_removed":
            text = f"reward {e['name']} removed"
            reward_src.pop(str(e["name"]), None)
        elif kind == "reward_weights":
            old_weights = json_object(e.get("old") or {})
            changed = {k: v for k, v in json_object(e.get("new") or {}).items() if old_weights.get(k) != v}
            text = f"reward weights {changed}"
        elif kind == "distill_coef":
            text = f"distillation coefficient {e.get('old')} -> {e.get('new')}"
        elif kind == "reward_effective":
            distill = f", distillation coefficient {e['distill_coef']}" if "distill_coef" in e else ""
            text = f"reward changes in effect from episode {e['first_episode']}: {e.get('rewards')}{distill}"
        elif kind == "checkpoint":
            text = f"checkpoint {e.get('path')}"
        elif kind == "resumed_from_checkpoint":
            text = f"resumed from {e.get('path')} (loss {e.get('loss')}, rewards {e.get('rewards')})"
        elif kind in ("forked", "forked_from"):
            text = f"{kind} {e.get('parent') or e.get('child') or ''} at step {e.get('at_step', step)}"
        elif kind == "eval":
            text = f"held-out accuracy {e.get('accuracy')}"
        elif kind.startswith("replica_"):
            text = f"{kind} replica {e.get('replica')}: {str(e.get('detail', ''))[:120]}"
        else:
            msg = e.get("message") or e.get("reason") or ""
            text = kind + (f": {msg}" if msg else "")
        out.append({"step": step, "kind": kind, "category": SHOWN[kind], "text": text, "diff": diff, "time": e.get("time")})
    return out


def format_timeline(run_or_dir: str | Path | RunSource, *, diffs: bool = True) -> str:
    """The text `forgelab show` prints."""
    cfg, events = change_source(run_or_dir)
    lines = [config_summary(cfg)]
    if isinstance(run_or_dir, (str, Path)):
        try:
            m = read_manifest(run_or_dir)
            v, forgelab, hw = json_object(m["versions"]), json_object(m["forgelab"]), json_object(m["hardware"])
            git = json_object(forgelab.get("git") or {})
            lines.append(f"  forgelab {forgelab['version']} git {str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}; "
                         + ", ".join(f"{k} {val}" for k, val in v.items()))
            lines.append(f"  host {hw['host']}, {hw['cores_usable']} cores, GPUs {hw['gpus'] or 'none'}; "
                         f"model sha256 {_text(json_object(m['model'])['sha256'])[:12]}")
        except FileNotFoundError:
            pass
    for en in timeline_entries(run_or_dir):
        lines.append(f"step {en['step']:>5}  {en['text']}")
        if diffs and en["diff"]:
            lines += ["             " + ln for ln in en["diff"].rstrip("\n").splitlines()]
    hidden = len(events) - len(timeline_entries(run_or_dir))
    if hidden:
        lines.append(f"({hidden} more events, e.g. reward errors: see events.jsonl)")
    return "\n".join(lines)
