"""The service's acquire cut off just after the pool handed a sandbox over."""

from __future__ import annotations

import asyncio

import pytest

from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolEvent
from sandman.server.schemas import AcquireRequest
from sandman.server.service import Service
from sandman.testing import FakeProvider
from tests.server.conftest import settings
from tests.support import eventually

pytestmark = pytest.mark.anyio


async def test_a_handler_cancelled_after_the_hand_over_leaks_nothing(
    fake: FakeProvider, pool: Pool
) -> None:
    service = Service(pool, settings())
    session, _ = service.open_session("a", None)
    waiting: list[asyncio.Task[object]] = []

    def cut_off(event: PoolEvent) -> None:
        # Inside the hand-over, before the result is set: the cancel lands after it.
        if event.name == "sandbox.leased" and waiting:
            asyncio.get_running_loop().call_soon(waiting[0].cancel)

    pool.add_hook(cut_off)

    async def never() -> None:
        await asyncio.Event().wait()

    request = AcquireRequest(spec=SandboxSpec(image="task"), session=session)
    waiting.append(asyncio.ensure_future(service.acquire("a", request, never)))
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    await eventually(lambda: fake.live == 0 and not pool.list(session=session))
    assert fake.created_total == 1
