"""Tinker's REST API over forgelab's primitives: the unmodified ``tinker==0.38.0`` SDK trains and samples on a
run's shared engines.

    server = LoopbackServer("tinker")
    api = await serve_primitives(prims, server)          # prims: a forgelab.experiments.primitives.Primitives
    # elsewhere:  TINKER_BASE_URL=<api.base_url> TINKER_API_KEY=<server.secret> python my_tinker_loop.py

What it really is: an `APIRouter` under ``/api/v1`` on the run's `forgelab.serve.http.LoopbackServer` (loopback,
the run's ``tml-`` key as ``X-API-Key``), mapping the SDK's calls onto `Primitives`: ``create_model`` takes a slot
(`Primitives.create_lora_training_client`), ``forward_backward`` / ``optim_step`` / ``save_weights_for_sampler``
call its `TrainingClient`, ``asample`` calls a `SamplingClient`. Work is asynchronous as in Tinker: a call
answers a future (``{"request_id"}``) at once and runs the primitive as an asyncio task in the server's loop;
``retrieve_future`` waits for it up to `TinkerAPI.poll_s` and answers ``{"type": "try_again"}`` while it runs,
the result when done (``ForwardBackwardOutput`` and ``SampleResponse`` as protobuf, `forgelab.serve.tinker_wire`;
the rest JSON), or ``{"error", "category"}`` (the SDK raises it as ``RequestFailedError``). A model's requests
run one after another in the SDK's ``seq_id`` order, whatever order they arrive in (the SDK sends the chunks of
one ``forward_backward`` in parallel).

Supported: LoRA training clients of the engines' model at the engines' rank (``train_mlp``/``train_attn`` as the
engines' targets; ``seed`` None or the engines' seed: every slot starts from the same adapter), the losses
``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``forward``, ``forward_backward_custom`` (the SDK
runs it client-side as a forward then a weighted ``cross_entropy``), AdamW with per-call hyperparameters,
``save_state`` / ``load_state`` (with or without the optimizer, also into a new client: a
``tinker://<model_id>/weights/<name>`` path), ``save_weights_for_sampler`` (named: a ``tinker://<model_id>/sampler_weights/<name>`` path under the primitives'
root; unnamed: an ephemeral sampler), sampling from the base model or a saved adapter with prompt logprobs, and
the ``RestClient``'s ``list_checkpoints`` / ``delete_checkpoint`` of a training run's checkpoints (plain names
only: nothing outside the root).
Refused with an error naming what is supported: another base model, full fine-tuning, ``train_unembed`` (forgelab's
LoRA cannot target the output projection), another rank, the ``dro``/``gspo``/``stable_reinforce`` losses,
top-k logprobs, images, ``inflight`` samplers, non-Adam optimizers. Sessions whose heartbeats stop for
`TinkerAPI.session_timeout_s` give their slots back (checked whenever a model is created).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from forgelab.algos.primitive_losses import PRIMITIVE_LOSSES
from forgelab.experiments.primitive_types import AdamParams, ModelInput, SamplingParams
from forgelab.serve.tinker_wire import (
    WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response,
)

if TYPE_CHECKING:
    from forgelab.experiments.primitives import Primitives, SamplingClient, TrainingClient
    from forgelab.serve.http import LoopbackServer

__all__ = ["TinkerAPI", "serve_primitives", "TINKER_SDK_VERSION"]

log = logging.getLogger("forgelab.serve.tinker")

TINKER_SDK_VERSION = "0.38.0"
"""The SDK version this server speaks (requirements-tinker.lock pins it)."""

PROTOBUF = "application/x-protobuf"


class UserError(ValueError):
    """A request forgelab refuses (the SDK shows it as a user error)."""


@dataclass
class _Future:
    task: "asyncio.Task[Any]"
    proto: Callable[[Any], bytes] | None = None
    """Encodes the result as protobuf (ForwardBackwardOutput, SampleResponse); None: the result is JSON."""
    answered: float | None = None
    """When its outcome was first sent (kept `TinkerAPI.keep_s` longer for the SDK's retries, then dropped)."""


@dataclass
class _Model:
    """One training client of the SDK: a slot of the engines."""

    model_id: str
    session_id: str
    client: "TrainingClient"
    next_seq: int = 1  # the SDK numbers a model's requests 1, 2, ... (seq_id = request id + 1)
    arrived: set[int] = field(default_factory=set)
    by_seq: dict[int, str] = field(default_factory=dict)  # a retried POST gets the future it already has
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)


