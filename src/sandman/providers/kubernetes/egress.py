"""Egress rules on Kubernetes: a NetworkPolicy of ipBlocks per sandbox.

``network="egress"`` (or ``Egress()``: anywhere) keeps deploy/networkpolicy.yaml's
shared policy (label ``sandman.io/egress=allow``). Any other `Egress` labels the pod
``sandman.io/egress=rules`` and ``sandman.io/sandbox=<name>`` instead, and gets a
NetworkPolicy ``sandman-egress-<name>`` selecting that pod alone, owned by it (the
garbage collector deletes it with the pod): one ipBlock per allowed CIDR (``0.0.0.0/0``
and ``::/0`` for anywhere), each with ``except`` for the walls (`WALLS`) and the denied
CIDRs inside it; an allowed CIDR inside a wall or a denied one is left out (deny wins).
Cluster DNS stays reachable only for anywhere-but rules: under an allow list a lookup
through kube-dns would carry data out to any domain's servers.

Domains are refused (`ConfigError`): NetworkPolicy knows addresses only. What would
hold them is not built: an egress proxy per namespace, or a CNI's FQDN policies
(Cilium's ``toFQDNs``, Calico Enterprise) where the cluster has one; the harness's
kube-router has none.

The pod is made first, without egress (the shared policy denies it), then its policy:
a sandbox is never out unfiltered, only briefly not out at all.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from sandman import errors
from sandman.egress import Egress
from sandman.models import SandboxSpec

if TYPE_CHECKING:
    from sandman.providers.kubernetes.api import KubeAPI

__all__ = ["WALLS", "check", "pod_labels", "policy", "set_egress", "start"]

LABEL = "sandman.io/egress"
SANDBOX = "sandman.io/sandbox"
WALLS: tuple[str, ...] = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/3",
    "::1/128", "64:ff9b::/96", "fc00::/7", "fe80::/10", "ff00::/8",
)  # fmt: skip
"""deploy/networkpolicy.yaml's ``except`` lists: no rule opens them."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _plain(egress: Egress) -> bool:
    return egress.allow is None and not egress.deny


def check(egress: Egress) -> None:
    """ConfigError for a rule Kubernetes cannot hold: a domain."""
    names = [r.value for r in (*egress.rules("allow"), *egress.rules("deny")) if r.kind != "cidr"]
    if names:
        raise errors.ConfigError(
            f"egress rules name domains ({', '.join(names)}): on Kubernetes only CIDRs are "
            "held (NetworkPolicy knows addresses, not names); give the addresses, or use "
            "the local provider, whose resolver admits names"
        )


def pod_labels(name: str, spec: SandboxSpec) -> dict[str, str]:
    """The labels that give a pod its egress (none without egress)."""
    egress = spec.egress
    if egress is None:
        return {}
    check(egress)
    if _plain(egress):
        return {LABEL: "allow"}
    return {LABEL: "rules", SANDBOX: name}


def _blocks(egress: Egress) -> list[dict[str, Any]]:
    walls = [ipaddress.ip_network(w) for w in WALLS]
    denied = [r.network() for r in egress.rules("deny")]
    if egress.allow is None:
        targets: list[Network] = [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
    else:
        targets = [r.network() for r in egress.rules("allow")]
    blocks = []
    for target in targets:
        cut = [n for n in (*walls, *denied) if n.version == target.version]
        if any(target.subnet_of(n) for n in cut):  # type: ignore[arg-type]
            continue  # inside a wall or a denied range: deny wins
        inside = sorted(
            {str(n) for n in cut if n.subnet_of(target)},  # type: ignore[arg-type]
        )
        block: dict[str, Any] = {"cidr": str(target)}
        if inside:
            block["except"] = inside
        blocks.append({"ipBlock": block})
    return blocks


def policy(pod: dict[str, Any], egress: Egress) -> dict[str, Any]:
    """The NetworkPolicy of ``pod``'s egress rules, owned by the pod."""
    name = pod["metadata"]["name"]
    rules: list[dict[str, Any]] = []
    blocks = _blocks(egress)
    if blocks:
        rules.append({"to": blocks})
    if egress.allow is None:
        rules.append({
            "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        })  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(name),
            "labels": {"app.kubernetes.io/managed-by": "sandman", SANDBOX: name},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}
            ],
        },
        "spec": {
            "podSelector": {"matchLabels": {SANDBOX: name}},
            "policyTypes": ["Egress"],
            "egress": rules,
        },
    }


def policy_name(name: str) -> str:
    return f"sandman-egress-{name}"


def _url(api: KubeAPI, name: str | None = None) -> str:
    base = api.url("networking.k8s.io/v1", "networkpolicies")
    return f"{base}/{name}" if name else base


async def _apply(api: KubeAPI, pod: dict[str, Any], egress: Egress) -> None:
    body = policy(pod, egress)
    name = body["metadata"]["name"]
    found = await api.request("GET", _url(api, name), f"get {name}", missing_ok=True)
    if found:
        body["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]
        await api.request("PUT", _url(api, name), f"replace {name}", body=body)
    else:
        await api.request("POST", _url(api), f"create {name}", body=body)


async def start(api: KubeAPI, pod: dict[str, Any], spec: SandboxSpec) -> None:
    """After the pod is made: its policy, if its rules need one."""
    egress = spec.egress
    if egress is not None and not _plain(egress):
        await _apply(api, pod, egress)


async def set_egress(api: KubeAPI, name: str, egress: Egress) -> None:
    """Replace the egress rules of the sandbox pod ``name``: narrowing, the new policy
    comes before the label changes; widening, after."""
    check(egress)
    pod = await api.get_pod(name)
    labels = pod["metadata"].get("labels") or {}
    if LABEL not in labels:
        raise errors.ConfigError(
            f"sandbox {name} has no egress: egress rules need a sandbox made with "
            "network='egress' or Egress(...)"
        )
    if _plain(egress):
        await api.patch_pod_labels(name, {LABEL: "allow", SANDBOX: name})
        url = _url(api, policy_name(name))
        await api.request("DELETE", url, f"delete {policy_name(name)}", missing_ok=True)
        return
    await _apply(api, pod, egress)
    await api.patch_pod_labels(name, {LABEL: "rules", SANDBOX: name})
