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

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forgelab.algos.agent_episodes import Segment
from forgelab.serve.tools import FunctionTool, ToolCall, ToolDialect, tool_calls_key

__all__ = ["ChatRenderer", "normalize_messages"]

_MESSAGE_KEYS = {"role", "content", "name"}
_TOOL_KEY = "tool_calls"
"""In a normalized assistant message: `tool_calls_key` of its content and calls (what continuation matches on)."""


def _calls(i: int, raw: object) -> list[ToolCall]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"messages[{i}].tool_calls must be a non-empty list")
    out = []
    for j, c in enumerate(raw):
        f = c.get("function") if isinstance(c, Mapping) else None
        if not (isinstance(f, Mapping) and isinstance(f.get("name"), str) and c.get("type", "function") == "function"):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\", \"arguments\"}}")
        args = f.get("arguments") or "{}"
        out.append(ToolCall(name=f["name"], arguments=args if isinstance(args, str) else json.dumps(args),
                            id=str(c.get("id") or "")))
    return out


def normalize_messages(raw: object, dialect: ToolDialect | None = None,
                       tools: Sequence[FunctionTool] = ()) -> list[dict[str, str]]:
    """An OpenAI ``messages`` list as plain ``{"role", "content"[, "name"]}`` dicts; ValueError naming what is not
    supported (non-text content parts; tool calls without ``tools``).

    With ``tools`` and their ``dialect`` (`forgelab.serve.tools`): an assistant message's ``tool_calls`` become the
    dialect's text (and the message keeps `tool_calls_key` under ``"tool_calls"`` for continuation), a ``tool``
    message its result text, and the dialect's tool listing is put in the system prompt."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    out: list[dict[str, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        allowed = _MESSAGE_KEYS | ({"tool_calls"} if m["role"] == "assistant" else set()) \
            | ({"tool_call_id"} if m["role"] == "tool" else set())
        extra = sorted(k for k, v in m.items() if k not in allowed and v is not None)
        if extra:
            raise ValueError(f"messages[{i}] has {', '.join(map(repr, extra))}, which the agent door does not "
                             "support (docs/agents.md)")
        if m.get("tool_calls") is not None and (dialect is None or not tools):
            raise ValueError(f"messages[{i}] has 'tool_calls': send the request's 'tools' too (the door renders "
                             "calls in the model's tool dialect, door.tool_dialect)")
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
        if dialect is not None and m.get("tool_calls") is not None:
            calls = _calls(i, m["tool_calls"])
            msg["content"] = dialect.render_call(content or None, calls, tools)
            msg[_TOOL_KEY] = tool_calls_key(content or None, calls)
        elif dialect is not None and tools and m["role"] == "tool":
            msg = dialect.result_message(content)
        out.append(msg)
    listing = dialect.system_text(tools) if dialect is not None and tools else None
    if listing is not None:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _same(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    """Two normalized messages say the same (a tool-call message: the same calls, however they were spelled)."""
    if _TOOL_KEY in a or _TOOL_KEY in b:
        return a.get("role") == b.get("role") and a.get(_TOOL_KEY) == b.get(_TOOL_KEY)
    return dict(a) == dict(b)


class ChatRenderer:
    """Prompt ids of chat messages with the run tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.decode([self.eos_id]) if self.eos_id is not None else ""

    def render(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        plain = [{k: v for k, v in m.items() if k != _TOOL_KEY} for m in messages]
        return str(self.tokenizer.apply_chat_template(plain, tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The whole conversation rendered with the assistant header (a new segment's first prompt)."""
        return self.encode(self.render(messages, True))

    def continuation(self, previous: Sequence[Mapping[str, object]] | None, segment: Segment | None,
                     messages: list[dict[str, str]], said_by: Callable[[str], str] | None = None,
                     ) -> tuple[list[int], int, str] | None:
        """``(prompt ids, choice continued, role of the new tokens)`` when ``messages`` continue the segment's last
        call (whose messages were ``previous``), else None. ``said_by(text)``: the `tool_calls_key` of a sampled
        text (the request's tool dialect), so an assistant tool-call message continues the choice whose text
        parses to the same calls; its sampled text replaces the message's rendering in ``messages`` (in place)."""
        if previous is None or segment is None or not segment.tail:
            return None
        j = len(previous)
        if len(messages) < j + 2 or not all(_same(a, b) for a, b in zip(messages[:j], previous)):
            return None
        messages[:j] = [dict(m) for m in previous]  # what the stored ids were rendered from
        said, new = messages[j], messages[j + 1:]
        if said["role"] != "assistant" or any(m["role"] == "assistant" for m in new):
            return None
        k = next((i for i, c in enumerate(segment.tail) if c.text == said["content"]), None)
        if k is None and _TOOL_KEY in said and said_by is not None:
            k = next((i for i, c in enumerate(segment.tail) if said_by(c.text) == said[_TOOL_KEY]), None)
            if k is not None:
                said = messages[j] = {**said, "content": segment.tail[k].text}
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
