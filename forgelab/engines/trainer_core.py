"""Deprecated alias of forgelab.engines.trainer_state (renamed in issue #38); removed after one release.

Kept importable because run directories and trainer checkpoints pickle module paths (e.g. ``PackedLoss``).
"""
import warnings

from forgelab.engines.trainer_state import *  # noqa: F401,F403
from forgelab.engines.trainer_state import SkipStep, TrainerState  # noqa: F401
from forgelab.engines.trainer_optim import WarmupCosine  # noqa: F401
from forgelab.engines.loss_specs import PackedLoss, pack_loss, resolve_loss  # noqa: F401
from forgelab.engines.contracts import check_tokens, check_spans, check_batch  # noqa: F401
from forgelab.engines.trainer_dist import resolve_device  # noqa: F401

warnings.warn("forgelab.engines.trainer_core is deprecated: import from forgelab.engines.trainer_state", DeprecationWarning, stacklevel=2)
