from collections.abc import Sequence

import torch
from torch import nn

from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.module import Module, ParamInit

class TransformerBlock(Module):
    class Config(Module.Config):
        attention: Module.Config
        attention_norm: RMSNorm.Config
        ffn_norm: RMSNorm.Config

class Decoder(Module):
    class Config(Module.Config):
        dim: int
        vocab_size: int
        enable_weight_tying: bool
        layers: list[TransformerBlock.Config]
        def __init__(self, *, dim: int, vocab_size: int, lm_head: Linear.Config, tok_embeddings: Embedding.Config,
                     norm: RMSNorm.Config, layers: Sequence[TransformerBlock.Config], enable_weight_tying: bool = ...,
                     param_init: ParamInit | None = None) -> None: ...
        def build(self) -> Decoder: ...

    layers: nn.ModuleDict
    def init_states(self, *, buffer_device: torch.device | None = None) -> None: ...
