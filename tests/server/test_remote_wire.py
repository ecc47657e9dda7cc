"""How the remote backend reaches the service: its own HTTP/1.1 transport, or httpx's."""

from __future__ import annotations

import httpx
import pytest

import sandman
from sandman.client.remote import RemoteBackend
from sandman.pool import Pool, PoolConfig
from sandman.server import create_app
from sandman.testing import FakeProvider
from tests.server.conftest import KEY_A, serve, settings
from tests.support import eventually

pytestmark = pytest.mark.anyio


async def test_ids_that_are_not_path_segments_reach_the_service_as_one() -> None:
    with serve(daemon=False) as served:
        backend = RemoteBackend(served.url, api_key=KEY_A)
        try:
            for odd in ("no such\r\nX-Injected: 1", "?probe=true", "%41", "#x"):
                with pytest.raises(sandman.SandboxNotFound):
                    await backend.describe(odd)
                await backend.release(odd)  # idempotent: unknown is fine
            with pytest.raises(sandman.SandboxNotFound):
                await backend.heartbeat("s-\r\nnope")
            # One connection kept alive through all of it: nothing broke the framing.
            session = await backend.open_session()
            await backend.heartbeat(session)
            assert await backend.sandboxes(state="leased") == []
            await backend.close_session(session)
        finally:
            await backend.aclose()


async def test_an_api_key_that_could_end_a_header_is_refused() -> None:
    with pytest.raises(sandman.ConfigError, match="printable ASCII"):
        RemoteBackend("http://127.0.0.1:9", api_key="key\r\nX-Injected: 1")


async def test_connect_over_a_callers_httpx_transport() -> None:
    async with FakeProvider(seed=5) as fake, Pool(fake, PoolConfig(name="wire")) as pool:
        transport = httpx.ASGITransport(app=create_app(pool, settings()))
        async with sandman.connect("http://sandman", api_key=KEY_A, transport=transport) as client:
            async with client.sandbox("task", timeout=20) as sb:
                assert (await sb.exec(["echo", "in process"])).stdout == "in process\n"
                assert fake.live == 1
            with pytest.raises(sandman.ConfigError, match="invalid_request"):
                await client.acquire("task", timeout=-1)
        await eventually(lambda: fake.live == 0)
