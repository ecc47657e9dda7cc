"""gVisor as ``hack/gvisor/build`` makes it (runsc from gVisor's current ``go``
branch, through the Go module proxy), on the systrap platform with gVisor's own
network stack (``runsc_network="sandbox"``), through the public API.

Debian 12's runsc (2022, ``test_gvisor.py``) has neither systrap nor a netstack
that starts on this kernel. The session fixture runs ``hack/gvisor/build``
(a no-op when ``hack/gvisor/.bin`` is current; the CI script runs it beforehand,
and a cold build takes a few minutes).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig
from tests.providers.local.conftest import config_for, needs_root_and_crun
from tests.providers.local.leaks import leftovers

REPO = Path(__file__).resolve().parents[3]
GVISOR = REPO / "hack" / "gvisor"
RUNSC = GVISOR / ".bin" / "runsc"
# A cold build of runsc and its shim: about 3-6 minutes on two cores.
BUILD_TIMEOUT = 1200

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.timeout(BUILD_TIMEOUT + 60),
]


@pytest.fixture(scope="session")
def built_runsc() -> Path:
    """``hack/gvisor/.bin/runsc``, built or brought up to date first when Go is here."""
    if shutil.which("go") is not None:
        proc = subprocess.run(
            [GVISOR / "build"], capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"hack/gvisor/build failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
    elif not RUNSC.exists():
        pytest.skip("no hack/gvisor/.bin/runsc and no Go to build it (hack/gvisor/build)")
    return RUNSC


@pytest.fixture
async def systrap(
    built_runsc: Path, state_dir: Path, busybox_tar: Path
) -> AsyncIterator[LocalConfig]:
    """Settings for the built runsc on systrap with netstack, the busybox image in their
    store; at the end, nothing of any sandbox may be left."""
    config = config_for(
        state_dir,
        runtime="runsc",
        runtime_path=str(built_runsc),
        runsc_platform="systrap",
        runsc_network="sandbox",
        # Else each create leaves an empty <state_dir>/runtime/runsc/null-netns: runsc
        # pins the gofers' namespace inside the private mount namespace it runs in.
        runsc_args=["--gofer-network-namespace=new"],
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    try:
        yield config
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        await provider.network.reset()
        await provider.aclose()
        left = _left(provider)
        with anyio.move_on_after(10):  # processes and mounts go a moment after the delete
            while left := _left(provider):
                await anyio.sleep(0.02)
        remove_cgroup_parent(config.cgroup_parent)
        assert not left, left


def _left(provider: LocalProvider) -> list[str]:
    return leftovers(provider, closed=True)


async def test_a_sandbox_runs_on_systrap_with_gvisors_own_network_stack(
    systrap: LocalConfig,
) -> None:
    async with (
        sandman.local(systrap) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        result = await sb.exec("echo hi from $(hostname); dmesg | head -1")
        assert result.stdout.startswith(f"hi from {sb.id}\n"), result
        assert "gVisor" in result.stdout, result  # gVisor's kernel answers, not the host's
        await sb.write_file("/work/a.txt", "kept\n")
        assert (await sb.exec("cat /work/a.txt")).stdout == "kept\n"
        # The platform and network stack asked for, as the sandbox process was started.
        pid = (systrap.state_dir / "sandboxes" / sb.id / "pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--platform=systrap" in argv and b"--network=sandbox" in argv, argv
        # netstack holds the sandbox's address; the sandbox reaches no host service.
        addresses = (await sb.exec("ip -4 addr show eth0")).stdout
        (inet,) = [line.split()[1] for line in addresses.splitlines() if "inet " in line]
        host_ip = str(ipaddress.ip_interface(inet).ip - 1)
        with socket.create_server(("0.0.0.0", 0)) as server:
            port = server.getsockname()[1]
            out = await sb.exec(["busybox", "nc", "-w", "2", host_ip, str(port)], stdin="x")
            assert out.exit_code not in (0, 127), out  # refused, not "no nc"


async def test_nothing_is_left_in_the_runtimes_state_directory(systrap: LocalConfig) -> None:
    async with (
        sandman.local(systrap) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        assert (await sb.exec("true")).exit_code == 0
    root = systrap.state_dir / "runtime" / "runsc"
    assert sorted(p.name for p in root.iterdir()) == []
