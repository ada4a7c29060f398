from collections.abc import Mapping

import torch

from torchtitan.protocols.module import Module

class ScaledDotProductAttention(Module):
    class Config(Module.Config):
        def __init__(self) -> None: ...
    def __init__(self, config: Module.Config) -> None: ...
    # attention_masks: torchtitan's BlockMask / VarlenMetadata (or a mapping of them); forgelab passes a dense mask
    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: object = None, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True, **kwargs: object) -> torch.Tensor: ...
