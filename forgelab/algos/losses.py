"""Policy-gradient losses as plain functions in a registry: swapping the loss is swapping a dict value.

Every loss has the signature::

    fn(logprobs_B_T, *, generator_logprobs_B_T, advantages_B, mask_B_T,
       ref_logprobs_B_T=None, is_weights_B_T=None, **hparams) -> (loss, metrics)

``logprobs_B_T`` is the current policy's logprob of each target token (with
grad); everything else is a constant (detached here, whatever the caller
passes). Per-token tensors follow the target alignment of
``forgelab.algos.logprobs``; ``mask_B_T`` is 1.0 exactly on trained tokens.
The built-in losses reject unknown hyperparameters (``LossError`` naming them
and listing the accepted ones; ``check_loss_kwargs`` checks the same before a
run starts). ``loss`` is a scalar tensor to minimise; ``metrics`` maps names
to plain floats.

KL to the reference: every loss takes ``kl_coef`` and adds ``kl_coef * k3`` per
trained token before its own reduction (``forgelab.algos.kl``, as TRL's
``beta``); the default is 0.04 for ``grpo`` and 0 for the others. It is
skipped when ``ref_logprobs_B_T`` is None.

Rows with no trained token (all-masked) are left out of the per-sequence
averages (grpo, gspo), contribute nothing to the token counts (dapo, cispo,
reinforce), and still count in dr_grpo's constant ``B * max_tokens``.

The ratio is taken against the generator's sampling logprobs,
``r = exp(logp - generator_logp)``: the behaviour policy is whatever produced
the tokens, so off-policy lag and trainer/generator numerical mismatch are both
inside ``r``. ``is_weights_B_T`` (e.g. from ``forgelab.algos.importance``)
multiplies the per-token policy-gradient term only, never the KL penalty
(as in verl's TIS), and is detached.

Every loss reports ``kl_behaviour`` (mean of ``generator_logp - logp`` over
trained tokens, an estimate of KL(behaviour || current)) and ``ratio_mean``;
``kl_ref`` (k3 estimate of KL(current || reference)) whenever
``ref_logprobs_B_T`` is given; ``clip_frac`` (share of trained tokens, or of
sequences for ``gspo``, where clipping is active) for the clipped losses.

Hyperparameter names: ``eps_low``/``eps_high`` clip the token ratio (grpo,
dapo, dr_grpo); gspo's sequence-ratio clip is ``seq_eps_low``/``seq_eps_high``
and cispo's IS-weight clip is ``is_eps_low``/``is_eps_high``, kept distinct
because their scales differ by three orders of magnitude and a value carried
over by a hot swap would be silently wrong.

    >>> import torch
    >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, metrics = LOSSES["reinforce"](logp, generator_logprobs_B_T=logp.detach(),
    ...     advantages_B=torch.tensor([1.0]), mask_B_T=torch.ones(1, 2))
    >>> round(loss.item(), 4), metrics["ratio_mean"]
    (1.5, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from forgelab.algos.kl import add_kl, k3_kl
from forgelab.algos.logprobs import masked_mean, masked_sum
from forgelab.algos.loss_checks import (
    KL_ONLY_REFERENCE, LOSSES, LossError, check_loss_kwargs, strict_hparams, validate_loss_output,
)

__all__ = [
    "LOSSES",
    "BUILTIN_LOSSES",
    "LossFn",
    "LossError",
    "validate_loss_output",
    "check_loss_kwargs",
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "reinforce",
]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
"""``fn(logprobs_B_T, *, generator_logprobs_B_T, advantages_B, mask_B_T, ...) -> (loss, metrics)`` (module docstring)."""


# --- shared pieces -----------------------------------------------------------


def _prepare(name, logprobs_B_T, generator_logprobs_B_T, advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T):
    """Checks shapes and returns fp32 tensors; padding positions of log-ratios are 0 so exp stays finite."""
    if logprobs_B_T.dim() != 2:
        raise LossError(f"loss {name!r}: logprobs must be [B, T], got shape {tuple(logprobs_B_T.shape)}")
    B, T = logprobs_B_T.shape
    expected = {"generator_logprobs_B_T": generator_logprobs_B_T, "mask_B_T": mask_B_T}
    if ref_logprobs_B_T is not None:
        expected["ref_logprobs_B_T"] = ref_logprobs_B_T
    if is_weights_B_T is not None:
        expected["is_weights_B_T"] = is_weights_B_T
    for arg, value in expected.items():
        if tuple(value.shape) != (B, T):
            raise LossError(
                f"loss {name!r}: {arg} has shape {tuple(value.shape)} but logprobs_B_T has {(B, T)}; "
                "every per-token tensor must be aligned to target positions (see forgelab.algos.batching.collate)"
            )
    if tuple(advantages_B.shape) not in ((B,), (B, T)):
        raise LossError(
            f"loss {name!r}: advantages_B has shape {tuple(advantages_B.shape)}, expected ({B},) (one advantage "
            f"per sequence) or ({B}, {T}) (one per token, aligned to target positions like logprobs_B_T)"
        )
    mask_B_T = mask_B_T.detach().float()
    on_B_T = mask_B_T != 0
    logp_B_T = logprobs_B_T.float()
    log_ratio_B_T = torch.where(on_B_T, logp_B_T - generator_logprobs_B_T.detach().float(), 0.0)
    adv = advantages_B.detach().float()
    # [B, 1] broadcasts along the row; a per-token [B, T] advantage is used as it is (0 off the mask)
    adv_B_1 = adv[:, None] if adv.dim() == 1 else torch.where(on_B_T, adv, 0.0)
    w_B_T = None if is_weights_B_T is None else is_weights_B_T.detach().float()
    return logp_B_T, log_ratio_B_T, adv_B_1, mask_B_T, on_B_T, w_B_T


def _sequence_advantage(adv, mask_B_T, on_B_T):
    """One advantage per sequence for a sequence-level loss: a [B, 1] advantage as it is; a per-token one
    averaged over the sequence's trained tokens, taken exactly where it is constant along the row (so a
    row-constant [B, T] advantage gives the [B] result bit for bit)."""
    if adv.shape[1] == 1:
        return adv[:, 0]
    first_B = adv.gather(1, on_B_T.float().argmax(dim=1, keepdim=True))[:, 0]
    const_B = torch.where(on_B_T, adv == first_B[:, None], True).all(dim=1)
    return torch.where(const_B, first_B, masked_mean(adv, mask_B_T, dim=1))


def _base_metrics(logp_B_T, log_ratio_B_T, mask_B_T, on_B_T, ref_logprobs_B_T) -> dict[str, float]:
    with torch.no_grad():
        metrics = {
            "kl_behaviour": masked_mean(-log_ratio_B_T, mask_B_T).item(),
            "ratio_mean": masked_mean(torch.exp(log_ratio_B_T), mask_B_T).item(),
        }
        if ref_logprobs_B_T is not None:
            metrics["kl_ref"] = masked_mean(k3_kl(logp_B_T, ref_logprobs_B_T, on_B_T), mask_B_T).item()
    return metrics


def _clipped_token_objective(log_ratio_B_T, logp_B_T, on_B_T, adv_B_1, eps_low, eps_high, mask_B_T):
    """PPO surrogate ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token, and the clip fraction."""
    ratio_B_T = torch.exp(log_ratio_B_T)
    objective_B_T = torch.minimum(ratio_B_T * adv_B_1, ratio_B_T.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_B_1)
    with torch.no_grad():
        # Clipping is active (zero gradient) only on the side the advantage pushes towards.
        clipped_B_T = ((ratio_B_T > 1.0 + eps_high) & (adv_B_1 > 0)) | ((ratio_B_T < 1.0 - eps_low) & (adv_B_1 < 0))
        clip_frac = masked_mean(clipped_B_T.float(), mask_B_T).item()
    return objective_B_T, clip_frac


def _sg_clipped_token_objective(log_ratio_B_T, logp_B_T, on_B_T, adv_B_1, eps_low, eps_high, mask_B_T):
    """CISPO's ``sg(clip(r, 1-eps_low, 1+eps_high)) A logp`` per token, and the clip fraction (either side)."""
    with torch.no_grad():
        ratio_B_T = torch.exp(log_ratio_B_T)
        is_weight_B_T = ratio_B_T.clamp(1.0 - eps_low, 1.0 + eps_high)
        clipped_B_T = (ratio_B_T > 1.0 + eps_high) | (ratio_B_T < 1.0 - eps_low)
        clip_frac = masked_mean(clipped_B_T.float(), mask_B_T).item()
    logp_on_B_T = torch.where(on_B_T, logp_B_T, 0.0)
    return is_weight_B_T * adv_B_1 * logp_on_B_T, clip_frac


