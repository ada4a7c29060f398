"""Greedy exact-answer accuracy of a causal LM on a list of problems (HF ``generate``).

``forgelab.data.format_prompt`` is the one place where a problem's prompt is chat-templated;
every other module (rollouts, vLLM, RL) calls it so that training and evaluation see the same text.

    acc = greedy_accuracy_hf("forgelab/assets/tiny-llama", None, get_task("addition").make("test", 500, 0))

A run's own evaluation (through its generator and environment) is `Evaluator`, which owns the run's
accuracy history.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from forgelab.data.prompts import format_prompt
from forgelab.data.tasks import Problem, get_task
from forgelab.envs.episode import final_answer
from forgelab.rewards.library import RewardFn

if TYPE_CHECKING:
    from forgelab.config.run_config import RolloutConfig
    from forgelab.controller.lifecycle import Lifecycle
    from forgelab.controller.rollout import EpisodeSource, TextTokenizer
    from forgelab.generation import SamplingSettings
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_model_and_tokenizer(model_dir: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` from a saved checkpoint, float32 on CPU in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)  # type: ignore[no-untyped-call]  # transformers: PreTrainedModel.eval is unannotated


@torch.no_grad()
def greedy_generate_hf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *, max_new_tokens: int = 8, batch_size: int = 256
) -> list[str]:
    """Greedy completions (special tokens stripped) of already-templated ``prompts``.

    Batched with left padding; each sequence stops at the tokenizer's eos (the end-of-turn token).
    """
    tokenizer.padding_side = "left"
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(
            list(prompts[start : start + batch_size]),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        ids_B_T = model.generate(  # type: ignore[operator]  # transformers: generate comes from GenerationMixin, mixed into each causal-LM class, not PreTrainedModel
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_B_T = ids_B_T[:, batch["input_ids"].shape[1] :]
        out += tokenizer.batch_decode(new_B_T, skip_special_tokens=True)
    return out


def greedy_accuracy_hf(
    model_dir_or_model: str | os.PathLike[str] | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    problems: Sequence[Problem],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> float:
    """Fraction of ``problems`` whose greedy completion gets reward 1.0 from its task.

    Args:
        model_dir_or_model: a checkpoint directory or a loaded ``PreTrainedModel``.
        tokenizer: the model's tokenizer; None loads it from the checkpoint directory.
        problems: problems of any registered tasks (each scored by its own task).
        max_new_tokens: generation budget; answers here are at most 4 characters + end.
    """
    if isinstance(model_dir_or_model, (str, os.PathLike)):
        model, loaded_tokenizer = load_model_and_tokenizer(str(model_dir_or_model))
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model = model_dir_or_model
    if tokenizer is None:
        raise ValueError("greedy_accuracy_hf: pass a tokenizer when passing a loaded model")
    if not problems:
        raise ValueError("greedy_accuracy_hf: no problems to evaluate")
    was_training = model.training
    model.eval()  # type: ignore[no-untyped-call]  # transformers: PreTrainedModel.eval is unannotated
    try:
        prompts = [format_prompt(tokenizer, p.prompt) for p in problems]
        completions = greedy_generate_hf(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
        )
    finally:
        model.train(was_training)
    rewards = [
        get_task(p.task).reward(p.prompt, c, p.target, **p.info) for p, c in zip(problems, completions)
    ]
    return sum(rewards) / len(rewards)


def heldout_reward(rollout: RolloutConfig) -> RewardFn:
    """The reward held-out answers are scored with: a toy task's own; a reasoning-gym task's exact match; for a
    dataset file, ``math_answer`` when the run trains on it (GSM8K/MATH-style answers), else ``exact_answer``."""
    from forgelab.rewards.library import REWARDS
    from forgelab.data.tasks import TASKS

    if isinstance(rollout.task, str) and rollout.task in TASKS:
        return get_task(rollout.task).reward
    if rollout.task == "reasoning_gym":  # exact match even when training takes partial credit
        return REWARDS["reasoning_gym"]
    return REWARDS["math_answer" if "math_answer" in (rollout.rewards or {}) else "exact_answer"]


async def heldout_accuracy(source: EpisodeSource, problems: Sequence[Problem], tokenizer: TextTokenizer | None,
                           sampling: SamplingSettings, reward: RewardFn) -> float:
    """Greedy accuracy of the generator's current weights, played through the run's rollout `source`.

    One path for single-turn and multi-turn runs: each problem is one episode of
    the run's environment (`forgelab.controller.rollout.SingleTurn` or `EnvEpisodes`), and
    its final answer (the last assistant turn) is scored by ``reward`` (the
    task's exact-answer reward); > 0.5 counts as correct, a reward that raises
    as wrong.
    """

    if not problems:
        return 0.0
    groups = await source.play(list(problems), 1, sampling)
    correct = 0
    for p, (ep,) in zip(problems, groups):
        try:
            correct += float(reward(p.prompt, final_answer(ep, tokenizer), p.target, **p.info)) > 0.5
        except Exception:
            pass
    return correct / len(problems)


class Evaluator:
    """The run's held-out evaluation and the one owner of its history (``[(step, accuracy)]``).

    Args:
        rollout: the run's ``RolloutConfig`` (``max_tokens``; the task picks the exact-answer reward).
        heldout: the held-out problems.
        lifecycle: the run's `Lifecycle` (its gate: new rollouts wait while an evaluation runs).
    """

    def __init__(self, rollout: RolloutConfig, heldout: Sequence[Problem], lifecycle: Lifecycle) -> None:
        self.rollout, self.heldout, self.lifecycle = rollout, list(heldout), lifecycle
        self.reward = heldout_reward(rollout)
        self.history: list[tuple[int, float]] = []
        self.source: EpisodeSource | None = None
        self.tokenizer: TextTokenizer | None = None
        self._observers: list[Callable[[int, float, float], None]] = []

    def bind(self, source: EpisodeSource, tokenizer: TextTokenizer) -> None:
        """The rollout source episodes are played through (`SingleTurn` / `EnvEpisodes`) and the tokenizer."""
        self.source, self.tokenizer = source, tokenizer

    def restore(self, history: Sequence[Sequence[float]]) -> None:
        """A checkpoint's history."""
        self.history = [(int(s), float(a)) for s, a in history]

    def use_problems(self, problems: Sequence[Problem]) -> None:
        """Evaluate on `problems` from now on (a benchmark's fixed held-out draw)."""
        self.heldout = list(problems)

    def add_observer(self, fn: Callable[[int, float, float], None]) -> None:
        """``fn(step, accuracy, seconds)`` after each evaluation (a benchmark times them; it may stop the run)."""
        self._observers.append(fn)

    def skip_initial(self) -> None:
        """Record the step-0 evaluation as not run (nan), so a run starts training at once."""
        if not self.history:
            self.history.append((0, float("nan")))

    async def evaluate(self, step: int, n: int | None = None) -> float:
        """Held-out greedy accuracy (the task's exact-answer reward) with the generator's current weights, each
        problem played as one episode of the run's environment; recorded against `step`."""
        from forgelab.engines.generator import SamplingConfig

        if self.source is None:
            raise RuntimeError("evaluate: the run has no processes yet (await run.start() or run.spawn() first)")
        greedy = SamplingConfig(temperature=0.0, max_tokens=self.rollout.max_tokens)
        t0 = time.perf_counter()
        async with self.lifecycle.gate.hold():  # its requests first: new rollouts wait until it is scored
            acc = await heldout_accuracy(self.source, self.heldout[: n or len(self.heldout)], self.tokenizer,
                                         greedy, self.reward)
        self.history.append((step, acc))
        seconds = time.perf_counter() - t0
        for fn in list(self._observers):
            fn(step, acc, seconds)
        return acc
