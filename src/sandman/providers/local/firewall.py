"""The nftables ruleset of the local provider's sandbox networks, as text (no I/O:
`network` loads it and adds and deletes each sandbox's elements, in its order).

One ruleset serves every sandbox (``smh*`` matches them all):

- ``input``: from a sandbox, only replies (ESTABLISHED, RELATED) reach the
  host. Without it the weak host model exposes every host service bound to
  0.0.0.0, through any host address, including the sandbox's own gateway.
- ``forward``: sandbox to sandbox is dropped; sandboxes in the ``egress_ifs``
  set may go out through an uplink in ``uplink_ifs``, except to the ranges of
  their `EgressPolicy` (``egress_deny``, keyed by interface and address, less
  ``egress_allow``), then by their own rules (``egress_chains``: `egress`);
  nothing else. IPv6 from egress sandboxes meets `egress.WALLS6`.
- ``sandman_nat``: what leaves through an uplink is masqueraded; an egress
  sandbox's DNS to its gateway goes to the resolver's port (``dns_ports``).
- in ``input`` and ``forward`` first: a sandbox's new connections past its
  ``conntrack_max`` tracked ones are dropped (``ct count``, per interface in the
  ``sandbox_flows`` set; each sandbox's element carries its manager's cap), so
  no sandbox can fill the host's conntrack table.

The outside excludes, unless the operator allows them: link-local addresses
(169.254.0.0/16: cloud metadata services answer there with the machine's
credentials), private ranges (the LAN, the cloud's VPC, other clusters) and the
rest of `DEFAULT_EGRESS_DENY`. The host's own addresses and other sandboxes are
never reachable (``input``, and ``forward`` above), whatever the policy says.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sandman import errors
from sandman.egress import Egress
from sandman.providers.local import egress as egress_rules

__all__ = [
    "DEFAULT_CONNTRACK_MAX",
    "DEFAULT_EGRESS_DENY",
    "HOST_PREFIX",
    "NAT_TABLE",
    "OUR_TABLES",
    "POLICY_SETS",
    "TABLE",
    "EgressPolicy",
    "SandboxEgress",
    "chain_element",
    "dns_elements",
    "flows_element",
    "policy_sets",
    "recorded_policy",
    "ruleset",
    "sandbox_egress",
]

HOST_PREFIX = "smh"
"""The host end of every sandbox's veth pair is named so (``smh<hash>``)."""
TABLE = "sandman"
NAT_TABLE = "sandman_nat"
OUR_TABLES = {f"table inet {TABLE}", f"table ip {NAT_TABLE}"}
POLICY_SETS = {"egress_deny", "egress_allow", "wall6", "dns_in", "sandbox_flows"}
"""Sets of the ``inet`` table that a ruleset from before egress policies lacks."""

DEFAULT_CONNTRACK_MAX = 4096
"""Tracked connections a sandbox may have at once (`LocalConfig.conntrack_max`)."""

DEFAULT_EGRESS_DENY: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # private (RFC 1918)
    "100.64.0.0/10",  # shared address space: carrier NAT, some clusters' pods
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local: cloud metadata (169.254.169.254), its credentials
    "224.0.0.0/4", "240.0.0.0/4",  # multicast, reserved and broadcast
)  # fmt: skip
"""What ``egress`` sandboxes may not reach unless allowed (`LocalConfig.egress_deny`)."""


def _networks(ranges: Iterable[str | ipaddress.IPv4Network], what: str) -> tuple[str, ...]:
    """Validated, merged CIDR ranges (nftables refuses overlapping intervals)."""
    parsed = []
    for item in ranges:
        try:
            parsed.append(ipaddress.IPv4Network(item))
        except ValueError as exc:
            raise errors.ConfigError(f"{what}: invalid IPv4 range {item!r}: {exc}") from None
    return tuple(str(n) for n in ipaddress.collapse_addresses(parsed))


