"""MCP tools for agents: the shipped calculator as a real MCP server, and any MCP server's tools as OpenAI tools.

    server = calculator_server()                  # an mcp 2.3 `MCPServer` (in-process)
    async with McpTools(server) as tools:         # or McpTools(calculator_stdio()): the same server over stdio
        r = await client.chat.completions.create(model=..., messages=messages, tools=tools.openai)
        for call in r.choices[0].message.tool_calls or []:
            messages.append(await tools.call(call))   # {"role": "tool", "tool_call_id": ..., "content": "84"}

    python -m forgelab.envs.mcp_tools             # the calculator over stdio (what `calculator_stdio` starts)

The calculator is `CalculatorToolEnv`'s: `safe_calc` over ``+ - *`` and brackets, and ``"error"`` for an expression
it cannot evaluate (the text `CalculatorToolEnv` answers a malformed call with), so through the door's ``calc``
dialect (`forgelab.serve.tools`) the model sees exactly the tool turns it was trained on. `McpTools` is the
agent-side helper: it lists an MCP server's tools once (`openai`: what ``tools=`` takes) and runs a call the
policy made (`call`), through the real mcp client (`mcp.Client`), in-process or over stdio.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from forgelab.envs.builtin import safe_calc

__all__ = ["McpTools", "calculator", "calculator_server", "calculator_stdio"]


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, * and brackets); "error" when it cannot.

    >>> calculator("(7+5)*3"), calculator("2+")
    ('36', 'error')
    """
    try:
        return str(safe_calc(expression))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return "error"


def calculator_server() -> Any:
    """The calculator as an mcp 2.3 `MCPServer` with one tool, ``calculator(expression: str) -> str``."""
    from mcp.server import MCPServer

    # log_level: MCPServer runs logging.basicConfig at it; at mcp's default (INFO) a process without a root handler
    # (a notebook's kernel) then prints every library's INFO lines, one per HTTP request through the door
    server = MCPServer("forgelab-calculator", instructions="Integer arithmetic: + - * and brackets.",
                       log_level="WARNING")
    # structured_output=False: the result is text (the tool message), and with no output schema the client does
    # not import jsonschema to validate it (2.1 CPU-s: its rfc3987 grammars compile at import)
    server.tool(name="calculator", structured_output=False,
                description="Evaluate an integer arithmetic expression (+, -, * and brackets); returns the result, or "
                            "'error'.")(calculator)
    return server


def calculator_stdio() -> Any:
    """`mcp.StdioServerParameters` that start the calculator server in a subprocess (this interpreter, this
    environment: ``python -m forgelab.envs.mcp_tools``)."""
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=["-m", "forgelab.envs.mcp_tools"], env=dict(os.environ))


class McpTools:
    """An MCP server's tools for an agent: `openai` (the ``tools=`` list) and `call` (run one tool call).

    Args:
        server: an `mcp.server.MCPServer` (in-process), `mcp.StdioServerParameters` (a subprocess over stdio), or
            a URL (streamable HTTP); anything `mcp.Client` takes.
    """

    def __init__(self, server: Any):
        from mcp import Client

        self._client = Client(server)
        self.openai: list[dict[str, Any]] = []
        """The server's tools as OpenAI function tools (filled on entering)."""

    async def __aenter__(self) -> McpTools:
        await self._client.__aenter__()
        listed = await self._client.list_tools()
        self.openai = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": dict(t.input_schema or {"type": "object", "properties": {}})}} for t in listed.tools]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._client.__aexit__(*exc)

    async def call(self, tool_call: Any) -> dict[str, str]:
        """Run one of the policy's tool calls (the SDK's ``message.tool_calls[i]``, or its dict) on the server; the
        ``tool`` message to append to the conversation. A tool error is its text (the policy sees it)."""
        if isinstance(tool_call, Mapping):
            cid, fn = str(tool_call.get("id", "")), tool_call["function"]
            name, raw = fn["name"], fn.get("arguments") or "{}"
        else:
            cid, name, raw = tool_call.id, tool_call.function.name, tool_call.function.arguments or "{}"
        try:
            args = json.loads(raw)
        except ValueError:
            return {"role": "tool", "tool_call_id": cid, "content": f"error: arguments are not JSON: {raw[:80]}"}
        result = await self._client.call_tool(name, args if isinstance(args, dict) else {})
        text = "".join(getattr(c, "text", "") for c in result.content)
        return {"role": "tool", "tool_call_id": cid, "content": text}


if __name__ == "__main__":
    calculator_server().run("stdio")
