"""Token-level truth: where the sampler (vLLM) and the trainer disagree about the same token.

The generator records each sampled token's logprob under the weights that sampled it; the trainer computes
the same token's logprob under the weights it trains (before the update). In synchronous on-policy RL they
are the same weights, so any difference is kernels, precision or a lost token; with staleness it is also the
policy's drift. These are pure functions over one batch:

    values = token_values(trainer_logprobs_B_T, entropy_B_T, is_weights_B_T, clipped_B_T)
    metrics = sampler_mismatch(generator_logprobs_B_T, trainer_logprobs_B_T, mask_B_T)
    clipped_B_T = clipped_tokens("grpo", {"eps_high": 0.28}, log_ratio_B_T, advantages_B, mask_B_T)
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from forgelab.algos.loss_checks import LOSSES

__all__ = ["MISMATCH_THRESHOLD", "sampler_mismatch", "clipped_tokens", "per_episode"]

MISMATCH_THRESHOLD = 0.1
"""|trainer logprob - generator logprob| (nats) above which a token counts in ``mismatch/frac_over``."""


def sampler_mismatch(generator_logprobs_B_T: torch.Tensor, trainer_logprobs_B_T: torch.Tensor,
                     mask_B_T: torch.Tensor, threshold: float = MISMATCH_THRESHOLD) -> dict[str, float]:
    """Sampler-vs-trainer disagreement over the trained tokens (``mask_B_T != 0``):

    ``mismatch/abs_mean`` mean |delta|, ``mismatch/k3`` the k3 estimate of KL(sampler || trainer)
    (``exp(d) - 1 - d`` with ``d = trainer - sampler``, unbiased for samples drawn by the sampler),
    ``mismatch/frac_over`` the share of tokens with |delta| > `threshold`, ``mismatch/max`` the largest |delta|.

    >>> g = torch.tensor([[-1.0, -2.0, 0.0]]); t = torch.tensor([[-1.0, -2.5, 9.0]]); m = torch.tensor([[1., 1., 0.]])
    >>> {k: round(v, 4) for k, v in sampler_mismatch(g, t, m).items()}
    {'mismatch/abs_mean': 0.25, 'mismatch/k3': 0.0533, 'mismatch/frac_over': 0.5, 'mismatch/max': 0.5}
    """
    on = mask_B_T != 0
    n = int(on.sum())
    if n == 0:
        return {"mismatch/abs_mean": 0.0, "mismatch/k3": 0.0, "mismatch/frac_over": 0.0, "mismatch/max": 0.0}
    d = (trainer_logprobs_B_T.double() - generator_logprobs_B_T.double())[on]
    return {"mismatch/abs_mean": float(d.abs().mean()), "mismatch/k3": float((torch.expm1(d) - d).mean()),
            "mismatch/frac_over": float((d.abs() > threshold).double().mean()), "mismatch/max": float(d.abs().max())}


def _hparams(loss_name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The loss's keyword defaults overridden by the run's kwargs."""
    fn = LOSSES.get(loss_name)
    if fn is None:
        return dict(kwargs)
    params = inspect.signature(fn).parameters
    return {**{k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}, **kwargs}


def clipped_tokens(loss_name: str, loss_kwargs: dict[str, Any], log_ratio_B_T: torch.Tensor, advantages: torch.Tensor,
                   mask_B_T: torch.Tensor) -> torch.Tensor | None:
    """Which trained tokens the built-in loss `loss_name` clipped (bool ``[B, T]``), by its own rule and
    hyperparameters; None for a loss whose rule is not known here (a user's own).

    grpo, dapo, dr_grpo: the PPO surrogate's active clip (ratio beyond ``1 + eps_high`` with a positive
    advantage, below ``1 - eps_low`` with a negative one; zero gradient). cispo: the IS weight capped on either
    side (the token keeps a gradient). gspo: every token of a sequence whose sequence ratio is clipped.
    reinforce: none. ``advantages`` is ``[B]`` or ``[B, T]``.
    """
    on = mask_B_T != 0
    adv = advantages.float()
    adv = adv[:, None] if adv.dim() == 1 else adv
    ratio = torch.exp(log_ratio_B_T.float())
    h = _hparams(loss_name, loss_kwargs)
    if loss_name in ("grpo", "dapo", "dr_grpo"):
        hi, lo = 1.0 + float(h["eps_high"]), 1.0 - float(h["eps_low"])
        out = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    elif loss_name == "cispo":
        out = (ratio > 1.0 + float(h["is_eps_high"])) | (ratio < 1.0 - float(h["is_eps_low"]))
    elif loss_name == "gspo":
        maskf = mask_B_T.float()
        seq = torch.exp((log_ratio_B_T.float() * maskf).sum(1) / maskf.sum(1).clamp_min(1.0))[:, None]
        adv_seq = (adv * maskf).sum(1, keepdim=True) / maskf.sum(1, keepdim=True).clamp_min(1.0)
        hi, lo = 1.0 + float(h["seq_eps_high"]), 1.0 - float(h["seq_eps_low"])
        out = (((seq > hi) & (adv_seq > 0)) | ((seq < lo) & (adv_seq < 0))).expand_as(on)
    elif loss_name == "reinforce":
        out = torch.zeros_like(on)
    else:
        return None
    return out & on


def per_episode(values_B_T: torch.Tensor, prompt_lens: list[int], completion_lens: list[int]) -> list[list[float]]:
    """Row ``b``'s values at its completion's target positions (``P - 1 .. P - 1 + C``, as `collate` aligns
    them): one list per episode, one value per completion token.

    >>> per_episode(torch.arange(8.).reshape(2, 4), [2, 1], [2, 3])
    [[1.0, 2.0], [4.0, 5.0, 6.0]]
    """
    rows = values_B_T.detach().cpu()
    return [rows[b, p - 1: p - 1 + c].tolist() for b, (p, c) in enumerate(zip(prompt_lens, completion_lens))]