@dataclass
class _Sampler:
    sampler_id: str
    client: "SamplingClient"
    model_path: str | None
    model_id: str | None = None
    """The training client that saved it (its adapter is dropped when that client closes); None: made from a path."""


@dataclass
class _Session:
    session_id: str
    last_seen: float
    models: list[str] = field(default_factory=list)


class TinkerAPI:
    """The server side of Tinker's SDK over a `Primitives` (see the module).

    Args:
        primitives: the shared engines' primitives; training clients take their slots.
        poll_s: how long ``retrieve_future`` waits for a pending result before answering ``try_again`` (under
            the SDK's 45 s request timeout).
        session_timeout_s: a session with no heartbeat for this long is closed and its slots freed.
        gap_s: how long a request waits for a missing earlier ``seq_id`` of its model that never arrives.
        keep_s: how long a future's outcome stays retrievable after it was first sent.
    """

    def __init__(self, primitives: "Primitives", *, poll_s: float = 20.0, session_timeout_s: float = 120.0,
                 gap_s: float = 60.0, keep_s: float = 300.0):
        self.primitives = primitives
        self.poll_s, self.session_timeout_s, self.gap_s, self.keep_s = poll_s, session_timeout_s, gap_s, keep_s
        cfg = primitives.engines.config
        self.base_model: str = cfg.model.path
        self.rank: int = cfg.lora.rank
        self.seed: int = cfg.train.seed
        self.targets: tuple[str, ...] = tuple(cfg.lora.targets)
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.futures: dict[str, _Future] = {}
        self._creations: dict[str, dict[str, Any]] = {}  # model id -> the future that creates it
        self._ids = itertools.count(1)
        self.base_url: str | None = None
        """The server's URL once `serve_primitives` started it."""

    # --- the router ------------------------------------------------------------------------------------
    def router(self, server: "LoopbackServer") -> APIRouter:
        """The ``/api/v1`` routes, every one behind the server's key."""
        r = server.authenticated("/api/v1")
        r.add_api_route("/healthz", self.healthz, methods=["GET"])
        r.add_api_route("/get_server_capabilities", self.capabilities, methods=["GET"])
        r.add_api_route("/client/config", self.client_config, methods=["POST"])
        r.add_api_route("/client/dynamic_config", self.dynamic_config, methods=["POST"])
        r.add_api_route("/create_session", self.create_session, methods=["POST"])
        r.add_api_route("/session_heartbeat", self.heartbeat, methods=["POST"])
        r.add_api_route("/sessions/{session_id}/finish", self.finish_session, methods=["POST"])
        r.add_api_route("/telemetry", self.telemetry, methods=["POST"])
        r.add_api_route("/create_model", self.create_model, methods=["POST"])
        r.add_api_route("/get_info", self.get_info, methods=["POST"])
        r.add_api_route("/forward_backward", self.forward_backward, methods=["POST"])
        r.add_api_route("/optim_step", self.optim_step, methods=["POST"])
        r.add_api_route("/save_weights_for_sampler", self.save_weights_for_sampler, methods=["POST"])
        r.add_api_route("/save_weights", self.save_weights, methods=["POST"])
        r.add_api_route("/load_weights", self.load_weights, methods=["POST"])
        r.add_api_route("/create_sampling_session", self.create_sampling_session, methods=["POST"])
        r.add_api_route("/samplers/{sampler_id}", self.get_sampler, methods=["GET"])
        r.add_api_route("/asample", self.asample, methods=["POST"])
        r.add_api_route("/retrieve_future", self.retrieve_future, methods=["POST"])
        r.add_api_route("/training_runs/{run_id}/checkpoints", self.list_checkpoints, methods=["GET"])
        r.add_api_route("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", self.delete_checkpoint,
                        methods=["DELETE"])
        for name in ("create_custom_loss", "retrieve_futures", "unload_model",
                     "join_sampling_session", "save_weights_external", "copy_weights"):
            r.add_api_route(f"/{name}", self._unsupported(name), methods=["POST"])
        return r

    def _unsupported(self, name: str) -> Callable[[], Awaitable[None]]:
        async def refuse() -> None:
            # 400, not 501: the SDK retries 5xx answers for minutes
            raise HTTPException(400, f"forgelab's Tinker server does not implement {name!r}; it serves "
                                     "create_model, forward, forward_backward, optim_step, save_state, load_state, "
                                     "save_weights_for_sampler and sampling (docs/tinker.md)")
        return refuse

    # --- handshake, sessions -------------------------------------------------------------------------
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    async def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.base_model, "max_context_length":
                                      self.primitives.engines.config.model.max_model_len,
                                      "trainable": True, "sampleable": True}]}

    async def client_config(self) -> dict[str, Any]:
        # No token exchange (the run's key is the credential), uncompressed protobuf, per-request futures,
        # custom losses computed client-side (the SDK's forward + weighted cross_entropy).
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False,
                "parallel_fwdbwd_chunks": True}

    async def dynamic_config(self) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def create_session(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        sdk = body.get("sdk_version")
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = _Session(sid, time.monotonic())
        warning = None if sdk == TINKER_SDK_VERSION else (
            f"forgelab's Tinker server speaks tinker=={TINKER_SDK_VERSION}; this client is {sdk}")
        return {"type": "create_session", "session_id": sid, "info_message": None, "warning_message": warning,
                "error_message": None}

    def _session(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise HTTPException(404, f"no session {session_id!r} on this server (it finished or timed out)")
        s.last_seen = time.monotonic()
        return s

    async def heartbeat(self, request: Request) -> dict[str, str]:
        self._session((await request.json()).get("session_id", ""))
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str) -> dict[str, str]:
        await self._close_session(session_id)
        return {}

    async def telemetry(self) -> dict[str, str]:
        return {"status": "accepted"}

    async def _close_session(self, session_id: str) -> None:
        s = self.sessions.pop(session_id, None)
        for model_id in list(s.models) if s else []:
            await self._close_model(s, model_id)

    async def _close_model(self, session: _Session | None, model_id: str) -> None:
        if session is not None and model_id in session.models:
            session.models.remove(model_id)
        m = self.models.pop(model_id, None)
        self._creations.pop(model_id, None)
        for sid in [k for k, v in self.samplers.items() if v.model_id == model_id]:
            del self.samplers[sid]
        if m is not None:
            try:
                await m.client.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the engines may be shutting down
                log.warning("closing %s failed", model_id, exc_info=True)

    async def _reap(self) -> None:
        now = time.monotonic()
        for sid in [s.session_id for s in self.sessions.values() if now - s.last_seen > self.session_timeout_s]:
            log.info("session %s sent no heartbeat for %.0f s: its slots are freed", sid, self.session_timeout_s)
            await self._close_session(sid)

    # --- futures ---------------------------------------------------------------------------------------
    def _submit(self, work: Awaitable[Any], proto: Callable[[Any], bytes] | None = None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
        now = time.monotonic()
        for old in [k for k, f in self.futures.items() if f.answered is not None and now - f.answered > self.keep_s]:
            del self.futures[old]
        rid = f"req-{next(self._ids)}"
        self.futures[rid] = _Future(asyncio.ensure_future(work), proto)
        return {"request_id": rid, **(extra or {})}

    async def retrieve_future(self, request: Request) -> Response:
        body = await request.json()
        rid = body.get("request_id", "")
        fut = self.futures.get(rid)
        if fut is None:
            raise HTTPException(404, f"no future {rid!r} on this server")
        if not fut.task.done():
            await asyncio.wait({fut.task}, timeout=self.poll_s)
        if not fut.task.done():
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        fut.answered = fut.answered or time.monotonic()
        if fut.task.cancelled():
            return JSONResponse({"error": f"request {rid} was cancelled (the server is stopping)", "category": "server"})
        exc = fut.task.exception()
        if exc is not None:
            user = isinstance(exc, (ValueError, LookupError, TypeError, RuntimeError))
            return JSONResponse({"error": str(exc) or type(exc).__name__, "category": "user" if user else "server"})
        result = fut.task.result()
        if fut.proto is not None and PROTOBUF in request.headers.get("accept", ""):
            return Response(fut.proto(result), media_type=PROTOBUF)
        return JSONResponse(result)

    # --- models ------------------------------------------------------------------------------------------
    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.base_model and (
                not os.path.exists(base_model) or os.path.realpath(base_model) != os.path.realpath(self.base_model)):
            raise UserError(f"base_model {base_model!r} is not served here: this server's engines run "
                            f"{self.base_model!r} (pass that path as base_model)")

    def _check_lora(self, lora: dict[str, Any] | None, optimizer: dict[str, Any] | None) -> None:
        if lora is None:
            raise UserError("full fine-tuning is not supported: create a LoRA training client "
                            f"(create_lora_training_client, rank={self.rank})")
        if lora.get("rank") != self.rank:
            raise UserError(f"LoRA rank {lora.get('rank')} is not supported: this server's engines train rank "
                            f"{self.rank} adapters (rank={self.rank})")
        if lora.get("seed") not in (None, self.seed):
            raise UserError(f"LoRA seed {lora.get('seed')} is not supported: every slot starts from the engines' "
                            f"adapter (seed={self.seed}, or leave it None)")
        if lora.get("train_unembed", True):
            raise UserError("train_unembed=True is not supported: forgelab's LoRA cannot adapt the unembedding "
                            "(output projection); pass train_unembed=False")
        attn = {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(self.targets)
        mlp = {"gate_proj", "up_proj", "down_proj"} <= set(self.targets)
        if bool(lora.get("train_attn", True)) != attn or bool(lora.get("train_mlp", True)) != mlp:
            raise UserError(f"train_attn={lora.get('train_attn', True)}, train_mlp={lora.get('train_mlp', True)} "
                            f"is not supported: this server's adapters target {list(self.targets)} "
                            f"(train_attn={attn}, train_mlp={mlp})")
        kind = (optimizer or {}).get("type", "adamw")
        if kind != "adamw":
            raise UserError(f"optimizer {kind!r} is not supported: AdamW only (the default)")

    async def create_model(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        session = self._session(body.get("session_id", ""))

        async def create() -> dict[str, Any]:
            self._check_base(body.get("base_model"))
            self._check_lora(body.get("lora_config"), body.get("optimizer_config"))
            m = await self._new_model(session, body.get("model_seq_id"))
            return {"type": "create_model", "model_id": m.model_id}

        return self._once(f"{session.session_id}:train:{body.get('model_seq_id')}", create)

    def _once(self, model_id: str, create: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
        """A model's creation runs once: a retried POST (the SDK retries one whose answer it lost) gets the
        future of the first."""
        if model_id not in self._creations:
            self._creations[model_id] = self._submit(create())
        return self._creations[model_id]

    async def _new_model(self, session: _Session, model_seq_id: object) -> _Model:
        session.last_seen = time.monotonic()  # it is asking now: never reaped by its own request
        await self._reap()
        # the SDK derives this id itself for a client created from a checkpoint (create_training_client_from_state)
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists already (model_seq_id {model_seq_id} was used)")
        client = await self.primitives.create_lora_training_client(model_id)
        m = self.models[model_id] = _Model(model_id, session.session_id, client)
        session.models.append(model_id)
        return m

    def _model(self, model_id: str) -> _Model:
        m = self.models.get(model_id)
        if m is None:
            raise HTTPException(404, f"no model {model_id!r} on this server (its session finished or timed out)")
        return m

    async def get_info(self, request: Request) -> dict[str, Any]:
        m = self._model((await request.json()).get("model_id", ""))
        return {"type": "get_info", "model_id": m.model_id, "is_lora": True, "lora_rank": self.rank,
                "model_name": self.base_model,
                # the SDK loads the tokenizer with AutoTokenizer.from_pretrained(tokenizer_id): a local directory
                "model_data": {"arch": None, "model_name": self.base_model, "tokenizer_id": self.base_model}}

    def _in_order(self, m: _Model, seq_id: int | None, work: Callable[[], Awaitable[Any]],
                  proto: Callable[[Any], bytes] | None = None) -> dict[str, Any]:
        """Submit ``work`` to run after every earlier ``seq_id`` of ``m`` (None: in arrival order)."""
        if seq_id is not None and seq_id in m.by_seq:
            return {"request_id": m.by_seq[seq_id], "model_id": m.model_id}
        if seq_id is not None:
            m.arrived.add(seq_id)

        async def run() -> Any:
            if seq_id is None:
                return await work()
            async with m.turn:
                while m.next_seq < seq_id:
                    if m.next_seq in m.arrived:
                        await m.turn.wait()
                        continue
                    try:
                        await asyncio.wait_for(m.turn.wait(), self.gap_s)
                    except asyncio.TimeoutError:
                        if m.next_seq not in m.arrived:
                            raise LookupError(f"{m.model_id}: request seq_id {seq_id} waited {self.gap_s:.0f} s for "
                                              f"seq_id {m.next_seq}, which never arrived") from None
            try:
                return await work()
            finally:
                async with m.turn:
                    m.arrived.discard(seq_id)
                    m.next_seq = max(m.next_seq, seq_id + 1)
                    m.turn.notify_all()

        fut = self._submit(run(), proto, {"model_id": m.model_id})
        if seq_id is not None:
            m.by_seq[seq_id] = fut["request_id"]
            for old in [k for k in m.by_seq if k < seq_id - 1024]:  # a retry comes soon or not at all
                del m.by_seq[old]
        return fut

    async def forward_backward(self, request: Request) -> dict[str, Any]:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise HTTPException(415, "compressed forward_backward bodies are not supported (this server's "
                                     "client/config says proto_compress_fwdbwd=false)")
        try:
            model_id, seq_id, data, loss_fn, config, forward_only = decode_forward_backward(await request.body())
        except WireError as e:
            raise HTTPException(400, str(e)) from e
        m = self._model(model_id)

        async def work() -> Any:
            if loss_fn not in PRIMITIVE_LOSSES:
                raise UserError(f"loss_fn {loss_fn!r} is not supported: this server has {sorted(PRIMITIVE_LOSSES)} "
                                "(and forward_backward_custom, which the SDK runs as cross_entropy)")
            if forward_only:
                return await m.client.forward(data, loss_fn, config)
            return await m.client.forward_backward(data, loss_fn, config)

        return self._in_order(m, seq_id or None, work, encode_forward_backward_output)

    async def optim_step(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        m = self._model(body.get("model_id", ""))

        async def work() -> dict[str, Any]:
            adam = body.get("adam_params")
            if adam is None:
                kind = (body.get("optimizer_params") or {}).get("type")
                raise UserError(f"optimizer params of type {kind!r} are not supported: AdamParams only")
            params = AdamParams(**{k: float(v) for k, v in adam.items() if k != "type"})
            out = await m.client.optim_step(params)
            return {"metrics": out.metrics}

        return self._in_order(m, body.get("seq_id"), work)

    # --- samplers ----------------------------------------------------------------------------------------
    _KINDS = {"sampler_weights": "sampler", "weights": "state"}
    """A ``tinker://`` path's kind -> the folder `Primitives` writes it to (``save_weights_for_sampler``: a PEFT
    adapter; ``save_state``: adapter, AdamW state and step)."""

    def tinker_path(self, model_id: str, name: str, kind: str = "sampler_weights") -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def local_path(self, tinker_path: str, kind: str = "sampler_weights") -> str:
        """The directory a ``tinker://<model_id>/<kind>/<name>`` path names, inside the primitives' root
        (`Primitives.path` refuses any part that is not a plain name: no path leaves the root)."""
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] != kind:
            what = "save_weights_for_sampler" if kind == "sampler_weights" else "save_state"
            raise UserError(f"path {tinker_path!r} is not a {kind} checkpoint of this server "
                            f"(tinker://<model_id>/{kind}/<name>, as {what} returns)")
        local = self.primitives.path(parts[0], self._KINDS[kind], parts[2])
        if not os.path.isdir(local):
            raise UserError(f"no checkpoint {tinker_path!r} on this server")
        return local

    # --- checkpoints (the SDK's RestClient) ----------------------------------------------------------
    _TYPES = {"weights": "training", "sampler_weights": "sampler"}
    """A ``tinker://`` path's kind -> the SDK's ``checkpoint_type``."""

    async def list_checkpoints(self, run_id: str) -> dict[str, Any]:
        """``RestClient.list_checkpoints(run_id)``: every ``save_state`` and named ``save_weights_for_sampler``
        checkpoint of the training run (a model id, or any client name under the primitives' root), oldest
        first."""
        try:
            run_dir = self.primitives.path(run_id)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        if not os.path.isdir(run_dir):
            raise HTTPException(404, f"no training run {run_id!r} on this server (nothing under its checkpoint root)")
        found = []
        for kind, folder in self._KINDS.items():
            base = os.path.join(run_dir, folder)
            for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                path = os.path.join(base, name)
                if not os.path.isdir(path):
                    continue
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
                mtime = os.path.getmtime(path)
                found.append((mtime, {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": self._TYPES[kind],
                                      "time": datetime.fromtimestamp(mtime, timezone.utc).isoformat(),
                                      "tinker_path": self.tinker_path(run_id, name, kind), "size_bytes": size}))
        return {"checkpoints": [c for _, c in sorted(found, key=lambda x: x[0])], "cursor": None}

    async def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> Response:
        """``RestClient.delete_checkpoint(run_id, "weights/<name>" | "sampler_weights/<name>")`` (and
        ``delete_checkpoint_from_tinker_path``): removes the checkpoint's directory under the primitives' root.
        A sampler already serving it keeps its loaded copy; a new sampler or ``load_state`` of it is refused."""
        path = f"tinker://{run_id}/{checkpoint_id}"
        kind, _, name = checkpoint_id.partition("/")
        if kind not in self._KINDS:
            raise HTTPException(400, f"checkpoint {checkpoint_id!r} is not one of this server's: weights/<name> "
                                     "(save_state) or sampler_weights/<name> (save_weights_for_sampler)")
        try:
            local = self.primitives.path(run_id, self._KINDS[kind], name)  # plain names only: inside the root
        except ValueError as e:
            raise HTTPException(400, f"checkpoint {path!r}: {e}") from e
        if not os.path.isdir(local):
            raise HTTPException(404, f"no checkpoint {path!r} on this server")
        shutil.rmtree(local)
        log.info("deleted checkpoint %s (%s)", path, local)
        return Response(status_code=204)

    # --- training state -------------------------------------------------------------------------------
    async def save_weights(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        m = self._model(body.get("model_id", ""))

        async def work() -> dict[str, Any]:
            name = body.get("path") or f"state-{body.get('seq_id')}"
            if os.path.exists(self.primitives.path(m.model_id, "state", name)) and not body.get("overwrite"):
                raise UserError(f"checkpoint {self.tinker_path(m.model_id, name, 'weights')!r} exists (pass "
                                "overwrite=True, or another name)")
            await m.client.save_state(name)
            return {"type": "save_weights", "path": self.tinker_path(m.model_id, name, "weights")}

        return self._in_order(m, body.get("seq_id"), work)

    async def load_weights(self, request: Request) -> dict[str, Any]:
        """``load_state`` on a model (``model_id``), or a new model loaded from a checkpoint (``session_id`` and
        ``model_seq_id``: `create_training_client_from_state`)."""
        body = await request.json()
        optimizer = bool(body.get("optimizer"))

        async def load(m: _Model) -> dict[str, Any]:
            await m.client.load_state(self.local_path(body.get("path", ""), "weights"), with_optimizer=optimizer)
            return {"type": "load_weights", "path": body.get("path"), "model_id": m.model_id}

        if body.get("model_id"):
            m = self._model(body["model_id"])
            return self._in_order(m, body.get("seq_id"), lambda: load(m))
        session = self._session(body.get("session_id", ""))

        async def create() -> dict[str, Any]:
            self._check_base(body.get("base_model"))
            kind = (body.get("optimizer_config") or {}).get("type", "adamw")
            if kind != "adamw":
                raise UserError(f"optimizer {kind!r} is not supported: AdamW only (the default)")
            self.local_path(body.get("path", ""), "weights")  # refused before a slot is taken
            m = await self._new_model(session, body.get("model_seq_id"))
            try:
                return await load(m)
            except BaseException:
                await self._close_model(session, m.model_id)
                raise

        return self._once(f"{session.session_id}:train:{body.get('model_seq_id')}", create)

    def _add_sampler(self, client: "SamplingClient", model_path: str | None, model_id: str | None = None) -> str:
        sid = f"sampler{next(self._ids)}"
        self.samplers[sid] = _Sampler(sid, client, model_path, model_id)
        return sid

    async def save_weights_for_sampler(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        m = self._model(body.get("model_id", ""))

        async def work() -> dict[str, Any]:
            if body.get("kind", "snapshot") != "snapshot":
                raise UserError(f"sampler kind {body.get('kind')!r} is not supported: 'snapshot' only")
            name = body.get("path")
            sampler = await m.client.save_weights_for_sampler(name or f"ephemeral-{body.get('seq_id')}")
            if name:
                path = self.tinker_path(m.model_id, name)
                self._add_sampler(sampler, path, m.model_id)
                return {"type": "save_weights_for_sampler", "path": path}
            return {"type": "save_weights_for_sampler",
                    "sampling_session_id": self._add_sampler(sampler, None, m.model_id)}

        return self._in_order(m, body.get("seq_id"), work)

    async def create_sampling_session(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self._session(body.get("session_id", ""))
        return {"type": "create_sampling_session",
                "sampling_session_id": await self._sampler_for(body.get("model_path"), body.get("base_model"))}

    async def _sampler_for(self, model_path: str | None, base_model: str | None) -> str:
        try:
            if model_path:
                local = self.local_path(model_path)
                for s in self.samplers.values():
                    if s.model_path == model_path:
                        return s.sampler_id
                return self._add_sampler(await self.primitives.create_sampling_client(local), model_path)
            self._check_base(base_model)
        except ValueError as e:  # UserError, and Primitives.path's refusal of a name that is not plain
            # a 400, not a 500: the SDK retries 5xx answers for minutes
            raise HTTPException(400, str(e)) from e
        return self._add_sampler(await self.primitives.create_sampling_client(), None)

    async def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        s = self.samplers.get(sampler_id)
        if s is None:
            raise HTTPException(404, f"no sampler {sampler_id!r} on this server")
        return {"sampler_id": sampler_id, "base_model": self.base_model, "model_path": s.model_path}

    async def asample(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        sid = body.get("sampling_session_id") or await self._sampler_for(body.get("model_path"),
                                                                          body.get("base_model"))
        sampler = self.samplers.get(sid)
        if sampler is None:
            raise HTTPException(404, f"no sampling session {sid!r} on this server")
        n = int(body.get("num_samples", 1))
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise HTTPException(400, f"{key} is not supported: sampled tokens' logprobs and prompt_logprobs only")
        for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(key) is not None:
                raise HTTPException(400, f"{key} is not supported: prompt_logprobs=True scores the whole prompt")
        chunks = []
        for c in body.get("prompt", {}).get("chunks", []):
            if c.get("type", "encoded_text") != "encoded_text":
                raise HTTPException(400, f"prompt chunks of type {c.get('type')!r} are not supported: tokens only")
            chunks.append(tuple(int(t) for t in c.get("tokens", [])))
        p = body.get("sampling_params", {})
        if p.get("stop") == []:
            raise HTTPException(400, "stop=[] (no stop, not even eos) is not supported: the model's eos always stops")
        try:
            params = SamplingParams(max_tokens=p.get("max_tokens") or SamplingParams().max_tokens,
                                    temperature=float(p.get("temperature", 1.0)), top_k=int(p.get("top_k", -1)),
                                    top_p=float(p.get("top_p", 1.0)), seed=p.get("seed"), stop=p.get("stop"))
        except (TypeError, ValueError) as e:
            raise HTTPException(400, f"sampling_params {p}: {e}") from e
        ids = [f"{sid}-{body.get('seq_id', 0)}-{i}" for i in range(n)]
        work = sampler.client.sample(ModelInput(tuple(chunks)), n, params,
                                     include_prompt_logprobs=bool(body.get("prompt_logprobs")))
        return self._submit(work, encode_sample_response, {"sample_sequence_ids": ids})

    async def close(self) -> None:
        """Free every model's slot and forget the futures (the server is stopping)."""
        for sid in list(self.sessions):
            await self._close_session(sid)
        for s in list(self.samplers.values()):  # the ones made from a tinker:// path
            await s.client.close()
        self.samplers.clear()
        for f in self.futures.values():
            f.task.cancel()
        self.futures.clear()


async def serve_primitives(primitives: "Primitives", server: "LoopbackServer", **options: Any) -> TinkerAPI:
    """Mount Tinker's API for ``primitives`` on ``server`` and start it; the `TinkerAPI`, whose ``base_url`` the SDK
    takes (``TINKER_BASE_URL``; the key is ``server.secret``). ``options`` go to `TinkerAPI`."""
    api = TinkerAPI(primitives, **options)
    server.mount(api.router(server))
    api.base_url = await server.start()
    return api
