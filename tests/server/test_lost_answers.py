"""An acquire whose answer is lost after the service recorded the hand-over: the remote
client gives back the sandbox it never received (issue 14, item 9)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

import sandman
from sandman.client.remote import RemoteBackend
from sandman.pool import Pool, PoolConfig
from sandman.server import create_app
from sandman.testing import FakeProvider
from tests.server.conftest import KEY_A, settings
from tests.support import eventually

pytestmark = pytest.mark.anyio


class LosesAnswers(httpx.AsyncBaseTransport):
    """The app's transport, except that the next ``lose`` acquires are answered by the
    service and then lost on the way back, as when it is killed just after."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.lose = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path == "/v1/sandboxes" and self.lose:
            self.lose -= 1
            await response.aread()
            assert response.status_code == 201  # handed over, and recorded
            raise httpx.RemoteProtocolError("connection lost before the answer", request=request)
        return response


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    async with (
        FakeProvider(daemon=True, seed=2) as provider,
        Pool(provider, PoolConfig(name="t")) as pool,
    ):
        yield pool


async def test_a_sandbox_whose_answer_was_lost_is_given_back(pool: Pool) -> None:
    transport = LosesAnswers(httpx.ASGITransport(app=create_app(pool, settings())))
    backend = RemoteBackend("http://sandman", api_key=KEY_A, transport=transport)
    session = await backend.open_session()
    try:
        kept = await backend.acquire(sandman.SandboxSpec(image="task"), session=session, timeout=20)
        transport.lose = 1
        with pytest.raises(sandman.ProviderError, match="connection lost"):
            await backend.acquire(sandman.SandboxSpec(image="task"), session=session, timeout=20)
        (stray,) = [r.id for r in pool.list(session=session) if r.id != kept.id]
        assert pool.get(stray).state == "leased"  # the service believes it answered
        await backend.heartbeat(session)  # the service answers again: the client settles
        await eventually(lambda: [r.id for r in pool.list(session=session)] == [kept.id])
        await backend.heartbeat(session)  # settled once; nothing more to give back
        assert [r.id for r in pool.list(session=session)] == [kept.id]
    finally:
        await backend.close_session(session)
        await backend.aclose()


async def test_nothing_is_given_back_while_an_acquire_is_in_flight(pool: Pool) -> None:
    transport = LosesAnswers(httpx.ASGITransport(app=create_app(pool, settings())))
    backend = RemoteBackend("http://sandman", api_key=KEY_A, transport=transport)
    session = await backend.open_session()
    provider = pool.provider
    assert isinstance(provider, FakeProvider)
    try:
        transport.lose = 1
        with pytest.raises(sandman.ProviderError):
            await backend.acquire(sandman.SandboxSpec(image="task"), session=session, timeout=20)
        provider.faults.create_latency = 0.5
        waiting = asyncio.ensure_future(
            backend.acquire(sandman.SandboxSpec(image="task"), session=session, timeout=20)
        )
        await eventually(lambda: provider.creating == 1)
        await backend.heartbeat(session)  # an acquire in flight: settling waits
        assert len(pool.list(session=session)) == 2
        lease = await waiting
        await backend.heartbeat(session)
        await eventually(lambda: [r.id for r in pool.list(session=session)] == [lease.id])
    finally:
        await backend.close_session(session)
        await backend.aclose()
