"""Tinker's built-in losses as plain functions: sums over target tokens, one value per batch.

    loss, metrics = PRIMITIVE_LOSSES["cross_entropy"](logprobs_B_T, mask_B_T=mask_B_T, weights_B_T=w_B_T, ...)

What they really are (``logp`` the current policy's logprob of a target token, ``q`` the sampler's, ``A`` the
token's advantage, ``w`` its weight; every sum runs over the positions where ``mask_B_T`` is not 0):

* ``cross_entropy``: ``sum -w * logp``. Supervised fine-tuning; ``w`` 1 on the tokens to learn, 0 on the
  prompt. Without ``weights_B_T`` every masked token has weight 1.
* ``importance_sampling``: ``sum -exp(logp - q) * A``. REINFORCE corrected for the sampler being another policy;
  its gradient is ``-r A d logp``.
* ``ppo``: ``sum -min(r A, clip(r, clip_low_threshold, clip_high_threshold) A)`` with ``r = exp(logp - q)``.
* ``cispo``: ``sum -sg(clip(r, clip_low_threshold, clip_high_threshold)) * logp * A`` (the clipped ratio is a
  constant: every token keeps a gradient, capped in size).

The thresholds are ratios, not distances from 1 (Tinker's ``loss_fn_config``), 0.8 and 1.2 by default.
These are sums, not means (Tinker's ``loss:sum``): a batch twice as long has twice the loss and gradient,
so the learning rate is per token. The trainer evaluates a loss once on the global batch whatever its number
of processes (`forgelab.engines.trainer`), so the sum is over every row on every rank.

They take the trainer's loss signature (`forgelab.algos.losses`), so the trainer runs them as it runs any loss:
``generator_logprobs_B_T`` is ``q``, ``advantages_B`` is ``A`` (``[B, T]`` per token, or ``[B]``),
``weights_B_T`` comes from ``TrainBatch.loss_inputs_B_T``. ``ref_logprobs_B_T`` and ``is_weights_B_T`` are
accepted and unused (Tinker's definitions have neither). They are kept out of `forgelab.algos.losses.LOSSES`
(forgelab's RL losses, whose ``cispo`` is a token mean with other thresholds): `forgelab.experiments.primitives`
ships them to the trainer by value.

    >>> import torch
    >>> logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    >>> loss, m = cross_entropy(logp, mask_B_T=torch.tensor([[0.0, 1.0, 1.0]]),
    ...                         weights_B_T=torch.tensor([[0.0, 1.0, 0.5]]))
    >>> loss.item(), m["weight_sum"]
    (3.5, 1.5)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from forgelab.algos.loss_checks import LossError

__all__ = ["PRIMITIVE_LOSSES", "PrimitiveLoss", "cross_entropy", "importance_sampling", "ppo", "cispo"]

PrimitiveLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def _on(name: str, logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    if logprobs_B_T.dim() != 2 or tuple(mask_B_T.shape) != tuple(logprobs_B_T.shape):
        raise LossError(f"loss {name!r}: logprobs_B_T {tuple(logprobs_B_T.shape)} and mask_B_T "
                        f"{tuple(mask_B_T.shape)} must be the same [B, T]")
    return mask_B_T.detach() != 0


def _per_token(name: str, arg: str, x: torch.Tensor | None, like: torch.Tensor, on_B_T: torch.Tensor) -> torch.Tensor:
    """``x`` as fp32 ``[B, T]`` (a ``[B]`` tensor broadcast along the row), 0 off the mask; None is an error."""
    if x is None:
        raise LossError(f"loss {name!r} needs {arg} (one value per target token)")
    x = x.detach().float()
    if x.dim() == 1 and x.shape[0] == like.shape[0]:
        x = x[:, None].expand_as(like)
    if tuple(x.shape) != tuple(like.shape):
        raise LossError(f"loss {name!r}: {arg} has shape {tuple(x.shape)}, expected {tuple(like.shape)} "
                        "(aligned to target positions like logprobs_B_T)")
    return torch.where(on_B_T, x, 0.0)


def _ratio(name: str, logprobs_B_T: torch.Tensor, generator_logprobs_B_T: torch.Tensor | None,
           on_B_T: torch.Tensor) -> torch.Tensor:
    """``exp(logp - q)`` on the mask, 1 off it (with grad through ``logp``)."""
    q_B_T = _per_token(name, "generator_logprobs_B_T (the sampler's logprobs)", generator_logprobs_B_T,
                       logprobs_B_T, on_B_T)
    return torch.exp(torch.where(on_B_T, logprobs_B_T.float() - q_B_T, 0.0))


def _thresholds(name: str, low: float, high: float) -> None:
    if not 0.0 <= low <= 1.0 <= high:
        raise LossError(f"loss {name!r}: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold (ratios, e.g. "
                        f"0.8 and 1.2), got {low} and {high}")


def _ratio_metrics(ratio_B_T: torch.Tensor, on_B_T: torch.Tensor) -> dict[str, float]:
    n = max(int(on_B_T.sum()), 1)
    with torch.no_grad():
        return {"ratio_mean": float(torch.where(on_B_T, ratio_B_T, 0.0).sum()) / n, "n_target_tokens": float(n)}


def cross_entropy(logprobs_B_T: torch.Tensor, *, mask_B_T: torch.Tensor, weights_B_T: torch.Tensor | None = None,
                  generator_logprobs_B_T: torch.Tensor | None = None, advantages_B: torch.Tensor | None = None,
                  ref_logprobs_B_T: torch.Tensor | None = None, is_weights_B_T: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum -weights * logp`` over the masked target tokens (weights default to 1).

    Args:
        logprobs_B_T: the policy's logprob of each target token (with grad), ``[B, T]``.
        mask_B_T: 1.0 on target tokens, 0.0 on padding, ``[B, T]``.
        weights_B_T: each token's weight, ``[B, T]`` (0 on tokens not learned, e.g. the prompt), or None.
        generator_logprobs_B_T, advantages_B, ref_logprobs_B_T, is_weights_B_T: unused.
    """
    on = _on("cross_entropy", logprobs_B_T, mask_B_T)
    w_B_T = on.float() if weights_B_T is None else _per_token("cross_entropy", "weights_B_T", weights_B_T,
                                                              logprobs_B_T, on)
    loss = -(w_B_T * torch.where(on, logprobs_B_T.float(), 0.0)).sum()
    return loss, {"weight_sum": float(w_B_T.sum()), "n_target_tokens": float(on.sum())}


