"""The trainer's and the reference's contract, engine side: the typed objects (defined in `forgelab.types`,
the bottom layer, so that `collate` and the weight sync can use them) and the checks an endpoint runs on them.

    batch = collate(episodes, pad_id)                      # TrainBatch
    metrics = await trainer.train_step(batch)             # StepMetrics (fused: forward, backward, optimizer step)
    fb = await trainer.forward_backward(batch)            # LossReport: gradients accumulate ...
    opt = await trainer.optim_step(AdamParams(lr=1e-5))    # OptimReport: ... until the optimizer step
    values = await trainer.token_values()                 # TokenValues | None
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from forgelab.types import (
    REQUIRED_BATCH_KEYS, AdamParams, DryRunReport, LossReport, OptimReport, SlotStep, StepMetrics, TokenValues,
    TrainBatch, WeightPush,
)

__all__ = ["TrainBatch", "StepMetrics", "LossReport", "OptimReport", "AdamParams", "TokenValues", "DryRunReport",
           "WeightPush", "SlotStep", "token_values_of", "check_tokens", "check_spans", "check_batch", "REQUIRED_BATCH_KEYS"]


def check_tokens(tokens_B_L: object) -> torch.Tensor:
    """``tokens_B_L`` as int64 ``[B, L]`` with ``L >= 2``; ``ValueError`` naming the problem otherwise."""
    if not isinstance(tokens_B_L, torch.Tensor) or tokens_B_L.dim() != 2 or tokens_B_L.shape[1] < 2:
        raise ValueError(
            f"tokens_B_L must be an int tensor [B, L] with L >= 2, got "
            f"{tuple(tokens_B_L.shape) if isinstance(tokens_B_L, torch.Tensor) else type(tokens_B_L).__name__}"
        )
    if tokens_B_L.is_floating_point():
        raise ValueError(f"tokens_B_L must hold integer token ids, got dtype {tokens_B_L.dtype}")
    return tokens_B_L.long()


def check_spans(spans_B_2: object, tokens_B_L: torch.Tensor) -> torch.Tensor | None:
    """None, or ``[B, 2]`` int spans ``(prompt length, length)`` per row of ``tokens_B_L`` (`forgelab.algos.packing`)."""
    if spans_B_2 is None:
        return None
    spans = torch.as_tensor(spans_B_2)
    B, L = tokens_B_L.shape
    if spans.shape != (B, 2) or spans.is_floating_point():
        raise ValueError(f"spans_B_2 must be an int tensor [B, 2] = [{B}, 2] of (prompt length, length) per row, "
                         f"got {tuple(spans.shape)} {spans.dtype}")
    s, e = spans[:, 0], spans[:, 1]
    bad = ~(((s >= 1) & (s < e) & (e <= L)) | ((s == 0) & (e == 0)))
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"spans_B_2 row {b} is ({int(s[b])}, {int(e[b])}); need 1 <= prompt length < length <= L "
                         f"= {L}, or (0, 0) for a row with nothing to compute")
    return spans.long().cpu()


def check_batch(batch: "TrainBatch | Mapping[str, object]") -> TrainBatch:
    """Validate a batch (``forgelab.algos.batching.collate``); raise ``ValueError`` naming the problem."""
    batch = TrainBatch.coerce(batch)
    tokens = check_tokens(batch.tokens_B_L)
    B, L = tokens.shape
    want: dict[str, tuple[int, ...]] = {"mask_B_T": (B, L - 1), "generator_logprobs_B_T": (B, L - 1),
                                        "advantages_B": (B,)}
    if batch.ref_logprobs_B_T is not None:
        want["ref_logprobs_B_T"] = (B, L - 1)
    if batch.advantages_B.dim() == 2:  # per token (on-policy distillation), aligned to targets
        want["advantages_B"] = (B, L - 1)
    shapes = {key: tuple(getattr(batch, key).shape) for key in want}
    shapes |= {key: tuple(v.shape) for key, v in batch.loss_inputs_B_T.items()}
    want |= {key: (B, L - 1) for key in batch.loss_inputs_B_T}
    for key, shape in want.items():
        if shapes[key] != shape:
            raise ValueError(
                f"train_step: batch[{key!r}] has shape {shapes[key]}, expected {shape} for "
                f"tokens_B_L {(B, L)} (per-token tensors are aligned to targets, T = L - 1)"
            )
    return dataclasses.replace(batch, tokens_B_L=tokens)


def token_values_of(trainer_logprobs_B_T: torch.Tensor, entropy_B_T: torch.Tensor,
                    generator_logprobs_B_T: torch.Tensor, mask_B_T: torch.Tensor, advantages: torch.Tensor,
                    is_weights_B_T: torch.Tensor | None, loss_name: str, loss_kwargs: Mapping[str, object],
                    metrics: dict[str, float]) -> TokenValues:
    """The trainer's view of every token of the batch it trains (issue #28): its logprob under the weights
    being trained (before the update), its entropy, the importance weight used (None: no IS), whether the loss
    clipped it (None: a loss whose rule is unknown) and the mask; adds the sampler-vs-trainer mismatch to
    `metrics` (`forgelab.algos.token_truth`). CPU float32 ``[B, T]`` tensors, sent back with the step's metrics."""
    from forgelab.algos.token_truth import clipped_tokens, sampler_mismatch

    lp, gen, mask = trainer_logprobs_B_T.float().cpu(), generator_logprobs_B_T.float().cpu(), mask_B_T.float().cpu()
    metrics.update(sampler_mismatch(gen, lp, mask))
    clipped = clipped_tokens(loss_name, dict(loss_kwargs), torch.where(mask != 0, lp - gen, 0.0), advantages.cpu(),
                             mask)
    return TokenValues(trainer_logprobs_B_T=lp, entropy_B_T=entropy_B_T.detach().float().cpu(),
                       is_weights_B_T=None if is_weights_B_T is None else is_weights_B_T.detach().float().cpu(),
                       clipped_B_T=None if clipped is None else clipped.float(), mask_B_T=mask)
