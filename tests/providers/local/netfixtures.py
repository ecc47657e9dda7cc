"""Helpers for the network tests: servers and probes inside namespaces, a fake internet, leak checks.

Traffic goes only to this machine: loopback, the host's own addresses and
addresses inside namespaces these helpers or the tests create. The "fake
internet" is a namespace of our own (``smt-fakeNN``) behind the veth
``smf-hNN``, which the tests pass to the manager as its uplink.

Names and subnets carry a random token per test process, so two test runs
on one host (or a live sandman) do not meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandman.providers.local import network

needs_root_and_ip = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="network namespaces and nftables need root, iproute2 and nftables (scripts/setup)",
)

_TOKEN = random.randrange(256)
TEST_SUBNET = f"10.231.{_TOKEN}.0/24"
FAKENET = f"smt-fake{_TOKEN:02x}"
FAKENET_HOST_IF = f"smf-h{_TOKEN:02x}"
# The fake internet is public address space (198.18.0.0/15, for benchmarks): private
# ranges are what egress sandboxes may not reach by default.
FAKENET_HOST_IP = f"198.18.{_TOKEN}.1"
FAKENET_IP = f"198.18.{_TOKEN}.2"
FAKENET_LINK_LOCAL = f"169.254.{_TOKEN}.254"
"""Also in the fake internet, routed there by `fake_internet`: a metadata service's kind."""
FAKENET_PRIVATE = f"10.254.{_TOKEN}.2"
"""Also in the fake internet: an address of the LAN or the cloud's VPC."""
PORT = 8080
DEADLINE = 10.0

_SERVER = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(64)
print("ready", flush=True)
while True:
    conn, peer = srv.accept()
    conn.sendall(f"{sys.argv[2]} sees peer {peer[0]}".encode())
    conn.close()
"""

_PROBE = """
import socket, sys
try:
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    conn.settimeout(float(sys.argv[3]))
    print(conn.recv(200).decode(), end="")
except OSError as exc:
    print(f"{type(exc).__name__}: {exc}", end="")
    sys.exit(1)
"""


async def run(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    """Run a command with a deadline; its stdout."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(DEADLINE):
            out, err = await process.communicate(stdin.encode() if stdin is not None else None)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if check and process.returncode != 0:
        raise AssertionError(f"{argv} failed: {err.decode(errors='replace')}")
    return out.decode(errors="replace")


@contextlib.asynccontextmanager
async def server(netns: str, name: str, port: int = PORT) -> AsyncIterator[None]:
    """A TCP server in ``netns`` that answers every connection with ``<name> sees peer <ip>``."""
    argv = ["ip", "netns", "exec", netns, sys.executable, "-I", "-c", _SERVER, str(port), name]
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(DEADLINE):
            line = await process.stdout.readline()
        assert line == b"ready\n", line
        yield
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@dataclass(frozen=True)
class Probe:
    reached: bool
    text: str


async def probe(netns: str | None, host: str, port: int = PORT, timeout: float = 1.0) -> Probe:
    """Connect from ``netns`` (None: the host) to host:port and read the banner."""
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    argv = [*prefix, sys.executable, "-I", "-c", _PROBE, host, str(port), str(timeout)]
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        async with asyncio.timeout(timeout + DEADLINE):
            out, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return Probe(process.returncode == 0, out.decode(errors="replace"))


@contextlib.asynccontextmanager
async def host_service() -> AsyncIterator[int]:
    """A TCP server on the host, bound to 0.0.0.0; yields its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        writer.write(f"host-service sees peer {peer[0]}".encode())
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(answer, host="0.0.0.0", port=0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


async def host_addresses() -> list[str]:
    """Every IPv4 address of the host's root namespace, but loopback."""
    found = []
    for link in json.loads(await run("ip", "-j", "-4", "addr", "show")):
        for info in link.get("addr_info", []):
            address = info.get("local")
            if address and not ipaddress.IPv4Address(address).is_loopback:
                found.append(address)
    return found


async def ipv6_addresses(netns: str | None, interface: str) -> list[str]:
    prefix = ["ip", "-n", netns] if netns is not None else ["ip"]
    out = await run(*prefix, "-j", "-6", "addr", "show", "dev", interface)
    return [info["local"] for link in json.loads(out or "[]") for info in link["addr_info"]]


