"""Plain dataclasses that cross process boundaries.

They carry token ids and logprobs as Python lists (cheap to pickle, no tensor
storage to share) and are the token-in/token-out contract between the
generator, the controller and the trainer: nothing downstream re-tokenizes
text to train on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """One sampled continuation of a prompt, exactly as the generator produced it.

    `logprobs[i]` is the sampling logprob (natural log, under the generator's
    weights `policy_version`) of `completion_ids[i]`.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length" | ...
    policy_version: int
    prompt: str = ""
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    token_versions: list[tuple[int, int]] = field(default_factory=list)
    """The policy version of each token, run-length: ``(version, first token index)`` pairs in order, the
    first at index 0 with `policy_version` (the oldest). One pair unless a weight update landed while this
    completion was generated (``generator.update_mode: inflight``); empty means all `policy_version`."""


@dataclass
class Episode:
    """A scored completion on its way to the trainer.

    `loss_mask` (over `completion_ids`) is 1 on generated tokens and 0 on tokens
    an environment inserted (multi-turn); None means every completion token is
    generated. `generator_logprobs` has one entry per completion token (0.0 on
    environment tokens).
    """

    id: int
    group_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    generator_logprobs: list[float]
    policy_version: int
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    prompt: str = ""
    completion: str = ""
    target: str = ""
    task: str = ""
    info: dict = field(default_factory=dict)
    finish_reason: str = ""
    loss_mask: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each completion token (None: no teacher)."""
    token_advantages: list[float] | None = None
    """A per-token advantage, one per completion token (None: `advantage` for every token). Distillation sets
    ``advantage + coef * (teacher_logprob - generator_logprob)`` (`forgelab.algos.advantages.distill_advantages`)."""
    train_values: dict[str, list | None] | None = None
    """The trainer's per-token view once trained (`forgelab.algos.token_truth`): ``trainer_logprobs``,
    ``entropy``, ``is_weight`` (None: no IS), ``clipped`` (None: the loss's rule is unknown), one value per
    completion token, and ``step``, the step that trained it."""
