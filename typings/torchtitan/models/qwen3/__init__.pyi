from torchtitan.models.common import RoPE
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.module import Module
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

class Qwen3Model(Decoder):
    class Config(Decoder.Config): ...

class _GQAttentionConfig(Module.Config):
    """torchtitan.models.common.attention.GQAttention.Config, the fields forgelab sets."""

    qk_norm: RMSNorm.Config
    inner_attention: Module.Config

class _Qwen3BlockConfig(TransformerBlock.Config):
    attention: _GQAttentionConfig

def _build_qwen3_layers(*, n_layers: int, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden_dim: int,
                        fuse_qkv: bool = True, attn_backend: str, rope: RoPE.Config) -> list[_Qwen3BlockConfig]: ...

class Qwen3StateDictAdapter(StateDictAdapter):
    def __init__(self, model_config: Qwen3Model.Config, hf_assets_path: str | None) -> None: ...
