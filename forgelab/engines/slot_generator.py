"""Deprecated alias (one release): the LoRA-slot generator moved to `forgelab.engines.generator_slots`."""
from __future__ import annotations

import warnings

from forgelab.engines.generator_slots import SlotGenerator, SlotVLLMEngine

warnings.warn("forgelab.engines.slot_generator is deprecated: import from forgelab.engines.generator_slots",
              DeprecationWarning, stacklevel=2)

__all__ = ["SlotGenerator", "SlotVLLMEngine"]
