"""OpenAI ``tools`` / ``tool_calls`` <-> a model's tool dialect, as pure functions (docs/agents.md, "Tools").

A tool dialect is how one model writes a tool call in its text and reads a tool's result. The door parses the
sampled text of each choice into OpenAI ``tool_calls`` (`ToolDialect.parse`) and, when the agent sends that
assistant message back with a ``tool`` message after it, renders both back into the text the model saw
(`ToolDialect.render_call`, `ToolDialect.result_message`) so the chat template and stitching work on plain text.
Parse then render gives the sampled text back exactly, so a tool turn continues the session's stored ids.

- ``calc``: the calculator dialect of ``forgelab/assets/tiny-llama-tool`` (`forgelab.envs.CalculatorToolEnv`):
  the model writes ``<calc>12*7</calc>`` and reads a ``tool`` turn ``<result>84</result>``. It knows one tool
  with one string parameter (the MCP calculator's ``calculator(expression)``); the model never sees the tool's
  description (it was trained without one).
- ``hermes``: the chat-template ``<tool_call>`` JSON format of real models (Qwen2.5 / Qwen3, Hermes): the tools are
  listed in the system prompt as Qwen3's template does, a call is ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`` after the content, and a result is a ``tool`` message the chat template renders (Qwen's
  wraps it in ``<tool_response>``).

    >>> calc = DIALECTS["calc"]
    >>> tools = check_tools([{"type": "function", "function": {"name": "calculator", "parameters": {
    ...     "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}], calc)
    >>> calc.parse("<calc>12*7</calc>", tools)
    (None, [ToolCall(name='calculator', arguments='{"expression": "12*7"}', id='')])
    >>> calc.render_call(None, [ToolCall(name="calculator", arguments='{"expression": "12*7"}')], tools)
    '<calc>12*7</calc>'
    >>> calc.result_message("84")
    {'role': 'tool', 'content': '<result>84</result>'}
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DIALECTS", "CalcDialect", "FunctionTool", "HermesDialect", "ToolCall", "ToolDialect", "check_tools",
           "choose_dialect", "tool_calls_key"]


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI carries it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI ``{"type": "function", "function": {...}}`` tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


class ToolDialect(Protocol):
    """How one model writes tool calls and reads results (see the module docstring)."""

    name: str

    def check(self, tools: Sequence[FunctionTool]) -> None:
        """ValueError naming what this dialect cannot express."""
        ...

    def system_text(self, tools: Sequence[FunctionTool]) -> str | None:
        """Text put in the system prompt to show the tools to the model (None: nothing)."""
        ...

    def parse(self, text: str, tools: Sequence[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a sampled text; no call: ``(text, [])``."""
        ...

    def render_call(self, content: str | None, calls: Sequence[ToolCall], tools: Sequence[FunctionTool]) -> str:
        """The text that `parse` reads as ``(content, calls)``."""
        ...

    def result_message(self, content: str) -> dict[str, str]:
        """The chat message a tool's result becomes."""
        ...


_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters"}


