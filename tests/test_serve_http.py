"""The shared loopback HTTP server (`forgelab.serve.http`): key checks, sessions in keys, loopback only, and the
real `openai` SDK seeing a forgelab error as its own error type."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fastapi import Depends

from forgelab.serve.http import LOOPBACK, LoopbackServer, ServerKey


def _serve(body):  # run an async body against a started server with one authenticated route
    async def main() -> None:
        server = LoopbackServer("probe")
        router = server.authenticated("/v1")

        @router.get("/who")
        async def who(key: ServerKey = Depends(server.key)) -> dict[str, str | None]:
            return {"session": key.session}

        server.mount(router)
        await server.start()
        try:
            await body(server)
        finally:
            await server.stop()
        assert not server.started

    asyncio.run(main())


def test_key_and_sessions() -> None:
    async def body(server: LoopbackServer) -> None:
        url = server.base_url
        assert server.secret.startswith("tml-") and url.startswith(f"http://{LOOPBACK}:")
        async with httpx.AsyncClient() as c:
            assert (await c.get(url + "/healthz")).json() == {"status": "ok"}
            missing = await c.get(url + "/v1/who")
            assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
            wrong = await c.get(url + "/v1/who", headers={"Authorization": "Bearer tml-0000"})
            assert wrong.status_code == 401 and "wrong key" in wrong.json()["error"]["message"]
            plain = await c.get(url + "/v1/who", headers={"Authorization": f"Bearer {server.secret}"})
            assert plain.json() == {"session": None}
            dotted = await c.get(url + "/v1/who", headers={"Authorization": f"Bearer {server.secret}.ep7"})
            assert dotted.json() == {"session": "ep7"}
            header = await c.get(url + "/v1/who", headers={"X-API-Key": server.secret, "X-Session-ID": "s2"})
            assert header.json() == {"session": "s2"}
            # a key that only starts with the secret is still wrong
            longer = await c.get(url + "/v1/who", headers={"X-API-Key": server.secret + "0"})
            assert longer.status_code == 401

    _serve(body)


def test_openai_sdk_sees_auth_error() -> None:
    async def body(server: LoopbackServer) -> None:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="tml-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="wrong key"):
            await client.get("/who", cast_to=object)

    _serve(body)


def test_listens_on_loopback_only() -> None:
    import psutil

    async def body(server: LoopbackServer) -> None:
        mine = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == server.port]
        assert mine and {c.laddr.ip for c in mine} == {LOOPBACK}

    _serve(body)
