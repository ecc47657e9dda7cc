"""Host-wide kernel budgets one sandbox could take from the others (red team, walls 11, 26).

11: TCP buffers. On cgroup v1 a cgroup's socket memory is charged to it only once its
``memory.kmem.tcp.limit_in_bytes`` is set: unset, a 64 MiB sandbox queued 900 MiB of
host memory in loopback TCP. The provider sets it to the memory limit.
26: pseudo-terminals. Every container's devpts draws on one host budget; each sandbox's
has a ``max`` (`LocalConfig.ptys`).
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

MIB = 2**20
_KMEM_TCP = Path("/sys/fs/cgroup/memory/memory.kmem.tcp.limit_in_bytes")
PAIRS = 48
"""Loopback connections whose receiver never reads: its receive buffer stays at its first
size (~128 KiB, tcp_rmem), the sender's grows to 4 MiB (tcp_wmem): ~200 MiB in all
without a limit, the attack's own bound."""

# Each pair: a listener stopped once it listens (it never accepts or reads: the kernel
# queues what arrives all the same) and a writer of zeros.
_FILL = f"""
for i in $(seq 1 {PAIRS}); do nc -l -p $((7000 + i)) >/dev/null 2>&1 & echo $! >>/tmp/listeners; done
until [ $(cat /proc/net/tcp* | grep -c ' 0A ') -ge {PAIRS} ]; do sleep 0.05; done
kill -STOP $(cat /tmp/listeners)
for i in $(seq 1 {PAIRS}); do nc 127.0.0.1 $((7000 + i)) </dev/zero >/dev/null 2>&1 & done
"""


def _cgroup(provider: LocalProvider, sandbox_id: str, controller: str) -> Path:
    parent = provider.config.cgroup_parent.strip("/")
    return Path(f"/sys/fs/cgroup/{controller}/{parent}/{sandbox_id}")


async def _queued(pid: int) -> int:
    """Bytes queued in TCP sockets (received and unread, sent and unacknowledged) in the
    network namespace of ``pid``."""
    with anyio.fail_after(10):
        done = await anyio.run_process(["nsenter", "-t", str(pid), "-n", "ss", "-tnH"])
    total = 0
    for line in done.stdout.decode().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
            total += int(fields[1]) + int(fields[2])
    return total


@pytest.mark.skipif(not _KMEM_TCP.exists(), reason="cgroup v1 only (v2 charges sockets always)")
async def test_tcp_buffers_stay_within_the_sandbox_s_memory_limit(provider: LocalProvider) -> None:
    limit = 64 * MIB
    info = await provider.create(SandboxSpec(image="busybox", memory=limit, network="none"))
    memory = _cgroup(provider, info.id, "memory")
    assert int((memory / "memory.kmem.tcp.limit_in_bytes").read_text()) == limit
    pid = int((memory / "cgroup.procs").read_text().split()[0])
    sb = await ready(info)
    try:
        await sb.exec(_FILL, timeout=30)
        # Until the queues stop growing (or the attack's own bound): ~0.5 s on an idle host.
        deadline = time.monotonic() + 30
        last, steady = -1, 0
        while steady < 5 and time.monotonic() < deadline:
            await anyio.sleep(0.2)
            now = await _queued(pid)
            steady = steady + 1 if now <= last else 0
            last = max(last, now)
        charged = int((memory / "memory.kmem.tcp.max_usage_in_bytes").read_text())
        assert last > 8 * MIB, last  # the attack ran: it filled queues
        assert charged > 8 * MIB, charged  # and they were charged to the sandbox
        # Without the limit: ~180 MiB queued, none of it charged. With it, about the limit
        # (the kernel forces a few charges past it rather than drop what is in flight).
        assert last <= limit + 8 * MIB, last
        assert charged <= limit + 8 * MIB, charged
    finally:
        await sb.aclose()
        await provider.delete(info.id)


async def test_a_sandbox_past_its_ptys_fails_and_another_still_gets_one(
    state_dir: Path, busybox_tar: Path
) -> None:
    ptys = 6
    async with provider_for(config_for(state_dir, ptys=ptys), busybox_tar) as provider:
        hog, other = [await provider.create(SandboxSpec(image="busybox")) for _ in range(2)]
        sb, nb = await ready(hog), await ready(other)
        try:
            held, refused = 0, None
            for _ in range(ptys + 4):  # bounded: past the max, not the host's budget
                try:
                    await sb.spawn(["sleep", "600"], tty=True)
                except errors.DaemonError as exc:
                    refused = exc
                    break
                held += 1
            assert held == ptys and refused is not None, (held, refused)
            assert "pty" in str(refused), refused
            # The other sandbox's budget is its own.
            said = await nb.spawn(["sh", "-c", "tty"], tty=True)
            assert (await nb.wait(said.id, timeout=10)).exit_code == 0
            assert "/dev/pts/" in (await nb.read_output(said.id)).stdout
        finally:
            await sb.aclose()
            await nb.aclose()
            await provider.delete(hog.id)
            await provider.delete(other.id)
