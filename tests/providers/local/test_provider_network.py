"""Network modes through the provider: the namespace is wired in and removed with the sandbox.

What each mode may and may not reach is tested at the NetworkManager level
(test_network.py); here we check the provider uses it."""

from __future__ import annotations

import socket

import anyio
import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.leaks import leftovers

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


def _receive(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=1) as conn:
        return conn.recv(100)


async def test_isolated_sandbox_is_reachable_from_the_host(provider: LocalProvider) -> None:
    info = await provider.create(SandboxSpec(image="busybox", network="isolated"))
    attachment = await provider.network.get(info.id)
    assert attachment is not None and info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=10)
        devices = (await sb.read_file("/proc/net/dev")).decode()
        assert {line.split(":")[0].strip() for line in devices.splitlines()[2:]} == {"lo", "eth0"}
        await sb.spawn("echo hello-from-sandbox | busybox nc -l -p 8080")
        with anyio.fail_after(10):
            while True:
                try:
                    got = await anyio.to_thread.run_sync(_receive, attachment.sandbox_ip, 8080)
                    break
                except OSError:
                    await anyio.sleep(0.02)
        assert got == b"hello-from-sandbox\n"
    await provider.delete(info.id)
    assert await provider.network.list() == []
    assert leftovers(provider) == []
