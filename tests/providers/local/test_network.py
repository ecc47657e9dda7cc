"""Network modes against real namespaces, veths and nftables; ``ip netns exec`` plays the sandbox.

Traffic stays on this machine (see netfixtures): the "internet" is a
namespace of our own behind the uplink ``smf-hNN``.

The tables and ``ip_forward`` are host-wide: where another manager's
sandboxes exist on the host, the checks that they are gone after a reset
are skipped (the tables must then stay).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandman import errors
from sandman.providers.local import network
from sandman.providers.local.network import NetworkAttachment, NetworkManager
from tests.providers.local.netfixtures import (
    FAKENET_HOST_IF,
    FAKENET_HOST_IP,
    FAKENET_IP,
    FAKENET_LINK_LOCAL,
    FAKENET_PRIVATE,
    PORT,
    TEST_SUBNET,
    egress_elements,
    fake_internet,
    force_clean,
    foreign_sandboxes,
    host_addresses,
    host_service,
    ipv6_addresses,
    leftovers,
    needs_root_and_ip,
    probe,
    run,
    server,
    tables,
)

logger = logging.getLogger(__name__)

# -- pure -----------------------------------------------------------------------


def test_names_fit_interface_names() -> None:
    netns, host_if = network.names("sb-0123456789ab")
    assert netns.startswith("sm-") and host_if.startswith("smh")
    assert len(host_if) <= 15 and netns[3:] == host_if[3:]
    assert network.names("sb-0123456789ab") == (netns, host_if)
    assert network.names("sb-0123456789ac") != (netns, host_if)
    assert len(network.names("x" * 63)[1]) <= 15


def test_slots() -> None:
    subnet = ipaddress.IPv4Network("10.200.0.0/16")
    assert network.slot(subnet, 0) == ("10.200.0.1", "10.200.0.2")
    assert network.slot(subnet, 1) == ("10.200.0.5", "10.200.0.6")
    assert network.slot(subnet, 16383) == ("10.200.255.253", "10.200.255.254")
    with pytest.raises(errors.CapacityError):
        network.slot(subnet, 16384)
    assert network._lowest_free([0, 1, 3]) == 2
    assert network._lowest_free([]) == 0


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError):
        NetworkManager(state_dir=tmp_path, subnet="10.200.0.0/31")
    with pytest.raises(errors.ConfigError):
        NetworkManager(state_dir=tmp_path, subnet="not-a-subnet")
    with pytest.raises(errors.ConfigError):
        NetworkManager(state_dir=tmp_path, uplink="smh0123456789")
    with pytest.raises(errors.ConfigError, match="egress_allow: invalid IPv4 range"):
        network.EgressPolicy.of(allow=["10.0.0.1/8"])
    with pytest.raises(errors.ConfigError, match="egress_deny"):
        network.EgressPolicy.of(deny=["fe80::/10"])


def test_egress_policy_in_the_ruleset() -> None:
    """The default policy is in force for an interface without one; ranges are merged."""
    default = network.EgressPolicy()
    assert "169.254.0.0/16" in default.deny and "10.0.0.0/8" in default.deny
    merged = network.EgressPolicy.of(deny=["10.0.0.0/8", "10.1.0.0/16"], allow=["10.1.2.3/32"])
    assert merged == network.EgressPolicy(deny=("10.0.0.0/8",), allow=("10.1.2.3/32",))
    rules = network.ruleset(
        egress_ifs=["smha", "smhb"], uplinks=["eth0"], policies={"smhb": merged}
    )  # fmt: skip
    assert '"smha" . 169.254.0.0/16' in rules and '"smhb" . 169.254.0.0/16' not in rules
    assert '"smhb" . 10.1.2.3/32' in rules
    forward = rules[rules.index("chain forward") :]
    # allow before deny before the general egress (each then by its own rules, `egress`)
    assert (
        forward.index("@egress_allow goto egress_rules")
        < forward.index("@egress_deny counter drop")
        < forward.index("oifname @uplink_ifs goto egress_rules\n")
    )


# -- real networks --------------------------------------------------------------


class Harness:
    """A manager on a temporary state dir, with the ids it handed out, for cleanup."""

    def __init__(self, state_dir: Path, uplink: str = FAKENET_HOST_IF) -> None:
        self.state_dir = state_dir
        self.manager = NetworkManager(state_dir=state_dir, subnet=TEST_SUBNET, uplink=uplink)
        self.uplink = uplink
        self.ids: list[str] = []

    def new_id(self) -> str:
        sandbox_id = f"t-{uuid.uuid4().hex[:10]}"
        self.ids.append(sandbox_id)
        return sandbox_id

    async def sandbox(self, mode: network.NetworkMode) -> tuple[str, NetworkAttachment]:
        sandbox_id = self.new_id()
        return sandbox_id, await self.manager.setup(sandbox_id, mode)


_FORWARD_RECORD = network.HOST_STATE / "ip_forward.original"


def _ip_forward() -> str:
    return network.IP_FORWARD.read_text().strip()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sm-net-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def harness(state_dir: Path) -> AsyncIterator[Harness]:
    """Resets the manager afterwards and checks that nothing is left, whatever the test did."""
    # Only a run alone on the host knows what ip_forward must return to.
    alone_before = not foreign_sandboxes([]) and not _FORWARD_RECORD.exists()
    before = _ip_forward()
    h = Harness(state_dir)
    try:
        yield h
    finally:
        try:
            await h.manager.reset()
        finally:
            alone = not foreign_sandboxes(h.ids)
            left = await leftovers(h.ids)
            remaining_tables = await tables() if alone else set()
            record = alone and _FORWARD_RECORD.exists()
            if left or remaining_tables or record:
                await force_clean(h.ids)
            after = _ip_forward()
        assert not left, left
        assert not remaining_tables, remaining_tables
        assert not record, "reset left ip_forward changed"
        if alone and alone_before:
            assert after == before, f"ip_forward was {before}, reset left {after}"


def _sandbox_ns(attachment: NetworkAttachment) -> str:
    return Path(attachment.netns_path).name


async def _unreachable(netns: str, targets: list[tuple[str, int]]) -> None:
    """None of the targets answers from ``netns`` within about a second."""
    results = await asyncio.gather(*(probe(netns, host, port) for host, port in targets))
    reached = [(t, r.text) for t, r in zip(targets, results, strict=True) if r.reached]
    assert not reached, f"{netns} reached {reached}"


@pytest.mark.anyio
@needs_root_and_ip
async def test_isolated(harness: Harness) -> None:
    async with fake_internet(), host_service() as host_port:
        a_id, a = await harness.sandbox("isolated")
        _, b = await harness.sandbox("isolated")
        # An egress sandbox switches ip_forward on: isolation must hold anyway.
        _, e = await harness.sandbox("egress")
        assert _ip_forward() == "1"
        assert a.netns_path == f"/var/run/netns/{network.names(a_id)[0]}"
        assert a.host_interface == network.names(a_id)[1]
        assert ipaddress.IPv4Address(a.sandbox_ip) in ipaddress.IPv4Network(TEST_SUBNET)
        a_ns, b_ns = _sandbox_ns(a), _sandbox_ns(b)
        async with server(a_ns, "sandbox-a"), server(b_ns, "sandbox-b"):
            # The host reaches the sandbox, and sees it under its own address.
            seen = await probe(None, a.sandbox_ip)
            assert seen.reached, seen.text
            assert seen.text == f"sandbox-a sees peer {a.host_ip}"
            # lo is up inside.
            assert (await probe(a_ns, "127.0.0.1")).text.startswith("sandbox-a")
            hosts = await host_addresses()
            assert {a.host_ip, b.host_ip, e.host_ip, FAKENET_HOST_IP} <= set(hosts)
            await _unreachable(
                a_ns,
                [(h, host_port) for h in hosts]  # host services, via every host address
                + [(b.sandbox_ip, PORT)]  # another sandbox
                + [(FAKENET_IP, PORT)],  # the outside
            )
        # No IPv6 on either end of the veth.
        assert await ipv6_addresses(None, a.host_interface) == []
        assert await ipv6_addresses(a_ns, "eth0") == []


@pytest.mark.anyio
@needs_root_and_ip
async def test_egress(harness: Harness) -> None:
    async with fake_internet(), host_service() as host_port:
        _, e = await harness.sandbox("egress")
        _, i = await harness.sandbox("isolated")
        e_ns, i_ns = _sandbox_ns(e), _sandbox_ns(i)
        assert _ip_forward() == "1"
        assert e.host_interface in await egress_elements()
        assert i.host_interface not in await egress_elements()
        async with server(e_ns, "sandbox-e"), server(i_ns, "sandbox-i"):
            out = await probe(e_ns, FAKENET_IP)
            assert out.reached, out.text
            # Masqueraded: the outside sees the uplink's address, not the sandbox's.
            assert out.text == f"fake-internet sees peer {FAKENET_HOST_IP}"
            hosts = await host_addresses()
            await _unreachable(
                e_ns, [(h, host_port) for h in hosts] + [(i.sandbox_ip, PORT)]
            )  # fmt: skip
            await _unreachable(i_ns, [(e.sandbox_ip, PORT), (FAKENET_IP, PORT)])
            assert (await probe(None, e.sandbox_ip)).reached


@pytest.mark.anyio
@needs_root_and_ip
async def test_teardown_and_reset_leave_nothing(harness: Harness) -> None:
    alone_before = not foreign_sandboxes([]) and not _FORWARD_RECORD.exists()
    before = _ip_forward()
    async with fake_internet():
        e_id, e = await harness.sandbox("egress")
        i_id, _ = await harness.sandbox("isolated")
        assert await harness.manager.list() == sorted([e_id, i_id])
        assert len(await tables()) == 2
        await harness.manager.teardown(e_id)
        assert await leftovers([e_id]) == []
        assert e.host_interface not in await egress_elements()
        await harness.manager.teardown(e_id)  # idempotent
        await harness.manager.teardown("t-never-made")
        assert await harness.manager.list() == [i_id]
        await harness.manager.teardown(i_id)
        assert await harness.manager.list() == []
        assert await leftovers(harness.ids) == []
        assert len(await tables()) == 2  # the tables stay until reset
        await harness.manager.reset()
        state = json.loads((harness.state_dir / "network" / "alloc.json").read_text())
        assert state["attachments"] == {}
        if not foreign_sandboxes(harness.ids):
            assert await tables() == set()
            assert not _FORWARD_RECORD.exists()
            if alone_before:
                assert _ip_forward() == before


@pytest.mark.anyio
@needs_root_and_ip
async def test_teardown_while_a_process_holds_the_namespace(harness: Harness) -> None:
    """A container not yet deleted keeps the netns alive: the veth is removed anyway."""
    sandbox_id, attachment = await harness.sandbox("isolated")
    async with server(_sandbox_ns(attachment), "still-running"):
        start = time.monotonic()
        await harness.manager.teardown(sandbox_id)
        assert time.monotonic() - start < network.VETH_WAIT + 2
        assert await leftovers([sandbox_id]) == []
        assert not (await probe(None, attachment.sandbox_ip)).reached


@pytest.mark.anyio
@needs_root_and_ip
async def test_reset_removes_live_networks(harness: Harness) -> None:
    async with fake_internet():
        await harness.sandbox("egress")
        await harness.sandbox("isolated")
        await harness.manager.reset()
        assert await harness.manager.list() == []
        assert await leftovers(harness.ids) == []
        if not foreign_sandboxes(harness.ids):
            assert await tables() == set()


@pytest.mark.anyio
@needs_root_and_ip
async def test_reset_keeps_the_rules_another_manager_needs(
    harness: Harness, tmp_path: Path
) -> None:
    async with fake_internet(), host_service() as host_port:
        _, mine = await harness.sandbox("egress")
        other = Harness(tmp_path)
        try:
            _, theirs = await other.sandbox("egress")
            # Same subnet, separate state: the address on the host is not handed out twice.
            assert theirs.host_ip != mine.host_ip
            await other.manager.reset()
            assert len(await tables()) == 2
            assert _ip_forward() == "1"
            await _unreachable(_sandbox_ns(mine), [(mine.host_ip, host_port)])
            out = await probe(_sandbox_ns(mine), FAKENET_IP)
            assert out.text == f"fake-internet sees peer {FAKENET_HOST_IP}"
        finally:
            await other.manager.reset()
            await force_clean(other.ids)


@pytest.mark.anyio
@needs_root_and_ip
async def test_ensure_reloads_a_removed_ruleset(harness: Harness) -> None:
    async with fake_internet(), host_service() as host_port:
        _, e = await harness.sandbox("egress")
        e_ns = _sandbox_ns(e)
        assert await harness.manager.ensure() is True
        # Exclusive: no other manager can make a sandbox while the rules are away.
        async with network._host_lock(shared=False):
            if foreign_sandboxes(harness.ids):
                pytest.skip("removing the tables would expose the other sandboxes on this host")
            for table in await tables():
                await run("nft", "delete", *table.split())
            assert (await probe(e_ns, e.host_ip, host_port)).reached  # exposed without rules
            assert await harness.manager.ensure() is False
        assert e.host_interface in await egress_elements()
        await _unreachable(e_ns, [(e.host_ip, host_port)])
        assert (await probe(e_ns, FAKENET_IP)).text == f"fake-internet sees peer {FAKENET_HOST_IP}"


@pytest.mark.anyio
@needs_root_and_ip
async def test_30_cycles_leak_nothing(harness: Harness) -> None:
    setups: list[float] = []
    teardowns: list[float] = []
    async with fake_internet():
        for n in range(30):
            mode: network.NetworkMode = "egress" if n % 2 else "isolated"
            sandbox_id = harness.new_id()
            start = time.perf_counter()
            attachment = await harness.manager.setup(sandbox_id, mode)
            setups.append(time.perf_counter() - start)
            assert attachment.host_ip == network.slot(ipaddress.IPv4Network(TEST_SUBNET), 0)[0]
            start = time.perf_counter()
            await harness.manager.teardown(sandbox_id)
            teardowns.append(time.perf_counter() - start)
            assert await leftovers([sandbox_id]) == []
    assert await harness.manager.list() == []
    assert await leftovers(harness.ids) == []
    logger.warning(
        "30 cycles: setup median %.1f ms (max %.1f), teardown median %.1f ms (max %.1f)",
        statistics.median(setups) * 1000, max(setups) * 1000,
        statistics.median(teardowns) * 1000, max(teardowns) * 1000,
    )  # fmt: skip


@pytest.mark.anyio
@needs_root_and_ip
async def test_allocations_persist_across_managers(harness: Harness) -> None:
    first = harness.manager
    s1, a1 = await harness.sandbox("isolated")
    s2, a2 = await harness.sandbox("isolated")
    second = NetworkManager(state_dir=harness.state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF)
    assert await second.list() == sorted([s1, s2])
    assert await second.get(s1) == a1
    s3 = harness.new_id()
    a3 = await second.setup(s3, "isolated")
    assert len({a1.host_ip, a2.host_ip, a3.host_ip}) == 3
    await first.teardown(s1)
    s4 = harness.new_id()
    a4 = await second.setup(s4, "isolated")
    assert a4.host_ip == a1.host_ip  # the lowest free /30 again
    assert await first.list() == sorted([s2, s3, s4])
    with pytest.raises(errors.ConfigError, match="holds networks"):
        await NetworkManager(state_dir=harness.state_dir, subnet="10.232.0.0/16").setup(
            harness.new_id(), "isolated"
        )


@pytest.mark.anyio
@needs_root_and_ip
async def test_concurrent_setups(harness: Harness) -> None:
    attachments = await asyncio.gather(*(harness.sandbox("isolated") for _ in range(8)))
    assert len({a.sandbox_ip for _, a in attachments}) == 8
    assert len(await harness.manager.list()) == 8
    await asyncio.gather(*(harness.manager.teardown(s) for s, _ in attachments))
    assert await leftovers(harness.ids) == []


@pytest.mark.anyio
@needs_root_and_ip
async def test_refusals_leave_nothing(harness: Harness, state_dir: Path) -> None:
    forward = _ip_forward()
    sandbox_id, _ = await harness.sandbox("isolated")
    with pytest.raises(errors.ConfigError, match="already has a network"):
        await harness.manager.setup(sandbox_id, "isolated")
    assert (await probe(None, "127.0.0.1", 1)).reached is False  # sanity of the probe itself
    missing = NetworkManager(state_dir=state_dir, subnet=TEST_SUBNET, uplink="smx-missing")
    other = harness.new_id()
    with pytest.raises(errors.ConfigError, match="does not exist"):
        await missing.setup(other, "egress")
    assert await harness.manager.list() == [sandbox_id]
    assert await leftovers([other]) == []
    assert _ip_forward() == forward


async def _policy_elements() -> str:
    out = await run("nft", "list", "set", "inet", network.TABLE, "egress_deny", check=False)
    return out + await run("nft", "list", "set", "inet", network.TABLE, "egress_allow", check=False)


@pytest.mark.anyio
@needs_root_and_ip
async def test_egress_excludes_link_local_private_and_the_host(harness: Harness) -> None:
    """Issue 12: egress reaches the outside, but not a metadata service (link-local), the
    LAN (private ranges) or the host, unless the operator allows a range."""
    allowing = Harness(harness.state_dir / "allowing")
    allowing.manager = NetworkManager(
        state_dir=allowing.state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF,
        egress=network.EgressPolicy.of(allow=[f"{FAKENET_PRIVATE}/32"]),
    )  # fmt: skip
    try:
        async with fake_internet(), host_service() as host_port:
            # The controls: each listener answers the host, so a refusal below is the rules'.
            for address in (FAKENET_IP, FAKENET_LINK_LOCAL, FAKENET_PRIVATE):
                seen = await probe(None, address)
                assert seen.reached, (address, seen.text)
            _, e = await harness.sandbox("egress")
            _, a = await allowing.sandbox("egress")
            e_ns, a_ns = _sandbox_ns(e), _sandbox_ns(a)
            out = await probe(e_ns, FAKENET_IP)
            assert out.reached, out.text
            hosts = await host_addresses()
            await _unreachable(
                e_ns,
                [(FAKENET_LINK_LOCAL, PORT), (FAKENET_PRIVATE, PORT)]
                + [(h, host_port) for h in hosts],
            )
            # The operator's exception, for its sandboxes only; link-local stays denied.
            allowed = await probe(a_ns, FAKENET_PRIVATE)
            assert allowed.reached, allowed.text
            assert (await probe(a_ns, FAKENET_IP)).reached
            await _unreachable(
                a_ns, [(FAKENET_LINK_LOCAL, PORT)] + [(h, host_port) for h in hosts]
            )  # fmt: skip
            # A reload (nft flush ruleset) brings the manager's sandboxes back with their
            # policies (another manager's stay shut out until it reloads: fail closed).
            await run("nft", "delete", "table", "inet", network.TABLE)
            assert not await harness.manager.ensure()
            await _unreachable(e_ns, [(FAKENET_LINK_LOCAL, PORT), (FAKENET_PRIVATE, PORT)])
            assert (await probe(e_ns, FAKENET_IP)).reached
            await _unreachable(a_ns, [(FAKENET_LINK_LOCAL, PORT)])
            await allowing.manager.teardown(allowing.ids[0])
            elements = await _policy_elements()
            assert a.host_interface not in elements and e.host_interface in elements
    finally:
        await allowing.manager.reset()
        left = await leftovers(allowing.ids)
        if left:
            await force_clean(allowing.ids)
        assert not left, left


@pytest.mark.anyio
@needs_root_and_ip
async def test_a_ruleset_without_policy_sets_is_replaced(harness: Harness) -> None:
    """Tables an older sandman loaded (no egress_deny): replaced, never used unfiltered."""
    old = network.ruleset(uplinks=[FAKENET_HOST_IF])
    old = old.replace(old[old.index("    set egress_deny") : old.index("    chain input")], "")
    old = "\n".join(line for line in old.splitlines() if "@egress_allow" not in line)
    old = "\n".join(line for line in old.splitlines() if "@egress_deny" not in line) + "\n"
    for newer in ("@dns_in", "@egress_chains", "@wall6", "@sandbox_flows"):  # later sets
        old = "\n".join(line for line in old.splitlines() if newer not in line) + "\n"
    if foreign_sandboxes([]):
        pytest.skip("another manager's sandboxes use the tables on this host")
    await run("nft", "-f", "-", stdin=old)
    async with fake_internet():
        _, e = await harness.sandbox("egress")
        assert e.host_interface in await _policy_elements()
        await _unreachable(_sandbox_ns(e), [(FAKENET_LINK_LOCAL, PORT)])
        assert (await probe(_sandbox_ns(e), FAKENET_IP)).reached


@pytest.mark.anyio
@needs_root_and_ip
async def test_a_network_that_cannot_be_recorded_is_not_made(harness: Harness) -> None:
    """Found by the chaos suite (embedded/state-ro): an egress sandbox's set elements were
    added before its allocation was saved; when the save failed (a read-only or full
    state directory) they stayed, and no teardown knew of them."""
    async with fake_internet():
        await harness.sandbox("isolated")  # the state file exists and stays readable
        blocker = harness.state_dir / "network" / "alloc.tmp"
        blocker.mkdir()  # where the new state is written first: every save fails
        sandbox_id = harness.new_id()
        try:
            with pytest.raises(errors.ProviderError, match="network state failed"):
                await harness.manager.setup(sandbox_id, "egress")
            _, host_if = network.names(sandbox_id)
            assert host_if not in await _policy_elements()
            assert await leftovers([sandbox_id]) == []
        finally:
            blocker.rmdir()
        assert len(await harness.manager.list()) == 1
