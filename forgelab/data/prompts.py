"""The one place where a problem's prompt is chat-templated: rollouts, vLLM, evaluation and RL all call
`format_prompt`, so that training and evaluation see the same text."""
from __future__ import annotations

__all__ = ["format_prompt", "problem_chat"]


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forgelab.data.tasks import Problem


def format_prompt(tokenizer, problem_prompt) -> str:
    """The chat-templated text of a prompt, ending with the assistant's header: a text prompt is one user turn;
    a list of messages (a chat-format dataset's prompt, system prompt included) is rendered as it is."""
    messages = problem_prompt if isinstance(problem_prompt, (list, tuple)) else [{"role": "user", "content": problem_prompt}]
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def problem_chat(problem: "Problem") -> "str | list[dict[str, str]]":
    """What `format_prompt` renders for a `Problem`: its chat messages (``info["prompt_messages"]``, set for
    chat-format datasets and by a system prompt) or its text."""
    from forgelab.rewards.trl_compat import PROMPT_MESSAGES

    return (problem.info or {}).get(PROMPT_MESSAGES) or problem.prompt
