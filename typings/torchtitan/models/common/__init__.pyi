"""torchtitan.models.common: the building blocks of its decoders, each a module with a ``Config`` dataclass."""
from typing import Literal

from torch import nn

from torchtitan.models.common.nn_modules import RMSNorm as RMSNorm
from torchtitan.protocols.module import Module, ParamInit

class RoPE(Module):
    """torchtitan.models.common.rope.RoPE."""

    class Config(Module.Config):
        dim: int
        max_seq_len: int
        theta: float
        def __init__(
            self, *, dim: int, max_seq_len: int, theta: float = ...,
            scaling: Literal["none", "llama", "yarn"] = ..., scaling_factor: float = ..., low_freq_factor: float = ...,
            high_freq_factor: float = ..., original_max_position_embeddings: int = ...,
            param_init: ParamInit | None = None,
        ) -> None: ...

class ComplexRoPE(RoPE): ...
class CosSinRoPE(RoPE): ...

class Embedding(nn.Embedding, Module):
    class Config(Module.Config):
        def __init__(self, *, num_embeddings: int, embedding_dim: int, param_init: ParamInit | None = None) -> None: ...

class Linear(nn.Linear, Module):
    class Config(Module.Config):
        def __init__(self, *, in_features: int, out_features: int, bias: bool = ...,
                     param_init: ParamInit | None = None) -> None: ...
