"""Egress rules of the local provider: each sandbox's nftables chain and sets, and the
resolver that admits the addresses of allowed names (`resolver`).

A sandbox whose `Egress` has rules gets, in the ``inet sandman`` table, a chain
``e_<h>_<g>`` (``h``: its interface's hash, ``g``: its rules' generation) that the
forward chain reaches through the ``egress_chains`` verdict map, after the walls
(the operator's `EgressPolicy` and `WALLS6`), and sets of its own:

- ``d4_/d6_<h>_<g>``: denied CIDRs: rejected, even on connections already open;
- ``a4_/a6_<h>_<g>``: allowed CIDRs;
- ``n4_/n6_<h>_<d>``: addresses the resolver admitted for allowed names, each with a
  timeout (``d``: a generation of its own, kept while the allowed names only grow).

The chain, in order: denied → reject; a connection already open under this
generation (``ct mark g``) → accept; ports 53 and 853 (DNS, DNS over TLS) → only to
allowed CIDRs (when the rules name domains or allow a list: another resolver would
step around the names); anywhere (``allow=None``) or allowed or admitted → accept,
marking the connection with ``g``; anything else → reject (admin-prohibited: the
caller sees "no route to host" at once, not a timeout).

New rules (`NetworkManager.set_egress`) are a new generation, swapped in one
transaction: connections opened under the old one are judged again by the new
rules at their next packet and cut if these refuse them ("install, then close the
network" closes what is open too); the old sets go, so an admission of the old
rules still in flight in the resolver fails rather than outliving them.

Every egress sandbox (rules or not) gets ``/etc/resolv.conf`` naming its gateway
(the provider binds it read-only);
``sandman_nat`` redirects its port-53 traffic to the gateway to the resolver's port
(``dns_ports``) and ``input`` lets only that in (``dns_in``).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from sandman import errors
from sandman.egress import Egress
from sandman.providers.local import resolver as resolver_module
from sandman.providers.local import spawn

__all__ = [
    "TTL_MAX",
    "TTL_MIN",
    "WALLS6",
    "Compiled",
    "compile_rules",
    "ensure_resolver",
    "stop_resolver",
]

WALLS6: tuple[str, ...] = (
    "::/127",  # unspecified and loopback
    "::ffff:0:0/96",  # IPv4-mapped: would carry an IPv4 wall
    "64:ff9b::/96", "64:ff9b:1::/48",  # NAT64: IPv4 addresses, walls included
    "100::/64",  # discard
    "2001::/32",  # Teredo: IPv4 inside
    "2001:db8::/32",  # documentation
    "2002::/16",  # 6to4: IPv4 inside
    "fc00::/7",  # unique local: the LAN's, the VPC's, the cluster's
    "fe80::/10",  # link-local: metadata (fd00:ec2::254 is ULA, above)
    "ff00::/8",  # multicast
)  # fmt: skip
"""IPv6 ranges no egress sandbox reaches, whatever its rules say."""

TTL_MIN = 60
"""Seconds an admitted address stays at least (a record's TTL of 0 or 5 s would cut
programs that connect a moment after they look up)."""
TTL_MAX = 3600
"""Seconds at most: the answer's TTL is cut to it, so no program caches longer."""

DNS_DIR = "dns"
RESOLVER_START = 10.0
RESOLVER_STOP = 5.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _collapse(networks: Iterable[Network], version: int) -> list[str]:
    chosen = [n for n in networks if n.version == version]
    return [str(n) for n in ipaddress.collapse_addresses(chosen)]  # type: ignore[type-var]


@dataclass(frozen=True)
class Compiled:
    """A sandbox's rules as the firewall and the resolver take them."""

    open: bool
    deny4: tuple[str, ...]
    deny6: tuple[str, ...]
    allow4: tuple[str, ...]
    allow6: tuple[str, ...]
    allow_names: tuple[tuple[str, str], ...]
    deny_names: tuple[tuple[str, str], ...]

    @property
    def chain(self) -> bool:
        """Whether it needs a chain: plain ``egress`` (anywhere, nothing denied) does not."""
        return not (self.open and not self.deny4 and not self.deny6 and not self.deny_names)

    @property
    def guard_dns(self) -> bool:
        """Whether other resolvers are closed: when names are judged or a list allowed."""
        return not self.open or bool(self.deny_names)

    @property
    def admits(self) -> bool:
        """Whether the resolver admits addresses (a list naming domains)."""
        return not self.open and bool(self.allow_names)


