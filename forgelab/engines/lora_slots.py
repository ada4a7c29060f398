"""Deprecated alias of forgelab.engines.trainer_slots (renamed in issue #38); removed after one release.

Kept importable because run directories and trainer checkpoints pickle module paths (e.g. ``PackedLoss``).
"""
import warnings

from forgelab.engines.trainer_slots import *  # noqa: F401,F403
from forgelab.engines.trainer_slots import SLOT_CALLS, SlotTable, SlotTrainer, set_peak_lr, slot_call  # noqa: F401

warnings.warn("forgelab.engines.lora_slots is deprecated: import from forgelab.engines.trainer_slots", DeprecationWarning, stacklevel=2)
