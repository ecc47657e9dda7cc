"""A sandbox that dies under its holder, seen through the service: the typed error with
its reason (HTTP 410 ``sandbox_lost``), its state, the metrics and the dashboard."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

import sandman
from sandman.pool import Pool, PoolConfig
from sandman.server import create_app
from sandman.testing import FakeProvider
from tests.pool.test_lost import Blind
from tests.server.conftest import AUTH_A, AUTH_B, KEY_A, serve, settings
from tests.server.test_api import acquire, error_code, open_session, sample
from tests.support import eventually

pytestmark = pytest.mark.anyio


async def test_a_lost_sandbox_is_410_with_its_reason_counted_and_shown(
    api: httpx.AsyncClient, fake: FakeProvider, pool: Pool
) -> None:
    session = await open_session(api)
    sid = (await acquire(api, session)).json()["id"]
    fake.lose(sid, reason="oom", detail="fake: out of memory")
    await eventually(lambda: fake.live == 0)
    described = (await api.get(f"/v1/sandboxes/{sid}")).json()
    assert (described["state"], described["lost_reason"]) == ("lost", "oom")
    assert described["lost_detail"] == "fake: out of memory"
    listed = (await api.get("/v1/sandboxes", params={"state": "lost"})).json()["sandboxes"]
    assert [s["id"] for s in listed] == [sid]
    # Through the daemon proxy route: gone, and why.
    answer = await api.post(f"/v1/sandboxes/{sid}/daemon/v1/exec", json={"argv": ["true"]})
    assert answer.status_code == 410
    assert answer.json()["error"] == {
        "code": "sandbox_lost", "reason": "oom",
        "message": f"sandbox {sid} is gone, lost (oom): fake: out of memory",
    }  # fmt: skip
    # Another tenant is not even told it exists.
    other = await api.get(f"/v1/sandboxes/{sid}/daemon/v1/health", headers=AUTH_B)
    assert (other.status_code, error_code(other)) == (404, "sandbox_not_found")
    text = (await api.get("/metrics")).text
    assert sample(text, 'sandman_sandboxes_lost_total{pool="t",reason="oom"}') == 1
    for reason in ("evicted", "preempted", "node_lost"):  # every reason is there, at 0
        assert sample(text, f'sandman_sandboxes_lost_total{{pool="t",reason="{reason}"}}') == 0
    board = (await api.get("/v1/dashboard")).json()
    assert board["lost"] == {"oom": 1}
    (shown,) = [e for e in board["errors"] if e["event"] == "sandbox.lost"]
    assert (shown["sandbox_id"], shown["kind"], shown["tenant"]) == (sid, "oom", "a")
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204


async def test_the_proxy_finds_a_dead_daemon_lost_when_no_one_told_the_pool() -> None:
    """A provider that cannot tell at once (gVisor's): the proxied call that finds the
    daemon unreachable asks the provider, and answers ``sandbox_lost``."""
    async with (
        FakeProvider(seed=2) as fake,
        Pool(Blind(fake), PoolConfig(name="t")) as pool,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(pool, settings())),
            base_url="http://sandman", headers=AUTH_A,
        ) as api,
    ):  # fmt: skip
        session = await open_session(api)
        created = (await acquire(api, session)).json()
        health = f"/v1/sandboxes/{created['id']}/daemon/v1/health"
        async with asyncio.timeout(10):
            while (await api.get(health)).status_code != 200:
                await asyncio.sleep(0.01)
        os.kill(created["endpoint"]["pid"], signal.SIGKILL)
        # Until the kill has landed (200), and the backend says so too: meanwhile a daemon
        # that does not answer is only unavailable (502), which a retry may get past.
        async with asyncio.timeout(10):
            while (answer := await api.get(health)).status_code in (200, 502):
                await asyncio.sleep(0.01)
        assert (answer.status_code, error_code(answer)) == (410, "sandbox_lost")
        assert pool.get(created["id"]).state == "lost"  # known now: no reconcile ran
        assert answer.json()["error"]["reason"] == "killed"
        await eventually(lambda: fake.live == 0)


@pytest.mark.parametrize("via_proxy", [False, True])
async def test_a_remote_holder_gets_the_typed_error_with_its_reason(via_proxy: bool) -> None:
    with serve() as served:
        async with sandman.connect(served.url, api_key=KEY_A, via_proxy=via_proxy) as client:
            sb = await client.acquire("task", timeout=20)
            assert (await sb.exec("true")).exit_code == 0
            sandbox_id = sb.id

            async def lose() -> None:
                # On the server's loop: the fake's daemon task lives there.
                served.provider.lose(sandbox_id, reason="evicted", detail="fake: a drain")

            await asyncio.to_thread(served.run, lose())
            with pytest.raises(sandman.SandboxLost, match="a drain") as lost:
                await sb.exec("true")
            assert lost.value.reason == "evicted"
            await sb.release()
        await eventually(lambda: served.provider.live == 0)
