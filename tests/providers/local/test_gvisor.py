"""runtime="runsc": sandboxes under gVisor, a user-space kernel, on this machine."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.client import AsyncClient
from sandman.client.backends import InProcessBackend
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc (gVisor) is not installed"),
]

SPEC = SandboxSpec(image="busybox", memory="256Mi", pids=128, cpu=1)


@pytest.fixture
async def gvisor(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    async with provider_for(config_for(state_dir, runtime="runsc"), busybox_tar) as provider:
        yield provider


async def test_a_sandbox_runs_under_gvisor_and_leaves_nothing(gvisor: LocalProvider) -> None:
    info = await gvisor.create(SPEC)
    assert info.endpoint is not None and info.endpoint.host is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=30)
        # gVisor's own kernel answers, not the host's.
        kernel = await sb.exec("dmesg")
        assert "gVisor" in kernel.stdout, kernel
        await sb.write_file("/work/a.txt", "kept\n")
        assert (await sb.exec("cat /work/a.txt")).stdout == "kept\n"
        # The token is not in the daemon's environment, and nothing goes out.
        environ = await sb.exec(["sh", "-c", "cat /proc/1/environ | tr '\\0' '\\n'"])
        assert info.endpoint.token not in environ.stdout
        # The sandbox reaches no host service (only the host reaches its daemon).
        host_ip = str(ipaddress.ip_address(info.endpoint.host) - 1)
        with socket.create_server(("0.0.0.0", 0)) as server:
            port = server.getsockname()[1]
            out = await sb.exec(["busybox", "nc", "-w", "2", host_ip, str(port)], stdin="x")
            assert out.exit_code not in (0, 127), out  # refused, not "no nc"
    # A restarted provider finds it, with the same endpoint.
    (listed,) = await gvisor.list()
    assert listed.endpoint == info.endpoint
    await gvisor.delete(info.id)
    with pytest.raises(sandman.SandboxNotFound):
        await gvisor.inspect(info.id)


async def test_a_dead_gvisor_sandbox_is_lost_on_the_holders_next_call(
    gvisor: LocalProvider,
) -> None:
    """No daemon pid on the host to watch: the holder's next call asks the provider."""
    async with AsyncClient(InProcessBackend(Pool(gvisor, PoolConfig(name="g")))) as client:
        sb = await client.acquire(SPEC, timeout=60)
        assert (await sb.exec("true")).exit_code == 0
        pid = int((gvisor.config.state_dir / "sandboxes" / sb.id / "pid").read_text())
        os.kill(pid, signal.SIGKILL)  # the whole gVisor sandbox, from the host
        with anyio.fail_after(30):
            while True:
                try:
                    await sb.exec("true", timeout=5)
                except sandman.SandboxLost as exc:
                    assert exc.reason == "killed", exc
                    break
                except sandman.DaemonUnavailable:
                    pass  # unreachable, but the runtime does not say stopped yet
                await anyio.sleep(0.05)
        with anyio.fail_after(30):
            while await gvisor.list():
                await anyio.sleep(0.05)
        await sb.release()
