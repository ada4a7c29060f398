"""Forward passes over a torchtitan model for RL: hidden states, the output projection's weight, and the
logprobs (and entropies) of given tokens, in chunks of the vocabulary projection and, for GRPO groups, with
the shared prompt run once (`forgelab.algos.packing`). The model is built by `forgelab.engines.titan`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from forgelab.algos.packing import PrefixPack

__all__ = ["hidden_states", "output_weight", "model_logprobs_entropy", "use_packing", "packed_logprobs_entropy",
           "model_logprobs"]


def hidden_states(model: torch.nn.Module, inputs_B_T: torch.Tensor, **forward_kwargs: object) -> torch.Tensor:
    """The final hidden states ``[B, T, D]`` (after the last norm, before the output projection).

    Runs the model's own forward (so FSDP's hooks fire) with torchtitan's
    ``_skip_lm_head`` set, so no ``[B, T, V]`` logits are ever built. ``forward_kwargs``
    (``positions``, ``attention_masks``) go to the model's forward.
    """
    skip = getattr(model, "_skip_lm_head")  # a plain attribute of torchtitan's Decoder (not a module or tensor)
    setattr(model, "_skip_lm_head", True)
    try:
        hidden_B_T_D: torch.Tensor = model(inputs_B_T, **forward_kwargs)
        return hidden_B_T_D
    finally:
        setattr(model, "_skip_lm_head", skip)


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output projection ``[V, D]`` (the embedding itself when tied), as the forward pass just used it.

    Under FSDP, read it right after `hidden_states`: the output unit is not
    resharded after forward, so this is the gathered parameter that autograd
    (and FSDP's reduce-scatter) tracks.
    """
    from torch.distributed.tensor import DTensor

    weight = model.get_submodule("lm_head").weight
    assert isinstance(weight, torch.Tensor)
    if isinstance(weight, DTensor):
        raise RuntimeError(
            "lm_head.weight is still sharded after the forward pass: the FSDP unit holding the output projection "
            "must not reshard after forward (torchtitan's default policy keeps it gathered)"
        )
    return weight


def model_logprobs_entropy(
    model: torch.nn.Module, tokens_B_L: torch.Tensor, *, need_entropy: bool = False, chunk: int | None = None,
    spans_B_2: torch.Tensor | None = None, share_prompts: str = "auto", max_pack_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(logprobs_B_T, entropy_B_T or None)``, never holding more than ``chunk`` rows of full-vocabulary logits.

    ``logprobs[:, t] = log p(tokens[:, t+1] | tokens[:, :t+1])``, ``T = L - 1``; causal
    forward with no mask (right padding only); differentiable when grad is enabled.

    With ``spans_B_2`` (each row's ``(prompt length, length)``, `forgelab.algos.packing`),
    only target positions ``start - 1 .. end - 2`` are computed (0 elsewhere), and rows that
    share a prompt run it once (`plan_shared_prefix`) when ``share_prompts`` is "on", or
    "auto" and packing runs fewer tokens (`use_packing`); "off" runs the plain batch.
    """
    from forgelab.algos.logprobs import DEFAULT_LOGITS_CHUNK, chunked_logprobs_entropy, shift_for_targets

    chunk = chunk or DEFAULT_LOGITS_CHUNK
    if spans_B_2 is not None and share_prompts != "off":
        from forgelab.algos.packing import DEFAULT_MAX_PACK_LEN, plan_shared_prefix

        pack = plan_shared_prefix(tokens_B_L, spans_B_2, max_len=max_pack_len or DEFAULT_MAX_PACK_LEN)
        if pack.src_M.numel() and (share_prompts == "on" or use_packing(pack)):
            return packed_logprobs_entropy(model, pack, need_entropy=need_entropy, chunk=chunk,
                                           device=tokens_B_L.device)
    inputs_B_T, targets_B_T = shift_for_targets(tokens_B_L)
    h_B_T_D = hidden_states(model, inputs_B_T)
    lp, ent = chunked_logprobs_entropy(h_B_T_D, output_weight(model), targets_B_T, chunk=chunk,
                                       need_entropy=need_entropy)
    if spans_B_2 is not None:  # the same zeros outside the spans as the packed path
        from forgelab.algos.packing import span_mask

        keep = span_mask(spans_B_2, lp.shape[1]).to(lp.device)
        lp = torch.where(keep, lp, 0.0)
        ent = None if ent is None else torch.where(keep, ent, 0.0)
    return lp, ent


def use_packing(pack: PrefixPack) -> bool:
    """Whether a shared-prompt pack is worth running: it must run at most 80 % of the plain batch's tokens.

    The pack's attention is dense over its length, so the padded packed token count (what the
    model runs) is compared, not the real one.
    """
    return bool(pack.padded_tokens <= 0.8 * pack.plain_tokens)


def packed_logprobs_entropy(
    model: torch.nn.Module, pack: PrefixPack, *, need_entropy: bool, chunk: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model_logprobs_entropy` of a `PrefixPack`: one masked forward over the packs, unpacked to ``[B, T]``."""
    from forgelab.algos.logprobs import chunked_logprobs_entropy
    from forgelab.algos.packing import unpack_to_rows

    h_N_S_D = hidden_states(model, pack.tokens_N_S.to(device), positions=pack.positions_N_S.to(device),
                            attention_masks=pack.allowed_N_S_S.to(device).unsqueeze(1))
    h_M_D = h_N_S_D.reshape(-1, h_N_S_D.shape[-1])[pack.src_M.to(h_N_S_D.device)]
    lp_1_M, ent_1_M = chunked_logprobs_entropy(h_M_D.unsqueeze(0), output_weight(model),
                                               pack.target_M.to(h_N_S_D.device).unsqueeze(0), chunk=chunk,
                                               need_entropy=need_entropy)
    return unpack_to_rows(lp_1_M[0], pack), (None if ent_1_M is None else unpack_to_rows(ent_1_M[0], pack))


def model_logprobs(model: torch.nn.Module, tokens_B_L: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """fp32 ``logprobs_B_T`` by `model_logprobs_entropy` (``chunk_size`` rows of logits at a time)."""
    return model_logprobs_entropy(model, tokens_B_L, chunk=chunk_size)[0]
