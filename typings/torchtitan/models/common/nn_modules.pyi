from torch import nn

from torchtitan.protocols.module import Module, ParamInit

class RMSNorm(nn.RMSNorm, Module):
    class Config(Module.Config):
        eps: float
        def __init__(self, *, normalized_shape: int, eps: float = ..., elementwise_affine: bool = ...,
                     param_init: ParamInit | None = None) -> None: ...
