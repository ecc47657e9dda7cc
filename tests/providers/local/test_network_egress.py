"""``network="egress"`` through the provider, from inside a real sandbox (crun, the daemon):
the outside is reachable; link-local addresses (a cloud's metadata service), private
ranges and the host are not, unless the operator allows a range (issue 12).

The "outside" is the fake internet of netfixtures, nothing beyond this machine. That
isolated sandboxes stay reachable from the host is test_provider_network.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from sandman.daemon.client import DaemonClient
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for
from tests.providers.local.netfixtures import (
    FAKENET_HOST_IF,
    FAKENET_IP,
    FAKENET_LINK_LOCAL,
    FAKENET_PRIVATE,
    PORT,
    TEST_SUBNET,
    fake_internet,
    host_addresses,
    host_service,
    needs_root_and_ip,
    probe,
)

pytestmark = [pytest.mark.anyio, needs_root_and_crun, needs_root_and_ip]


@pytest.fixture
async def egress_provider(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    """A provider whose egress goes out through the fake internet and may reach the one
    private address ``FAKENET_PRIVATE`` (the operator's exception)."""
    config = config_for(
        state_dir, subnet=TEST_SUBNET, uplink=FAKENET_HOST_IF,
        egress_allow=[IPv4Network(f"{FAKENET_PRIVATE}/32")],
    )  # fmt: skip
    async with provider_for(config, busybox_tar) as provider:
        yield provider


async def _connects(sb: DaemonClient, host: str, port: int) -> tuple[bool, str]:
    """Whether busybox nc inside the sandbox gets the listener's banner within 2 s."""
    result = await sb.exec(f"busybox nc -w 2 {host} {port} </dev/null", timeout=10)
    out = result.stdout
    return "sees peer" in out, out + result.stderr


async def test_egress_sandbox_reaches_out_but_not_metadata_lan_or_host(
    egress_provider: LocalProvider,
) -> None:
    async with fake_internet(), host_service() as host_port:
        for address in (FAKENET_IP, FAKENET_LINK_LOCAL, FAKENET_PRIVATE):
            assert (await probe(None, address)).reached, address  # the listeners answer
        info = await egress_provider.create(SandboxSpec(image="busybox", network="egress"))
        attachment = await egress_provider.network.get(info.id)
        assert info.endpoint is not None and attachment is not None
        async with info.endpoint.client() as sb:
            await sb.wait_ready(timeout=10)
            reached, said = await _connects(sb, FAKENET_IP, PORT)
            assert reached, said
            # The operator's exception: one private address.
            reached, said = await _connects(sb, FAKENET_PRIVATE, PORT)
            assert reached, said
            hosts = await host_addresses()
            assert attachment.host_ip in hosts
            for host, port in [(FAKENET_LINK_LOCAL, PORT)] + [(h, host_port) for h in hosts]:
                reached, said = await _connects(sb, host, port)
                assert not reached, (host, said)
        await egress_provider.delete(info.id)
