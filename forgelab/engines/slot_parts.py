"""Deprecated alias (one release): a run's view of shared engines moved to `forgelab.engines.shared_parts`."""
from __future__ import annotations

import warnings

from forgelab.engines.shared_parts import SlotGenerators, SlotParts, SlotTrainerHandle

warnings.warn("forgelab.engines.slot_parts is deprecated: import from forgelab.engines.shared_parts",
              DeprecationWarning, stacklevel=2)

__all__ = ["SlotGenerators", "SlotParts", "SlotTrainerHandle"]
