"""``Egress(allow=[CIDR...], deny=[...])`` on the harness's real node: a NetworkPolicy of
ipBlocks per sandbox (providers/kubernetes/egress.py), enforced by kube-router.

The "internet" is two public addresses on a portless bridge of this machine (pods
reach the node's own addresses). Each refusal is shown open first: with ``Egress()``
(the shared policy's anywhere-but-walls; deploy/networkpolicy.yaml is not applied in
this namespace, so nothing else restricts it).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
from collections.abc import Iterator

import anyio
import pytest

import sandman
from sandman import errors
from sandman.egress import Egress
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.deployment import kubectl
from tests.kube.support import real_node_spec
from tests.kube.test_network_policy import (
    config_in,
    converge,
    enforced,  # noqa: F401 (a fixture)
    from_sandbox,
    listener,
    namespace,  # noqa: F401 (a fixture)
    pool,
)

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 300)]


@contextlib.contextmanager
def public_addresses() -> Iterator[tuple[str, str]]:
    """Two addresses of 198.19.N.0/24 (benchmarking space: no wall) on this machine."""
    link, n = f"sne{secrets.token_hex(3)}", secrets.randbelow(250) + 1
    a, b = f"198.19.{n}.1", f"198.19.{n}.2"
    subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
    try:
        for address in (a, b):
            subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", link], check=True)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        yield a, b
    finally:
        subprocess.run(["ip", "link", "del", link], check=False)


def _policies(cluster: KubeCluster, in_namespace: str) -> list[str]:
    out = kubectl(cluster, "-n", in_namespace, "get", "networkpolicies", "-o", "json").stdout
    return [item["metadata"]["name"] for item in json.loads(out)["items"]]


async def test_cidr_rules_hold_on_the_node_and_change_live(
    kube_cluster: KubeCluster,
    enforced: str,  # noqa: F811
    namespace: str,  # noqa: F811
) -> None:
    config = config_in(kube_cluster, namespace)
    with public_addresses() as (a, b):
        rules = Egress(allow=[f"{a.rsplit('.', 1)[0]}.0/24"], deny=[f"{b}/32"])
        async with (
            listener(a) as port_a,
            listener(b) as port_b,
            sandman.kubernetes(config, pool=pool(namespace)) as client,
            client.sandbox(real_node_spec(kube_cluster, network=rules), timeout=120) as sb,
        ):
            to_a, to_b = from_sandbox(sb, a, port_a), from_sandbox(sb, b, port_b)
            policy = f"sandman-egress-{sb.id}"
            assert policy in _policies(kube_cluster, namespace)
            # Shown open first: anywhere (no policy of its own).
            await sb.set_egress(Egress())
            assert policy not in _policies(kube_cluster, namespace)
            await converge("anywhere -> b", to_b, open_=True)
            await converge("anywhere -> a", to_a, open_=True)
            # The /24 allowed, b denied inside it: deny wins.
            await sb.set_egress(rules)
            await converge("rules -> b (denied)", to_b, open_=False)
            await converge("rules -> a (allowed)", to_a, open_=True)
            # Live: only b now.
            await sb.set_egress(allow=[b])
            await converge("b only -> a", to_a, open_=False)
            await converge("b only -> b", to_b, open_=True)
            # Closed.
            await sb.set_egress(allow=[])
            await converge("closed -> b", to_b, open_=False)
            # The walls stay walls: a CIDR inside one is left out.
            await sb.set_egress(allow=["169.254.0.0/16", enforced + "/32"])
            body = json.loads(
                kubectl(
                    kube_cluster, "-n", namespace, "get", "networkpolicy", policy, "-o", "json"
                ).stdout
            )
            assert body["spec"].get("egress", []) == []
            # Domains are refused, with what would hold them.
            with pytest.raises(errors.ConfigError, match="only CIDRs"):
                await sb.set_egress(allow=["pypi.org"])
            sandbox_id = sb.id
        # Nothing left: the policy goes with its pod (owner reference).
        deadline = anyio.current_time() + 60
        while f"sandman-egress-{sandbox_id}" in _policies(kube_cluster, namespace):
            assert anyio.current_time() < deadline, "the sandbox's policy outlived it"
            await anyio.sleep(0.5)


async def test_a_domain_rule_is_refused_at_create(
    kube_cluster: KubeCluster,
    namespace: str,  # noqa: F811
) -> None:
    config = config_in(kube_cluster, namespace)
    async with sandman.kubernetes(config, pool=pool(namespace)) as client:
        spec = real_node_spec(kube_cluster, network=Egress(allow=["pypi.org"]))
        with pytest.raises(errors.ConfigError, match="only CIDRs"):
            async with client.sandbox(spec, timeout=60):
                pass
