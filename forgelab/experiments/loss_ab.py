"""Loss A/B on one frozen batch: each loss's value, gradient and metrics on the same rollouts, nothing changed.

    report = await run.compare_losses(["grpo", "dapo", my_loss], batch=None)   # default: the last trained batch
    report.table                      # one row per loss: loss, grad_norm, clip_frac, ... (pandas)
    report.cosine                     # pairwise cosine similarity of the parameter gradients (pandas)

The trainer computes it (`Trainer.compare_losses` -> `forgelab.engines.loss_compare.compare_on_state`): for
each loss, the same forward/loss/backward the train step runs
(`TrainerState.forward_loss_backward`, so a multi-process trainer gives the
global-batch gradient), a copy of the resulting gradient, then the gradients are
zeroed and the RNG state put back. The optimizer never steps: weights, optimizer
state and schedule are untouched (`trainer.fingerprint` before == after).
Gradients are compared before clipping. Memory: one gradient copy per loss
(float64 on each rank's shard).

A loss is a name in `LOSSES`, a function, or ``(name_or_fn, kwargs)``, resolved as
`Run.set_loss` resolves it (checked keywords, the completion budget that
``dr_grpo``-style losses divide by; a bare name of the run's loss takes the run's
keywords). The first row is always the baseline, ``"current: NAME"``: the loss the
next train step runs, with its keywords, i.e. what that step computes on the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from forgelab.engines.loss_compare import CURRENT_LOSS, loss_spec
from forgelab.controller.facade import RunFacade

if TYPE_CHECKING:
    import pandas as pd

    from forgelab.engines.loss_specs import LossFunction, LossSpec
    from forgelab.engines.trainer_client import Fingerprint, TrainerInfo
    from forgelab.types import TrainBatch

__all__ = ["compare_losses", "LossComparison"]


@dataclass
class LossComparison:
    """What `compare_losses` found; ``fingerprint_before == fingerprint_after`` shows nothing changed."""

    losses: list[dict[str, object]]
    cosine_matrix: list[list[float]]
    fingerprint_before: "list[Fingerprint] | None" = None
    fingerprint_after: "list[Fingerprint] | None" = None
    step: int = 0
    names: list[str] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        return self.fingerprint_before == self.fingerprint_after

    @property
    def table(self) -> "pd.DataFrame":
        """One row per loss: ok, loss, grad_norm and every metric the loss reported (clip fractions among them)."""
        import pandas as pd

        out: list[dict[str, object]] = []
        for name, r in zip(self.names, self.losses):
            metrics = r["metrics"]
            assert isinstance(metrics, dict), type(metrics)
            out.append({"loss_fn": name, "ok": r["ok"], "loss": r["loss"], "grad_norm": r["grad_norm"],
                        **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                        "reason": r["reason"]})
        return pd.DataFrame(out).set_index("loss_fn")

    @property
    def cosine(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame(self.cosine_matrix, index=self.names, columns=self.names)

    def __repr__(self) -> str:
        return (f"<LossComparison step {self.step}: {', '.join(self.names)}; trainer unchanged: {self.unchanged}>\n"
                f"{self.table[['loss', 'grad_norm']].to_string()}\n{self.cosine.round(4).to_string()}")


def _label(item: object, name: str, seen: dict[str, int]) -> str:
    spec, kwargs = loss_spec(item)
    label = name + (f"({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")
    seen[label] = seen.get(label, 0) + 1
    return label if seen[label] == 1 else f"{label}#{seen[label]}"


def _resolve(run: RunFacade, item: object, current: "TrainerInfo") -> tuple[object, dict[str, object]]:
    """``(spec, kwargs)`` for the trainer, resolved as `Run.set_loss` resolves a loss (`controls.prepare_loss`):
    checked keywords, the completion budget, a function packed. A bare name of the run's current loss means
    it with the run's keywords (``train.loss_kwargs`` or the last swap's)."""
    from forgelab.controller.controls import LossSwapRefused, prepare_loss
    from forgelab.engines.loss_specs import PackedLoss

    spec, kwargs = loss_spec(item)
    if isinstance(spec, str) and spec == current.get("loss") and not kwargs:
        kwargs = dict(current.get("loss_kwargs") or {})
    loss: LossSpec
    if isinstance(spec, (str, PackedLoss)):
        loss = spec
    elif callable(spec):  # a function: its signature is the trainer's to check when it calls it
        loss = cast("LossFunction", spec)
    else:  # what prepare_loss refuses, with its words
        raise LossSwapRefused(f"expected a loss name or a function, got {spec!r}")
    _, packed, kwargs = prepare_loss(run.config, loss, kwargs)
    return packed, kwargs


async def compare_losses(run: RunFacade, losses: Sequence[object], batch: "TrainBatch | None" = None) -> LossComparison:
    """`Run.compare_losses`: A/B `losses` on `batch` (default: the run's last trained batch) on its trainer.

    The first row is the baseline, ``"current: NAME"``: the loss the next train step runs, with its keywords,
    so its value is the one that step computes on `batch` from the same weights. Each of `losses` is resolved
    as `Run.set_loss` resolves it (`_resolve`); a bad name or keyword raises `LossSwapRefused` before
    anything runs."""
    if batch is None:
        batch = run.last_batch
    if batch is None:
        raise ValueError("compare_losses: the run has trained no batch yet; pass batch=... "
                         "(forgelab.algos.batching.collate of episodes) or wait for the first step")
    if not losses:
        raise ValueError("compare_losses: give at least one loss (a name in LOSSES, a function, or (loss, kwargs))")
    trainer = run.trainer
    if trainer is None:
        raise RuntimeError(f"compare_losses: run {run.config.name} has no trainer (its processes are down)")
    current = await trainer.info()
    specs: list[object] = [CURRENT_LOSS] + [_resolve(run, item, current) for item in losses]
    before = await trainer.fingerprint()
    out = await trainer.compare_losses(specs, batch)
    after = await trainer.fingerprint()
    seen: dict[str, int] = {}
    names = [f"current: {out['losses'][0]['name']}"]
    names += [_label(item, str(r["name"]), seen) for item, r in zip(losses, out["losses"][1:])]
    report = LossComparison(out["losses"], out["cosine"], before, after, run.step, names)
    run.emit("losses_compared", losses=names, values=[r["loss"] for r in out["losses"]], unchanged=report.unchanged)
    return report
