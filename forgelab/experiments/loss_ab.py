"""Loss A/B on one frozen batch: each loss's value, gradient and metrics on the same rollouts, nothing changed.

    report = await run.compare_losses(["grpo", "dapo", my_loss], batch=None)   # default: the last trained batch
    report.table                      # one row per loss: loss, grad_norm, clip_frac, ... (pandas)
    report.cosine                     # pairwise cosine similarity of the parameter gradients (pandas)

The trainer computes it (`Trainer.compare_losses` -> `compare_on_state`): for
each loss, the same forward/loss/backward the train step runs
(`TrainerState._forward_loss_backward`, so a multi-process trainer gives the
global-batch gradient), a copy of the resulting gradient, then the gradients are
zeroed and the RNG state put back. The optimizer never steps: weights, optimizer
state and schedule are untouched (`trainer.fingerprint` before == after).
Gradients are compared before clipping. Memory: one gradient copy per loss
(float64 on each rank's shard).

A loss is a name in `LOSSES`, a function, or ``(name_or_fn, kwargs)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["compare_on_state", "compare_losses", "LossComparison"]


def _spec(item: Any) -> tuple[Any, dict]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
        return item[0], dict(item[1])
    return item, {}


def compare_on_state(state: Any, specs: list, batch: Any) -> dict[str, Any]:
    """Run on a `forgelab.engines.trainer_core.TrainerState` (collective: every rank calls it with the same arguments).

    Returns ``{"losses": [{"name", "ok", "reason", "loss", "grad_norm", "metrics"}], "cosine": [[...]]}``;
    a loss that fails (raises, NaN) has ``ok False`` and NaN cosines.
    """
    import torch

    from forgelab.engines.trainer_core import _Skip
    from forgelab.engines.trainer_support import _local, _rng_state, _set_rng_state, check_batch, resolve_loss

    batch = check_batch(batch)
    rng = _rng_state()
    rows, grads = [], []
    for item in specs:
        spec, kwargs = _spec(item)
        name, fn = resolve_loss(spec)
        try:
            loss, metrics, grad_norm = state._forward_loss_backward(batch, fn, name, kwargs)
            flat = [(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p.data))).reshape(-1)
                    for p in state.params]
            grads.append(torch.cat(flat).double().cpu())
            rows.append({"name": name, "ok": True, "reason": "", "loss": loss, "grad_norm": grad_norm,
                         "metrics": metrics, "kwargs": kwargs})
        except _Skip as skip:
            grads.append(None)
            rows.append({"name": name, "ok": False, "reason": str(skip), "loss": float("nan"),
                         "grad_norm": float("nan"), "metrics": {}, "kwargs": kwargs})
        finally:
            state.optimizer.zero_grad(set_to_none=True)
            _set_rng_state(rng)
    n = len(rows)
    # dot products of the local shards, summed over ranks: the global inner products
    pairs = [(i, j) for i in range(n) for j in range(i, n) if grads[i] is not None and grads[j] is not None]
    sums = state._sum([float(grads[i] @ grads[j]) for i, j in pairs]) if pairs else []
    dot = {p: v for p, v in zip(pairs, sums)}
    cos = [[float("nan")] * n for _ in range(n)]
    for (i, j), v in dot.items():
        den = math.sqrt(dot[(i, i)] * dot[(j, j)])
        cos[i][j] = cos[j][i] = v / den if den > 0 else float("nan")
    return {"losses": rows, "cosine": cos}


@dataclass
class LossComparison:
    """What `compare_losses` found; ``fingerprint_before == fingerprint_after`` shows nothing changed."""

    losses: list[dict]
    cosine_matrix: list[list[float]]
    fingerprint_before: Any = None
    fingerprint_after: Any = None
    step: int = 0
    names: list[str] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        return self.fingerprint_before == self.fingerprint_after

    @property
    def table(self):
        """One row per loss: ok, loss, grad_norm and every metric the loss reported (clip fractions among them)."""
        import pandas as pd

        out = []
        for name, r in zip(self.names, self.losses):
            out.append({"loss_fn": name, "ok": r["ok"], "loss": r["loss"], "grad_norm": r["grad_norm"],
                        **{k: v for k, v in r["metrics"].items() if isinstance(v, (int, float))},
                        "reason": r["reason"]})
        return pd.DataFrame(out).set_index("loss_fn")

    @property
    def cosine(self):
        import pandas as pd

        return pd.DataFrame(self.cosine_matrix, index=self.names, columns=self.names)

    def __repr__(self) -> str:
        return (f"<LossComparison step {self.step}: {', '.join(self.names)}; trainer unchanged: {self.unchanged}>\n"
                f"{self.table[['loss', 'grad_norm']].to_string()}\n{self.cosine.round(4).to_string()}")


def _label(item: Any, name: str, seen: dict) -> str:
    spec, kwargs = _spec(item)
    label = name + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")
    seen[label] = seen.get(label, 0) + 1
    return label if seen[label] == 1 else f"{label}#{seen[label]}"


async def compare_losses(run: Any, losses: list, batch: dict | None = None) -> LossComparison:
    """`Run.compare_losses`: A/B `losses` on `batch` (default: the run's last trained batch) on its trainer."""
    if batch is None:
        batch = run.last_batch
    if batch is None:
        raise ValueError("compare_losses: the run has trained no batch yet; pass batch=... "
                         "(forgelab.algos.batching.collate of episodes) or wait for the first step")
    if not losses:
        raise ValueError("compare_losses: give at least one loss (a name in LOSSES, a function, or (loss, kwargs))")
    before = await run.trainer.call("fingerprint")
    out = (await run.trainer.call("compare_losses", list(losses), batch))[0]
    after = await run.trainer.call("fingerprint")
    seen: dict = {}
    names = [_label(item, r["name"], seen) for item, r in zip(losses, out["losses"])]
    report = LossComparison(out["losses"], out["cosine"], before, after, run.step, names)
    run._event("losses_compared", losses=names, values=[r["loss"] for r in out["losses"]], unchanged=report.unchanged)
    return report
