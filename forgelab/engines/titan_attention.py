"""Causal SDPA that also takes a dense boolean attention mask (torchtitan's own SDPA takes none).

forgelab's model configs use `MaskedSDPA` as every layer's inner attention. With
``attention_masks=None`` it is torchtitan's ``ScaledDotProductAttention``
(causal); with a bool tensor ``[N, 1, S, S]`` (True: may attend) it calls
``scaled_dot_product_attention`` with that mask, which is how shared-prompt packs
(`forgelab.algos.packing`) run. Parameter-free: checkpoints and FSDP wrapping are
those of the stock module. Imports torchtitan, so import this lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from forgelab.engines.titan_import import import_titan_models

import_titan_models()  # before torchtitan's attention module: its import-time compiles deferred

from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

__all__ = ["MaskedSDPA"]

#: Backends able to take an arbitrary mask, best first (CPU: the flash kernel takes one; CUDA: memory-efficient).
_MASKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class MaskedSDPA(ScaledDotProductAttention):
    """``ScaledDotProductAttention``, plus a dense bool ``attention_masks`` ``[N, 1, S, S]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: object = None, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True, **kwargs: object) -> torch.Tensor:
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                   is_causal=is_causal, **kwargs)
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype != torch.bool:
            raise TypeError(f"MaskedSDPA: attention_masks must be a bool tensor [N, 1, S, S] (True: may attend), "
                            f"got {type(attention_masks).__name__}")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(_MASKED_BACKENDS, set_priority=True):
            out_BNLH = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale,
                                                      enable_gqa=enable_gqa)
        return out_BNLH.transpose(1, 2)
