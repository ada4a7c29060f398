"""Group-relative advantages: one scalar per sampled completion, from the rewards of its group.

Each prompt is sampled ``G`` times; the ``G`` rewards of a prompt form a group
and every completion's advantage says how much better it did than its
siblings. No value network is involved. All functions take ``rewards_P_G``
(``P`` prompts, ``G`` samples each) and return ``advantages_P_G``.

- ``grpo`` (``group_zscore``): ``(r - mean) / (std + eps)``
  (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).
- ``grpo_unbiased`` (``group_zscore_unbiased``): ``(r - mean) / (std_unbiased + 1e-4)``,
  TRL's ``GRPOTrainer`` normalisation (``scale_rewards="group"``), so a comparison
  with TRL can normalise identically.
- ``dr_grpo`` (``group_mean_centered``): ``r - mean``, no division by the std,
  which up-weights groups whose rewards barely differ
  (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).
- ``rloo`` (``leave_one_out``): ``r_i - mean_{j != i} r_j``
  (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

- ``none`` (``no_reward_advantage``): 0 everywhere: the rewards are recorded but teach
  nothing; on-policy distillation alone (a ``teacher``: the per-token signal below) uses it.

A group whose rewards are all equal gets advantage 0 everywhere under all
three: it teaches nothing, and the controller may drop it before training.

On-policy distillation (``distill_advantages``) adds a per-token term to the
sequence's advantage: ``a_t = advantage + coef * (teacher_logp_t - student_logp_t)``,
the negative per-token reverse KL to the teacher on the student's own samples
(Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines, "On-Policy
Distillation", 2025). The student's logprob is the generator's logprob of the
sampled token.

    >>> import torch
    >>> ADVANTAGES["dr_grpo"](torch.tensor([[1.0, 0.0, 0.0, 1.0]])).tolist()
    [[0.5, -0.5, -0.5, 0.5]]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["no_reward_advantage", "distill_advantages", "group_zscore", "group_zscore_unbiased", "group_mean_centered", "leave_one_out", "ADVANTAGES", "AdvantageFn"]

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
"""``fn(rewards_P_G) -> advantages_P_G``: an advantage estimator (a value of `ADVANTAGES`)."""


def _as_rewards_P_G(rewards_P_G, fn: str) -> torch.Tensor:
    # float64 inside: a group of equal float32 rewards then has an exact mean, so r - mean is exactly 0
    # (in float32 the rounding noise of the mean, divided by a std of the same size, gave advantages of ~0.01)
    rewards_P_G = torch.as_tensor(rewards_P_G).to(torch.float64)
    if rewards_P_G.dim() != 2:
        raise ValueError(
            f"{fn}: rewards must be [P, G] (prompts x samples per prompt), got shape {tuple(rewards_P_G.shape)}; "
            "for a single group use rewards.unsqueeze(0)"
        )
    if not torch.isfinite(rewards_P_G).all():
        raise ValueError(
            f"{fn}: rewards contain NaN or inf: {rewards_P_G.tolist()}; episodes whose reward failed "
            "must be dropped before computing advantages"
        )
    return rewards_P_G


def group_zscore(rewards_P_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - mean_G(r)) / (std_G(r) + eps)`` within each group.

    The std is the population std (``unbiased=False``, divide by ``G``), a
    deliberate choice: it is defined for ``G = 1`` (giving 0 rather than NaN)
    and makes a group's advantages have unit RMS exactly. Libraries that use
    the unbiased std (e.g. TRL) give advantages smaller by ``sqrt((G-1)/G)``:
    a constant factor, equivalent to a slightly lower learning rate.

    Args:
        rewards_P_G: rewards, ``[P, G]``.
        eps: added to the std so zero-variance groups give 0, not NaN.

    Returns:
        ``advantages_P_G``, fp32.
    """
    rewards_P_G = _as_rewards_P_G(rewards_P_G, "group_zscore")
    mean_P_1 = rewards_P_G.mean(dim=1, keepdim=True)
    std_P_1 = rewards_P_G.std(dim=1, keepdim=True, unbiased=False)
    return ((rewards_P_G - mean_P_1) / (std_P_1 + eps)).float()