def _weighted(x_B_T, w_B_T):
    return x_B_T if w_B_T is None else x_B_T * w_B_T


class _PGTerms(NamedTuple):
    """What a clipped token-level loss needs after `_clipped_pg_terms`; every tensor is fp32 ``[B, T]``."""

    pg_B_T: torch.Tensor  # -w * objective (with grad); not 0 off the mask, so normalise with mask_B_T
    logp_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    on_B_T: torch.Tensor  # bool, mask_B_T != 0
    metrics: dict[str, float]  # _base_metrics plus clip_frac


def _clipped_pg_terms(
    name, objective, logprobs_B_T, generator_logprobs_B_T, advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T,
    eps_low, eps_high,
) -> _PGTerms:
    """Checks the inputs, then the weighted per-token policy-gradient term and the metrics of a clipped loss.

    ``objective`` is `_clipped_token_objective` (grpo, dapo, dr_grpo) or
    `_sg_clipped_token_objective` (cispo); each loss only chooses how to
    normalise ``pg_B_T`` (and grpo adds its KL penalty).
    """
    logp, log_ratio, adv, mask, on, w = _prepare(
        name, logprobs_B_T, generator_logprobs_B_T, advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T
    )
    objective_B_T, clip_frac = objective(log_ratio, logp, on, adv, eps_low, eps_high, mask)
    metrics = {**_base_metrics(logp, log_ratio, mask, on, ref_logprobs_B_T), "clip_frac": clip_frac}
    return _PGTerms(-_weighted(objective_B_T, w), logp, mask, on, metrics)


