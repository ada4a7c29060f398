"""The generators' own engine counters as step metrics: KV-cache usage and vLLM preemptions per trainer step.

    meter = GeneratorMeter()
    row.update(await meter.row(run.generators))   # once per step, after the weight push

Each generator replica counts, inside its engine loop (forgelab.engines.generator), the KV-cache usage after
every engine step (vLLM's scheduler: the fraction of KV blocks in use) and every preemption (vLLM freed a
running request's blocks because the cache was full; the request is recomputed later). This turns those
cumulative counters into one row per trainer step:

- ``generator/kv_cache_usage``: mean over the engine steps since the last row (all replicas together);
- ``generator/kv_cache_usage_now``: the highest replica's usage when the row was made;
- ``generator/preemptions``: preemptions since the last row (all replicas);
- ``generator/preemptions_per_request``: those over the requests the generators finished meanwhile.

A user sees from them when the cache, not the model, is the bottleneck (usage near 1 and preemptions rising).
Generators without these counters (fakes, another engine) give no columns; a failed read gives none that step.
"""
from __future__ import annotations

from forgelab.generation import Generators

__all__ = ["GeneratorMeter"]

_COUNTERS = ("kv_cache_usage_sum", "steps", "preemptions", "requests")


class GeneratorMeter:
    """Deltas of the generator replicas' engine counters between two rows (see the module docstring)."""

    def __init__(self) -> None:
        self.last: dict[int, dict[str, float]] = {}  # replica position -> counters at the previous row

    def deltas(self, stats: list[dict[str, float]]) -> dict[str, float]:
        """The row's columns from each replica's `stats()` (pure: only `self.last` changes).

        >>> m = GeneratorMeter()
        >>> s = {"kv_cache_usage_sum": 1.0, "steps": 4, "preemptions": 0, "requests": 10, "kv_cache_usage": 0.2}
        >>> m.deltas([s])["generator/kv_cache_usage"]
        0.25
        >>> m.deltas([{**s, "kv_cache_usage_sum": 3.0, "steps": 6, "preemptions": 3, "requests": 16}])
        {'generator/kv_cache_usage': 1.0, 'generator/kv_cache_usage_now': 0.2, 'generator/preemptions': 3.0, 'generator/preemptions_per_request': 0.5}
        """
        stats = [s for s in stats if isinstance(s, dict) and all(k in s for k in _COUNTERS)]
        if not stats:
            return {}
        d = {k: 0.0 for k in _COUNTERS}
        for i, s in enumerate(stats):
            prev = self.last.get(i, {})
            if prev and s["steps"] < prev["steps"]:  # a respawned replica starts its counters again
                prev = {}
            for k in _COUNTERS:
                d[k] += float(s[k]) - float(prev.get(k, 0.0))
            self.last[i] = {k: float(s[k]) for k in _COUNTERS}
        return {
            "generator/kv_cache_usage": d["kv_cache_usage_sum"] / d["steps"] if d["steps"] > 0 else 0.0,
            "generator/kv_cache_usage_now": max(float(s.get("kv_cache_usage", 0.0)) for s in stats),
            "generator/preemptions": d["preemptions"],
            "generator/preemptions_per_request": d["preemptions"] / d["requests"] if d["requests"] > 0 else 0.0,
        }

    async def row(self, generators: Generators) -> dict[str, float]:
        """Read every healthy replica's counters (one `stats` call each) and return the row's columns."""
        try:
            stats = await generators.engine_stats()
        except Exception:  # noqa: BLE001 -- a metric never fails a step (a dying replica, a respawn)
            return {}
        return self.deltas([s.counters() for s in stats])
