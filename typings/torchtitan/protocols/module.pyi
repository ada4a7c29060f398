from collections.abc import Callable, Mapping

import torch
from torch import nn

ParamInit = Mapping[str, Callable[[torch.Tensor], object]]
"""Parameter name -> its init function (``{"weight": partial(nn.init.trunc_normal_, std=0.02)}``)."""

class Module(nn.Module):
    class Config:
        """What every building block's ``Config`` (a dataclass) derives from."""

        param_init: ParamInit | None
        def build(self) -> nn.Module: ...
