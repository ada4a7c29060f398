"""The KL-to-reference term every ratio-based loss shares (k3 estimator, added per token).

``k3 = exp(d) - d - 1`` with ``d = ref_logp - logp`` is Schulman's unbiased,
always non-negative estimator of KL(current || reference) from samples of the
current policy (http://joschu.net/blog/kl-approx.html). As in TRL's
``GRPOTrainer`` (its ``beta``), a loss adds ``kl_coef * k3`` to each trained
token's policy-gradient term *before* its own reduction, so the KL is averaged
exactly like the rest of that loss (per sequence for grpo and gspo, per token
for dapo/cispo/reinforce, over the constant budget for dr_grpo). Importance
weights never multiply it.

    >>> import torch

    >>> logp = torch.tensor([[-1.0, -2.0]])
    >>> k3_kl(logp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[True, True]])).tolist()  # e^1 - 1 - 1
    [[0.0, 0.7182817459106445]]
"""

from __future__ import annotations

import torch

from forgelab.algos.loss_checks import LossError

__all__ = ["k3_kl", "add_kl"]


def k3_kl(logp_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor, on_B_T: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(current || ref) per token, ``[B, T]``, 0 where ``on_B_T`` is False; >= 0.

    Gradient flows through ``logp_B_T`` only (the reference is detached).
    """
    d_B_T = torch.where(on_B_T, ref_logprobs_B_T.detach().float() - logp_B_T, 0.0)
    return torch.exp(d_B_T) - d_B_T - 1.0


def add_kl(
    per_token_B_T: torch.Tensor,
    logp_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None,
    on_B_T: torch.Tensor,
    kl_coef: float,
    loss_name: str,
) -> torch.Tensor:
    """``per_token_B_T + kl_coef * k3`` per token; unchanged when ``kl_coef == 0`` or there is no reference.

    A run without a reference model (``placement.reference: false``) passes
    ``ref_logprobs_B_T=None``; config validation reports a positive
    ``kl_coef`` set by hand in that case. Raises ``LossError`` (a
    ``ValueError``) when ``kl_coef`` is not a finite number >= 0.
    """
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not kl_coef >= 0 or kl_coef == float("inf"):
        raise LossError(f"loss {loss_name!r}: kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if kl_coef == 0 or ref_logprobs_B_T is None:
        return per_token_B_T
    return per_token_B_T + kl_coef * k3_kl(logp_B_T, ref_logprobs_B_T, on_B_T)
