"""Acquires that wait by ticket (``wait``: a long poll), in-process over a pool on the
fake provider, and through the SDK against a real uvicorn server: a waiting acquire
holds no request open, and one nobody asks for again is given up."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import sandman
from sandman.client import remote
from sandman.pool import Pool, PoolConfig
from sandman.server import create_app, service_of
from sandman.server.tickets import Tickets
from sandman.testing import FakeProvider
from tests.server.conftest import AUTH_A, AUTH_B, KEY_A, serve, settings
from tests.support import eventually

pytestmark = pytest.mark.anyio


async def _session(api: httpx.AsyncClient) -> str:
    response = await api.post("/v1/sessions")
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def _acquire(api: httpx.AsyncClient, session: str, **extra: Any) -> httpx.Response:
    body = {"spec": {"image": "task"}, "session": session, **extra}
    return await api.post("/v1/sandboxes", json=body)


def _client(app: FastAPI, auth: dict[str, str] = AUTH_A) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://x", headers=auth)


async def test_an_acquire_with_wait_is_answered_with_a_ticket_then_the_sandbox(
    fake: FakeProvider, pool: Pool
) -> None:
    fake.faults.create_latency = 0.5
    app = create_app(pool, settings())
    tickets = service_of(app).tickets
    async with _client(app) as api, _client(app, AUTH_B) as other:
        session = await _session(api)
        pending = await _acquire(api, session, wait=0.05, timeout=10)
        assert pending.status_code == 202, pending.text
        answer = pending.json()
        assert set(answer) == {"ticket", "position", "retry_after"}
        assert answer["position"] == 0 and 1 <= answer["retry_after"] <= 60
        assert pending.headers["retry-after"] == str(round(answer["retry_after"]))
        assert tickets.attached == 0 and len(tickets) == 1  # no request open
        ticket = answer["ticket"]
        # Only its own session's, and only its tenant's.
        for client, where in ((api, await _session(api)), (other, await _session(other))):
            stranger = await _acquire(client, where, ticket=ticket, wait=1)
            assert stranger.status_code == 404, stranger.text
        await eventually(lambda: fake.created_total == 1 and pool.stats().get("leased") == 1)
        got = await _acquire(api, session, ticket=ticket, wait=5)
        assert got.status_code == 201, got.text
        assert got.json()["session"] == session and fake.created_total == 1
        # The acquire's time counts from its first request, not its last.
        text = (await api.get("/metrics")).text
        ok = 'sandman_acquire_seconds_sum{outcome="ok"'
        took = next(line for line in text.splitlines() if line.startswith(ok))
        assert float(took.split()[-1]) >= 0.5
        assert len(tickets) == 0
        again = await _acquire(api, session, ticket=ticket, wait=5)
        assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


async def test_past_the_open_requests_allowed_an_acquire_is_answered_at_once(
    fake: FakeProvider, pool: Pool
) -> None:
    fake.faults.create_latency = 0.5
    app = create_app(pool, settings(max_waiting_requests=1))
    async with _client(app) as api:
        session = await _session(api)
        held = asyncio.ensure_future(_acquire(api, session, wait=30))
        await eventually(lambda: service_of(app).tickets.attached == 1)
        started = time.monotonic()
        second = await _acquire(api, session, wait=30)
        assert second.status_code == 202 and time.monotonic() - started < 5
        assert second.json()["position"] == 1
        assert (await held).status_code == 201
        # Without wait, a request is held open whatever the count (the old protocol).
        assert (await _acquire(api, session, timeout=10)).status_code == 201


async def test_a_ticket_given_up_or_not_asked_for_again_leaves_nothing(
    fake: FakeProvider, serial_pool: Pool
) -> None:
    pool = serial_pool
    app = create_app(pool, settings())
    service = service_of(app)
    async with _client(app) as api:
        session = await _session(api)
        # Given up by its caller: the pool drops it.
        first = (await _acquire(api, session, wait=0)).json()["ticket"]
        path = f"/v1/sandboxes/acquires/{first}"
        assert (await api.delete(path, params={"session": session})).status_code == 204
        assert (await api.delete(path, params={"session": session})).status_code == 204
        assert len(service.tickets) == 0
        # Never asked for again: dropped once past its time, its sandbox released.
        (await _acquire(api, session, wait=0)).json()
        await eventually(lambda: pool.stats().get("leased") == 1, timeout=10)
        assert len(service.tickets) == 1
        assert service.tickets.sweep(now=time.monotonic() + 3600) == 1
        assert len(service.tickets) == 0
        await eventually(lambda: fake.live == 0 and not pool.list(), timeout=10)
        assert service.queue_depths() == {}


async def test_a_client_gone_before_it_heard_of_its_ticket_gives_the_acquire_up(
    fake: FakeProvider, pool: Pool
) -> None:
    fake.faults.create_latency = 0.5
    app = create_app(pool, settings())
    async with _client(app) as api:
        session = await _session(api)
        waiting = asyncio.ensure_future(_acquire(api, session, wait=30))
        await eventually(lambda: service_of(app).tickets.attached == 1)
        waiting.cancel()
        await eventually(lambda: len(service_of(app).tickets) == 0)
        await eventually(lambda: fake.live == 0 and not pool.list(), timeout=10)


async def test_the_sdk_polls_with_its_ticket_until_the_sandbox_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote, "_ACQUIRE_POLL", 0.1)
    with serve(daemon=True) as served:
        served.provider.faults.create_latency = 1.0
        async with sandman.connect(served.url, api_key=KEY_A) as client:
            sandbox = asyncio.ensure_future(client.acquire("task", timeout=30))
            # Between two asks: a ticket waits with no request open.
            await eventually(lambda: served.run(_tickets(served.app)) == (1, 0), timeout=10)
            sb = await sandbox
            assert (await sb.exec("echo hi")).stdout == "hi\n"
            await sb.release()
        assert served.run(_tickets(served.app)) == (0, 0)


async def _tickets(app: FastAPI) -> tuple[int, int]:
    tickets = service_of(app).tickets
    return len(tickets), tickets.attached


async def test_the_later_in_line_the_later_a_ticket_asks_again() -> None:
    """Before any acquire was answered, a burst's tickets ask again spread over a
    minute by their place in line, not all every few seconds."""
    tickets = Tickets(lambda _: None, max_attached=0)
    waits = [asyncio.ensure_future(asyncio.Event().wait()) for _ in range(700)]
    try:
        opened = [tickets.open("a", "s", cast("asyncio.Task[Any]", w)) for w in waits]
        answers = [tickets.detach(t) for t in (opened[0], opened[99], opened[699])]
        assert answers == [(0, 1.0), (99, 10.0), (699, 60.0)]
        tickets.close(opened[0])
        assert tickets.detach(opened[99])[0] == 98
        assert all(t.expires < math.inf for t in opened[:100:99])
    finally:
        for w in waits:
            w.cancel()
        await tickets.aclose()


def _before_tickets(app: FastAPI, refusal: str, asked: list[dict[str, Any]]) -> ASGIApp:
    """``app`` as a service from before tickets answers: an acquire with ``wait`` or
    ``ticket`` (fields it does not know) refused as ``refusal`` (422); the rest its own.
    Records each acquire's body in ``asked``."""

    async def serve_it(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) != ("POST", "/v1/sandboxes"):
            return await app(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        asked.append(json.loads(body))
        if "wait" in asked[-1] or "ticket" in asked[-1]:
            error = {"code": "invalid_request", "message": refusal}
            return await JSONResponse({"error": error}, status_code=422)(scope, receive, send)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await app(scope, replay, send)

    return serve_it


async def test_the_sdk_acquires_from_a_service_from_before_tickets() -> None:
    """A service from before tickets refuses ``wait`` (422): the SDK then acquires as
    before, its request held open, and sends no ``wait`` again."""
    async with FakeProvider(seed=5) as fake, Pool(fake, PoolConfig(name="old")) as pool:
        app = create_app(pool, settings())
        async with _client(app) as api:
            # How these schemas refuse a field they do not know (the old AcquireRequest's).
            refused = await api.post("/v1/sessions", json={"wait": 30})
        assert refused.status_code == 422
        refusal = refused.json()["error"]["message"]
        assert refusal == remote._TICKETLESS
        asked: list[dict[str, Any]] = []
        transport = httpx.ASGITransport(app=_before_tickets(app, refusal, asked))
        async with sandman.connect("http://sandman", api_key=KEY_A, transport=transport) as client:
            for _ in range(2):
                async with client.sandbox("task", timeout=20) as sb:
                    assert (await sb.exec(["echo", "hi"])).stdout == "hi\n"
        assert ["wait" in body for body in asked] == [True, False, False]
        assert service_of(app).tickets.attached == 0 and len(service_of(app).tickets) == 0
        await eventually(lambda: fake.live == 0)