def importance_sampling(logprobs_B_T: torch.Tensor, *, mask_B_T: torch.Tensor,
                        generator_logprobs_B_T: torch.Tensor | None = None, advantages_B: torch.Tensor | None = None,
                        ref_logprobs_B_T: torch.Tensor | None = None, is_weights_B_T: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum -exp(logp - q) * A`` over the masked target tokens.

    Args:
        logprobs_B_T: the policy's logprob of each target token (with grad), ``[B, T]``.
        mask_B_T: 1.0 on target tokens, 0.0 on padding, ``[B, T]``.
        generator_logprobs_B_T: ``q``, the sampler's logprob of each token, ``[B, T]``.
        advantages_B: ``A``, per token ``[B, T]`` (0 on the prompt) or per sequence ``[B]``.
        ref_logprobs_B_T, is_weights_B_T: unused.
    """
    on = _on("importance_sampling", logprobs_B_T, mask_B_T)
    ratio = _ratio("importance_sampling", logprobs_B_T, generator_logprobs_B_T, on)
    adv = _per_token("importance_sampling", "advantages_B", advantages_B, logprobs_B_T, on)
    return -(ratio * adv).sum(), _ratio_metrics(ratio, on)


def ppo(logprobs_B_T: torch.Tensor, *, mask_B_T: torch.Tensor, generator_logprobs_B_T: torch.Tensor | None = None,
        advantages_B: torch.Tensor | None = None, ref_logprobs_B_T: torch.Tensor | None = None,
        is_weights_B_T: torch.Tensor | None = None, clip_low_threshold: float = 0.8, clip_high_threshold: float = 1.2,
        ) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum -min(r A, clip(r, clip_low_threshold, clip_high_threshold) A)``, ``r = exp(logp - q)``.

    Args:
        logprobs_B_T, mask_B_T, generator_logprobs_B_T, advantages_B: as `importance_sampling`.
        clip_low_threshold: the smallest ratio the clipped term keeps (``1 - eps_low``).
        clip_high_threshold: the largest (``1 + eps_high``).
        ref_logprobs_B_T, is_weights_B_T: unused.
    """
    _thresholds("ppo", clip_low_threshold, clip_high_threshold)
    on = _on("ppo", logprobs_B_T, mask_B_T)
    ratio = _ratio("ppo", logprobs_B_T, generator_logprobs_B_T, on)
    adv = _per_token("ppo", "advantages_B", advantages_B, logprobs_B_T, on)
    objective = torch.minimum(ratio * adv, ratio.clamp(clip_low_threshold, clip_high_threshold) * adv)
    with torch.no_grad():
        clipped = on & (((ratio > clip_high_threshold) & (adv > 0)) | ((ratio < clip_low_threshold) & (adv < 0)))
    return -objective.sum(), {**_ratio_metrics(ratio, on),
                              "clip_frac": float(clipped.sum()) / max(int(on.sum()), 1)}


def cispo(logprobs_B_T: torch.Tensor, *, mask_B_T: torch.Tensor, generator_logprobs_B_T: torch.Tensor | None = None,
          advantages_B: torch.Tensor | None = None, ref_logprobs_B_T: torch.Tensor | None = None,
          is_weights_B_T: torch.Tensor | None = None, clip_low_threshold: float = 0.8,
          clip_high_threshold: float = 1.2) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum -sg(clip(r, clip_low_threshold, clip_high_threshold)) * logp * A``, ``r = exp(logp - q)``.

    Args:
        logprobs_B_T, mask_B_T, generator_logprobs_B_T, advantages_B: as `importance_sampling`.
        clip_low_threshold: the smallest weight a token's ratio gives it.
        clip_high_threshold: the largest.
        ref_logprobs_B_T, is_weights_B_T: unused.
    """
    _thresholds("cispo", clip_low_threshold, clip_high_threshold)
    on = _on("cispo", logprobs_B_T, mask_B_T)
    ratio = _ratio("cispo", logprobs_B_T, generator_logprobs_B_T, on)
    adv = _per_token("cispo", "advantages_B", advantages_B, logprobs_B_T, on)
    weight = ratio.detach().clamp(clip_low_threshold, clip_high_threshold)
    with torch.no_grad():
        clipped = on & ((ratio > clip_high_threshold) | (ratio < clip_low_threshold))
    loss = -(weight * torch.where(on, logprobs_B_T.float(), 0.0) * adv).sum()
    return loss, {**_ratio_metrics(ratio, on), "clip_frac": float(clipped.sum()) / max(int(on.sum()), 1)}


PRIMITIVE_LOSSES: dict[str, PrimitiveLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}
"""Tinker's loss names -> the functions (`forgelab.experiments.primitives.TrainingClient.forward_backward`)."""

PRIMITIVE_LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
"""The ``Datum.loss_fn_inputs`` each loss needs (``weights`` is optional for ``cross_entropy``)."""