@contextlib.asynccontextmanager
async def fake_internet() -> AsyncIterator[str]:
    """Our own "internet": netns ``smt-fakeNN`` at 198.18.NN.2 behind ``smf-hNN``; yields the uplink.

    It routes the test subnet back to the host, so traffic that were forwarded
    without NAT would be answered: a must-not-reach check cannot pass by accident.
    """
    await run("ip", "-force", "-batch", "-", stdin=f"netns del {FAKENET}\n", check=False)
    await run(
        "ip", "-batch", "-",
        stdin=(
            f"netns add {FAKENET}\n"
            f"link add {FAKENET_HOST_IF} type veth peer name eth0 netns {FAKENET}\n"
            f"link set {FAKENET_HOST_IF} addrgenmode none\n"
            f"addr add {FAKENET_HOST_IP}/30 dev {FAKENET_HOST_IF}\n"
            f"link set {FAKENET_HOST_IF} up\n"
        ),
    )  # fmt: skip
    try:
        await run(
            "ip", "-n", FAKENET, "-batch", "-",
            stdin=(
                "link set lo up\n"
                f"addr add {FAKENET_IP}/30 dev eth0\n"
                "link set eth0 up\n"
                f"route add {TEST_SUBNET} via {FAKENET_HOST_IP}\n"
                f"addr add {FAKENET_LINK_LOCAL}/32 dev lo\n"
                f"addr add {FAKENET_PRIVATE}/32 dev lo\n"
            ),
        )  # fmt: skip
        await run(
            "ip", "-batch", "-",
            stdin=(
                f"route add {FAKENET_LINK_LOCAL}/32 via {FAKENET_IP}\n"
                f"route add {FAKENET_PRIVATE}/32 via {FAKENET_IP}\n"
            ),
        )  # fmt: skip
        async with server(FAKENET, "fake-internet"):
            yield FAKENET_HOST_IF
    finally:
        await run(
            "ip", "-force", "-batch", "-",
            stdin=f"link del {FAKENET_HOST_IF}\nnetns del {FAKENET}\n", check=False,
        )  # fmt: skip


async def tables() -> set[str]:
    out = await run("nft", "list", "tables")
    return {line.strip() for line in out.splitlines()} & {
        f"table inet {network.TABLE}",
        f"table ip {network.NAT_TABLE}",
    }


async def egress_elements() -> set[str]:
    out = await run(
        "nft", "-j", "list", "set", "inet", network.TABLE, "egress_ifs", check=False
    )  # fmt: skip
    found: set[str] = set()
    for item in json.loads(out or '{"nftables": []}')["nftables"]:
        found.update(str(e) for e in item.get("set", {}).get("elem", []))
    return found


async def leftovers(sandbox_ids: list[str]) -> list[str]:
    """What remains of these sandboxes' networks: netns, veth, set elements."""
    found = []
    elements = await egress_elements()
    for sandbox_id in sandbox_ids:
        netns, host_if = network.names(sandbox_id)
        if (network.NETNS_DIR / netns).exists():
            found.append(f"netns {netns} of {sandbox_id}")
        if (Path("/sys/class/net") / host_if).exists():
            found.append(f"veth {host_if} of {sandbox_id}")
        if host_if in elements:
            found.append(f"egress_ifs element {host_if} of {sandbox_id}")
    return found


def foreign_sandboxes(sandbox_ids: list[str]) -> list[str]:
    """Sandbox interfaces on the host that are not these sandboxes' (another run's, or live)."""
    ours = {network.names(s)[1] for s in sandbox_ids}
    return [
        p.name
        for p in Path("/sys/class/net").iterdir()
        if p.name.startswith(network.HOST_PREFIX) and p.name not in ours
    ]


async def force_clean(sandbox_ids: list[str]) -> None:
    """Last resort after a failed test: remove the netns of these ids, and our tables and
    ip_forward change unless another manager's sandboxes still need them."""
    batch = "".join(
        f"link del {network.names(s)[1]}\nnetns del {network.names(s)[0]}\n" for s in sandbox_ids
    )
    if batch:
        await run("ip", "-force", "-batch", "-", stdin=batch, check=False)
    if not foreign_sandboxes(sandbox_ids):
        for table in await tables():
            await run("nft", "delete", *table.split(), check=False)
        original = network._take_ip_forward()
        if original is not None:
            network.IP_FORWARD.write_text(original + "\n")