def compile_rules(egress: Egress) -> Compiled:
    """Split and merge ``egress``'s rules (CIDRs merged: nftables refuses overlaps)."""
    allow, deny = egress.rules("allow"), egress.rules("deny")
    allow_nets = [r.network() for r in allow if r.kind == "cidr"]
    deny_nets = [r.network() for r in deny if r.kind == "cidr"]
    return Compiled(
        open=egress.open,
        deny4=tuple(_collapse(deny_nets, 4)),
        deny6=tuple(_collapse(deny_nets, 6)),
        allow4=tuple(_collapse(allow_nets, 4)),
        allow6=tuple(_collapse(allow_nets, 6)),
        allow_names=tuple((r.kind, r.value) for r in allow if r.kind != "cidr"),
        deny_names=tuple((r.kind, r.value) for r in deny if r.kind != "cidr"),
    )


def _short(host_if: str) -> str:
    return host_if.removeprefix("smh")


def chain_name(host_if: str, generation: int) -> str:
    return f"e_{_short(host_if)}_{generation}"


def set_name(kind: str, host_if: str, generation: int) -> str:
    """``kind``: d4 d6 a4 a6 n4 n6."""
    return f"{kind}_{_short(host_if)}_{generation}"


def owned(name: str, host_if: str) -> bool:
    """Whether a chain or set name is one of this interface's (any generation)."""
    head, _, generation = name.rpartition("_")
    return generation.isdigit() and head.split("_", 1)[-1] == _short(host_if)


def define(
    table: str, host_if: str, rules: Compiled, generation: int, dyn: int, *, new_dyn: bool
) -> list[str]:
    """nft commands that make the sandbox's chain and sets of ``generation`` (the admitted
    sets of ``dyn``, made too if ``new_dyn``); the map entry is the caller's."""
    lines: list[str] = []
    name = chain_name(host_if, generation)
    rule = f"add rule inet {table} {name}"
    reject = "counter reject with icmpx type admin-prohibited"
    mark = f"ct mark set {generation} accept"

    def cidrs(kind: str, family: str, items: Sequence[str]) -> str | None:
        if not items:
            return None
        sname = set_name(kind, host_if, generation)
        lines.append(
            f"add set inet {table} {sname} {{ type {family}_addr; flags interval; "
            f"elements = {{ {', '.join(items)} }}; }}"
        )
        return sname

    d4 = cidrs("d4", "ipv4", rules.deny4)
    d6 = cidrs("d6", "ipv6", rules.deny6)
    a4 = cidrs("a4", "ipv4", rules.allow4)
    a6 = cidrs("a6", "ipv6", rules.allow6)
    n4 = set_name("n4", host_if, dyn) if rules.admits else None
    n6 = set_name("n6", host_if, dyn) if rules.admits else None
    if rules.admits and new_dyn:
        lines.append(f"add set inet {table} {n4} {{ type ipv4_addr; flags timeout; }}")
        lines.append(f"add set inet {table} {n6} {{ type ipv6_addr; flags timeout; }}")
    lines.append(f"add chain inet {table} {name}")
    if d4:
        lines.append(f"{rule} ip daddr @{d4} {reject}")
    if d6:
        lines.append(f"{rule} ip6 daddr @{d6} {reject}")
    lines.append(f"{rule} ct state established,related ct mark {generation} accept")
    if rules.guard_dns:
        dns = "meta l4proto { tcp, udp } th dport { 53, 853 }"
        if a4:
            lines.append(f"{rule} {dns} ip daddr @{a4} {mark}")
        if a6:
            lines.append(f"{rule} {dns} ip6 daddr @{a6} {mark}")
        lines.append(f"{rule} {dns} {reject}")
    if rules.open:
        lines.append(f"{rule} {mark}")
    else:
        for family, sname in (("ip", a4), ("ip6", a6), ("ip", n4), ("ip6", n6)):
            if sname:
                lines.append(f"{rule} {family} daddr @{sname} {mark}")
        lines.append(f"{rule} {reject}")
    return lines


def undefine(table: str, chains: Iterable[str], sets: Iterable[str]) -> list[str]:
    """nft commands that remove chains (emptied first) and then sets."""
    lines = []
    for chain in chains:
        lines += [f"flush chain inet {table} {chain}", f"delete chain inet {table} {chain}"]
    lines += [f"delete set inet {table} {s}" for s in sets]
    return lines


def objects(
    table: str, host_if: str, rules: Compiled, generation: int, dyn: int
) -> tuple[list[str], list[str]]:
    """The (chains, sets) that `define` makes for these rules."""
    if not rules.chain:
        return [], []
    sets = [
        set_name(kind, host_if, generation)
        for kind, items in (
            ("d4", rules.deny4), ("d6", rules.deny6), ("a4", rules.allow4), ("a6", rules.allow6)
        )
        if items
    ]  # fmt: skip
    if rules.admits:
        sets += [set_name("n4", host_if, dyn), set_name("n6", host_if, dyn)]
    return [chain_name(host_if, generation)], sets