def check_tools(raw: object, dialect: ToolDialect | None) -> list[FunctionTool]:
    """The request's ``tools`` as `FunctionTool`s; ValueError naming any feature the door or the dialect does not
    support (non-function tools, ``strict`` schemas, a dialect-specific limit)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    if dialect is None:
        raise ValueError("'tools': this model has no tool dialect (door.tool_dialect is 'none'); set door.tool_dialect "
                         "to 'calc' or 'hermes' (docs/agents.md)")
    out: list[FunctionTool] = []
    for i, t in enumerate(raw):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            kind = t.get("type") if isinstance(t, Mapping) else type(t).__name__
            raise ValueError(f"tools[{i}]: only function tools are supported, got type {kind!r}")
        extra = sorted(set(t) - _TOOL_KEYS)
        f = t["function"]
        extra += sorted(f"function.{k}" for k in set(f) - _FUNCTION_KEYS if not (k == "strict" and not f[k]))
        if extra:
            raise ValueError(f"tools[{i}] has {', '.join(map(repr, extra))}, which the agent door does not support "
                             "(no constrained decoding: 'strict' schemas are not enforced)")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(FunctionTool(name=name, description=str(f.get("description") or ""), parameters=params))
    if len({t.name for t in out}) != len(out):
        raise ValueError("'tools' names a function twice")
    dialect.check(out)
    return out


def tool_calls_key(content: str | None, calls: Sequence[ToolCall]) -> str:
    """A canonical text of an assistant tool-call message (content and each call's name and parsed arguments, ids
    left out): two messages that say the same thing have the same key, however their JSON was spaced."""
    def args(a: str) -> Any:
        try:
            return json.loads(a)
        except ValueError:
            return a
    return json.dumps([content or "", [[c.name, args(c.arguments)] for c in calls]], sort_keys=True)


class CalcDialect:
    """``<calc>EXPR</calc>`` / ``<result>R</result>``: the dialect ``tiny-llama-tool`` learnt (module docstring).

    A text is a call when it is some content (possibly none) then exactly one ``<calc>...</calc>`` that ends it;
    any other text is content (`CalculatorToolEnv` would read a call anywhere; the door returns as a call only what
    renders back to the same text)."""

    name = "calc"
    _CALL = re.compile(r"<calc>(.*?)</calc>\Z", re.DOTALL)

    def check(self, tools: Sequence[FunctionTool]) -> None:
        if len(tools) != 1 or self._param(tools[0]) is None:
            raise ValueError("the 'calc' tool dialect (tiny-llama-tool) expresses exactly one tool with one string "
                             "parameter, e.g. calculator(expression: string); 'tools' has "
                             + ", ".join(f"{t.name}({', '.join((t.parameters.get('properties') or {}))})" for t in tools))

    @staticmethod
    def _param(tool: FunctionTool) -> str | None:
        props = tool.parameters.get("properties") or {}
        if len(props) != 1:
            return None
        (name, schema), = props.items()
        return name if isinstance(schema, Mapping) and schema.get("type", "string") == "string" else None

    def system_text(self, tools: Sequence[FunctionTool]) -> str | None:
        return None

    def parse(self, text: str, tools: Sequence[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
        m = self._CALL.search(text)
        if m is None or "<calc>" in m.group(1) or "<calc>" in text[: m.start()]:
            return text, []
        param = self._param(tools[0]) or "expression"
        call = ToolCall(name=tools[0].name, arguments=json.dumps({param: m.group(1)}))
        return (text[: m.start()] or None), [call]

    def render_call(self, content: str | None, calls: Sequence[ToolCall], tools: Sequence[FunctionTool]) -> str:
        if len(calls) != 1:
            raise ValueError(f"the 'calc' tool dialect makes one call per turn, got {len(calls)} tool_calls")
        param = self._param(tools[0]) or "expression"
        try:
            args = json.loads(calls[0].arguments)
        except ValueError:
            raise ValueError(f"tool_calls[0].function.arguments is not JSON: {calls[0].arguments[:80]!r}") from None
        if not isinstance(args, dict) or not isinstance(args.get(param), str):
            raise ValueError(f"tool_calls[0].function.arguments must be {{\"{param}\": \"...\"}}, got "
                             f"{calls[0].arguments[:80]!r}")
        return (content or "") + f"<calc>{args[param]}</calc>"

    def result_message(self, content: str) -> dict[str, str]:
        return {"role": "tool", "content": f"<result>{content}</result>"}


class HermesDialect:
    """The ``<tool_call>`` JSON dialect of Qwen2.5 / Qwen3 and Hermes models (module docstring). Calls follow the
    content, each ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, joined by ``\\n``.

        >>> h = DIALECTS["hermes"]
        >>> text = 'Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>'
        >>> content, calls = h.parse(text, [])
        >>> content, calls[0].name, json.loads(calls[0].arguments)
        ('Let me add.', 'add', {'a': 1, 'b': 2})
        >>> h.render_call(content, calls, []) == text
        True
    """

    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    def check(self, tools: Sequence[FunctionTool]) -> None:
        return None

    def system_text(self, tools: Sequence[FunctionTool]) -> str | None:
        # Qwen3's chat template's words, so a Qwen3 model sees the tools as it was trained to
        listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

    def parse(self, text: str, tools: Sequence[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
        first = text.find("<tool_call>")
        if first < 0:
            return text, []
        calls: list[ToolCall] = []
        for m in self._CALL.finditer(text, first):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return text, []  # a malformed call is the model's text, not a call
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("arguments", {})
            calls.append(ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[:first].rstrip("\n")
        return (content or None), calls

    def render_call(self, content: str | None, calls: Sequence[ToolCall], tools: Sequence[FunctionTool]) -> str:
        parts = []
        for c in calls:
            try:
                args = json.loads(c.arguments) if c.arguments else {}
            except ValueError:
                raise ValueError(f"tool call {c.name!r}: arguments are not JSON: {c.arguments[:80]!r}") from None
            parts.append("<tool_call>\n" + json.dumps({"name": c.name, "arguments": args}, ensure_ascii=False)
                         + "\n</tool_call>")
        calls_text = "\n".join(parts)
        return f"{content}\n{calls_text}" if content else calls_text

    def result_message(self, content: str) -> dict[str, str]:
        return {"role": "tool", "content": content}


DIALECTS: dict[str, ToolDialect] = {"calc": CalcDialect(), "hermes": HermesDialect()}
"""The tool dialects by name (``door.tool_dialect``); a user's own is one more entry."""


def choose_dialect(name: str, tokenizer: Any) -> ToolDialect | None:
    """``door.tool_dialect``: a name in `DIALECTS`, "none", or "auto": ``hermes`` when the chat template writes
    ``<tool_call>`` (Qwen2.5 / Qwen3, Hermes), else ``calc`` when it renders a ``tool`` role (forgelab's tiny
    models), else none."""
    if name == "none":
        return None
    if name != "auto":
        if name not in DIALECTS:
            raise ValueError(f"door.tool_dialect: unknown dialect {name!r}; choose one of "
                             f"{sorted(DIALECTS) + ['auto', 'none']}")
        return DIALECTS[name]
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "<tool_call>" in template:
        return DIALECTS["hermes"]
    if "'tool'" in template or '"tool"' in template:
        return DIALECTS["calc"]
    return None
