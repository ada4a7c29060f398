"""Truncated importance sampling (TIS) for tokens sampled by a different policy than the one being trained.

The generator (vLLM) samples with its own kernels and, in an asynchronous loop,
with weights one or more versions old; the trainer computes the gradient
under its own policy. The importance weight of a trained token is
``rho = pi_trainer(y) / pi_generator(y)``; using it unbounded makes the
gradient's variance explode on the rare tokens where the generator was far
less confident, so it is truncated at ``cap``: ``w = min(rho, cap)``.
Weights are detached: they rescale the gradient, they are not optimised.
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (truncated IS, TIS).

Three granularities (``level``):

- ``"token"``: one weight per token, ``min(exp(logp_t - genlogp_t), cap)``.
- ``"sequence"``: the product over the sequence, ``min(exp(sum_t (logp_t - genlogp_t)), cap)``,
  the unbiased sequence-level weight (high variance on long sequences).
- ``"geometric"``: the length-normalised product, ``min(exp(mean_t (...)), cap)``.

Sequence-level weights are broadcast to every trained token of the sequence.

    >>> import torch
    >>> w, m = truncated_is_weights(torch.log(torch.tensor([[0.5, 0.9]])),
    ...     torch.log(torch.tensor([[0.1, 0.9]])), torch.ones(1, 2), cap=2.0)
    >>> [round(x, 4) for x in w[0].tolist()], m["is_truncated_frac"]
    ([2.0, 1.0], 0.5)
"""

from __future__ import annotations

import math

import torch

from forgelab.algos.logprobs import masked_mean

__all__ = ["truncated_is_weights", "IS_LEVELS"]

IS_LEVELS = ("token", "sequence", "geometric")
"""The granularities `truncated_is_weights` computes its weights at."""


def truncated_is_weights(
    trainer_logprobs_B_T: torch.Tensor,
    generator_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    cap: float = 2.0,
    *,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_trainer / pi_generator, cap)`` on trained tokens, 1 elsewhere.

    Args:
        trainer_logprobs_B_T: the trainer's logprobs of the sampled tokens, ``[B, T]``
            (detached here).
        generator_logprobs_B_T: the generator's sampling logprobs, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, ``[B, T]``.
        cap: truncation threshold ``C > 0`` (``math.inf`` disables truncation).
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (see module docstring).

    Returns:
        ``(weights_B_T, metrics)``: fp32 weights, and plain floats over the
        weighted units (trained tokens for ``"token"``, sequences with at least
        one trained token otherwise): ``is_weight_mean``, ``is_weight_max``,
        ``is_truncated_frac`` (share with ``rho > cap``), ``is_ess`` (normalised
        effective sample size ``(sum w)^2 / (n sum w^2)`` in ``(0, 1]``; 1 means
        uniform weights). With nothing to weigh the metrics are 1, 1, 0, 1.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"truncated_is_weights: unknown level {level!r}; choose one of {IS_LEVELS}")
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}; use math.inf for no truncation")
    if trainer_logprobs_B_T.shape != generator_logprobs_B_T.shape or trainer_logprobs_B_T.shape != mask_B_T.shape:
        raise ValueError(
            "truncated_is_weights: shapes differ: trainer "
            f"{tuple(trainer_logprobs_B_T.shape)}, generator {tuple(generator_logprobs_B_T.shape)}, "
            f"mask {tuple(mask_B_T.shape)}; all must be the same [B, T]"
        )
    with torch.no_grad():
        mask_B_T = mask_B_T.float()
        on_B_T = mask_B_T != 0
        log_rho_B_T = torch.where(on_B_T, trainer_logprobs_B_T.float() - generator_logprobs_B_T.float(), 0.0)
        log_cap = math.log(cap)
        if level == "token":
            log_rho_U, on_U = log_rho_B_T[on_B_T], None
        else:
            per_seq = log_rho_B_T.sum(dim=1)
            if level == "geometric":
                per_seq = masked_mean(log_rho_B_T, mask_B_T, dim=1)
            on_U = mask_B_T.sum(dim=1) > 0
            log_rho_U = per_seq[on_U]
        # Clamp in log space: exp of a large log-ratio would overflow to inf first.
        w_U = torch.exp(log_rho_U.clamp_max(log_cap))
        if level == "token":
            weights_B_T = torch.ones_like(mask_B_T)
            weights_B_T[on_B_T] = w_U
        else:
            w_B = torch.exp(per_seq.clamp_max(log_cap))
            weights_B_T = torch.where(on_B_T, w_B[:, None].expand_as(mask_B_T), 1.0)
        n = w_U.numel()
        if n == 0:
            metrics = {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_frac": 0.0, "is_ess": 1.0}
        else:
            w64_U = w_U.double()
            metrics = {
                "is_weight_mean": w64_U.mean().item(),
                "is_weight_max": w64_U.max().item(),
                "is_truncated_frac": (log_rho_U > log_cap).double().mean().item(),
                "is_ess": (w64_U.sum() ** 2 / (n * (w64_U**2).sum())).item(),
            }
    return weights_B_T, metrics
