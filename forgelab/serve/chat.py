"""Chat messages -> the prompt ids the generator sees, reusing a session's stored ids where the messages continue it.

A chat call's messages *continue* the session's last call when they are that call's messages, then an assistant
message whose content is the text of one of its choices (the one the agent kept), then one or more new
non-assistant messages (tool results, the user's next turn). Its prompt is then built from stored ids, never from
re-tokenized text:

    stored prompt + chosen completion ids                     (exactly what was sampled, eos included if sampled)
    + ids of the template text that closes that assistant turn (only what was not sampled: eos when the turn was
      cut by max_tokens or a stop string, and whatever the template puts after eos)
    + ids of the new messages' rendering and the next assistant header

The template's text of each piece comes from rendering the conversation itself with the run tokenizer's chat
template (prefix differences), so a template that re-renders the past differently (one that strips earlier
reasoning, say) is detected and the call starts a new segment from its full rendering instead.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from forgelab.algos.agent_episodes import Segment

__all__ = ["ChatRenderer", "normalize_messages"]

_MESSAGE_KEYS = {"role", "content", "name"}


def normalize_messages(raw: object) -> list[dict[str, str]]:
    """An OpenAI ``messages`` list as plain ``{"role", "content"[, "name"]}`` dicts; ValueError naming what is not
    supported (tool calls, non-text content parts)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    out: list[dict[str, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        extra = sorted(k for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None)
        if extra:
            raise ValueError(f"messages[{i}] has {', '.join(map(repr, extra))}, which the agent door does not support "
                             "yet (tool calls come with the tool dialects, docs/agents.md)")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content: only text parts are supported, got {str(part)[:80]!r}")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


class ChatRenderer:
    """Prompt ids of chat messages with the run tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.decode([self.eos_id]) if self.eos_id is not None else ""

    def render(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The whole conversation rendered with the assistant header (a new segment's first prompt)."""
        return self.encode(self.render(messages, True))

    def continuation(self, previous: Sequence[Mapping[str, object]] | None, segment: Segment | None,
                     messages: list[dict[str, str]]) -> tuple[list[int], int, str] | None:
        """``(prompt ids, choice continued, role of the new tokens)`` when ``messages`` continue the segment's last
        call (whose messages were ``previous``), else None."""
        if previous is None or segment is None or not segment.tail:
            return None
        j = len(previous)
        if len(messages) < j + 2 or [dict(m) for m in messages[:j]] != [dict(m) for m in previous]:
            return None
        said, new = messages[j], messages[j + 1:]
        if said["role"] != "assistant" or any(m["role"] == "assistant" for m in new):
            return None
        k = next((i for i, c in enumerate(segment.tail) if c.text == said["content"]), None)
        if k is None:
            return None
        before = self.render(messages[:j], True)
        closed = self.render(messages[: j + 1], False)
        full = self.render(messages, True)
        if not (closed.startswith(before + said["content"]) and full.startswith(closed)):
            return None
        closing = closed[len(before) + len(said["content"]):]  # the template text after the assistant's content
        choice = segment.tail[k]
        if self.eos_id is not None and choice.completion_ids[-1:] == [self.eos_id]:
            if not closing.startswith(self.eos_text):
                return None
            closing = closing[len(self.eos_text):]  # the sampled eos is that text: keep its id, not a re-encoding
        delta = self.encode(closing + full[len(closed):])
        roles = list(dict.fromkeys(m["role"] for m in new))
        return segment.ids() + choice.completion_ids + delta, k, "+".join(roles)
