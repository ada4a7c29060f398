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

__all__ = [
    "gather_logprobs", "token_entropy", "shift_for_targets", "masked_sum", "masked_mean",
    "chunked_logprobs_entropy", "DEFAULT_LOGITS_CHUNK",
]


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


# --- chunked logprobs and entropy from hidden states -----------------------------
# With a 151,936-token vocabulary the logits of 16 x 1,024 tokens are ~10 GB in
# fp32. The model stops before its output projection and hands over the final
# hidden states; `chunked_logprobs_entropy` projects CHUNK rows at a time, keeps
# only per-row numbers (target logit, logsumexp, entropy), and in the backward
# pass recomputes each chunk's logits to form its gradient. Peak logits memory
# is ``chunk * V`` elements (a few copies), whatever the batch.

#: Rows (tokens) projected onto the vocabulary at a time by default.
DEFAULT_LOGITS_CHUNK = 256


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (so gradcheck can check the maths)."""
    return torch.promote_types(t.dtype, torch.float32)


def _rowdot(a_C_V: torch.Tensor, b_C_V: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)``; torch's pairwise sum (an einsum/bmm would save the ``[C, V]`` temporary but sums
    152k terms in a straight line, and the entropy gradient ``-p (log p + H)`` cancels what it gets wrong)."""
    return (a_C_V * b_C_V).sum(-1)


def _logits(h_C_D: torch.Tensor, w_V_D: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (h_C_D @ w_V_D.t()).to(dtype)


def _logp_p_entropy(z_C_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp_C_V, p_C_V, entropy_C)`` from logits (consumed), as `token_entropy` computes them: the max-shifted
    log-softmax, ``p = exp(logp)``, ``H = -sum p log p`` with -inf log-probabilities contributing 0."""
    logp_C_V = torch.log_softmax(z_C_V, dim=-1)
    del z_C_V
    p_C_V = logp_C_V.exp()
    logp_C_V.clamp_min_(torch.finfo(logp_C_V.dtype).min)
    return logp_C_V, p_C_V, -_rowdot(p_C_V, logp_C_V)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Differentiable ``(logprobs_N, entropy_N)`` of ``softmax(h @ W.T)`` computed ``chunk`` rows at a time.

    Forward keeps only ``h``, ``W`` and the targets; backward recomputes each chunk's logits.
    At most ~3 ``[chunk, V]`` blocks are alive at once, in either pass.
    """

    @staticmethod
    def forward(ctx, h_N_D, w_V_D, y_N, chunk: int, want_entropy: bool):
        N, acc = h_N_D.shape[0], _acc_dtype(h_N_D)
        lp_N = torch.empty(N, dtype=acc, device=h_N_D.device)
        ent_N = torch.zeros_like(lp_N)
        for s in range(0, N, chunk):
            z_C_V = _logits(h_N_D[s : s + chunk], w_V_D, acc)
            # log p(y) = z_y - logsumexp(z), exactly as gather_logprobs computes it
            lp_N[s : s + chunk] = z_C_V.gather(-1, y_N[s : s + chunk].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
                z_C_V, dim=-1)
            if want_entropy:
                ent_N[s : s + chunk] = _logp_p_entropy(z_C_V)[2]
            del z_C_V
        ctx.save_for_backward(h_N_D, w_V_D, y_N)
        ctx.chunk = chunk
        return lp_N, ent_N

    @staticmethod
    def backward(ctx, g_lp_N, g_ent_N):
        h_N_D, w_V_D, y_N = ctx.saved_tensors
        chunk, acc = ctx.chunk, _acc_dtype(h_N_D)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.zeros_like(h_N_D) if need_h else None
        g_w = torch.zeros(w_V_D.shape, dtype=acc, device=w_V_D.device) if need_w else None
        for s in range(0, h_N_D.shape[0], chunk):
            h_C_D, y_C, g_lp_C = h_N_D[s : s + chunk], y_N[s : s + chunk], g_lp_N[s : s + chunk]
            logp_C_V, g_z, ent_C = _logp_p_entropy(_logits(h_C_D, w_V_D, acc))
            # d logp_y / dz = onehot(y) - p ;  d H / dz = -p * (log p + H)
            g_ent_C = None if g_ent_N is None else g_ent_N[s : s + chunk]
            if g_ent_C is not None and bool((g_ent_C != 0).any()):
                logp_C_V.add_(ent_C.unsqueeze(-1)).mul_(g_z).mul_(-g_ent_C.unsqueeze(-1))
            else:
                logp_C_V = None
            g_z.mul_(-g_lp_C.unsqueeze(-1))  # p is consumed: g_z = -g_lp * p
            if logp_C_V is not None:
                g_z.add_(logp_C_V)
            del logp_C_V
            g_z.scatter_add_(-1, y_C.unsqueeze(-1), g_lp_C.unsqueeze(-1).to(acc))
            g_z = g_z.to(h_N_D.dtype)
            if need_h:
                g_h[s : s + chunk] = g_z @ w_V_D
            if need_w:
                g_w.addmm_(g_z.t().to(acc), h_C_D.to(acc))
            del g_z
        return g_h, (None if g_w is None else g_w.to(w_V_D.dtype)), None, None, None


def chunked_logprobs_entropy(
    hidden_B_T_D: torch.Tensor,
    weight_V_D: torch.Tensor,
    targets_B_T: torch.Tensor,
    *,
    chunk: int = DEFAULT_LOGITS_CHUNK,
    need_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target logprobs and entropies of ``logits = hidden @ weight.T``, never holding more than ``chunk`` rows of logits.

    Equal (fp32) to ``gather_logprobs(logits, targets)`` and ``token_entropy(logits)``
    on the full logits, and so are the gradients with respect to ``hidden`` and
    ``weight``: the backward pass recomputes each chunk's logits instead of keeping them.

    Args:
        hidden_B_T_D: final hidden states (after the last norm), ``[B, T, D]``.
        weight_V_D: the output projection (``lm_head.weight``; the embedding when tied), ``[V, D]``.
        targets_B_T: target ids, ``[B, T]``.
        chunk: rows (of ``B * T``) projected at a time; peak logits memory ~ ``chunk * V * 4`` bytes x a few.
        need_entropy: also return ``entropy_B_T`` (nats); otherwise ``None``.

    Returns:
        ``(logprobs_B_T, entropy_B_T or None)``, fp32.

    >>> h, w, y = torch.randn(2, 3, 4), torch.randn(7, 4), torch.randint(0, 7, (2, 3))
    >>> lp, ent = chunked_logprobs_entropy(h, w, y, chunk=2)
    >>> torch.allclose(lp, gather_logprobs(h @ w.t(), y), atol=1e-6)
    True
    >>> torch.allclose(ent, token_entropy(h @ w.t()), atol=1e-5)
    True
    """
    if hidden_B_T_D.shape[:-1] != targets_B_T.shape or hidden_B_T_D.shape[-1] != weight_V_D.shape[-1]:
        raise ValueError(
            f"chunked_logprobs_entropy: hidden {tuple(hidden_B_T_D.shape)}, weight {tuple(weight_V_D.shape)} and "
            f"targets {tuple(targets_B_T.shape)} disagree: expected hidden [B, T, D], weight [V, D], targets [B, T]"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    B, T, D = hidden_B_T_D.shape
    lp_N, ent_N = _ChunkedLogprobsEntropy.apply(
        hidden_B_T_D.reshape(B * T, D), weight_V_D, targets_B_T.reshape(-1).long(), int(chunk), bool(need_entropy)
    )
    return lp_N.view(B, T), (ent_N.view(B, T) if need_entropy else None)