@dataclass(frozen=True)
class EgressPolicy:
    """Where an ``egress`` sandbox may not go (``deny``), and the exceptions (``allow``,
    checked first). CIDR strings; merged and validated by `EgressPolicy.of`."""

    deny: tuple[str, ...] = field(default_factory=lambda: _networks(DEFAULT_EGRESS_DENY, "deny"))
    allow: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        deny: Iterable[str | ipaddress.IPv4Network] = DEFAULT_EGRESS_DENY,
        allow: Iterable[str | ipaddress.IPv4Network] = (),
    ) -> EgressPolicy:
        """ConfigError on a range that is not IPv4 CIDR."""
        return cls(deny=_networks(deny, "egress_deny"), allow=_networks(allow, "egress_allow"))


@dataclass(frozen=True)
class SandboxEgress:
    """An egress sandbox's rules in the firewall: `egress.Compiled` and its generations."""

    rules: egress_rules.Compiled
    generation: int = 1
    dyn: int = 1


def _ifnames(items: Iterable[str]) -> str:
    return ", ".join(json.dumps(item) for item in sorted(items))


def _policy_elements(host_if: str, ranges: Sequence[str]) -> list[str]:
    return [f"{json.dumps(host_if)} . {cidr}" for cidr in ranges]


def _elements(items: Sequence[str]) -> str:
    return f" elements = {{ {', '.join(items)} }};" if items else ""


def ruleset(
    *,
    egress_ifs: Iterable[str] = (),
    uplinks: Iterable[str] = (),
    policies: Mapping[str, EgressPolicy] | None = None,
    rules: Mapping[str, SandboxEgress] | None = None,
    dns_port: int | None = None,
    flows: Mapping[str, int] | None = None,
    conntrack_max: int = DEFAULT_CONNTRACK_MAX,
) -> str:
    """The whole nftables ruleset (both tables), replacing any previous one atomically.

    ``policies`` maps an egress interface to its policy; one not in it gets the default.
    ``rules``: an egress interface's own rules (`egress`); ``dns_port``: the resolver's,
    to which each egress interface's DNS goes. ``flows``: each sandbox interface's cap
    on tracked connections; one not in it gets ``conntrack_max``.
    """
    flow_elements = [flows_element(i, n) for i, n in sorted((flows or {}).items())]
    cap = f"add @sandbox_flows {{ iifname ct count over {conntrack_max} }}"
    wild = json.dumps(HOST_PREFIX + "*")
    egress_ifs = sorted(egress_ifs)
    egress = _ifnames(egress_ifs)
    up = _ifnames(uplinks)
    egress_elements = f" elements = {{ {egress} }};" if egress else ""
    uplink_elements = f" elements = {{ {up} }};" if up else ""
    deny: list[str] = []
    allow: list[str] = []
    own: list[str] = []
    for host_if in egress_ifs:
        policy = (policies or {}).get(host_if) or EgressPolicy()
        deny += _policy_elements(host_if, policy.deny)
        allow += _policy_elements(host_if, policy.allow)
        mine = (rules or {}).get(host_if)
        if mine is not None and mine.rules.chain:
            own += egress_rules.define(
                TABLE, host_if, mine.rules, mine.generation, mine.dyn, new_dyn=True
            )
            own.append(chain_element(host_if, mine.generation, "add"))
        if dns_port is not None:
            own += dns_elements(host_if, dns_port, "add")
    walls6 = ", ".join(egress_rules.WALLS6)
    return f"""\
add table inet {TABLE}
delete table inet {TABLE}
add table ip {NAT_TABLE}
delete table ip {NAT_TABLE}
table inet {TABLE} {{
    set egress_ifs {{ type ifname;{egress_elements} }}
    set uplink_ifs {{ type ifname;{uplink_elements} }}
    set egress_deny {{ type ifname . ipv4_addr; flags interval;{_elements(deny)} }}
    set egress_allow {{ type ifname . ipv4_addr; flags interval;{_elements(allow)} }}
    set wall6 {{ type ipv6_addr; flags interval; elements = {{ {walls6} }}; }}
    set dns_in {{ type ifname . inet_service; }}
    map egress_chains {{ type ifname : verdict; }}
    set sandbox_flows {{ type ifname; size 65535; flags dynamic;{_elements(flow_elements)} }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname {wild} ct state new {cap} counter drop
        iifname {wild} ct state established,related accept
        meta l4proto {{ tcp, udp }} iifname . th dport @dns_in ct status dnat accept
        iifname {wild} counter drop
    }}
    chain egress_rules {{
        iifname vmap @egress_chains
        meta nfproto ipv4 accept
        counter drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname {wild} oifname {wild} counter drop
        iifname {wild} ct state new {cap} counter drop
        oifname {wild} ct state established,related accept
        meta nfproto ipv4 iifname @egress_ifs oifname @uplink_ifs iifname . ip daddr @egress_allow goto egress_rules
        meta nfproto ipv4 iifname . ip daddr @egress_deny counter drop
        meta nfproto ipv6 iifname @egress_ifs ip6 daddr @wall6 counter drop
        iifname @egress_ifs oifname @uplink_ifs goto egress_rules
        iifname {wild} counter drop
        oifname {wild} counter drop
    }}
}}
table ip {NAT_TABLE} {{
    set uplink_ifs {{ type ifname;{uplink_elements} }}
    map dns_ports {{ type ifname : inet_service; }}
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname {wild} fib daddr type local meta l4proto {{ tcp, udp }} th dport 53 redirect to :iifname map @dns_ports
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        iifname {wild} oifname @uplink_ifs counter masquerade
    }}
}}
""" + "".join(line + "\n" for line in own)


