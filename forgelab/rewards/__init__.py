"""Rewards: plain callables `fn(prompt, completion, target, **info) -> float`, a registry and a composer.

    from forgelab.rewards import REWARDS, RewardComposer, validate
    REWARDS["my_reward"] = my_reward        # adding one is adding an entry

`library` holds the registry, the composer (weights, hot swaps) and the call/validation helpers;
`math_answers` the rewards for real data (GSM8K/MATH answers, think tags, overlong shaping);
`reasoning_gym` scores reasoning-gym tasks with their own `score_answer`;
`trl_compat` adapts TRL-style batched rewards (``reward(completions, **kwargs) -> list[float]``) unchanged.
"""
from forgelab.rewards.library import (REWARDS, RewardComposer, RewardFailure, RewardFn, RewardResult,
                                      ValidationReport, WeightedReward, answer_format, call_reward, exact_answer,
                                      extract_answer, resolve_reward, validate)
from forgelab.rewards.math_answers import (extract_math_answer, make_overlong, math_answer, overlong, parse_number,
                                           target_value, think_format)
from forgelab.rewards.reasoning_gym import reasoning_gym_exact, reasoning_gym_partial
from forgelab.rewards.trl_compat import (PROMPT_MESSAGES, TRLReward, TrainerStateLike, as_reward, is_trl_reward,
                                         trl_kwargs, trl_reward)

__all__ = ["REWARDS", "RewardComposer", "RewardFailure", "RewardFn", "RewardResult", "ValidationReport",
           "WeightedReward", "answer_format", "call_reward", "exact_answer", "extract_answer", "extract_math_answer",
           "make_overlong", "math_answer", "overlong", "parse_number", "target_value", "think_format", "validate",
           "PROMPT_MESSAGES", "TRLReward", "TrainerStateLike", "as_reward", "is_trl_reward", "trl_kwargs", "trl_reward",
           "resolve_reward", "reasoning_gym_exact", "reasoning_gym_partial"]
