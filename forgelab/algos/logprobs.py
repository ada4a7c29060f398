"""Token logprobs, entropies and masked reductions: the tensor plumbing under every loss.

Target alignment (the convention every per-token tensor in forgelab follows):
a batch holds ``tokens_B_L`` (prompt + completion, right padded) and the model
reads ``inputs_B_T = tokens_B_L[:, :-1]``; position ``t`` of any ``*_B_T``
tensor refers to predicting ``tokens_B_L[:, t + 1]`` from the logits at ``t``,
so ``T = L - 1``. ``shift_for_targets`` produces that pair.

Logprobs are computed in fp32 whatever the logits' dtype: a bf16 log-softmax
over a 150k vocabulary loses several bits exactly where the PPO ratio
``exp(logp - generator_logp)`` is most sensitive. ``chunk_size`` bounds the
fp32 copy to ``B * chunk_size * V`` elements.

    >>> import torch
    >>> tokens_B_L = torch.tensor([[5, 6, 7]])
    >>> inputs_B_T, targets_B_T = shift_for_targets(tokens_B_L)
    >>> inputs_B_T.tolist(), targets_B_T.tolist()
    ([[5, 6]], [[6, 7]])
"""

from __future__ import annotations

import torch

__all__ = ["gather_logprobs", "token_entropy", "shift_for_targets", "masked_sum", "masked_mean"]


def shift_for_targets(tokens_B_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token batch into model inputs and next-token targets.

    Args:
        tokens_B_L: token ids, ``[B, L]``.

    Returns:
        ``(inputs_B_T, targets_B_T)``, both ``[B, L - 1]``: ``targets[:, t] == tokens[:, t + 1]``.
    """
    if tokens_B_L.dim() != 2 or tokens_B_L.shape[1] < 2:
        raise ValueError(
            f"shift_for_targets needs tokens of shape [B, L] with L >= 2, got {tuple(tokens_B_L.shape)}; "
            "a sequence needs at least one prompt token and one target token"
        )
    return tokens_B_L[:, :-1], tokens_B_L[:, 1:]


def _logprobs_fp32(logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor) -> torch.Tensor:
    logits_B_T_V = logits_B_T_V.float()
    # log p(y) = z_y - logsumexp(z): avoids materialising the full log_softmax.
    target_logits_B_T = logits_B_T_V.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    return target_logits_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def gather_logprobs(
    logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-probability of each target token under the logits, in fp32.

    ``logprobs[b, t] = logits[b, t, y] - logsumexp_v(logits[b, t, v])`` with
    ``y = targets[b, t]``. Differentiable with respect to the logits.

    Args:
        logits_B_T_V: model logits, any float dtype, ``[B, T, V]``.
        targets_B_T: target token ids (int64), ``[B, T]``; padding positions
            must still hold a valid id (mask them out afterwards).
        chunk_size: if set, process this many positions of ``T`` at a time so
            the fp32 upcast never exceeds ``B * chunk_size * V`` elements.

    Returns:
        ``logprobs_B_T`` (fp32), ``[B, T]``, all ``<= 0``.
    """
    if logits_B_T_V.shape[:-1] != targets_B_T.shape:
        raise ValueError(
            f"gather_logprobs: logits {tuple(logits_B_T_V.shape)} and targets {tuple(targets_B_T.shape)} "
            "disagree on [B, T]; did you forget shift_for_targets?"
        )
    targets_B_T = targets_B_T.long()
    T = targets_B_T.shape[1]
    if chunk_size is None or chunk_size >= T:
        return _logprobs_fp32(logits_B_T_V, targets_B_T)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return torch.cat(
        [
            _logprobs_fp32(logits_B_T_V[:, s : s + chunk_size], targets_B_T[:, s : s + chunk_size])
            for s in range(0, T, chunk_size)
        ],
        dim=1,
    )


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at every position, in fp32.

    ``H[b, t] = -sum_v p_v log p_v`` with ``p = softmax(logits[b, t])``.

    Args:
        logits_B_T_V: model logits, ``[B, T, V]``.

    Returns:
        ``entropy_B_T`` (fp32), ``[B, T]``, in ``[0, log V]``.
    """
    logp_B_T_V = torch.log_softmax(logits_B_T_V.float(), dim=-1)
    # A -inf logit (a banned token) would make p * logp = 0 * -inf = nan; the
    # clamp makes that term 0 and keeps the backward pass finite too.
    return -(logp_B_T_V.exp() * logp_B_T_V.clamp_min(torch.finfo(torch.float32).min)).sum(-1)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is non-zero (weighted by ``mask``).

    Masked-out entries are replaced by 0 before multiplying, so a NaN or inf
    sitting on a padding position cannot leak into the sum.

    Args:
        x: values, any shape.
        mask: same shape as ``x`` (or broadcastable), float or bool.
        dim: dimension(s) to reduce; None reduces everything to a scalar.
    """
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is non-zero; 0 where nothing is unmasked.

    An all-masked row (a padding row, an episode whose tokens all came from the
    environment) gives 0 rather than NaN, so it contributes nothing and
    poisons no gradient.

    Args:
        x: values, any shape.
        mask: same shape as ``x`` (or broadcastable), float or bool.
        dim: dimension(s) to reduce; None reduces everything to a scalar.
    """
    mask = mask.to(x.dtype)
    total = masked_sum(x, mask, dim)
    count = mask.expand_as(x).sum() if dim is None else mask.expand_as(x).sum(dim)
    return torch.where(count > 0, total / count.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
