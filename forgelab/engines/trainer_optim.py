"""The optimizer side of the trainer: the LR schedule, the peak lr, and one step's own AdamW hyperparameters.

    LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))
    set_schedule_peak(optimizer, scheduler, 3e-5)   # keeps the schedule's position
    with adam_hyperparameters(optimizer, AdamParams(lr=1e-4)): optimizer.step()
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from forgelab.engines.trainer_dist import sum_of_squares
from forgelab.types import AdamParams

__all__ = ["WarmupCosine", "set_schedule_peak", "adam_hyperparameters", "global_grad_norm"]


class WarmupCosine:
    """LR multiplier for step ``s``: linear warmup to 1, then cosine to ``min_ratio`` at ``total_steps`` (1 if None).

    >>> f = WarmupCosine(warmup_steps=2, total_steps=4, min_ratio=0.0)
    >>> [round(f(s), 3) for s in range(5)]
    [0.5, 1.0, 0.5, 0.0, 0.0]
    """

    def __init__(self, warmup_steps: int, total_steps: int | None, min_ratio: float):
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps + 1) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))



def set_schedule_peak(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      lr: float) -> float:
    """Make ``lr`` the peak learning rate from now on, keeping the schedule's position; returns the current lr."""
    scheduler.base_lrs = [float(lr)] * len(optimizer.param_groups)
    for g, f in zip(optimizer.param_groups, scheduler.lr_lambdas):
        g["initial_lr"], g["lr"] = float(lr), float(lr) * f(scheduler.last_epoch)
    return float(optimizer.param_groups[0]["lr"])


@contextlib.contextmanager
def adam_hyperparameters(optimizer: torch.optim.Optimizer, adam: AdamParams) -> Iterator[None]:
    """Every param group uses ``adam``'s lr, betas, eps and weight decay inside the block; the scheduled values
    are put back after it (a call's own hyperparameters do not move the schedule)."""
    keys = ("lr", "betas", "eps", "weight_decay")
    saved = [{k: g[k] for k in keys} for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g.update(lr=float(adam.lr), betas=tuple(adam.betas), eps=float(adam.eps),
                     weight_decay=float(adam.weight_decay))
        yield
    finally:
        for g, s in zip(optimizer.param_groups, saved):
            g.update(s)


def global_grad_norm(params: list[torch.nn.Parameter], device: torch.device, world: int
                     ) -> tuple[float, torch.Tensor | None]:
    """The global L2 norm of the gradients (float64 sum of squares: `sum_of_squares`), as a float and as the
    tensor (gradient dtype) that clipping takes; ``(0.0, None)`` without gradients."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0, None
    sharded = [g for g in grads if isinstance(g, DTensor)]  # FSDP2: Shard(0), each element on one rank
    sq = sum_of_squares([g for g in grads if not isinstance(g, DTensor)]).to(device)
    sq_sharded = sum_of_squares(sharded).to(device)
    if sharded and world > 1:
        dist.all_reduce(sq_sharded)
    total = (sq + sq_sharded).sqrt()
    return float(total), total.to(grads[0].dtype)
