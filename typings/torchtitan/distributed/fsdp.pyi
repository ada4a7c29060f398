import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

def apply_fsdp_to_decoder(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                          pp_enabled: bool, cpu_offload: bool = False, reshard_after_forward_policy: str = "default",
                          ep_degree: int = 1, edp_mesh: DeviceMesh | None = None, enable_symm_mem: bool = False
                          ) -> None: ...
