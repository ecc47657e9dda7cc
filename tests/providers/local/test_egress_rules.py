"""``network=Egress(allow=[...], deny=[...])`` on the local provider, from inside real
sandboxes (crun, the daemon, busybox's own resolver and nc), against the fake internet
of netfixtures and a DNS server of ours (dnsfixtures): nothing leaves this machine.

Each test plays an attack or checks a promise of docs/security.md ("Egress rules").
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from sandman import errors
from sandman.daemon.client import DaemonClient
from sandman.egress import Egress
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider, egress, network
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for
from tests.providers.local.dnsfixtures import (
    FAKENET6,
    HOST6,
    FakeDNS,
    fake_dns,
    public_addresses,
    stray_resolver,
)
from tests.providers.local.netfixtures import (
    FAKENET,
    FAKENET_HOST_IF,
    FAKENET_IP,
    FAKENET_LINK_LOCAL,
    FAKENET_PRIVATE,
    PORT,
    TEST_SUBNET,
    fake_internet,
    needs_root_and_ip,
    run,
)
from tests.support import wait_for

pytestmark = [pytest.mark.anyio, needs_root_and_crun, needs_root_and_ip]


@dataclass
class World:
    provider: LocalProvider
    dns: FakeDNS
    public: list[str]


@pytest.fixture
async def world(state_dir: Path, busybox_tar: Path) -> AsyncIterator[World]:
    """The fake internet with four more public addresses, our upstream DNS, and a
    provider whose egress goes there (the operator excepts ``FAKENET_PRIVATE``)."""
    async with fake_internet(), public_addresses() as public, fake_dns() as dns:
        config = config_for(
            state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF,
            egress_allow=[IPv4Network(f"{FAKENET_PRIVATE}/32")],
            dns_upstream=[f"127.0.0.1:{dns.port}"],
        )  # fmt: skip
        async with provider_for(config, busybox_tar) as provider:
            yield World(provider, dns, public)
        # After the last delete: the resolver is gone and so are its files.
        network_dir = state_dir / "network"

        async def resolver_gone() -> bool:
            return egress.resolver_pid(network_dir) is None and not (network_dir / "dns").exists()

        await wait_for("the resolver to exit and its files to go", 10, resolver_gone)


@pytest.fixture
async def sandbox(world: World) -> AsyncIterator[tuple[str, DaemonClient]]:
    """An egress sandbox with nothing allowed yet (tests set its rules)."""
    info = await world.provider.create(
        SandboxSpec(image="busybox", network=Egress(allow=[]))
    )  # fmt: skip
    assert info.endpoint is not None
    async with info.endpoint.client() as client:
        await client.wait_ready(timeout=10)
        yield info.id, client
    await world.provider.delete(info.id)
    assert await _leftovers(world.provider, info.id) == []


async def _reaches(sb: DaemonClient, host: str, port: int = PORT) -> bool:
    """Whether busybox nc inside gets a banner from host:port (the fake internet's, or
    the stray resolver's on 853)."""
    result = await sb.exec(f"busybox nc -w 2 {host} {port} </dev/null", timeout=15)
    return "sees peer" in result.stdout or "stray-dot" in result.stdout


async def _lookup(sb: DaemonClient, name: str, server: str = "") -> list[str]:
    """The addresses busybox's nslookup gets for ``name`` (from its resolv.conf's server)."""
    result = await sb.exec(f"busybox nslookup -type=a {name} {server}", timeout=15)
    lines = result.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Name:")), len(lines))
    return [line.split()[-1] for line in lines[start:] if line.startswith("Address")]


async def _leftovers(provider: LocalProvider, sandbox_id: str) -> list[str]:
    """What is left of a deleted sandbox's egress rules: chains, sets, map entries, files."""
    _, host_if = network.names(sandbox_id)
    found = []
    for argv in (("list", "chains", "inet"), ("-t", "list", "sets", "inet")):
        out = await run("nft", "-j", *argv)
        for item in json.loads(out)["nftables"]:
            thing = item.get("chain") or item.get("set")
            if thing and egress.owned(thing["name"], host_if):
                found.append(thing["name"])
    for table, name in (("inet sandman", "egress_chains"), ("ip sandman_nat", "dns_ports")):
        out = await run("nft", "list", "map", *table.split(), name, check=False)
        if host_if in out:
            found.append(f"{name} entry")
    if host_if in await run("nft", "list", "set", "inet", "sandman", "dns_in", check=False):
        found.append("dns_in entry")
    rules = egress.rules_path(provider.config.state_dir.resolve() / "network", host_if)
    if rules.exists():
        found.append(str(rules))
    return found


# -- CIDRs ------------------------------------------------------------------------------


async def test_an_allowed_cidr_is_reachable_and_nothing_else(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    sid, sb = sandbox
    a, b, c, _ = world.public
    assert not await _reaches(sb, a)  # allow=[]: nothing
    await world.provider.set_egress(sid, Egress(allow=[f"{a}/32", f"{FAKENET_PRIVATE}/32"]))
    assert await _reaches(sb, a)
    assert await _reaches(sb, FAKENET_PRIVATE)  # behind a wall the operator opened
    assert not await _reaches(sb, b)
    assert not await _reaches(sb, FAKENET_IP)
    # Walls stay walls whatever allow says: metadata, other private ranges.
    await world.provider.set_egress(sid, Egress(allow=["169.254.0.0/16", "10.0.0.0/8", a]))
    assert not await _reaches(sb, FAKENET_LINK_LOCAL)
    assert await _reaches(sb, FAKENET_PRIVATE)  # the operator's exception, and allowed
    assert await _reaches(sb, a) and not await _reaches(sb, c)


async def test_deny_wins_over_allow(world: World, sandbox: tuple[str, DaemonClient]) -> None:
    sid, sb = sandbox
    a, b, _, _ = world.public
    world.dns.zone.update(
        {
            "x.test": [("A", a, 300)],
            "bad.x.test": [("A", b, 300)],
            "good.x.test": [("CNAME", "bad.x.test", 300)],
        }
    )
    wide = str(IPv4Network(f"{a}/24", strict=False))
    await world.provider.set_egress(
        sid, Egress(allow=[wide, "*.x.test"], deny=[f"{b}/32", "bad.x.test"])
    )
    assert await _reaches(sb, a)
    assert not await _reaches(sb, b)
    world.dns.asked.clear()
    assert await _lookup(sb, "bad.x.test") == []  # NXDOMAIN, and never asked upstream
    assert await _lookup(sb, "good.x.test") == []  # its CNAME leads to a denied name
    assert ("bad.x.test", 1) not in world.dns.asked
    assert await _lookup(sb, "x.test") == []  # *.x.test is what is under it, not x.test


# -- domains ----------------------------------------------------------------------------


async def test_an_allowed_name_opens_its_addresses_only_once_looked_up_here(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    sid, sb = sandbox
    a, b, c, _ = world.public
    world.dns.zone.update(
        {
            "pkg.test": [("CNAME", "edge.cdn.test", 300)],
            "edge.cdn.test": [("A", a, 5)],
            "files.pkg.test": [("A", b, 300)],
            "other.test": [("A", c, 300)],
        }
    )
    await world.provider.set_egress(sid, Egress(allow=["pkg.test", "*.pkg.test"]))
    # Decided: an allowed name's address is closed until the sandbox looks the name up
    # through our resolver (the firewall knows addresses, not names).
    assert not await _reaches(sb, a)
    assert await _lookup(sb, "pkg.test") == [a]
    assert await _reaches(sb, a)  # by its address, as a program does after the lookup
    assert await _reaches(sb, "pkg.test")  # by name: nc looks it up itself
    assert await _lookup(sb, "files.pkg.test") == [b]
    assert await _reaches(sb, b)
    # A name no rule allows is NXDOMAIN, without a lookup leaving the host.
    world.dns.asked.clear()
    assert await _lookup(sb, "other.test") == []
    assert world.dns.asked == []
    assert not await _reaches(sb, c)
    # The record's TTL was 5 s: the set keeps it at least TTL_MIN, and says so.
    host_if = network.names(sid)[1]
    out = await run("nft", "list", "set", "inet", "sandman", f"n4_{host_if[3:]}_2")
    assert a in out and "expires" in out


async def test_dns_rebinding_to_private_or_metadata_addresses_gains_nothing(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    sid, sb = sandbox
    a, _, _, _ = world.public
    attachment = await world.provider.network.get(sid)
    assert attachment is not None
    world.dns.zone["rebind.test"] = [("A", a, 1)]
    await world.provider.set_egress(sid, Egress(allow=["rebind.test"]))
    assert await _lookup(sb, "rebind.test") == [a]
    # The same name now answers the metadata address, the host's gateway, loopback,
    # a private address, an IPv4-mapped private address: none is admitted or answered.
    for evil in (FAKENET_LINK_LOCAL, attachment.host_ip, "127.0.0.1", "10.254.0.9"):
        world.dns.zone["rebind.test"] = [("A", evil, 1)]
        assert await _lookup(sb, "rebind.test") == [], evil
        assert not await _reaches(sb, evil), evil
    world.dns.zone["rebind.test"] = [("A", a, 1), ("A", FAKENET_LINK_LOCAL, 1)]
    assert await _lookup(sb, "rebind.test") == [a]  # the public one only
    # What the operator excepted from the walls may be admitted by name.
    world.dns.zone["rebind.test"] = [("A", FAKENET_PRIVATE, 1)]
    assert await _lookup(sb, "rebind.test") == [FAKENET_PRIVATE]
    assert await _reaches(sb, FAKENET_PRIVATE)


async def test_a_direct_ip_and_other_resolvers_are_refused(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    sid, sb = sandbox
    a, b, _, _ = world.public
    world.dns.zone["ok.test"] = [("A", a, 300)]
    await world.provider.set_egress(sid, Egress(allow=["ok.test"]))
    async with stray_resolver(answer=b) as stray:
        # A direct IP: refused at once ("no route to host"), not a timeout.
        result = await sb.exec(f"busybox nc -w 5 {b} {PORT} </dev/null", timeout=15)
        assert "No route to host" in result.stderr, result
        # Another resolver: its port 53 (UDP) and 853 (DNS over TLS) are closed...
        assert await _lookup(sb, "ok.test", stray) == []
        assert not await _reaches(sb, stray, 853)
        # ...even once its address is admitted under an allowed name (a name of the
        # workload's choice pointing at a resolver of its own).
        world.dns.zone["ok.test"] = [("A", a, 300), ("A", stray, 300)]
        assert sorted(await _lookup(sb, "ok.test")) == sorted([a, stray])
        assert await _reaches(sb, stray)  # its port 8080 now, as the name's address
        assert await _lookup(sb, "ok.test", stray) == []
        assert not await _reaches(sb, stray, 853)
        # Allowed by CIDR, it is a resolver like another (the caller chose it).
        await world.provider.set_egress(sid, Egress(allow=[f"{stray}/32"]))
        assert await _lookup(sb, "anything.test", stray) == [b]
        assert await _reaches(sb, stray, 853)
        assert not await _reaches(sb, b)  # what it answered is not admitted


async def test_set_egress_changes_rules_live_and_cuts_what_they_refuse(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    sid, sb = sandbox
    a, b, _, _ = world.public
    await world.provider.set_egress(sid, Egress(allow=[a, b]))
    async with _echo_server(8081):
        process = await sb.spawn(f"busybox nc {a} 8081", stdin=True)
        assert await _echoed(sb, process.id, "one\n")
        # Only b now: the open connection to a is cut at its next packet.
        await world.provider.set_egress(sid, Egress(allow=[b]))
        assert not await _echoed(sb, process.id, "two\n", wait=2)
        assert await _reaches(sb, b) and not await _reaches(sb, a)
        await sb.signal(process.id, "KILL")
        # Rules that still allow it keep a connection open across a change.
        await world.provider.set_egress(sid, Egress(allow=[a]))
        process = await sb.spawn(f"busybox nc {a} 8081", stdin=True)
        assert await _echoed(sb, process.id, "three\n")
        await world.provider.set_egress(sid, Egress(allow=[a, b], deny=["nothing.test"]))
        assert await _echoed(sb, process.id, "four\n")
        # Close the network ("install, then close").
        await world.provider.set_egress(sid, Egress(allow=[]))
        assert not await _echoed(sb, process.id, "five\n", wait=2)
        assert not await _reaches(sb, a) and not await _reaches(sb, b)
        await sb.signal(process.id, "KILL")
    # And open it (anywhere but the walls).
    await world.provider.set_egress(sid, Egress())
    assert await _reaches(sb, a) and await _reaches(sb, FAKENET_IP)
    assert not await _reaches(sb, FAKENET_LINK_LOCAL)


async def test_set_egress_needs_an_egress_sandbox(world: World) -> None:
    info = await world.provider.create(SandboxSpec(image="busybox", network="isolated"))
    with pytest.raises(errors.ConfigError, match="network 'isolated'"):
        await world.provider.set_egress(info.id, Egress(allow=[]))
    await world.provider.delete(info.id)
    with pytest.raises(errors.SandboxNotFound):
        await world.provider.set_egress(info.id, Egress(allow=[]))


async def test_ipv6_is_refused_unless_allowed(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    """Local sandboxes get no IPv6 route; this test gives one (a /64 on the veth, IPv6
    forwarding on) to show that the firewall holds IPv6 too: walls, deny, allow."""
    sid, sb = sandbox
    netns, host_if = network.names(sid)
    forwarding = Path("/proc/sys/net/ipv6/conf/all/forwarding")
    before = forwarding.read_text()
    gateway6, inside6 = HOST6.replace(":0:", ":1:", 1), FAKENET6.replace(":0:", ":1:", 1)
    wall6 = "fd00:5a4d::1"
    await run(
        "ip", "-batch", "-",
        stdin=(
            f"addr add {gateway6}/64 dev {host_if} nodad\n"
            f"addr add {HOST6}/64 dev {FAKENET_HOST_IF} nodad\n"
            f"route add {wall6}/128 via {FAKENET6}\n"
        ),
    )  # fmt: skip
    await run(
        "ip", "-n", FAKENET, "-batch", "-",
        stdin=(
            f"addr add {FAKENET6}/64 dev eth0 nodad\naddr add {wall6}/128 dev lo\n"
            f"route add {gateway6.rsplit(':', 2)[0]}::/64 via {HOST6}\n"
        ),
    )  # fmt: skip
    await run(
        "ip", "-n", netns, "-batch", "-",
        stdin=f"addr add {inside6}/64 dev eth0 nodad\nroute add default via {gateway6}\n",
    )  # fmt: skip
    # Static neighbours: the host's input chain takes nothing from a sandbox, neighbour
    # discovery included (another reason local sandboxes have no IPv6).
    for here, peer_ns, peer_if, address, there in (
        (None, netns, "eth0", inside6, host_if),
        (netns, None, host_if, gateway6, "eth0"),
        (None, FAKENET, "eth0", FAKENET6, FAKENET_HOST_IF),
        (FAKENET, None, FAKENET_HOST_IF, HOST6, "eth0"),
    ):
        peer = ["ip", "-n", peer_ns] if peer_ns else ["ip"]
        mac = json.loads(await run(*peer, "-j", "link", "show", peer_if))[0]["address"]
        mine = ["ip", "-n", here] if here else ["ip"]
        await run(*mine, "-6", "neigh", "replace", address, "lladdr", mac, "dev", there)
    server = _echo_server(PORT6, _BANNER6)
    await server.__aenter__()
    try:
        forwarding.write_text("1\n")
        probe = f"busybox nc -w 2 {FAKENET6} {PORT6} </dev/null"
        assert "sees peer" not in (await sb.exec(probe, timeout=15)).stdout
        await world.provider.set_egress(sid, Egress(allow=[f"{FAKENET6}/128", wall6]))
        assert "sees peer" in (await sb.exec(probe, timeout=15)).stdout
        walled = f"busybox nc -w 2 {wall6} {PORT6} </dev/null"
        assert "sees peer" not in (await sb.exec(walled, timeout=15)).stdout  # a ULA wall
        await world.provider.set_egress(
            sid, Egress(allow=[f"{FAKENET6}/128"], deny=[f"{FAKENET6}/128"])
        )
        assert "sees peer" not in (await sb.exec(probe, timeout=15)).stdout
    finally:
        await server.__aexit__()
        forwarding.write_text(before)
        await run("ip", "route", "del", f"{wall6}/128", check=False)
        await run(
            "ip", "-6", "addr", "del", f"{HOST6}/64", "dev", FAKENET_HOST_IF, check=False
        )  # fmt: skip


# -- the limits (docs/security.md: what cannot be held) ---------------------------------


async def test_a_shared_address_serves_names_never_allowed(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    """A CDN's address serves many tenants: once an allowed name opens it, every name it
    serves is reachable (HTTP Host, TLS SNI). Shown here as the limit it is."""
    sid, sb = sandbox
    _, _, c, _ = world.public
    world.dns.zone.update({"mine.test": [("A", c, 300)], "theirs.test": [("A", c, 300)]})
    await world.provider.set_egress(sid, Egress(allow=["mine.test"], deny=["theirs.test"]))
    assert await _lookup(sb, "theirs.test") == []
    assert await _lookup(sb, "mine.test") == [c]
    assert await _reaches(sb, c)  # and so whatever else c serves


async def test_dns_over_https_to_an_allowed_host_opens_no_address(
    world: World, sandbox: tuple[str, DaemonClient]
) -> None:
    """An allowed host may answer names itself (DNS over HTTPS): no filter on DNS can
    see that, but what it answers is not admitted; only our resolver's answers are."""
    sid, sb = sandbox
    a, b, _, _ = world.public
    world.dns.zone["doh.test"] = [("A", a, 300)]
    await world.provider.set_egress(sid, Egress(allow=["doh.test"]))
    assert await _lookup(sb, "doh.test") == [a]
    assert await _reaches(sb, a)  # the "DoH server" answers: b is where evil.test is
    assert not await _reaches(sb, b)


async def test_the_resolver_outlives_the_provider_that_started_it(
    state_dir: Path, busybox_tar: Path
) -> None:
    """``sandman create`` exits once its sandbox runs: its DNS must go on."""
    async with fake_internet(), public_addresses() as public, fake_dns() as dns:
        dns.zone["ok.test"] = [("A", public[0], 300)]
        config = config_for(
            state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF,
            dns_upstream=[f"127.0.0.1:{dns.port}"],
        )  # fmt: skip
        async with provider_for(config, busybox_tar) as keeper:
            first = LocalProvider(config)
            info = await first.create(
                SandboxSpec(image="busybox", network=Egress(allow=["ok.test"]))
            )
            await first.aclose()
            pid = egress.resolver_pid(state_dir / "network")
            assert pid is not None
            assert info.endpoint is not None
            async with info.endpoint.client() as sb:
                await sb.wait_ready(timeout=10)
                assert await _lookup(sb, "ok.test") == [public[0]]
                assert await _reaches(sb, public[0])
            await keeper.delete(info.id)

            async def exited() -> bool:
                return not Path(f"/proc/{pid}").exists()

            await wait_for("the resolver to exit", 10, exited)


# -- helpers ----------------------------------------------------------------------------

_ECHO = """
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(8)
print("ready", flush=True)
def echo(c):
    while data := c.recv(4096):
        c.sendall(data)
while True:
    threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
"""


PORT6 = 8082
_BANNER6 = """
import socket, sys
srv = socket.socket(socket.AF_INET6); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("::", int(sys.argv[1]))); srv.listen(8)
print("ready", flush=True)
while True:
    c, peer = srv.accept(); c.sendall(f"v6 sees peer {peer[0]}".encode()); c.close()
"""


class _echo_server:
    """A line echo server (or another ``script``) in the fake internet on ``port``."""

    def __init__(self, port: int, script: str = _ECHO) -> None:
        self.port = port
        self.script = script
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> None:
        argv = [
            "ip",
            "netns",
            "exec",
            FAKENET,
            sys.executable,
            "-I",
            "-c",
            self.script,
            str(self.port),
        ]
        self.process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(10):
            assert await self.process.stdout.readline() == b"ready\n"

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()


async def _echoed(sb: DaemonClient, process_id: str, line: str, wait: float = 5) -> bool:
    """Whether ``line`` written to the nc process comes back within ``wait`` seconds."""
    before = len((await sb.read_output(process_id)).stdout)
    await sb.write_stdin(process_id, line)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while loop.time() < deadline:
        output = await sb.read_output(process_id, stdout_offset=before, wait=0.5)
        if line.strip() in output.stdout:
            return True
    return False
