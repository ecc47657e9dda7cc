"""deploy/networkpolicy.yaml, read as a network plugin would (issue 12).

The harness cluster (hack/kube) uses the plain bridge CNI, which does not enforce
NetworkPolicy; so the policies' meaning is checked here with a small evaluator of
label selectors and ipBlocks, against the labels the provider really puts on pods."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandman.models import SandboxSpec
from sandman.providers.kubernetes import pods
from sandman.settings import KubernetesConfig

POLICIES = Path(__file__).parents[3] / "deploy" / "networkpolicy.yaml"
CONFIG = KubernetesConfig(server="https://127.0.0.1:6443", namespace="sandman")
POOL = {"sandman.io/pool": "p", "sandman.io/session": "s", "sandman.io/expires-at": "1"}


def _policies() -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(POLICIES.read_text())}


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) on ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        ok = {
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
        }[operator]
        if not ok:
            return False
    return True


def _sandbox_labels(network: str = "none", **spec: Any) -> dict[str, str]:
    made = pods.pod_manifest(
        name="sb-1", spec=SandboxSpec(image="x", network=network, **spec), labels=POOL,
        token="t", config=CONFIG,
    )  # fmt: skip
    return dict(made["metadata"]["labels"])


def _ingress_peers(labels: Mapping[str, str]) -> bool:
    """Whether a pod with ``labels`` (in any namespace) may connect to a sandbox."""
    (rule,) = _policies()["sandman-sandboxes"]["spec"]["ingress"]
    return any(
        "namespaceSelector" in peer and _selects(peer["podSelector"], labels)
        for peer in rule["from"]
    )


def _egress_allows(address: str) -> bool:
    """Whether an egress sandbox may send to ``address`` (any port) by an ipBlock."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a socket sends to ::ffff:a.b.c.d as IPv4
    for rule in _policies()["sandman-sandboxes-egress"]["spec"]["egress"]:
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None or ip.version != ipaddress.ip_network(block["cidr"]).version:
                continue
            if ip in ipaddress.ip_network(block["cidr"]) and not any(
                ip in ipaddress.ip_network(e) for e in block.get("except", [])
            ):
                return True
    return False


def test_the_policies_select_every_sandbox_and_egress_only_by_the_providers_label() -> None:
    policies = _policies()
    for network in ("none", "isolated", "egress"):
        labels = _sandbox_labels(network)
        assert _selects(policies["sandman-sandboxes"]["spec"]["podSelector"], labels)
        egress = _selects(policies["sandman-sandboxes-egress"]["spec"]["podSelector"], labels)
        assert egress == (network == "egress")


def test_only_clients_reach_the_daemon_and_a_sandbox_is_never_one() -> None:
    assert _ingress_peers({"sandman.io/client": "true", "app": "trainer"})
    assert not _ingress_peers({"app": "trainer"})
    for network in ("none", "egress"):
        assert not _ingress_peers(_sandbox_labels(network))
    # Even a sandbox pod that got the client label somehow (it cannot: see
    # test_provider_pods.py::test_reserved_labels_cannot_be_had_any_way) is no client.
    assert not _ingress_peers({**_sandbox_labels(), "sandman.io/client": "true"})
    (rule,) = _policies()["sandman-sandboxes"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "sandmand"}]
    assert _policies()["sandman-sandboxes"]["spec"]["egress"] == []


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # cloud metadata (AWS, GCP, Azure)
        "169.254.170.2",  # ECS task metadata
        "10.96.0.1",  # the API server's service IP on most clusters
        "10.244.3.7",  # a pod
        "172.20.0.10",  # EKS service range
        "192.168.1.1",  # a LAN
        "100.64.0.5",  # carrier NAT / some pod ranges
        "127.0.0.1",
        "fe80::1",  # IPv6 link-local
        "fd00:ec2::254",  # AWS metadata over IPv6
        "fd12:3456::1",  # a ULA pod or service
        "::ffff:169.254.169.254",  # IPv4-mapped: sent as IPv4, to metadata
    ],
)
def test_egress_excludes_metadata_and_the_clusters_ranges(address: str) -> None:
    assert not _egress_allows(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "151.101.0.223", "2606:4700::1111"])
def test_egress_reaches_the_internet(address: str) -> None:
    assert _egress_allows(address)


def test_egress_resolves_names_through_the_clusters_dns_only() -> None:
    rules = _policies()["sandman-sandboxes-egress"]["spec"]["egress"]
    dns = [rule for rule in rules if any("podSelector" in peer for peer in rule["to"])]
    assert len(dns) == 1
    (peer,) = dns[0]["to"]
    assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
    }
    assert {p["port"] for p in dns[0]["ports"]} == {53}
