from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.module import Module
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

class Llama3Model(Decoder):
    class Config(Decoder.Config): ...

class Llama3TransformerBlock(TransformerBlock):
    class Config(TransformerBlock.Config):
        def __init__(self, *, attention: Module.Config, feed_forward: Module.Config | None = None,
                     attention_norm: RMSNorm.Config, ffn_norm: RMSNorm.Config) -> None: ...

class Llama3StateDictAdapter(StateDictAdapter):
    def __init__(self, model_config: Llama3Model.Config, hf_assets_path: str | None) -> None: ...