def keeps_admitted(old: Compiled | None, new: Compiled) -> bool:
    """Whether addresses admitted under ``old`` may stay under ``new``: every name
    allowed before still is, and no name is newly denied."""
    if old is None or not old.admits or not new.admits:
        return False
    return set(old.allow_names) <= set(new.allow_names) and set(new.deny_names) <= set(
        old.deny_names
    )


# -- the resolver's files ---------------------------------------------------------------


def dns_dir(network_dir: Path) -> Path:
    return network_dir / DNS_DIR


def rules_path(network_dir: Path, host_if: str) -> Path:
    return dns_dir(network_dir) / f"{host_if}.json"


def write_rules(
    network_dir: Path,
    *,
    table: str,
    host_if: str,
    host_ip: str,
    sandbox_ip: str,
    rules: Compiled,
    generation: int,
    dyn: int,
    walls: Sequence[str],
    wall_exceptions: Sequence[str],
    upstreams: Sequence[str],
) -> None:
    """The resolver's file for this sandbox, replaced atomically."""
    data: dict[str, Any] = {
        "version": resolver_module.VERSION,
        "host_if": host_if,
        "host_ip": host_ip,
        "sandbox_ip": sandbox_ip,
        "open": rules.open,
        "allow": [list(r) for r in rules.allow_names],
        "deny": [list(r) for r in rules.deny_names],
        "deny_cidrs": [*rules.deny4, *rules.deny6],
        "walls": [*walls, *WALLS6],
        "wall_exceptions": list(wall_exceptions),
        "table": table,
        "set4": set_name("n4", host_if, dyn) if rules.admits else None,
        "set6": set_name("n6", host_if, dyn) if rules.admits else None,
        "upstreams": list(upstreams),
        "ttl_min": TTL_MIN,
        "ttl_max": TTL_MAX,
        "generation": generation,
    }
    path = rules_path(network_dir, host_if)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def remove_rules(network_dir: Path, host_if: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        rules_path(network_dir, host_if).unlink()


# -- the resolver process ---------------------------------------------------------------


def _alive(directory: Path) -> bool:
    """Whether a resolver holds the directory's lock."""
    try:
        fd = os.open(directory / "resolver.lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _recorded(directory: Path) -> dict[str, int]:
    try:
        data = json.loads((directory / "resolver.json").read_text())
        return {"pid": int(data["pid"]), "port": int(data["port"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


async def ensure_resolver(network_dir: Path) -> int:
    """The port of the resolver of ``network_dir``, started if none runs. Call it under the
    network state's lock (a resolver exits only under it)."""
    directory = dns_dir(network_dir)
    await anyio.to_thread.run_sync(lambda: directory.mkdir(mode=0o700, parents=True, exist_ok=True))
    if await anyio.to_thread.run_sync(_alive, directory):
        port = (await anyio.to_thread.run_sync(_recorded, directory)).get("port")
        if port:
            return port
    script = Path(resolver_module.__file__)
    # -S -E: the standard library only, no site-packages, no PYTHON* variables.
    done = await spawn.run(
        [sys.executable, "-S", "-E", str(script), str(directory)], timeout=RESOLVER_START
    )
    out = done.stdout.decode(errors="replace").split()
    if done.returncode != 0 or len(out) != 2 or out[0] != "ready":
        raise errors.ProviderError(
            f"the egress resolver did not start ({done.returncode}): "
            f"{done.stderr.decode(errors='replace').strip()[-500:]}"
        )
    return int(out[1])


async def stop_resolver(network_dir: Path) -> None:
    """Stop the resolver (no sandbox needs it); under the network state's lock."""
    directory = dns_dir(network_dir)
    if not await anyio.to_thread.run_sync(_alive, directory):
        return
    pid = (await anyio.to_thread.run_sync(_recorded, directory)).get("pid")
    if pid is None or not _is_resolver(pid, directory):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + RESOLVER_STOP
    while await anyio.to_thread.run_sync(_alive, directory):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
        await anyio.sleep(0.01)


def _is_resolver(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is this directory's resolver (not a pid reused since)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(directory).encode() in argv and any(a.endswith(b"resolver.py") for a in argv)


def resolver_pid(network_dir: Path) -> int | None:
    """The running resolver's pid (for tests and ``doctor``), or None."""
    directory = dns_dir(network_dir)
    if not _alive(directory):
        return None
    return _recorded(directory).get("pid")