def group_zscore_unbiased(rewards_P_G: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages as TRL computes them: ``(r - mean_G(r)) / (std_G(r, unbiased) + eps)``, eps 1e-4.

    The std divides by ``G - 1`` (TRL's ``nanstd`` with ``scale_rewards="group"``),
    so advantages are ``sqrt(G / (G - 1))`` times smaller than ``group_zscore``'s
    for groups with spread. Needs ``G >= 2``.

        >>> group_zscore_unbiased(torch.tensor([[1.0, 0.0]])).tolist()  # std = sqrt(0.5)
        [[0.7070068120956421, -0.7070068120956421]]

    Args:
        rewards_P_G: rewards, ``[P, G]`` with ``G >= 2``.
        eps: added to the std (TRL: 1e-4).

    Returns:
        ``advantages_P_G``, fp32.
    """
    rewards_P_G = _as_rewards_P_G(rewards_P_G, "group_zscore_unbiased")
    if rewards_P_G.shape[1] < 2:
        raise ValueError(f"group_zscore_unbiased needs at least 2 samples per group, got G={rewards_P_G.shape[1]}; "
                         "use group_size >= 2 or the 'grpo' estimator")
    mean_P_1 = rewards_P_G.mean(dim=1, keepdim=True)
    std_P_1 = rewards_P_G.std(dim=1, keepdim=True, unbiased=True)
    return ((rewards_P_G - mean_P_1) / (std_P_1 + eps)).float()


def group_mean_centered(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages: ``r - mean_G(r)``, no std normalisation.

    Pair with the ``dr_grpo`` loss, which also drops the per-sequence length
    normalisation; together they remove GRPO's two optimisation biases.

    Args:
        rewards_P_G: rewards, ``[P, G]``.

    Returns:
        ``advantages_P_G``, fp32.
    """
    rewards_P_G = _as_rewards_P_G(rewards_P_G, "group_mean_centered")
    return (rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)).float()


def leave_one_out(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """RLOO advantages: ``r_i - (sum_j r_j - r_i) / (G - 1)``, the baseline excludes the sample itself.

    Equal to ``G / (G - 1) * (r_i - mean)``; the baseline is independent of
    ``r_i``, so the gradient estimate stays unbiased.

    Args:
        rewards_P_G: rewards, ``[P, G]`` with ``G >= 2``.

    Returns:
        ``advantages_P_G``, fp32.
    """
    rewards_P_G = _as_rewards_P_G(rewards_P_G, "leave_one_out")
    G = rewards_P_G.shape[1]
    if G < 2:
        raise ValueError(f"leave_one_out needs at least 2 samples per group, got G={G}; use group_size >= 2")
    others_mean_P_G = (rewards_P_G.sum(dim=1, keepdim=True) - rewards_P_G) / (G - 1)
    return (rewards_P_G - others_mean_P_G).float()


def no_reward_advantage(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Zero advantages ``[P, G]``: rewards teach nothing (on-policy distillation alone).

    >>> no_reward_advantage(torch.tensor([[1.0, 0.0]])).tolist()
    [[0.0, 0.0]]
    """
    return torch.zeros_like(_as_rewards_P_G(rewards_P_G, "no_reward_advantage")).float()


def distill_advantages(advantage: float, teacher_logprobs_C: list[float], student_logprobs_C: list[float],
                       coef: float, loss_mask_C: list[int] | None = None) -> list[float]:
    """One episode's per-token advantages: ``advantage + coef * (teacher_logp - student_logp)`` per completion
    token (``C`` of them); ``advantage`` alone where `loss_mask_C` is 0 (tokens an environment inserted, never
    trained). Computed in float64, returned as floats.

    >>> distill_advantages(0.5, [-1.0, -0.25], [-2.0, -0.25], 2.0)
    [2.5, 0.5]
    """
    C = len(student_logprobs_C)
    if len(teacher_logprobs_C) != C:
        raise ValueError(f"distill_advantages: {len(teacher_logprobs_C)} teacher logprobs for {C} completion tokens; "
                         "they must be aligned one-to-one")
    mask = loss_mask_C if loss_mask_C is not None else [1] * C
    return [float(advantage) + (float(coef) * (float(t) - float(s)) if m else 0.0)
            for t, s, m in zip(teacher_logprobs_C, student_logprobs_C, mask)]


ADVANTAGES: dict[str, AdvantageFn] = {
    "none": no_reward_advantage,
    "grpo": group_zscore,
    "grpo_unbiased": group_zscore_unbiased,
    "dr_grpo": group_mean_centered,
    "rloo": leave_one_out,
}
"""Advantage estimators by name; add your own ``fn(rewards_P_G) -> advantages_P_G``."""
