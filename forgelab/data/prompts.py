"""The one place where a problem's prompt is chat-templated: rollouts, vLLM, evaluation and RL all call
`format_prompt`, so that training and evaluation see the same text."""
from __future__ import annotations

__all__ = ["format_prompt"]


def format_prompt(tokenizer, problem_prompt: str) -> str:
    """The chat-templated text of a single user turn, ending with the assistant's header."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem_prompt}], tokenize=False, add_generation_prompt=True
    )
