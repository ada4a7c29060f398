"""Pure algorithm functions over tensors: logprobs, advantages, losses, importance weights, batching.

Nothing here imports an actor, a widget, Monarch or vLLM; every function can
be read, called and tested on CPU tensors.
"""

from forgelab.algos.advantages import ADVANTAGES, AdvantageFn, group_mean_centered, group_zscore, leave_one_out
from forgelab.algos.batching import collate
from forgelab.algos.importance import IS_LEVELS, truncated_is_weights
from forgelab.algos.logprobs import gather_logprobs, masked_mean, masked_sum, shift_for_targets, token_entropy
from forgelab.algos.loss_checks import accepted_loss_kwargs, check_loss_kwargs
from forgelab.algos.losses import (
    LOSSES,
    LossError,
    LossFn,
    cispo,
    dapo,
    dr_grpo,
    grpo,
    gspo,
    reinforce,
    validate_loss_output,
)

__all__ = [
    "ADVANTAGES",
    "AdvantageFn",
    "group_zscore",
    "group_mean_centered",
    "leave_one_out",
    "collate",
    "IS_LEVELS",
    "truncated_is_weights",
    "gather_logprobs",
    "token_entropy",
    "shift_for_targets",
    "masked_sum",
    "masked_mean",
    "LOSSES",
    "LossFn",
    "LossError",
    "validate_loss_output",
    "check_loss_kwargs",
    "accepted_loss_kwargs",
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "reinforce",
]
