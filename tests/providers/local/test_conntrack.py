"""The host's connection tracking and sandboxes (red team, walls 08 and 09).

08: a deleted sandbox's flows (its NAT mappings) are forgotten before its address is
handed out again, so what was meant for it never reaches the next sandbox there.
09: one sandbox cannot fill the host's conntrack table: past `LocalConfig.conntrack_max`
tracked connections, its new ones are dropped.

Traffic goes only to the fake internet of netfixtures (a namespace of ours).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import network
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for
from tests.providers.local.netfixtures import (
    FAKENET,
    FAKENET_HOST_IF,
    FAKENET_IP,
    TEST_SUBNET,
    fake_internet,
    needs_root_and_ip,
    run,
)

pytestmark = [pytest.mark.anyio, needs_root_and_crun, needs_root_and_ip]

STREAM_PORT = 9999
SANDBOX_PORT = 5000

# In the fake internet: every datagram's sender gets a stream back, "data for <what it
# sent> #n", 20 a second for 30 s (bounded), whoever holds that address meanwhile.
_STREAMER = """
import socket, sys, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
def stream(peer, token):
    for n in range(600):
        try:
            s.sendto(f"data for {token} #{n}".encode(), peer)
        except OSError:
            pass
        time.sleep(0.05)
while True:
    data, peer = s.recvfrom(200)
    threading.Thread(target=stream, args=(peer, data.decode()), daemon=True).start()
"""

# In a sandbox's network namespace: (optionally) send argv[3] from udp/argv[1] to
# argv[2]:9999, then print what arrives on udp/argv[1] within argv[4] seconds.
_UDP = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
if sys.argv[3]:
    s.sendto(sys.argv[3].encode(), (sys.argv[2], 9999))
end = time.monotonic() + float(sys.argv[4])
got = []
while time.monotonic() < end and len(got) < 3:
    s.settimeout(max(0.01, end - time.monotonic()))
    try:
        got.append(s.recv(200).decode())
    except TimeoutError:
        break
print("|".join(got))
"""


@contextlib.asynccontextmanager
async def _streamer() -> AsyncIterator[None]:
    argv = ["ip", "netns", "exec", FAKENET, sys.executable, "-I", "-c", _STREAMER]
    process = await asyncio.create_subprocess_exec(
        *argv, str(STREAM_PORT), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(10):
            assert await process.stdout.readline() == b"ready\n"
        yield
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def _udp(netns: str, send: str, seconds: float) -> list[str]:
    """What arrives on udp/5000 in ``netns`` within ``seconds`` (after sending ``send``)."""
    out = await run(
        "ip", "netns", "exec", netns, sys.executable, "-I", "-c", _UDP,
        str(SANDBOX_PORT), FAKENET_IP, send, str(seconds),
    )  # fmt: skip
    return [item for item in out.strip().split("|") if item]


async def _flows(address: str) -> int:
    """Conntrack entries with ``address`` as the original source."""
    out = await run("conntrack", "-L", "--orig-src", address, check=False)
    return len([line for line in out.splitlines() if line.strip()])


async def test_a_deleted_sandbox_s_flows_do_not_reach_the_next_holder_of_its_address(
    state_dir: Path, busybox_tar: Path
) -> None:
    config = config_for(state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF)
    async with provider_for(config, busybox_tar) as provider, fake_internet(), _streamer():
        a = await provider.create(SandboxSpec(image="busybox", network="egress"))
        mine = await provider.network.get(a.id)
        assert mine is not None
        netns_a, _ = network.names(a.id)
        # A's flow works: the stream comes back to A, through the host's NAT.
        got = await _udp(netns_a, "secret-of-A", 5.0)
        assert got and got[0].startswith("data for secret-of-A"), got
        assert await _flows(mine.sandbox_ip) > 0
        await provider.delete(a.id)
        # The stream goes on (the peer does not know), but its mapping is gone.
        assert await _flows(mine.sandbox_ip) == 0
        b = await provider.create(SandboxSpec(image="busybox", network="egress"))
        theirs = await provider.network.get(b.id)
        assert theirs is not None and theirs.sandbox_ip == mine.sandbox_ip  # A's address
        netns_b, _ = network.names(b.id)
        assert await _udp(netns_b, "", 2.0) == []
        await provider.delete(b.id)


_BURST = """
import socket, sys
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", (sys.argv[1], 9))
    s.close()
"""


async def test_a_sandbox_s_tracked_connections_are_capped(
    state_dir: Path, busybox_tar: Path
) -> None:
    cap, burst = 16, 64  # bounded: the cap set low, far from the host's table
    config = config_for(state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF, conntrack_max=cap)
    async with provider_for(config, busybox_tar) as provider, fake_internet():
        hog, other = [
            await provider.create(SandboxSpec(image="busybox", network="egress")) for _ in range(2)
        ]
        try:
            for info, count in ((hog, burst), (other, 1)):
                netns, _ = network.names(info.id)
                await run(
                    "ip", "netns", "exec", netns, sys.executable, "-I", "-c", _BURST,
                    FAKENET_IP, str(count),
                )  # fmt: skip
            hog_ip = (await provider.network.get(hog.id)).sandbox_ip  # type: ignore[union-attr]
            other_ip = (await provider.network.get(other.id)).sandbox_ip  # type: ignore[union-attr]
            assert await _flows(hog_ip) == cap  # 64 new flows, of which 16 tracked
            assert await _flows(other_ip) == 1  # the cap is each sandbox's own
        finally:
            await provider.delete(hog.id)
            await provider.delete(other.id)
