"""The agent door: an OpenAI-compatible API over the run's generator service (docs/agents.md).

    client = openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=f"{run.door_key}.{session}")
    r = await client.chat.completions.create(model=run.config.name, messages=[...], seed=7, logprobs=True)
    r.choices[0].token_ids, r.prompt_token_ids          # vLLM's extras: the exact ids (model_extra in the SDK)

Routes (all on the run's `forgelab.serve.http.LoopbackServer`, all needing the run's key):

- ``GET /v1/models``; ``POST /v1/chat/completions`` (``stream`` too); ``POST /v1/completions`` (text or token-id
  prompts, ``echo`` with prompt logprobs);
- ``POST /v1/forgelab/sessions/{id}/reward`` ``{"reward": r, "group": key, "choice": k}`` (or ``"target"``, scored
  by ``door.rewards`` over the final transcript): close the session;
  ``GET /v1/forgelab/sessions/{id}/episodes``: the episodes it would close with now; ``GET /v1/forgelab/stats``.

Every call goes through the run's generator service with a typed `GenerateRequest` (the same admission, replica
choice and policy versions as native rollouts: no second engine). A call whose key names a session
(``<key>.<session>`` or ``X-Session-ID``) is recorded (`forgelab.controller.agent_sessions`); one without a
session is served and not recorded (evaluations). A parameter the door does not implement is a 400 naming it.
Streaming sends the finished completion as one chunk per token (the engine returns whole completions), so a
streamed call returns exactly the tokens of the same call unstreamed; with ``tools`` a tool-call choice is streamed
as OpenAI's ``tool_calls`` deltas. A client that disconnects mid-generation has its samples aborted in the engines
(`Generators.abort` with the call's ``abort_key``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from forgelab.algos.agent_episodes import call_of
from forgelab.controller.agent_sessions import AgentSessions, DoorBusy, DoorRefused, UnknownSession
from forgelab.generation import GenerateRequest, Generators
from forgelab.serve.chat import ChatRenderer, normalize_messages
from forgelab.serve.http import LoopbackServer, ServerKey
from forgelab.serve.sampling import DoorSampling
from forgelab.serve.tools import FunctionTool, ToolDialect, check_tools, tool_calls_key
from forgelab.types import Completion

__all__ = ["OpenAIDoor"]

log = logging.getLogger("forgelab.serve.openai_api")

_COMMON = {"model", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "stream", "stream_options", "user",
           "logprobs", "min_tokens"}
CHAT_PARAMS = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "return_token_ids", "tools",
                                   "tool_choice", "parallel_tool_calls"})
COMPLETION_PARAMS = frozenset(_COMMON | {"prompt", "echo", "return_token_ids"})


class ClientGone(Exception):
    """The client disconnected while its call was generating."""


async def _disconnected(request: Request) -> None:
    """Return once the client has gone: after the body was read, the ASGI server's next message is
    ``http.disconnect`` (uvicorn sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _bad(message: str) -> HTTPException:
    return HTTPException(400, message)


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


class OpenAIDoor:
    """The OpenAI-compatible router over a run's generator service and its agent sessions.

    Args:
        server: the run's loopback server (its key check; `router` is mounted on it).
        generators: the run's generator service (typed `generate`).
        tokenizer: the run's tokenizer (chat template, decoding).
        sessions: the door's `AgentSessions` (recording, admission, rewards).
        model_name: the id `GET /v1/models` lists; requests must name it.
        max_model_len: the generator's context length (prompt + max_tokens).
        max_n: the largest ``n``; max_concurrent_calls: calls generating at once (beyond: 429).
        retry_after_s: a 429's Retry-After; lora_slot: serve this LoRA slot (shared engines), None: the run's own.
        tool_dialect: how the model writes tool calls (`forgelab.serve.tools`); None: ``tools`` are refused.
    """

    def __init__(self, server: LoopbackServer, generators: Generators, tokenizer: Any, sessions: AgentSessions, *,
                 model_name: str, max_model_len: int, max_n: int = 16, max_concurrent_calls: int = 1024,
                 retry_after_s: float = 1.0, lora_slot: str | None = None, tool_dialect: ToolDialect | None = None):
        self.server, self.generators, self.tokenizer, self.sessions = server, generators, tokenizer, sessions
        self.renderer = ChatRenderer(tokenizer)
        self.model_name, self.max_model_len, self.max_n = model_name, max_model_len, max_n
        self.max_concurrent_calls, self.retry_after_s, self.lora_slot = max_concurrent_calls, retry_after_s, lora_slot
        self.tool_dialect = tool_dialect
        self.in_flight = 0
        self.disconnects = 0
        self.aborted_requests = 0
        """Samples the engines aborted because their client disconnected (`Generators.abort`)."""
        self.closed = False

    # -- the router -------------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        r = self.server.authenticated("/v1")
        r.add_api_route("/models", self.models, methods=["GET"])
        r.add_api_route("/chat/completions", self.chat, methods=["POST"])
        r.add_api_route("/completions", self.completions, methods=["POST"])
        r.add_api_route("/forgelab/sessions/{session_id}/reward", self.reward, methods=["POST"])
        r.add_api_route("/forgelab/sessions/{session_id}/episodes", self.episodes, methods=["GET"])
        r.add_api_route("/forgelab/stats", self.stats, methods=["GET"])
        return r

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "forgelab", "max_model_len": self.max_model_len}]}

    async def stats(self) -> dict[str, Any]:
        return {**self.sessions.counters(), "agent/in_flight_calls": self.in_flight,
                "agent/disconnects": self.disconnects, "agent/aborted_requests": self.aborted_requests}

    async def reward(self, session_id: str, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        unknown = sorted(set(body) - {"reward", "target", "group", "choice", "parts"})
        if unknown:
            raise _bad(f"unsupported field(s) {', '.join(map(repr, unknown))} in a reward: send reward (or target), "
                       "and optionally group, choice and parts")
        reward, target = body.get("reward"), body.get("target")
        if (reward is None) == (target is None):
            raise _bad("send exactly one of 'reward' (a number) and 'target' (a string the door's reward functions, "
                       "door.rewards, score the session's final transcript against)")
        if target is not None and (not isinstance(target, str) or body.get("parts") is not None):
            raise _bad(f"'target' must be a string (and comes without 'parts': the reward functions give them), "
                       f"got {target!r}")
        if target is None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward):
            raise _bad(f"'reward' must be a number, got {reward!r}")
        group = body.get("group")
        if group is not None and not isinstance(group, str):
            raise _bad(f"'group' must be a string (the key of the sessions advantages are normalised over), got {group!r}")
        choice = _int(body, "choice", 0, 0, 1 << 20) or 0
        parts = body.get("parts")
        if parts is not None and not (isinstance(parts, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts.values())):
            raise _bad("'parts' must map reward names to numbers")
        dropped = None
        try:
            if target is not None:
                ids, scored, dropped = await self.sessions.reward_transcript(session_id, target, group, choice)
                reward = scored
            else:
                ids = await self.sessions.reward(session_id, float(reward), group, choice, parts)
        except UnknownSession:
            raise HTTPException(404, f"no open session {session_id!r} (it was rewarded already, expired after "
                                     "door.idle_timeout_s, or never made a call)") from None
        except DoorRefused as e:
            raise _bad(str(e)) from None
        return {"session": session_id, "episodes": ids, "reward": reward, **({"dropped": dropped} if dropped else {})}

    async def episodes(self, session_id: str, choice: int = 0) -> dict[str, Any]:
        try:
            eps = self.sessions.export(session_id, choice)
        except UnknownSession:
            raise HTTPException(404, f"no open session {session_id!r}") from None
        except ValueError as e:
            raise _bad(str(e)) from None
        return {"session": session_id, "episodes": [
            {"prompt_ids": ep.prompt_ids, "completion_ids": ep.completion_ids, "loss_mask": ep.loss_mask,
             "generator_logprobs": ep.generator_logprobs, "policy_version": ep.policy_version,
             "turns": ep.info.get("turns"), "calls": ep.info.get("calls")} for ep in eps]}

    # -- requests -----------------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def _check(self, body: Mapping[str, Any], allowed: frozenset[str], route: str) -> None:
        unknown = sorted(k for k, v in body.items() if k not in allowed and v is not None)
        if unknown:
            raise _bad(f"unsupported parameter(s) {', '.join(map(repr, unknown))} for {route}: the agent door does "
                       f"not implement them (docs/agents.md lists what it does); remove them")
        if body.get("model") != self.model_name:
            raise HTTPException(404, f"model {body.get('model')!r} is not served here; this run serves "
                                     f"{self.model_name!r} (GET /v1/models)")
        if self.closed:
            raise HTTPException(503, "the run has stopped: its agent door takes no more requests")

    def _sampling(self, body: Mapping[str, Any], prompt_len: int, default_max: int | None,
                  top: int, echo: bool) -> DoorSampling:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise _bad(f"the prompt has {prompt_len} tokens, which leaves no room in the context length "
                       f"{self.max_model_len}; shorten it")
        max_tokens = _int(body, "max_completion_tokens", None, 1, 1 << 30)
        max_tokens = _int(body, "max_tokens", max_tokens, 1, 1 << 30)
        max_tokens = max_tokens if max_tokens is not None else min(default_max or room, room)
        if prompt_len + max_tokens > self.max_model_len:
            raise _bad(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: more than the context "
                       f"length {self.max_model_len}; lower max_tokens to at most {room}")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
            raise _bad(f"'stop' must be a string or a list of at most 4 non-empty strings, got {stop!r}")
        min_tokens = _int(body, "min_tokens", 0, 0, max_tokens) or 0
        return DoorSampling(temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_float(body, "top_p", 1.0, 1e-9, 1.0), max_tokens=max_tokens, stop=stop or None,
                            top_logprobs=top, prompt_logprobs=echo, min_tokens=min_tokens)

    def _n(self, body: Mapping[str, Any]) -> int:
        return _int(body, "n", 1, 1, self.max_n) or 1

    async def _generate(self, prompts: list[list[int]], n: int, sampling: DoorSampling, seed: int | None,
                        request: Request | None = None) -> list[list[Completion]]:
        """The generator's completions; `ClientGone` if ``request``'s client disconnects first: the door stops
        waiting, and the engines abort the call's unfinished samples (`Generators.abort` with the call's key)."""
        if self.in_flight >= self.max_concurrent_calls:
            raise HTTPException(429, f"the agent door has {self.in_flight} calls generating "
                                     "(door.max_concurrent_calls); retry after a moment",
                                headers={"Retry-After": f"{self.retry_after_s:g}"})
        seeds = [[(seed + g) & 0x7FFFFFFF for g in range(n)] for _ in prompts] if seed is not None else None
        key = "door-" + secrets.token_hex(8) if request is not None else None
        self.in_flight += 1
        call = asyncio.ensure_future(self.generators.generate(GenerateRequest(
            prompts_P=prompts, n=n, sampling=sampling, seeds_P_G=seeds, lora_slot=self.lora_slot, abort_key=key)))
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            await asyncio.wait({call} | ({gone} if gone is not None else set()), return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                self.disconnects += 1
                call.cancel()
                if key is not None:
                    await self._abort(key)
                raise ClientGone()
            return call.result()
        except ValueError as e:
            raise _bad(str(e)) from None
        finally:
            self.in_flight -= 1
            if gone is not None:
                gone.cancel()
            if not call.done():
                call.cancel()

    async def _abort(self, key: str) -> None:
        """Abort a disconnected call's samples in the engines (never raises: the client is gone anyway)."""
        try:
            self.aborted_requests += sum(await self.generators.abort(key))
        except Exception:
            log.exception("forgelab: the agent door could not abort a disconnected call's requests (%s)", key)

    async def _served(self, key: ServerKey, prompt: list[int], n: int, sampling: DoorSampling, seed: int | None,
                      messages: list[dict[str, str]] | None, request: Request,
                      tools: Sequence[FunctionTool] = ()) -> tuple[list[int], list[Completion]]:
        """Generate one prompt's ``n`` completions, recorded in the key's session if it names one. ``messages``:
        a chat call (its prompt may be rebuilt from the session's stored ids)."""
        if key.session is None:
            return prompt, (await self._generate([prompt], n, sampling, seed, request))[0]
        try:
            s = self.sessions.session(key.session)
        except DoorBusy as e:
            raise HTTPException(429, str(e), headers={"Retry-After": f"{e.retry_after_s:g}"}) from None
        try:
            async with s.lock:
                dialect = self.tool_dialect if tools else None
                said_by = (lambda text: tool_calls_key(*dialect.parse(text, tools))) if dialect is not None else None
                cont = (self.renderer.continuation(s.messages, s.current, messages, said_by)
                        if messages is not None else None)
                ids, prefer, role = cont if cont is not None else (prompt, None, "user" if messages else "env")
                if len(ids) + sampling.max_tokens > self.max_model_len:
                    raise _bad(f"this session's conversation is {len(ids)} tokens and max_tokens is "
                               f"{sampling.max_tokens}: more than the context length {self.max_model_len}")
                k = await self.sessions.plan(s, ids, prefer)
                try:
                    comps = (await self._generate([ids], n, sampling, seed, request))[0]
                except BaseException:
                    await self.sessions.abandon(s)
                    raise
                self.sessions.record(s, k, call_of(ids, comps), role=role, messages=messages)
                return ids, comps
        except ClientGone:
            self.sessions.disconnected(s)
            raise
        except DoorBusy as e:
            raise HTTPException(429, str(e), headers={"Retry-After": f"{e.retry_after_s:g}"}) from None
        except DoorRefused as e:
            raise _bad(str(e)) from None

    # -- /v1/chat/completions -------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Any:
        key = self.server.key(request)
        body = await self._body(request)
        self._check(body, CHAT_PARAMS, "/v1/chat/completions")
        try:
            tools, parse_calls = self._tools(body)
            messages = normalize_messages(body.get("messages"), self.tool_dialect if tools else None, tools)
            prompt = self.renderer.prompt_ids(messages)
        except ValueError as e:
            raise _bad(str(e)) from None
        except Exception as e:  # the chat template refused them (an unknown role, say)
            raise _bad(f"the chat template cannot render these messages: {e}") from None
        want_lp = body.get("logprobs")
        if want_lp is not None and not isinstance(want_lp, bool):
            raise _bad(f"'logprobs' must be true or false for chat completions, got {want_lp!r}")
        top = _int(body, "top_logprobs", 0, 0, 20) or 0
        if top and not want_lp:
            raise _bad("'top_logprobs' needs 'logprobs': true")
        n, seed = self._n(body), _int(body, "seed", None, -(1 << 63), (1 << 63) - 1)
        sampling = self._sampling(body, len(prompt), None, top, False)
        try:
            ids, comps = await self._served(key, prompt, n, sampling, seed, messages, request, tools)
        except ClientGone:
            raise HTTPException(499, "the client disconnected while its call was generating") from None
        rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        usage = self._usage(len(ids), comps)
        if body.get("stream"):
            return self._stream(self._chat_chunks(rid, created, comps, bool(want_lp), usage, body,
                                                  tools if parse_calls else ()))
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": g, **self._message(c, tools if parse_calls else ()),
                             "logprobs": {"content": self._lp_entries(c, range(len(c.completion_ids)))} if want_lp else None,
                             "token_ids": c.completion_ids} for g, c in enumerate(comps)],
                "usage": usage, "prompt_token_ids": ids}

    def _tools(self, body: Mapping[str, Any]) -> tuple[list[FunctionTool], bool]:
        """The request's tools (`check_tools`) and whether the answer's text is parsed for calls (``tool_choice``
        "auto", the default, or "none"); ValueError naming an unsupported choice."""
        raw, choice = body.get("tools"), body.get("tool_choice")
        if raw is None:
            if choice is not None:
                raise ValueError("'tool_choice' needs 'tools'")
            return [], False
        if choice not in (None, "auto", "none"):
            raise ValueError(f"'tool_choice' {choice!r} is not supported: the door does not constrain decoding, so it "
                             "takes only \"auto\" (the default) or \"none\"")
        if body.get("parallel_tool_calls") is False:
            raise ValueError("'parallel_tool_calls': false is not supported (the dialect decides how many calls a "
                             "turn makes); leave it out")
        return check_tools(raw, self.tool_dialect), choice != "none"

    def _calls(self, c: Completion, tools: Sequence[FunctionTool]) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a choice: the dialect's calls in its text, OpenAI-shaped (none without
        ``tools``)."""
        content, calls = (self.tool_dialect.parse(c.text, tools) if tools and self.tool_dialect is not None
                          else (c.text, []))
        return content, [{"id": "call_" + secrets.token_hex(8), "type": "function",
                          "function": {"name": t.name, "arguments": t.arguments}} for t in calls]

    def _message(self, c: Completion, tools: Sequence[FunctionTool]) -> dict[str, Any]:
        """A choice's ``message`` and ``finish_reason``: with ``tools``, the dialect's calls in the text become
        ``tool_calls`` (finish_reason "tool_calls")."""
        content, calls = self._calls(c, tools)
        if not calls:
            return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
        return {"message": {"role": "assistant", "content": content, "tool_calls": calls}, "finish_reason": "tool_calls"}

    def _usage(self, prompt_len: int, comps: Sequence[Completion], prompts: int = 1) -> dict[str, int]:
        done = sum(len(c.completion_ids) for c in comps)
        return {"prompt_tokens": prompt_len * prompts, "completion_tokens": done,
                "total_tokens": prompt_len * prompts + done}

    def _token(self, t: int) -> str:
        return str(self.tokenizer.decode([t]))

    def _lp_entries(self, c: Completion, positions: Sequence[int]) -> list[dict[str, Any]]:
        out = []
        for i in positions:
            tok = self._token(c.completion_ids[i])
            top = (c.top_logprobs or [])[i] if c.top_logprobs else {}
            out.append({"token": tok, "logprob": c.logprobs[i], "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": self._token(t), "logprob": lp, "bytes": list(self._token(t).encode())}
                                         for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]})
        return out

    def _pieces(self, c: Completion) -> list[str]:
        """The completion's text cut at token boundaries (incremental decoding), one piece per token, summing to
        exactly ``c.text`` (a stop string cut from the text is cut from the pieces)."""
        pieces, prev = [], ""
        for i in range(len(c.completion_ids)):
            cur = str(self.tokenizer.decode(c.completion_ids[: i + 1], skip_special_tokens=True))
            if cur.startswith(prev):
                pieces.append(cur[len(prev):])
                prev = cur
            else:  # a multi-byte character still incomplete: it comes with a later token
                pieces.append("")
        if "".join(pieces) == c.text:
            return pieces
        if prev.startswith(c.text):  # a stop string was cut from the text
            out, left = [], len(c.text)
            for p in pieces:
                out.append(p[:left])
                left -= len(out[-1])
            return out
        return [c.text] + [""] * (len(pieces) - 1) if pieces else [c.text]

    async def _chat_chunks(self, rid: str, created: int, comps: list[Completion], want_lp: bool,
                           usage: dict[str, int], body: Mapping[str, Any],
                           tools: Sequence[FunctionTool] = ()) -> AsyncIterator[dict[str, Any]]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        for g, c in enumerate(comps):
            yield {**head, "choices": [{"index": g, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None, "logprobs": None}]}
            content, calls = self._calls(c, tools)
            if calls:  # a tool-call turn: its content, then each call as OpenAI streams one (header, then arguments)
                everything = range(len(c.completion_ids))
                yield {**head, "choices": [{"index": g, "delta": {"content": content} if content else {},
                                            "finish_reason": None, "token_ids": c.completion_ids,
                                            "logprobs": {"content": self._lp_entries(c, everything)} if want_lp else None}]}
                for j, call in enumerate(calls):
                    fn = call["function"]
                    yield {**head, "choices": [{"index": g, "finish_reason": None, "logprobs": None, "delta": {
                        "tool_calls": [{"index": j, "id": call["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]}}]}
                    yield {**head, "choices": [{"index": g, "finish_reason": None, "logprobs": None, "delta": {
                        "tool_calls": [{"index": j, "function": {"arguments": fn["arguments"]}}]}}]}
                yield {**head, "choices": [{"index": g, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}]}
                continue
            for i, piece in enumerate(self._pieces(c)):
                yield {**head, "choices": [{"index": g, "delta": {"content": piece}, "finish_reason": None,
                                            "logprobs": {"content": self._lp_entries(c, [i])} if want_lp else None,
                                            "token_ids": [c.completion_ids[i]]}]}
            yield {**head, "choices": [{"index": g, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**head, "choices": [], "usage": usage}

    def _stream(self, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def sse() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Any:
        key = self.server.key(request)
        body = await self._body(request)
        self._check(body, COMPLETION_PARAMS, "/v1/completions")
        raw = body.get("prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not (isinstance(raw, list) and raw and all(
                isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                          for t in p)) for p in raw)):
            raise _bad("'prompt' must be a string, a list of token ids, or a list of either (non-empty)")
        prompts = [self.renderer.encode(p) if isinstance(p, str) else list(p) for p in raw]
        if any(not p for p in prompts):
            raise _bad("a prompt encodes to no token; give text or token ids")
        if key.session is not None and len(prompts) > 1:
            raise _bad(f"a call in session {key.session!r} takes one prompt ({len(prompts)} given): sessions record "
                       "one conversation")
        echo = bool(body.get("echo"))
        top = _int(body, "logprobs", None, 0, 20)
        n, seed = self._n(body), _int(body, "seed", None, -(1 << 63), (1 << 63) - 1)
        longest = max(len(p) for p in prompts)
        sampling = self._sampling(body, longest, 16, top or 0, echo)
        try:
            if key.session is not None:
                ids, comps = await self._served(key, prompts[0], n, sampling, seed, None, request)
                groups = [comps]
                prompts = [ids]
            else:
                groups = await self._generate(prompts, n, sampling, seed, request)
        except ClientGone:
            raise HTTPException(499, "the client disconnected while its call was generating") from None
        rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        flat = [(p, c) for p, comps in zip(prompts, groups) for c in comps]
        usage = {"prompt_tokens": sum(len(p) for p in prompts) * n,
                 "completion_tokens": sum(len(c.completion_ids) for _, c in flat)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        texts = [(raw[i] if isinstance(raw[i], str) else str(self.tokenizer.decode(prompts[i]))) for i in range(len(prompts))]
        choices = []
        for j, (p, c) in enumerate(flat):
            prompt_text = texts[j // n] if echo else ""
            choices.append({"index": j, "text": prompt_text + c.text, "finish_reason": c.finish_reason,
                            "logprobs": self._legacy_logprobs(p, c, echo, top) if top is not None else None,
                            "token_ids": c.completion_ids, "prompt_token_ids": p})
        if body.get("stream"):
            return self._stream(self._completion_chunks(rid, created, choices, usage, body))
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage}

    def _legacy_logprobs(self, prompt: list[int], c: Completion, echo: bool, top: int | None) -> dict[str, Any]:
        """The completions API's ``logprobs`` object; with ``echo`` the prompt's tokens come first (the first has
        logprob null, the others their logprob under the policy and, as for sampled tokens, the ``logprobs`` most
        likely tokens at their position: lm-eval's log-likelihood requests read them to tell a greedy continuation)."""
        ids = (prompt if echo else []) + c.completion_ids
        lps: list[float | None] = (list(c.prompt_logprobs or [None] * len(prompt)) if echo else []) + list(c.logprobs)
        tops: list[dict[str, float] | None] = []
        if echo:
            given = c.prompt_top_logprobs or [None] * len(prompt)
            for t, alts, lp in zip(prompt, given, lps):
                tops.append(None if lp is None else {self._token(a): v for a, v in {**(alts or {}), t: lp}.items()})
        for i, t in enumerate(c.completion_ids):
            alts = (c.top_logprobs[i] if c.top_logprobs else None) or {t: c.logprobs[i]}
            tops.append({self._token(a): lp for a, lp in alts.items()})
        tokens = [self._token(t) for t in ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def _completion_chunks(self, rid: str, created: int, choices: list[dict[str, Any]], usage: dict[str, int],
                                 body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        for ch in choices:
            yield {**head, "choices": [{**ch, "finish_reason": ch["finish_reason"]}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**head, "choices": [], "usage": usage}
