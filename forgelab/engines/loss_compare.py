"""The trainer's side of a loss A/B (`forgelab.experiments.loss_ab`): each loss's value, gradient and
metrics on one frozen batch, computed on a `TrainerState` with nothing changed (the optimizer never steps;
gradients are zeroed and the RNG state put back after each loss)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from forgelab.engines.contracts import TrainBatch
    from forgelab.engines.trainer_state import TrainerState

__all__ = ["compare_on_state", "loss_spec", "CURRENT_LOSS"]

CURRENT_LOSS = "<current loss>"
"""A spec meaning "the loss the next train step runs, with its keywords" (`TrainerState.next_loss`)."""


def loss_spec(item: object) -> tuple[object, dict[str, object]]:
    """``(spec, kwargs)`` of one item of `compare_on_state`'s list: ``(spec, kwargs)`` or a spec alone."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
        return item[0], dict(item[1])
    return item, {}


def compare_on_state(state: TrainerState, specs: Sequence[object], batch: TrainBatch | Mapping[str, object]
                     ) -> dict[str, object]:
    """Run on a `forgelab.engines.trainer_state.TrainerState` (collective: every rank calls it with the same arguments).

    A spec is a loss name, a function, a `PackedLoss`, `CURRENT_LOSS`, or ``(spec, kwargs)``.
    Returns ``{"losses": [{"name", "ok", "reason", "loss", "grad_norm", "metrics", "kwargs"}], "cosine": [[...]]}``;
    a loss that fails (raises, NaN) has ``ok False`` and NaN cosines.
    """
    import torch

    from forgelab.engines.contracts import check_batch
    from forgelab.engines.loss_specs import resolve_loss
    from forgelab.engines.trainer_dist import local_tensor, rng_state, set_rng_state
    from forgelab.engines.trainer_state import SkipStep

    state.require_closed_window("compare_losses")  # it zeroes gradients a forward_backward accumulated
    batch = check_batch(batch)
    rng = rng_state()
    rows: list[dict[str, object]] = []
    grads: list[torch.Tensor | None] = []
    for item in specs:
        spec, kwargs = loss_spec(item)
        if isinstance(spec, str) and spec == CURRENT_LOSS:
            name, fn, kwargs = state.next_loss()
        else:
            name, fn = resolve_loss(spec)
        try:
            loss, metrics, grad_norm = state.forward_loss_backward(batch, fn, name, kwargs)
            flat = [(local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p.data))).reshape(-1)
                    for p in state.params]
            grads.append(torch.cat(flat).double().cpu())
            rows.append({"name": name, "ok": True, "reason": "", "loss": loss, "grad_norm": grad_norm,
                         "metrics": metrics, "kwargs": kwargs})
        except SkipStep as skip:
            grads.append(None)
            rows.append({"name": name, "ok": False, "reason": str(skip), "loss": float("nan"),
                         "grad_norm": float("nan"), "metrics": {}, "kwargs": kwargs})
        finally:
            state.optimizer.zero_grad(set_to_none=True)
            set_rng_state(rng)
    n = len(rows)
    # dot products of the local shards, summed over ranks: the global inner products
    pairs = [(i, j) for i in range(n) for j in range(i, n) if grads[i] is not None and grads[j] is not None]
    sums = state.sum_across_ranks([float(_dot(grads[i], grads[j])) for i, j in pairs]) if pairs else []
    dot = {p: v for p, v in zip(pairs, sums)}
    cos = [[float("nan")] * n for _ in range(n)]
    for (i, j), v in dot.items():
        den = math.sqrt(dot[(i, i)] * dot[(j, j)])
        cos[i][j] = cos[j][i] = v / den if den > 0 else float("nan")
    return {"losses": rows, "cosine": cos}


def _dot(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    assert a is not None and b is not None  # pairs name only the losses that ran
    return a @ b
