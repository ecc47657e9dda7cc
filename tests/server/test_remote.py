"""``sandman.connect`` against a real uvicorn server on 127.0.0.1, end to end."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import sandman
from sandman.client.remote import SERVICE_ERRORS
from sandman.pool import PacingConfig, PoolConfig
from sandman.server import STATUS, TenantLimits
from tests.server.conftest import AUTH_A, AUTH_B, KEY_A, KEY_B, serve
from tests.support import eventually

pytestmark = pytest.mark.anyio


def test_every_service_error_code_maps_to_an_exception() -> None:
    assert set(STATUS) == set(SERVICE_ERRORS)


async def test_connect_acquire_exec_release_leaves_nothing() -> None:
    with serve() as served:
        async with sandman.connect(served.url, api_key=KEY_A, heartbeat_interval=0.2) as client:
            async with client.sandbox("task", timeout=20, env={"GREETING": "hello"}) as sb:
                result = await sb.exec("echo $GREETING from $(pwd)")
                assert result.exit_code == 0 and result.stdout.startswith("hello from")
                await sb.write_file("/tmp/sandman-remote-test", "data")
                assert await sb.read_file("/tmp/sandman-remote-test") == b"data"
                assert served.provider.live == 1
                timeline = await sb.timeline()
                assert list(timeline)[:2] == ["queued", "create_called"]
                assert "handed_out" in timeline
                session = client.session
                await asyncio.sleep(0.5)  # two heartbeats (every 0.2 s), each accepted:
                assert client.session == session  # none found the session expired
            await eventually(lambda: served.provider.live == 0)
            timeline = await sb.timeline()
            assert "released" in timeline
            with pytest.raises(sandman.SandboxNotFound):
                await sb.exec("true")
        await eventually(lambda: served.provider.live == 0)
        assert served.provider.created_total == served.provider.deleted_total == 1


async def test_service_errors_become_the_package_exceptions() -> None:
    limits = {"b": TenantLimits(max_sandboxes=0)}
    with serve(daemon=False, tenant_limits=limits) as served:
        served.provider.faults.image_errors = frozenset({"missing"})
        async with sandman.connect(served.url, api_key=KEY_A) as client:
            with pytest.raises(sandman.ImageError, match="missing"):
                await client.acquire("missing", timeout=5)
            served.provider.faults.create_latency = 1.0
            with pytest.raises(sandman.CreateTimeout) as timeout:
                await client.acquire("task", timeout=0.1)
            assert isinstance(timeout.value, TimeoutError)
            with pytest.raises(sandman.ConfigError, match="invalid_request"):
                await client.acquire("task", cpu=0.5, memory=2**30, pids=16, labels={"x": "y"},
                                     timeout=-1)  # fmt: skip
        async with sandman.connect(served.url, api_key=KEY_B) as client:
            with pytest.raises(sandman.CapacityError, match="tenant_sandbox_limit"):
                await client.acquire("task", timeout=5)
        with pytest.raises(sandman.ConfigError, match="unauthorized"):
            async with sandman.connect(served.url, api_key="wrong-key-0123456789"):
                pass
        with pytest.raises(sandman.ProviderError, match="cannot reach"):
            async with sandman.connect("http://127.0.0.1:9", api_key=KEY_A):
                pass
        await eventually(lambda: served.provider.live == 0)


async def test_a_client_that_goes_away_hands_its_sandbox_to_the_next_waiter() -> None:
    pacing = PacingConfig(window=1, min_window=1, rate=100.0)
    with serve(pool_config=PoolConfig(name="served", pacing=pacing)) as served:
        fake = served.provider
        fake.faults.create_latency = 0.5
        async with sandman.connect(served.url, api_key=KEY_A) as first:
            impatient = asyncio.ensure_future(first.acquire("task"))
            await eventually(lambda: fake.creating == 1)
            async with sandman.connect(served.url, api_key=KEY_A) as second:
                patient = asyncio.ensure_future(second.acquire("task", timeout=10))
                await eventually(lambda: served.pool.stats()["pacing_queued"] == 1)
                # The first client gives up: its HTTP request is dropped mid-wait.
                impatient.cancel()
                sb = await patient
                assert fake.created_total == 1  # handed over, not made again
                await sb.release()
        await eventually(lambda: fake.live == 0)


async def test_a_client_that_goes_away_leaves_nothing() -> None:
    with serve(daemon=False) as served:
        fake = served.provider
        fake.faults.create_latency = 0.5
        async with sandman.connect(served.url, api_key=KEY_A) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):  # the caller's own deadline, not the service's
                    await client.acquire("task")
            await eventually(lambda: fake.created_total == 1 and fake.live == 0)
            assert served.pool.list() == []


async def test_the_daemon_proxy_route() -> None:
    with serve() as served:
        async with (
            sandman.connect(served.url, api_key=KEY_A) as client,
            client.sandbox("task", timeout=20) as sb,
            httpx.AsyncClient(base_url=served.url, headers=AUTH_A) as api,
        ):
            base = f"/v1/sandboxes/{sb.id}/daemon"
            got = (await api.get(f"/v1/sandboxes/{sb.id}")).json()
            assert got["endpoint"]["proxy"] == base and got["endpoint"]["token"]
            health = await api.get(f"{base}/v1/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            result = await api.post(f"{base}/v1/exec", json={"argv": ["echo", "proxied"]})
            assert result.status_code == 200, result.text
            assert result.json()["stdout"] == "proxied\n"
            # Bodies and queries pass through both ways.
            put = await api.put(f"{base}/v1/files", params={"path": "/tmp/sandman-proxied"},
                                content=b"\x00bytes\xff", headers={"content-type": "application/octet-stream"})  # fmt: skip
            assert put.status_code in (200, 201, 204), put.text
            assert (await sb.read_file("/tmp/sandman-proxied")) == b"\x00bytes\xff"
            got_file = await api.get(f"{base}/v1/files", params={"path": "/tmp/sandman-proxied"})
            assert got_file.content == b"\x00bytes\xff"
            # The daemon's own errors come back as it sent them.
            missing = await api.get(f"{base}/v1/files", params={"path": "/nonexistent/x"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
            # Streams arrive as they happen.
            script = "for i in 1 2 3; do echo line$i; sleep 0.2; done"
            lines: list[tuple[float, dict[str, object]]] = []
            clock = asyncio.get_running_loop().time
            async with api.stream(
                "POST", f"{base}/v1/exec/stream", json={"argv": ["sh", "-c", script]}
            ) as stream:
                assert stream.status_code == 200
                lines.extend([(clock(), json.loads(line)) async for line in stream.aiter_lines()
                              if line.strip()])  # fmt: skip
            assert lines[-1][1]["event"] == "exit" and lines[-1][1]["exit_code"] == 0
            assert "line1line2line3" in "".join(
                str(e.get("data", "")).replace("\n", "") for _, e in lines
            )
            assert lines[-1][0] - lines[0][0] > 0.25  # the first line came before the command ended
            # Another tenant cannot use it.
            foreign = await api.post(f"{base}/v1/exec", json={"argv": ["true"]}, headers=AUTH_B)
            assert foreign.status_code == 404
            assert foreign.json()["error"]["code"] == "sandbox_not_found"
        await eventually(lambda: served.provider.live == 0)


async def test_egress_rules_change_through_the_service() -> None:
    with serve() as served:
        fake = served.provider
        async with (
            sandman.connect(served.url, api_key=KEY_A) as client,
            client.sandbox("task", network="egress", timeout=20) as sb,
            client.sandbox("task", timeout=20) as closed,
            httpx.AsyncClient(base_url=served.url, headers=AUTH_A) as api,
        ):
            assert fake.egress_of(sb.id) == sandman.Egress()
            await sb.set_egress(allow=["pypi.org", "10.0.0.0/8"], deny=["10.1.0.0/16"])
            assert fake.egress_of(sb.id) == sandman.Egress(
                allow=["pypi.org", "10.0.0.0/8"], deny=["10.1.0.0/16"]
            )
            await sb.set_egress(allow=None)
            assert fake.egress_of(sb.id) == sandman.Egress()
            # A sandbox made without egress: the provider's word, as the package's error.
            with pytest.raises(sandman.ConfigError, match="network='egress'"):
                await closed.set_egress(allow=[])
            assert fake.egress_of(closed.id) is None
            # Bad rules and bad bodies are a 4xx that changes nothing.
            path = f"/v1/sandboxes/{sb.id}/egress"
            bodies: list[object] = [
                {"allow": ["not a rule!"]},
                {"allow": "pypi.org"},
                {"permit": []},
            ]
            for body in bodies:
                response = await api.put(path, json=body)
                assert response.status_code == 422, (body, response.text)
                assert response.json()["error"]["code"] == "invalid_request"
            # Another tenant's sandbox, and one that does not exist, are not found.
            for headers, sid in ((AUTH_B, sb.id), (AUTH_A, "sb-nonexistent")):
                response = await api.put(
                    f"/v1/sandboxes/{sid}/egress", json={"allow": []}, headers=headers
                )
                assert response.status_code == 404, response.text
                assert response.json()["error"]["code"] == "sandbox_not_found"
            assert fake.egress_of(sb.id) == sandman.Egress()
        with pytest.raises(sandman.SandboxNotFound):
            await sb.set_egress(allow=[])  # released
        await eventually(lambda: fake.live == 0)


def test_connect_sync() -> None:
    with serve() as served, sandman.connect_sync(served.url, api_key=KEY_B) as client:
        with client.sandbox("task", timeout=20) as sb:
            assert sb.exec(["echo", "sync"]).stdout == "sync\n"
        for _ in range(500):
            if served.provider.live == 0:
                break
            time.sleep(0.01)
        assert served.provider.live == 0
