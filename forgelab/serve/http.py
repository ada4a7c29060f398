"""One loopback HTTP server per run, shared by every API forgelab serves (the OpenAI-compatible agent door and
Tinker's REST primitives are routers mounted on it).

The server runs in the controller's own event loop (a notebook kernel's, a script's `asyncio.run`): its handlers
await the same generator and trainer services as native rollouts, so there is no second engine and no thread
hop. It listens on 127.0.0.1 only, on a port the OS picks unless one is given, and every route except
``/healthz`` needs the run's secret (docs/security.md):

- ``Authorization: Bearer <secret>`` (the OpenAI SDK's ``api_key``), or ``X-API-Key: <secret>`` (the Tinker SDK's);
- a key may carry a session after a dot, ``<secret>.<session>``: `ServerKey.session` (an agent's episode).

The secret starts with ``tml-`` because the Tinker SDK refuses keys that do not; any OpenAI client accepts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("forgelab.serve")

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerKey:
    """What a request's key says: it holds the run's secret, and maybe names a session."""

    session: str | None


def new_secret() -> str:
    """A fresh per-run secret (``tml-`` + 32 hex digits)."""
    return "tml-" + secrets.token_hex(16)


def key_of(request: Request, secret: str) -> ServerKey:
    """Check a request's key against ``secret``; raise 401 naming what to send when it is missing or wrong."""
    given = request.headers.get("x-api-key")
    if given is None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    if not given:
        raise HTTPException(401, "this forgelab server needs the run's key: send 'Authorization: Bearer <key>' "
                                 "(the OpenAI SDK's api_key) or 'X-API-Key: <key>'; the run prints it as "
                                 "run.server.secret")
    base, dot, session = given.partition(".")
    if not hmac.compare_digest(base.encode(), secret.encode()):
        raise HTTPException(401, "wrong key for this forgelab server (each run has its own: run.server.secret)")
    header_session = request.headers.get("x-session-id")
    return ServerKey(session=(session if dot and session else None) or header_session or None)


class _Uvicorn(uvicorn.Server):
    """uvicorn that leaves signal handlers alone: the kernel (or the script) owns SIGINT and SIGTERM, and an
    interrupted notebook cell must not shut the run's server down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LoopbackServer:
    """A FastAPI app served by uvicorn on loopback inside the running event loop.

    Args:
        name: shown in logs and errors (the run's name).
        port: 0 (default) lets the OS pick a free port.
        secret: the key clients must send; a fresh `new_secret()` when None.
    """

    def __init__(self, name: str, *, port: int = 0, secret: str | None = None):
        self.name = name
        self.secret = secret or new_secret()
        self.port = port
        self.app = FastAPI(title=f"forgelab {name}")
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

        @self.app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        @self.app.exception_handler(HTTPException)
        async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
            # The OpenAI shape ({"error": {"message", "type", "code"}}): the openai SDK puts the message in its
            # exception; the Tinker SDK reads the body as text.
            return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                           "code": exc.status_code}},
                                status_code=exc.status_code, headers=exc.headers)

    def authenticated(self, prefix: str = "") -> APIRouter:
        """A router whose every route needs the run's key; a handler gets the `ServerKey` by declaring a
        parameter ``key: ServerKey = Depends(server.key)``."""
        return APIRouter(prefix=prefix, dependencies=[Depends(self.checked_key)])

    def key(self, request: Request) -> ServerKey:
        """The FastAPI dependency that checks a request's key (see the module)."""
        return key_of(request, self.secret)

    async def checked_key(self, request: Request) -> ServerKey:
        """`key` as an async dependency: FastAPI runs a sync dependency in its thread pool, a thread hop per
        request (about a tenth of a millisecond of CPU on the agent door's path, twice per call)."""
        return key_of(request, self.secret)

    def mount(self, router: APIRouter) -> None:
        """Serve ``router``'s routes (call before or after `start`)."""
        self.app.include_router(router)

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
        if not self.started:
            raise RuntimeError(f"the HTTP server of {self.name} is not running: await its start() first")
        return f"http://{LOOPBACK}:{self.port}"

    async def start(self) -> str:
        """Bind 127.0.0.1 (the port chosen now, so `base_url` is known before the first request), serve in the
        running loop, and return the base URL once uvicorn accepts connections."""
        if self.started:
            return self.base_url
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, self.port))
        self.port = int(sock.getsockname()[1])
        self._sock = sock
        # keep-alive 75 s (uvicorn's default is 5 s): a client pooling connections (the agent runner, keep-alive
        # 30 s) must not reuse one the server is closing at that moment ("Server disconnected", a failed session)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=75)
        server = _Uvicorn(config)
        self._server = server
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                            name=f"forgelab-http-{self.name}")
        while not server.started:  # uvicorn sets it once the socket accepts; a failed start ends the task
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the HTTP server of {self.name} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("%s serves on %s", self.name, self.base_url)
        return self.base_url

    async def stop(self) -> None:
        """Stop accepting, let running requests end (uvicorn's graceful shutdown), close the socket."""
        task, server = self._task, self._server
        self._task = self._server = None
        if task is None or server is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(task, timeout=30)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
