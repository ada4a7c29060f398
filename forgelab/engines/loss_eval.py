"""Deprecated alias of forgelab.engines.loss_compare (renamed in issue #38); removed after one release.

Kept importable because run directories and trainer checkpoints pickle module paths (e.g. ``PackedLoss``).
"""
import warnings

from forgelab.engines.loss_compare import *  # noqa: F401,F403
from forgelab.engines.loss_compare import CURRENT_LOSS, compare_on_state, loss_spec  # noqa: F401

warnings.warn("forgelab.engines.loss_eval is deprecated: import from forgelab.engines.loss_compare", DeprecationWarning, stacklevel=2)
