"""Episodes to a padded training batch, aligned to target positions.

An episode with prompt ids ``p_0..p_{P-1}`` and completion ids ``c_0..c_{C-1}``
becomes the row ``tokens = [p_0 .. p_{P-1}, c_0 .. c_{C-1}, pad ..]``. Per-token
tensors live on target positions (``T = L - 1``; position ``t`` predicts
``tokens[t + 1]``), so completion token ``j`` sits at target position
``P - 1 + j``. ``mask_B_T`` is 1.0 there, times the episode's ``loss_mask[j]``
for multi-turn episodes (0 on environment-inserted tokens), and 0 on prompt
and padding positions; logprob tensors are 0 wherever the mask is 0.

``advantages_B`` is one advantage per sequence, ``[B]``, unless an episode of the
batch carries per-token advantages (``Episode.token_advantages``: on-policy
distillation); then it is ``[B, T]`` on target positions (0 off the mask), a
row without them holding its sequence advantage on every trained token. The
losses take either shape.

    >>> from forgelab.types import Episode, TrainBatch
    >>> ep = Episode(id=0, group_id=0, prompt_ids=[1, 2], completion_ids=[3, 4],
    ...              generator_logprobs=[-0.5, -0.25], policy_version=0, advantage=1.0)
    >>> batch = collate([ep], pad_id=0)
    >>> batch.tokens_B_L.tolist(), batch.mask_B_T.tolist(), batch.generator_logprobs_B_T.tolist()
    ([[1, 2, 3, 4]], [[0.0, 1.0, 1.0]], [[0.0, -0.5, -0.25]])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgelab.types import Episode, TrainBatch

__all__ = ["collate"]


def _check(ep: Episode) -> None:
    n = len(ep.completion_ids)
    if len(ep.prompt_ids) == 0:
        raise ValueError(
            f"episode {ep.id}: empty prompt_ids; the first completion token needs at least one prompt token "
            "(e.g. BOS) to be predicted from"
        )
    for field in ("generator_logprobs", "ref_logprobs", "loss_mask", "teacher_logprobs", "token_advantages"):
        value = getattr(ep, field)
        if value is not None and len(value) != n:
            raise ValueError(
                f"episode {ep.id}: {field} has {len(value)} entries but completion_ids has {n}; "
                "they must be aligned one-to-one"
            )


def collate(episodes: Sequence[Episode], pad_id: int, *, pad_to: int | None = None) -> TrainBatch:
    """Stack episodes into right-padded tensors.

    Args:
        episodes: the batch, ``B`` episodes. ``ref_logprobs`` must be set on
            all of them or on none.
        pad_id: token id used for padding (its logits are masked out anyway).
        pad_to: pad ``L`` up to at least this length (fixed shapes help compiled models).

    Returns:
        A `forgelab.types.TrainBatch`: ``tokens_B_L`` (int64), ``mask_B_T``, ``generator_logprobs_B_T``,
        ``ref_logprobs_B_T`` (fp32, or None), ``advantages_B`` (fp32, ``[B]``, or ``[B, T]`` when an episode
        has ``token_advantages``), ``policy_version_B`` and ``episode_id_B`` (int64); ``T = L - 1``.
    """
    if len(episodes) == 0:
        raise ValueError("collate: no episodes; sample a batch from the buffer first")
    for ep in episodes:
        _check(ep)
    with_ref = [ep.ref_logprobs is not None for ep in episodes]
    if any(with_ref) and not all(with_ref):
        missing = [ep.id for ep in episodes if ep.ref_logprobs is None]
        raise ValueError(
            f"collate: episodes {missing[:10]} have no ref_logprobs while others do; "
            "compute reference logprobs for every episode of a batch or for none"
        )
    B = len(episodes)
    L = max(2, max(len(ep.prompt_ids) + len(ep.completion_ids) for ep in episodes), pad_to or 0)
    T = L - 1
    tokens_B_L = torch.full((B, L), pad_id, dtype=torch.long)
    mask_B_T = torch.zeros(B, T)
    generator_logprobs_B_T = torch.zeros(B, T)
    ref_logprobs_B_T = torch.zeros(B, T) if all(with_ref) else None
    per_token = any(ep.token_advantages is not None for ep in episodes)
    advantages_B_T = torch.zeros(B, T) if per_token else None
    for b, ep in enumerate(episodes):
        P, C = len(ep.prompt_ids), len(ep.completion_ids)
        tokens_B_L[b, : P + C] = torch.tensor(ep.prompt_ids + ep.completion_ids, dtype=torch.long)
        if C == 0:
            continue
        m_C = torch.ones(C) if ep.loss_mask is None else torch.tensor(ep.loss_mask, dtype=torch.float32)
        span = slice(P - 1, P - 1 + C)
        mask_B_T[b, span] = m_C
        on_C = m_C != 0
        generator_logprobs_B_T[b, span] = torch.where(on_C, torch.tensor(ep.generator_logprobs, dtype=torch.float32), 0.0)
        if ref_logprobs_B_T is not None:
            ref_logprobs_B_T[b, span] = torch.where(on_C, torch.tensor(ep.ref_logprobs, dtype=torch.float32), 0.0)
        if advantages_B_T is not None:
            adv_C = (torch.tensor(ep.token_advantages, dtype=torch.float32) if ep.token_advantages is not None
                     else torch.full((C,), float(ep.advantage)))
            advantages_B_T[b, span] = torch.where(on_C, adv_C, 0.0)
    return TrainBatch(
        tokens_B_L=tokens_B_L,
        mask_B_T=mask_B_T,
        generator_logprobs_B_T=generator_logprobs_B_T,
        ref_logprobs_B_T=ref_logprobs_B_T,
        advantages_B=advantages_B_T if advantages_B_T is not None
        else torch.tensor([float(ep.advantage) for ep in episodes], dtype=torch.float32),
        policy_version_B=torch.tensor([int(ep.policy_version) for ep in episodes], dtype=torch.long),
        episode_id_B=torch.tensor([int(ep.id) for ep in episodes], dtype=torch.long),
    )
