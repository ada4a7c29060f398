"""Deprecated alias of forgelab.engines.loss_specs, .trainer_optim, .trainer_dist and .contracts (renamed in issue #38); removed after one release.

Kept importable because run directories and trainer checkpoints pickle module paths (e.g. ``PackedLoss``).
"""
import warnings

from forgelab.engines.contracts import REQUIRED_BATCH_KEYS, check_batch, check_spans, check_tokens, token_values_of  # noqa: F401
from forgelab.engines.loss_specs import PackedLoss, pack_loss, resolve_loss, shipped_loss  # noqa: F401
from forgelab.engines.trainer_dist import (  # noqa: F401
    local_tensor, rendezvous, resolve_device, rng_state, set_rng_state, sha256_hex, sum_of_squares,
)
from forgelab.engines.trainer_optim import WarmupCosine  # noqa: F401

warnings.warn("forgelab.engines.trainer_support is deprecated: import from forgelab.engines.loss_specs, .trainer_optim, .trainer_dist and .contracts", DeprecationWarning, stacklevel=2)
