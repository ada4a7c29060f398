"""Deprecated alias of forgelab.engines.lora_adapters (renamed in issue #38); removed after one release.

Kept importable because run directories and trainer checkpoints pickle module paths (e.g. ``PackedLoss``).
"""
import warnings

from forgelab.engines.lora_adapters import *  # noqa: F401,F403
from forgelab.engines.lora_adapters import (  # noqa: F401
    adapter_config, adapter_state_dict, add_adapters, base_hash, check_checkpoint_record, checkpoint_model_state,
    checkpoint_record, export_adapter, merged_hf_state_dict, peft_tensors, step_dropout,
)

warnings.warn("forgelab.engines.lora is deprecated: import from forgelab.engines.lora_adapters", DeprecationWarning, stacklevel=2)