def flows_element(host_if: str, conntrack_max: int) -> str:
    """``host_if``'s element of ``sandbox_flows``: its cap on tracked connections."""
    return f"{json.dumps(host_if)} ct count over {conntrack_max}"


def chain_element(host_if: str, generation: int, verb: Literal["add", "delete"]) -> str:
    """The ``egress_chains`` element that sends ``host_if`` to its rules' chain."""
    value = f" : goto {egress_rules.chain_name(host_if, generation)}" if verb == "add" else ""
    return f"{verb} element inet {TABLE} egress_chains {{ {json.dumps(host_if)}{value} }}"


def dns_elements(host_if: str, port: int, verb: Literal["add", "delete"]) -> list[str]:
    """The elements that send ``host_if``'s DNS to the resolver's ``port``."""
    name = json.dumps(host_if)
    if verb == "delete":
        return [
            f"delete element ip {NAT_TABLE} dns_ports {{ {name} }}",
            f"delete element inet {TABLE} dns_in {{ {name} . {port} }}",
        ]
    return [
        f"add element ip {NAT_TABLE} dns_ports {{ {name} : {port} }}",
        f"add element inet {TABLE} dns_in {{ {name} . {port} }}",
    ]


def policy_sets(
    host_if: str, policy: EgressPolicy, verb: Literal["add", "delete"], only: str | None = None
) -> str:
    """nft commands that add (or delete) the elements of ``host_if``'s policy."""
    lines = []
    for which, ranges in (("deny", policy.deny), ("allow", policy.allow)):
        if ranges and only in (None, which):
            items = ", ".join(_policy_elements(host_if, ranges))
            lines.append(f"{verb} element inet {TABLE} egress_{which} {{ {items} }}\n")
    return "".join(lines)


def sandbox_egress(entry: Mapping[str, Any]) -> SandboxEgress:
    """An egress allocation's rules (anywhere for one recorded before rules were)."""
    rules = Egress(**entry["rules"]) if "rules" in entry else Egress()
    return SandboxEgress(
        egress_rules.compile_rules(rules), entry.get("generation", 1), entry.get("dyn", 1)
    )


def recorded_policy(entry: Mapping[str, Any]) -> EgressPolicy:
    """The policy an egress allocation was made with (the default for one recorded before
    policies were: fail closed)."""
    if "egress_deny" not in entry:
        return EgressPolicy()
    return EgressPolicy(
        deny=tuple(entry["egress_deny"]), allow=tuple(entry.get("egress_allow", ()))
    )