def _sequence_mean(per_token_B_T, mask_B_T):
    """Mean over each sequence's trained tokens, then over the sequences that have any."""
    per_seq_B = masked_mean(per_token_B_T, mask_B_T, dim=1)
    n_seqs = (mask_B_T.sum(dim=1) > 0).sum()
    return per_seq_B.sum() / n_seqs.clamp_min(1)


# --- losses ------------------------------------------------------------------


@strict_hparams
def grpo(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.04,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: PPO-clipped surrogate plus a k3 KL penalty, averaged per sequence then over sequences.

    ``loss = 1/|S| sum_{i in S} 1/|o_i| sum_t [ -w_it min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)
    + kl_coef * k3_it ]`` with ``r = exp(logp - generator_logp)``,
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` and ``S`` the sequences with at
    least one trained token (all-masked rows are left out of the average).
    The KL term is skipped when ``ref_logprobs_B_T`` is None or ``kl_coef == 0``.
    Pair with ``grpo`` advantages.
    Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs, ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs, ``[B, T]``, or None.
        is_weights_B_T: per-token importance weights multiplying the clipped term, ``[B, T]``, or None.
        eps_low: the ratio's clip range is ``[1 - eps_low, 1 + eps_high]``.
        eps_high: see ``eps_low``.
        kl_coef: weight of the KL penalty (beta).
    """
    t = _clipped_pg_terms("grpo", _clipped_token_objective, logprobs_B_T, generator_logprobs_B_T, advantages_B,
                          mask_B_T, ref_logprobs_B_T, is_weights_B_T, eps_low, eps_high)
    per_token_B_T = add_kl(t.pg_B_T, t.logp_B_T, ref_logprobs_B_T, t.on_B_T, kl_coef, "grpo")
    return _sequence_mean(per_token_B_T, t.mask_B_T), t.metrics


@strict_hparams
def dapo(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO: clip-higher PPO surrogate with token-level normalisation; no KL unless ``kl_coef > 0``.

    ``loss = 1/N sum_{i,t} [ -w_it min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) + kl_coef * k3_it ]``
    with ``N`` the number of trained tokens in the batch, so long sequences
    weigh in proportion to their length (all-masked rows add nothing). A larger
    ``eps_high`` lets low-probability tokens grow (against entropy collapse).
    Yu et al. 2025, "DAPO", arXiv:2503.14476.

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs, ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs (``kl_ref`` metric, KL term), ``[B, T]``, or None.
        is_weights_B_T: per-token importance weights, ``[B, T]``, or None.
        eps_low: the ratio's clip range is ``[1 - eps_low, 1 + eps_high]``.
        eps_high: see ``eps_low``.
        kl_coef: weight of the k3 KL-to-reference term (0: none, the DAPO paper's choice).
    """
    t = _clipped_pg_terms("dapo", _clipped_token_objective, logprobs_B_T, generator_logprobs_B_T, advantages_B,
                          mask_B_T, ref_logprobs_B_T, is_weights_B_T, eps_low, eps_high)
    per_token_B_T = add_kl(t.pg_B_T, t.logp_B_T, ref_logprobs_B_T, t.on_B_T, kl_coef, "dapo")
    return masked_mean(per_token_B_T, t.mask_B_T), t.metrics


@strict_hparams
def dr_grpo(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    max_tokens: int | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr.GRPO: PPO-clipped surrogate normalised by a constant, not by sequence length; no KL unless ``kl_coef > 0``.

    ``loss = 1/(B * max_tokens) sum_{i,t} [ -w_it min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) + kl_coef * k3_it ]``.
    Dividing by each sequence's own length (GRPO) favours long wrong answers
    and short right ones; a constant removes that bias. ``max_tokens`` is the
    completion budget (TRL: ``max_completion_length``): a ``Run`` passes
    ``rollout.max_tokens`` (times ``rollout.max_turns`` for environment runs)
    unless ``loss_kwargs`` sets it. ``B`` counts every row, all-masked ones too
    (as TRL does). Pair with the ``dr_grpo`` advantages (``r - mean``, no std),
    which remove the other (difficulty) bias.
    Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783.

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs, ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs (``kl_ref`` metric, KL term), ``[B, T]``, or None.
        is_weights_B_T: per-token importance weights, ``[B, T]``, or None.
        eps_low: the ratio's clip range is ``[1 - eps_low, 1 + eps_high]``.
        eps_high: see ``eps_low``.
        max_tokens: the normalising constant per sequence, the completion budget. Called
            without it (outside a run), the widest trained span of the batch (first to
            last trained position of a row, the largest over rows): never the padded
            width, which includes prompt positions.
        kl_coef: weight of the k3 KL-to-reference term (0: none, the paper's choice).
    """
    t = _clipped_pg_terms("dr_grpo", _clipped_token_objective, logprobs_B_T, generator_logprobs_B_T, advantages_B,
                          mask_B_T, ref_logprobs_B_T, is_weights_B_T, eps_low, eps_high)
    B, T = logprobs_B_T.shape
    max_tokens = _trained_span(t.on_B_T) if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise LossError(f"loss 'dr_grpo': max_tokens must be a positive integer, got {max_tokens!r}")
    per_token_B_T = add_kl(t.pg_B_T, t.logp_B_T, ref_logprobs_B_T, t.on_B_T, kl_coef, "dr_grpo")
    return masked_sum(per_token_B_T, t.mask_B_T) / (max(B, 1) * max_tokens), t.metrics


def _trained_span(on_B_T: torch.Tensor) -> int:
    """Largest ``last - first + 1`` trained position over rows (1 if nothing is trained)."""
    pos_T = torch.arange(on_B_T.shape[1])
    has_B = on_B_T.any(dim=1)
    if not has_B.any():
        return 1
    last_B = torch.where(on_B_T, pos_T, -1).amax(dim=1)
    first_B = torch.where(on_B_T, pos_T, on_B_T.shape[1]).amin(dim=1)
    return int((last_B - first_B + 1)[has_B].max())


@strict_hparams
def gspo(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    seq_eps_low: float = 3e-4,
    seq_eps_high: float = 4e-4,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one length-normalised importance ratio per sequence, clipped per sequence.

    ``s_i = exp(1/|o_i| sum_t (logp_it - generator_logp_it))`` and
    ``loss = 1/|S| sum_{i in S} [ -w_i min(s_i A_i, clip(s_i, 1-seq_eps_low, 1+seq_eps_high) A_i)
    + kl_coef * 1/|o_i| sum_t k3_it ]`` over the sequences ``S`` with at least
    one trained token (all-masked rows are left out). ``w_i`` is the
    mean of ``is_weights_B_T`` over the sequence's trained tokens (constant
    along a sequence when it comes from sequence-level truncated IS). The
    clip range is tiny because ``s_i`` is a geometric mean; ``clip_frac`` is
    the share of sequences clipped. The KL term (``kl_coef``, default 0) is
    per token, averaged per sequence like the rest.
    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs, ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs (``kl_ref`` metric, KL term), ``[B, T]``, or None.
        is_weights_B_T: importance weights, ``[B, T]``, averaged per sequence, or None.
        seq_eps_low: the sequence ratio's clip range is ``[1 - seq_eps_low, 1 + seq_eps_high]``.
        seq_eps_high: see ``seq_eps_low``.
        kl_coef: weight of the k3 KL-to-reference term.
    """
    logp, log_ratio, adv, mask, on, w = _prepare(
        "gspo", logprobs_B_T, generator_logprobs_B_T, advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T
    )
    has_tokens_B = mask.sum(dim=1) > 0
    seq_ratio_B = torch.exp(masked_mean(log_ratio, mask, dim=1))
    adv_B = _sequence_advantage(adv, mask, on)
    clipped_B = seq_ratio_B.clamp(1.0 - seq_eps_low, 1.0 + seq_eps_high)
    objective_B = torch.minimum(seq_ratio_B * adv_B, clipped_B * adv_B)
    if w is not None:
        objective_B = objective_B * masked_mean(w, mask, dim=1)
    kl_B_T = add_kl(torch.zeros_like(logp), logp, ref_logprobs_B_T, on, kl_coef, "gspo")
    seq_B = -objective_B + masked_mean(kl_B_T, mask, dim=1)
    seq_B = torch.where(has_tokens_B, seq_B, 0.0)
    loss = seq_B.sum() / has_tokens_B.sum().clamp_min(1)
    with torch.no_grad():
        active_B = ((seq_ratio_B > 1.0 + seq_eps_high) & (adv_B > 0)) | ((seq_ratio_B < 1.0 - seq_eps_low) & (adv_B < 0))
        n_seqs = max(int(has_tokens_B.sum()), 1)
        metrics = _base_metrics(logp, log_ratio, mask, on, ref_logprobs_B_T)
        metrics["seq_ratio_mean"] = (seq_ratio_B * has_tokens_B).sum().item() / n_seqs
        metrics["clip_frac"] = (active_B & has_tokens_B).sum().item() / n_seqs
    return loss, metrics


@strict_hparams
def cispo(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    is_eps_low: float = 1.0,
    is_eps_high: float = 2.0,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio; every token keeps its gradient.

    ``loss = 1/N sum_{i,t} [ -sg(clip(r_it, 1-is_eps_low, 1+is_eps_high)) w_it A_i logp_it + kl_coef * k3_it ]``
    with ``N`` the number of trained tokens (all-masked rows add nothing). Unlike PPO clipping, which zeroes
    the gradient of clipped tokens (often the rare "fork" tokens), CISPO only
    caps their weight. The default ``is_eps_low = 1`` puts the lower bound at
    0, i.e. no lower bound, as in the paper; the default cap is
    ``1 + is_eps_high = 3``. The loss value is on the scale of ``A * logp``;
    only its gradient is meaningful. No KL unless ``kl_coef > 0``.
    MiniMax 2025, "MiniMax-M1", arXiv:2506.13585.

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs, ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs (``kl_ref`` metric, KL term), ``[B, T]``, or None.
        is_weights_B_T: extra per-token importance weights, ``[B, T]``, or None.
        is_eps_low: the IS weight's clip range is ``[1 - is_eps_low, 1 + is_eps_high]``.
        is_eps_high: see ``is_eps_low``.
        kl_coef: weight of the k3 KL-to-reference term.
    """
    t = _clipped_pg_terms("cispo", _sg_clipped_token_objective, logprobs_B_T, generator_logprobs_B_T,
                          advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T, is_eps_low, is_eps_high)
    per_token_B_T = add_kl(t.pg_B_T, t.logp_B_T, ref_logprobs_B_T, t.on_B_T, kl_coef, "cispo")
    return masked_mean(per_token_B_T, t.mask_B_T), t.metrics


@strict_hparams
def reinforce(
    logprobs_B_T: torch.Tensor,
    *,
    generator_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    ref_logprobs_B_T: torch.Tensor | None = None,
    is_weights_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with a given advantage: ``loss = 1/N sum_{i,t} [ -w_it A_i logp_it + kl_coef * k3_it ]``, token-level mean.

    No ratio, no clipping: strictly on-policy unless ``is_weights_B_T`` corrects
    for the generator (e.g. truncated IS). ``generator_logprobs_B_T`` feeds
    the ``ratio_mean``/``kl_behaviour`` metrics only.
    Williams 1992, "Simple statistical gradient-following algorithms".

    Args:
        logprobs_B_T: current policy logprobs of the target tokens (with grad), ``[B, T]``.
        generator_logprobs_B_T: behaviour-policy sampling logprobs (metrics only), ``[B, T]``.
        advantages_B: one advantage per sequence, ``[B]``, or one per token, ``[B, T]``.
        mask_B_T: 1.0 on trained tokens, 0.0 elsewhere, ``[B, T]``.
        ref_logprobs_B_T: reference-model logprobs (``kl_ref`` metric, KL term), ``[B, T]``, or None.
        is_weights_B_T: per-token importance weights, ``[B, T]``, or None.
        kl_coef: weight of the k3 KL-to-reference term.
    """
    logp, log_ratio, adv, mask, on, w = _prepare(
        "reinforce", logprobs_B_T, generator_logprobs_B_T, advantages_B, mask_B_T, ref_logprobs_B_T, is_weights_B_T
    )
    logp_on_B_T = torch.where(on, logp, 0.0)
    per_token_B_T = add_kl(-_weighted(adv * logp_on_B_T, w), logp, ref_logprobs_B_T, on, kl_coef, "reinforce")
    loss = masked_mean(per_token_B_T, mask)
    return loss, _base_metrics(logp, log_ratio, mask, on, ref_logprobs_B_T)


LOSSES.update({
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
    "reinforce": reinforce,
})

BUILTIN_LOSSES: dict[str, LossFn] = dict(LOSSES)
"""The losses every forgelab process knows by name. An entry added to (or replaced in) `LOSSES` in one process
exists there only: it reaches the trainer by value (`forgelab.engines.loss_specs.shipped_loss`)."""
KL_ONLY_REFERENCE.extend(BUILTIN_LOSSES.values())  # each reads the reference in its kl_coef term only
