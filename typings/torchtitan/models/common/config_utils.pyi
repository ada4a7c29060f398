from typing import Literal

from torchtitan.models.common import RoPE
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.module import Module, ParamInit

def get_attention_config(backend: str) -> Module.Config: ...
def make_ffn_config(*, dim: int, hidden_dim: int, w1_param_init: ParamInit, w2w3_param_init: ParamInit,
                    tp_gemm_backend: Literal["default", "dist_gemm"] = "default") -> Module.Config: ...
def make_gqa_config(*, dim: int, n_heads: int, wqkv_param_init: ParamInit, wo_param_init: ParamInit,
                    inner_attention: Module.Config, rope: RoPE.Config, n_kv_heads: int | None = None,
                    head_dim: int | None = None, fuse_qkv: bool = False, qk_norm: RMSNorm.Config | None = None,
                    tp_gemm_backend: Literal["default", "dist_gemm"] = "default") -> Module.Config: ...
