"""Plain-text views of a run: what the lab shows when there is no notebook frontend.

Every function here reads the run through its public API and never raises:
a missing piece (no services yet, no metrics yet) is reported as such.
"""
from __future__ import annotations

import math
from typing import Any

from forgelab.controller.view import events_of
from forgelab.controller.facade import RunFacade


def field(obj: Any, name: str, default: Any = None) -> Any:
    """`obj.name` or `obj[name]`: service status entries may be dataclasses or dicts."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)

#: Metric columns shown in the one-line "last metrics" summary, in order.
SUMMARY_METRICS = ("reward_mean", "heldout_accuracy", "loss", "kl_ref", "entropy", "clip_frac", "policy_age_mean",
                   "tokens_per_s", "step_time_s")

#: Event kinds worth a line in summaries and a marker on plots.
MARKED_EVENTS = ("loss_swapped", "loss_refused", "reward_weights", "reward_added", "replica_restarted",
                 "replica_failed", "step_skipped", "paused", "resumed", "checkpoint", "failed", "stuck")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _safe(fn, default):
    try:
        return fn()
    except Exception:
        return default


def event_label(ev: dict) -> str:
    """A short label for an event: 'loss→dapo', 'weights', '+reward brevity', 'restart gen0', 'skipped'."""
    kind = ev.get("kind", "?")
    if kind == "loss_swapped":
        return f"loss→{ev.get('loss')}"
    if kind == "loss_refused":
        return f"refused {ev.get('loss')}"
    if kind == "reward_weights":
        old, new = ev.get("old") or {}, ev.get("new") or {}
        changed = [k for k in new if old.get(k) != new.get(k)]
        return "w " + ",".join(f"{k}={new[k]:g}" for k in changed[:2]) if changed else "weights"
    if kind == "reward_added":
        return f"+reward {ev.get('name')}"
    if kind in ("replica_restarted", "replica_failed"):
        who = ev.get("service", ev.get("name", ""))
        idx = ev.get("index", ev.get("replica", ""))
        return f"{'restart' if kind == 'replica_restarted' else 'failed'} {who}{idx}".strip()
    if kind == "step_skipped":
        return "skipped"
    return kind


def state_line(run: RunFacade) -> str:
    st = _safe(run.status, {}) or {}
    name = _safe(lambda: run.snapshot().name, "run")
    line = (f"Run {name}: {st.get('state', '?')}  step {st.get('step', '?')}/{st.get('steps', '?')}"
            f"  version {st.get('version', '?')}  loss {loss_name_of(st.get('loss', '?'))}")
    if st.get("message"):
        line += f"\n  message: {st['message']}"
    return line


def loss_name_of(loss: Any) -> str:
    return loss if isinstance(loss, str) else getattr(loss, "__name__", str(loss))


def rewards_line(run: RunFacade) -> str:
    w = _safe(lambda: run.snapshot().reward_weights, {})
    return "rewards: " + (", ".join(f"{k}={v:g}" for k, v in w.items()) or "(none)")


def metrics_line(run: RunFacade) -> str:
    df = _safe(lambda: run.metrics, None)
    if df is None or len(df) == 0:
        return "last metrics: (no steps yet)"
    last = df.iloc[-1]
    parts = [f"{c} {_fmt(float(last[c]))}" for c in SUMMARY_METRICS if c in df.columns and last[c] == last[c]]
    return f"last metrics (step {int(last['step']) if 'step' in df.columns else len(df)}): " + ", ".join(parts)


def events_lines(run: RunFacade, n: int = 6) -> list[str]:
    evs = [e for e in (_safe(lambda: events_of(run.events), []) or []) if e.kind in MARKED_EVENTS or e.kind == "eval"]
    if not evs:
        return ["recent events: (none)"]
    out = ["recent events:"]
    for ev in evs[-n:]:
        extra = ev.get("reason") or ev.get("message") or ev.get("path") or ""
        out.append(f"  step {ev.get('step', '?'):>4}  {event_label(ev)}" + (f"  ({str(extra)[:100]})" if extra else ""))
    return out


def services_rows(run: RunFacade) -> list[dict]:
    """One dict per replica: service, index, healthy, in_flight, restarts, version, pid, last_error, calls,
    failures and latency (p50/p95/p99 text)."""
    st = _safe(run.status, {}) or {}
    rows = []
    for service, replicas in (st.get("services") or {}).items():
        for i, r in enumerate(replicas or []):
            info = field(r, "info", None) or {}
            pid = field(r, "pid", None)
            if pid is None:
                pids = field(r, "pids", None)
                pid = ",".join(str(p) for p in pids) if pids else ""
            rows.append({
                "service": service, "index": field(r, "index", i), "healthy": bool(field(r, "healthy", False)),
                "in_flight": field(r, "in_flight", 0), "restarts": field(r, "restarts", 0),
                "version": info.get("version", "") if isinstance(info, dict) else "",
                "pid": pid, "last_error": field(r, "last_error", None) or "",
                "calls": field(r, "calls", 0), "failures": field(r, "failures", 0),
                "latency": latency_text(field(r, "latency_ms", None) or {}),
            })
    return rows


def stuck_rows(run: RunFacade) -> list[dict]:
    """One dict per call the watchdog declared stuck (the run's ``stuck`` events, oldest first): part, call,
    waited_s, reason and path (the stack dump file, or "")."""
    return [{"part": str(ev.get("part", "?")), "call": str(ev.get("call", "?")), "waited_s": ev.get("waited_s", ""),
             "reason": str(ev.get("reason", "")), "path": str(ev.get("path") or "")}
            for ev in (_safe(lambda: events_of(run.events), []) or []) if ev.kind == "stuck"]


def stuck_lines(run: RunFacade) -> list[str]:
    """"stuck: <part> in <call> after N s; stacks: <file>" for each stuck call (docs/hangs.md)."""
    return [f"  stuck: {r['part']} in {r['call']} after {r['waited_s']} s; stacks: {r['path'] or '(not written)'}"
            for r in stuck_rows(run)]


def latency_text(ms: dict) -> str:
    """"p50 / p95 / p99 ms" of a replica's recent calls ("" before any call)."""
    if not ms or not ms.get("n"):
        return ""
    return f"{ms['p50']:.1f} / {ms['p95']:.1f} / {ms['p99']:.1f} ms"


def pool_line(run: RunFacade) -> str:
    """"pool: ..." when the run's processes come from a `forgelab.engines.pool.ProcessPool`, else ""."""
    parts = getattr(run, "parts", None)
    pool = getattr(parts, "pool", None)
    if pool is None:
        return ""
    if hasattr(pool, "line"):  # shared engines (forgelab.experiments.variants.SharedEngines): runs per slot
        return pool.line(parts)
    return (f"pool: these processes served {parts.runs} run(s); pool idle {len(pool.idle)} busy {len(pool.busy)}, "
            f"spawned {pool.spawned} reused {pool.reused}; {pool.last_note}")


def cpu_view(run: RunFacade) -> dict | None:
    """The run's cores busy over its steady state (``status()["cpu_use"]``: ``cores_busy``, ``cpu_s_per_episode``,
    ``cores``, ``cores_busy_by_part``, ...), or None before two steps."""
    st = _safe(run.status, {}) or {}
    use = st.get("cpu_use")
    return use if isinstance(use, dict) else None


def cpu_line(run: RunFacade) -> str:
    """"cores busy 0.87 of 2 · 0.042 CPU-s per episode (generator 0.5, trainer 0.2, ...)", or "" before two steps."""
    use = cpu_view(run)
    if use is None:
        return ""
    per_ep = use.get("cpu_s_per_episode")
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted((use.get("cores_busy_by_part") or {}).items(),
                                                           key=lambda kv: -kv[1]))
    return (f"cores busy {_fmt(use['cores_busy'])} of {use.get('cores', '?')} · "
            f"{_fmt(per_ep) if per_ep is not None else '-'} CPU-s per episode" + (f" ({parts})" if parts else ""))


def services_lines(run: RunFacade) -> list[str]:
    rows = services_rows(run)
    if not rows:
        return ["services: (none running)"]
    out = ["services:"] + ([pool_line(run)] if pool_line(run) else []) + ([cpu_line(run)] if cpu_line(run) else [])
    for r in rows:
        err = f"  last error: {str(r['last_error'])[:80]}" if r["last_error"] else ""
        out.append(f"  {r['service']}[{r['index']}] {'healthy' if r['healthy'] else 'DOWN'}  in_flight {r['in_flight']}"
                   f"  restarts {r['restarts']}  version {r['version']}  calls {r['calls']}  failures {r['failures']}"
                   + (f"  latency p50/p95/p99 {r['latency']}" if r["latency"] else "") + err)
    return out + stuck_lines(run)


def text_summary(run: RunFacade) -> str:
    """State, rewards, last metrics, recent events and services, as plain text."""
    return "\n".join([state_line(run), rewards_line(run), metrics_line(run), *events_lines(run), *services_lines(run)])
