"""Network modes of the local provider: ``isolated`` and ``egress``.

(About 890 lines: `NetworkManager`'s setup, teardown, `set_egress` and reset, with the
commands and state files they run under its locks; their order is what keeps a crash
from leaking a namespace, a /30 or a flow, and any sandbox from going out unfiltered.
The ruleset's text is `firewall`'s, each sandbox's own rules `egress`'s.)

Each sandbox with a network gets a named network namespace ``sm-<h>`` (``h``
is 10 hex digits of a hash of the sandbox id) and a veth pair: ``smh<h>`` on
the host, ``eth0`` inside, with a /30 from the subnet (index ``n`` is the n-th
/30: host end ``.1``, sandbox ``.2``), lo up and a default route via the host
end. IPv6 is off on both ends (no address is ever generated), and the
``inet`` table drops IPv6 from sandboxes as well.

One nftables ruleset (`firewall`) serves every sandbox: from a sandbox, only replies
reach the host, sandbox to sandbox is dropped, and an ``egress`` sandbox goes out
only through an uplink, past the walls of its `EgressPolicy` and by its own rules.

``isolated``: reachable from the host only. ``egress``: also NAT to the
outside, which needs ``ip_forward`` (host-wide; switched on only once the
forward rules are loaded, and restored by :meth:`NetworkManager.reset`).
A sandbox's policy is recorded with its allocation and goes
into the sets in the same transaction as its ``egress_ifs`` element, before
it: there is no moment when it may go out unfiltered.

Allocations live in ``<state_dir>/network/alloc.json`` under an ``flock``,
so several processes and a restarted one agree on them. An allocation is
recorded before anything is made, so a crash leaves nothing that
:meth:`NetworkManager.list` does not report and ``teardown`` cannot remove.

The tables, the ``smh*`` names and ``ip_forward`` belong to the whole host,
and several managers (state directories) may share it: their state lives in
``/run/sandman/network`` (boot-scoped, like the namespaces and ``ip_forward``
themselves). Setups hold its lock shared; ``reset`` holds it exclusively and
removes the tables and restores ``ip_forward`` only when no sandbox interface
is left on the host. A /30 whose address is already on the host is skipped.

A teardown forgets the sandbox's flows before its /30 is free again: every
conntrack entry with either of its two addresses, as source or destination of
either direction, is deleted (``conntrack -D``) once its veth is gone. Else a
NAT mapping of the deleted sandbox (a UDP stream, a DNS answer in flight) would
deliver what was meant for it to the next sandbox given its address. If that
fails, the /30 stays allocated and the next teardown tries again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio

from sandman import _flock, errors
from sandman.egress import Egress
from sandman.providers.local import egress as egress_rules
from sandman.providers.local import spawn
from sandman.providers.local.firewall import (
    DEFAULT_CONNTRACK_MAX,
    DEFAULT_EGRESS_DENY,
    HOST_PREFIX,
    NAT_TABLE,
    OUR_TABLES,
    POLICY_SETS,
    TABLE,
    EgressPolicy,
    SandboxEgress,
    chain_element,
    dns_elements,
    flows_element,
    policy_sets,
    recorded_policy,
    ruleset,
    sandbox_egress,
)

__all__ = [
    "DEFAULT_EGRESS_DENY",
    "HOST_PREFIX",
    "NAT_TABLE",
    "TABLE",
    "EgressPolicy",
    "NetworkAttachment",
    "NetworkManager",
    "NetworkMode",
    "names",
    "ruleset",
    "slot",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

NetworkMode = Literal["isolated", "egress"]

NETNS_PREFIX = "sm-"
SANDBOX_INTERFACE = "eth0"
NETNS_DIR = Path("/var/run/netns")
SYS_NET = Path("/sys/class/net")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
HOST_STATE = Path("/run/sandman/network")
COMMAND_TIMEOUT = 10.0
VETH_WAIT = 1.0
_STATE_VERSION = 1
_IFNAMSIZ = 15


@dataclass(frozen=True)
class NetworkAttachment:
    """What a sandbox's container needs to join its network."""

    netns_path: str
    """``/var/run/netns/<name>``: goes into the OCI config, ``namespaces[].path``."""
    sandbox_ip: str
    host_ip: str
    host_interface: str


# -- pure parts -------------------------------------------------------------


def names(sandbox_id: str) -> tuple[str, str]:
    """The (netns, host interface) names of a sandbox: stable, and short enough for IFNAMSIZ."""
    short = hashlib.sha256(sandbox_id.encode()).hexdigest()[:10]
    host = HOST_PREFIX + short
    assert len(host) <= _IFNAMSIZ
    return NETNS_PREFIX + short, host


def slot(subnet: ipaddress.IPv4Network, index: int) -> tuple[str, str]:
    """The (host, sandbox) addresses of the ``index``-th /30 of ``subnet``."""
    base = int(subnet.network_address) + 4 * index
    if index < 0 or base + 3 > int(subnet.broadcast_address):
        raise errors.CapacityError(f"no free /30 left in {subnet}")
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def _lowest_free(used: Iterable[int]) -> int:
    taken = set(used)
    index = 0
    while index in taken:
        index += 1
    return index


def _host_batch(netns: str, host_if: str, host_ip: str) -> str:
    return (
        f"netns add {netns}\n"
        f"link add {host_if} type veth peer name {SANDBOX_INTERFACE} netns {netns}\n"
        f"link set {host_if} addrgenmode none\n"
        f"addr add {host_ip}/30 dev {host_if}\n"
        f"link set {host_if} up\n"
    )


def _inside_batch(sandbox_ip: str, host_ip: str) -> str:
    return (
        "link set lo up\n"
        f"link set {SANDBOX_INTERFACE} addrgenmode none\n"
        f"addr add {sandbox_ip}/30 dev {SANDBOX_INTERFACE}\n"
        f"link set {SANDBOX_INTERFACE} up\n"
        f"route add default via {host_ip}\n"
    )


# -- state ------------------------------------------------------------------


def _empty_state(subnet: str) -> dict[str, Any]:
    return {"version": _STATE_VERSION, "subnet": subnet, "attachments": {}, "uplinks": []}


async def _lock(path: Path, operation: int) -> int:
    """``path``'s flock (close the fd to unlock); a cancelled caller leaves it free
    (`sandman._flock`), a failing state directory is a ProviderError naming the path."""
    try:
        return await _flock.lock(path, operation, mode=0o600, parent_mode=0o700)
    except OSError as exc:
        if isinstance(exc, errors.SandboxError):
            raise
        raise errors.ProviderError(
            f"the network state failed at {exc.filename or path}: {exc.strerror or exc}"
        ) from exc


async def _on_disk(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` on the state files, in a thread; a failing state directory
    (read-only, full) is a ProviderError naming the path, not a bare OSError."""
    try:
        return await anyio.to_thread.run_sync(call, *args)
    except OSError as exc:
        if isinstance(exc, errors.SandboxError):
            raise
        raise errors.ProviderError(
            f"the network state failed at {exc.filename or call}: {exc.strerror or exc}"
        ) from exc


@contextlib.asynccontextmanager
async def _host_lock(*, shared: bool) -> AsyncIterator[None]:
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    fd = await _lock(HOST_STATE / "lock", operation)
    try:
        yield
    finally:
        os.close(fd)


class _Store:
    """``alloc.json`` guarded by an flock on ``lock`` (blocking calls: run them in a thread)."""

    def __init__(self, directory: Path, subnet: str) -> None:
        self.directory = directory
        self.path = directory / "alloc.json"
        self.subnet = subnet

    async def acquire(self) -> int:
        return await _lock(self.directory / "lock", fcntl.LOCK_EX)

    def load(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.path.read_text())
        except FileNotFoundError:
            return _empty_state(self.subnet)
        if state.get("version") != _STATE_VERSION:
            raise errors.ConfigError(f"{self.path}: unknown state version {state.get('version')}")
        return state

    def save(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


# -- commands ---------------------------------------------------------------


async def _run(*argv: str, stdin: str | None = None, check: bool = True) -> tuple[int, str]:
    """Run a command with a deadline; returns (exit code, stdout), or raises ProviderError."""
    # Not asyncio's subprocesses: one cancelled as asyncio.run ends (which cancels
    # every task, asyncio's own pipe-connecting one too) never finishes, and the
    # interpreter's exit hung on it.
    try:
        done = await spawn.run(
            argv, timeout=COMMAND_TIMEOUT, stdin=stdin.encode() if stdin is not None else None
        )
    except FileNotFoundError:
        raise errors.ConfigError(
            f"{argv[0]} not found: apt-get install -y iproute2 nftables"
        ) from None
    if check and done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()
        raise errors.ProviderError(f"{' '.join(argv)} failed ({done.returncode}): {message}")
    return done.returncode, done.stdout.decode(errors="replace")


_CONNTRACK_DIRECTIONS = ("--orig-src", "--orig-dst", "--reply-src", "--reply-dst")


async def _forget_flows(addresses: Iterable[str]) -> None:
    """Delete every conntrack entry that has one of ``addresses`` at either end, in either
    direction (the original one and the reply, which NAT rewrites). ProviderError if
    one could not be deleted.

    One call at a time: conntrack stops at the first entry it finds already gone
    (another call's, or expired), so such a call is made again."""
    for address in addresses:
        for flag in _CONNTRACK_DIRECTIONS:
            for _ in range(_CONNTRACK_TRIES):
                try:
                    done = await spawn.run(
                        ["conntrack", "-D", flag, address], timeout=COMMAND_TIMEOUT
                    )
                except FileNotFoundError:
                    raise errors.ConfigError(_NO_CONNTRACK) from None
                message = done.stderr.decode(errors="replace").strip()
                # It exits 1 when nothing matched: "0 flow entries have been deleted".
                if done.returncode == 0 or "flow entries have been deleted" in message:
                    break
                if "such conntrack doesn't exist" not in message:
                    raise errors.ProviderError(
                        f"conntrack -D {flag} {address} failed ({done.returncode}): {message}"
                    )
            else:
                raise errors.ProviderError(f"conntrack -D {flag} {address}: entries kept going")


_CONNTRACK_TRIES = 10


_NO_CONNTRACK = (
    "conntrack not found: sandbox networks need it to forget a deleted sandbox's flows "
    "(apt-get install -y conntrack)"
)


async def _default_uplink() -> str | None:
    _, out = await _run("ip", "-j", "route", "show", "default")
    for route in json.loads(out or "[]"):
        if isinstance(route, dict) and route.get("dev"):
            return str(route["dev"])
    return None


async def _host_slots(subnet: ipaddress.IPv4Network) -> set[int]:
    """The /30s of ``subnet`` whose addresses are on the host already (another manager's)."""
    _, out = await _run("ip", "-j", "-4", "addr", "show")
    taken = set()
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            address = ipaddress.IPv4Address(info.get("local", "0.0.0.0"))
            if address in subnet:
                taken.add((int(address) - int(subnet.network_address)) // 4)
    return taken


async def _sandbox_links() -> builtins.list[str]:
    """Every sandbox interface (``smh*``) on the host, whichever manager made it."""
    return [p.name async for p in anyio.Path(SYS_NET).iterdir() if p.name.startswith(HOST_PREFIX)]


async def _loaded_sets() -> dict[str, set[str]]:
    """Our tables that are loaded (as ``table <family> <name>``), each with its sets' names.

    Both tables always hold sets, so ``list sets`` sees them (terse: no elements)."""
    _, out = await _run("nft", "-t", "list", "sets")
    found: dict[str, set[str]] = {}
    table: str | None = None
    for line in out.splitlines():
        words = line.split()
        if line.startswith("table ") and len(words) >= 3:
            table = " ".join(words[:3])
            if table in OUR_TABLES:
                found.setdefault(table, set())
        elif table in found and words[:1] == ["set"] and len(words) >= 2:
            found[table].add(words[1])
    return found


async def _our_tables() -> set[str]:
    """Which of our two tables are loaded (as ``table <family> <name>``)."""
    return set(await _loaded_sets())


class NetworkManager:
    """Creates and removes the network of each sandbox (see the module docstring)."""

    def __init__(
        self,
        *,
        state_dir: Path,
        subnet: str = "10.200.0.0/16",
        uplink: str | None = None,
        egress: EgressPolicy | None = None,
        dns_upstream: Sequence[str] = (),
        conntrack_max: int = DEFAULT_CONNTRACK_MAX,
    ) -> None:
        """``egress``: what ``egress`` sandboxes set up from now on may not reach
        (default: `DEFAULT_EGRESS_DENY`, nothing allowed). ``dns_upstream``: where the
        egress resolver asks (``host`` or ``host:port``; default: the host's
        ``/etc/resolv.conf``). ``conntrack_max``: the most connections the host tracks for
        each sandbox set up from now on; its new ones past it are dropped."""
        if conntrack_max < 1:
            raise errors.ConfigError(f"conntrack_max must be at least 1, not {conntrack_max}")
        try:
            network = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise errors.ConfigError(f"invalid subnet {subnet!r}: {exc}") from None
        if network.prefixlen > 30:
            raise errors.ConfigError(f"subnet {subnet} is too small: it needs at least a /30")
        if uplink is not None and (uplink.startswith(HOST_PREFIX) or len(uplink) > _IFNAMSIZ):
            raise errors.ConfigError(f"invalid uplink interface {uplink!r}")
        self.subnet = network
        self.uplink = uplink
        self.egress = egress or EgressPolicy()
        self.dns_upstream = tuple(dns_upstream)
        self.conntrack_max = conntrack_max
        self._store = _Store(state_dir / "network", str(network))
        self._mutex = asyncio.Lock()

    def __repr__(self) -> str:
        return f"NetworkManager(state_dir={str(self._store.directory.parent)!r}, subnet={str(self.subnet)!r})"

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[dict[str, Any]]:
        """The state, under the in-process lock and the flock; saved when the block succeeds."""
        async with self._mutex:
            fd = await self._store.acquire()
            try:
                state = await _on_disk(self._store.load)
                before = json.dumps(state, sort_keys=True)
                yield state
                if json.dumps(state, sort_keys=True) != before:
                    await _on_disk(self._store.save, state)
            finally:
                os.close(fd)

    # -- setup ------------------------------------------------------------

    async def setup(
        self, sandbox_id: str, mode: NetworkMode, egress: Egress | None = None
    ) -> NetworkAttachment:
        """Make the sandbox's netns, veth pair and addresses, and admit it to ``mode``
        (``egress``: with these rules, default anywhere but the walls).

        Call before the runtime's ``create``; the container joins
        ``netns_path``. On failure everything made so far is removed.
        """
        if mode not in ("isolated", "egress"):
            raise errors.ConfigError(f"unknown network mode {mode!r}: isolated or egress")
        if egress is not None and mode != "egress":
            raise errors.ConfigError(f"egress rules need network mode 'egress', not {mode!r}")
        if not sandbox_id:
            raise errors.ConfigError("empty sandbox id")
        if os.geteuid() != 0:
            raise errors.ConfigError("sandbox networks need root")
        if shutil.which("conntrack") is None:  # a teardown could not forget its flows
            raise errors.ConfigError(_NO_CONNTRACK)
        uplink = None
        if mode == "egress":
            uplink = self.uplink or await _default_uplink()
            if uplink is None:
                raise errors.ConfigError(
                    "network mode 'egress' needs an uplink: this host has no default route;"
                    " configure the uplink interface explicitly"
                )
            if uplink.startswith(HOST_PREFIX):
                raise errors.ConfigError(f"uplink {uplink!r} is a sandbox interface")
            if not await anyio.Path(SYS_NET / uplink).exists():
                raise errors.ConfigError(f"uplink interface {uplink!r} does not exist")
        netns, host_if = names(sandbox_id)
        # Shared: a reset elsewhere cannot remove the rules until our veth exists.
        async with _host_lock(shared=True):
            taken = await _host_slots(self.subnet)
            # Saved before anything is made: if the state directory cannot take it (read-only,
            # full), nothing was; once it is saved, teardown knows what to remove.
            async with self._locked() as state:
                attachment = self._allocate(
                    state, sandbox_id, mode, netns, host_if, taken, egress or Egress()
                )
            try:
                async with self._locked() as state:
                    await self._admit(
                        state, host_if if uplink is not None else None, uplink, sandbox_id
                    )
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await self.teardown(sandbox_id)  # if it fails, the record stays for the next
                raise
            await self._make_links(sandbox_id, attachment)
        logger.debug("network %s for %s: %s", mode, sandbox_id, attachment)
        return attachment

    async def _make_links(self, sandbox_id: str, attachment: NetworkAttachment) -> None:
        netns, host_if = names(sandbox_id)
        try:
            if (
                await anyio.Path(NETNS_DIR / netns).exists()
                or await anyio.Path(SYS_NET / host_if).exists()
            ):
                # Left by a crash that also lost the state: the names are this sandbox's.
                await self._remove_links(netns, host_if)
            await _run("ip", "-batch", "-", stdin=_host_batch(netns, host_if, attachment.host_ip))
            await _run(
                "ip",
                "-n",
                netns,
                "-batch",
                "-",
                stdin=_inside_batch(attachment.sandbox_ip, attachment.host_ip),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.teardown(sandbox_id)
            raise

    def _allocate(
        self,
        state: dict[str, Any],
        sandbox_id: str,
        mode: str,
        netns: str,
        host_if: str,
        taken: set[int],
        egress: Egress,
    ) -> NetworkAttachment:
        attachments: dict[str, dict[str, Any]] = state["attachments"]
        if sandbox_id in attachments:
            raise errors.ConfigError(f"sandbox {sandbox_id} already has a network")
        if state["subnet"] != str(self.subnet):
            if attachments:
                raise errors.ConfigError(
                    f"{self._store.path} holds networks in {state['subnet']}, not {self.subnet}"
                )
            state["subnet"] = str(self.subnet)
        for other, entry in attachments.items():
            if entry["netns"] == netns:
                raise errors.ProviderError(f"sandbox ids {other} and {sandbox_id} hash alike")
        index = _lowest_free([*taken, *(entry["index"] for entry in attachments.values())])
        host_ip, sandbox_ip = slot(self.subnet, index)
        attachments[sandbox_id] = {
            "index": index, "mode": mode, "netns": netns, "host_interface": host_if,
            "conntrack_max": self.conntrack_max,
        }  # fmt: skip
        if mode == "egress":
            attachments[sandbox_id]["egress_deny"] = list(self.egress.deny)
            attachments[sandbox_id]["egress_allow"] = list(self.egress.allow)
            attachments[sandbox_id]["rules"] = egress.model_dump(mode="json")
            attachments[sandbox_id]["generation"] = 1
            attachments[sandbox_id]["dyn"] = 1
            attachments[sandbox_id]["upstreams"] = list(self.dns_upstream)
        return NetworkAttachment(
            netns_path=str(NETNS_DIR / netns),
            sandbox_ip=sandbox_ip,
            host_ip=host_ip,
            host_interface=host_if,
        )

    async def _admit(
        self, state: dict[str, Any], egress_if: str | None, uplink: str | None, sandbox_id: str
    ) -> None:
        """Load the ruleset if it is missing; for egress, add the sandbox and the uplink to it
        and switch on forwarding, in that order. Runs under the lock."""
        uplinks: list[str] = state["uplinks"]
        if uplink is not None and uplink not in uplinks:
            uplinks.append(uplink)
        own: list[str] = []
        if egress_if is not None:
            # The resolver first: the sandbox's DNS has somewhere to go from its first packet.
            port = await self._dns(state)
            entry = state["attachments"][sandbox_id]
            await _on_disk(self._write_rules, state, entry)
            mine = sandbox_egress(entry)
            if mine.rules.chain:
                own += egress_rules.define(
                    TABLE, egress_if, mine.rules, mine.generation, mine.dyn, new_dyn=True
                )
                own.append(chain_element(egress_if, mine.generation, "add"))
            own += dns_elements(egress_if, port, "add")
        # A freshly loaded ruleset already holds this sandbox and its uplink.
        loaded = await self._ensure_rules(state)
        if loaded:
            entry = state["attachments"][sandbox_id]
            element = flows_element(entry["host_interface"], entry["conntrack_max"])
            await _run("nft", "add", "element", "inet", TABLE, "sandbox_flows", f"{{ {element} }}")
        if loaded and egress_if is not None and uplink is not None:
            # One transaction, the policy and rules before the interface: never out unfiltered.
            policy = policy_sets(egress_if, self.egress, "add") + "".join(f"{x}\n" for x in own)
            await _run(
                "nft",
                "-f",
                "-",
                stdin=(
                    f"add element inet {TABLE} uplink_ifs {{ {json.dumps(uplink)} }}\n"
                    f"add element ip {NAT_TABLE} uplink_ifs {{ {json.dumps(uplink)} }}\n"
                    f"{policy}"
                    f"add element inet {TABLE} egress_ifs {{ {json.dumps(egress_if)} }}\n"
                ),
            )
        if egress_if is not None:
            ip_forward = anyio.Path(IP_FORWARD)
            current = (await ip_forward.read_text()).strip()
            if current != "1":
                await anyio.to_thread.run_sync(_record_ip_forward, current)
                await ip_forward.write_text("1\n")

    async def _ensure_rules(self, state: dict[str, Any]) -> bool:
        """Load the ruleset, with the sets as the state says, unless both tables are there.
        True if they were. Runs under the lock."""
        loaded = await _loaded_sets()
        if set(loaded) == OUR_TABLES:
            if loaded[f"table inet {TABLE}"] >= POLICY_SETS:
                return True
            # Loaded by a sandman from before egress policies (or rules): replaced, or a
            # policy could not be added. Egress sandboxes of other managers (state dirs)
            # lose egress then: fail closed.
            logger.warning("the sandman nftables tables had no egress policy sets: replaced")
        egress = [e for e in state["attachments"].values() if e["mode"] == "egress"]
        policies = {entry["host_interface"]: recorded_policy(entry) for entry in egress}
        await _run(
            "nft",
            "-f",
            "-",
            stdin=ruleset(
                egress_ifs=policies,
                uplinks=state["uplinks"],
                policies=policies,
                rules={entry["host_interface"]: sandbox_egress(entry) for entry in egress},
                dns_port=state.get("dns_port"),
                flows={
                    e["host_interface"]: e.get("conntrack_max", self.conntrack_max)
                    for e in state["attachments"].values()
                },
                conntrack_max=self.conntrack_max,
            ),
        )
        return False

    # -- egress rules and the resolver ----------------------------------------------------

    async def _dns(self, state: dict[str, Any]) -> int:
        """The resolver's port, started if it is not running; if it came back on another
        port, every egress sandbox's DNS is sent there. Runs under the lock."""
        port = await egress_rules.ensure_resolver(self._store.directory)
        old = state.get("dns_port")
        if old != port:
            state["dns_port"] = port
            for entry in state["attachments"].values():
                if entry["mode"] != "egress" or old is None:
                    continue
                host_if = entry["host_interface"]
                for line in [
                    *dns_elements(host_if, old, "delete"),
                    *dns_elements(host_if, port, "add"),
                ]:
                    await _run("nft", "-f", "-", stdin=f"{line}\n", check=False)
        return port

    def _write_rules(self, state: dict[str, Any], entry: Mapping[str, Any]) -> None:
        host_ip, sandbox_ip = slot(ipaddress.IPv4Network(state["subnet"]), entry["index"])
        policy = recorded_policy(entry)
        mine = sandbox_egress(entry)
        egress_rules.write_rules(
            self._store.directory,
            table=TABLE,
            host_if=entry["host_interface"],
            host_ip=host_ip,
            sandbox_ip=sandbox_ip,
            rules=mine.rules,
            generation=mine.generation,
            dyn=mine.dyn,
            walls=policy.deny,
            wall_exceptions=policy.allow,
            upstreams=entry.get("upstreams", ()),
        )

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace a running egress sandbox's rules, in one transaction: connections it
        has open are judged by the new rules at their next packet (see `egress`).
        `SandboxNotFound` if it has no network here; `ConfigError` if it was not made
        with egress."""
        async with self._locked() as state:
            entry = state["attachments"].get(sandbox_id)
            if entry is None:
                raise errors.SandboxNotFound(f"sandbox {sandbox_id} has no network here")
            if entry["mode"] != "egress":
                raise errors.ConfigError(
                    f"sandbox {sandbox_id} has network {entry['mode']!r}: egress rules need "
                    "a sandbox made with network='egress' or Egress(...)"
                )
            host_if = entry["host_interface"]
            old = sandbox_egress(entry)
            new_rules = egress_rules.compile_rules(egress)
            keep = egress_rules.keeps_admitted(old.rules, new_rules)
            generation = old.generation + 1
            new = SandboxEgress(new_rules, generation, old.dyn if keep else generation)
            previous = dict(entry)
            entry.update(
                rules=egress.model_dump(mode="json"), generation=new.generation, dyn=new.dyn
            )
            port = await self._dns(state)
            await _on_disk(self._write_rules, state, entry)
            try:
                if await self._ensure_rules(state):  # else: just loaded, with the new rules
                    await self._swap(host_if, old, new, keep)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    entry.clear()
                    entry.update(previous)
                    await _on_disk(self._write_rules, state, entry)
                raise
            logger.debug(
                "egress of %s: %s (generation %d, dns %d)", sandbox_id, egress, generation, port
            )

    async def _swap(self, host_if: str, old: SandboxEgress, new: SandboxEgress, keep: bool) -> None:
        lines: list[str] = []
        if new.rules.chain:
            lines += egress_rules.define(
                TABLE, host_if, new.rules, new.generation, new.dyn, new_dyn=not keep
            )
        if old.rules.chain:
            lines.append(chain_element(host_if, old.generation, "delete"))
        if new.rules.chain:
            lines.append(chain_element(host_if, new.generation, "add"))
        chains, sets = await _owned_objects(host_if)
        kept = set(egress_rules.objects(TABLE, host_if, new.rules, new.generation, new.dyn)[1])
        lines += egress_rules.undefine(TABLE, chains, [s for s in sets if s not in kept])
        await _run("nft", "-f", "-", stdin="\n".join(lines) + "\n")

    async def ensure(self) -> bool:
        """Reload the ruleset if something removed it (e.g. ``nft flush ruleset``) while
        networks exist; for the reconciler. True if it was intact (or not needed)."""
        async with self._locked() as state:
            if not state["attachments"]:
                return True
            if any(e["mode"] == "egress" for e in state["attachments"].values()):
                await self._dns(state)  # a resolver that died comes back
            intact = await self._ensure_rules(state)
        if not intact:
            logger.warning("the sandman nftables tables were missing: reloaded")
        return intact

    # -- teardown -----------------------------------------------------------

    async def teardown(self, sandbox_id: str) -> None:
        """Remove the sandbox's netns and veth pair, its set element, its flows (conntrack)
        and its /30. Idempotent.

        Call after the runtime's ``delete``."""
        netns, host_if = names(sandbox_id)
        async with self._locked() as state:
            entry = state["attachments"].get(sandbox_id)
            dns_port = state.get("dns_port")
            subnet = ipaddress.IPv4Network(state["subnet"])
        removals: builtins.list[Coroutine[Any, Any, object]] = [self._remove_links(netns, host_if)]
        if entry is not None:
            flows = ("delete", "element", "inet", TABLE, "sandbox_flows", f"{{ {host_if} }}")
            removals.append(_run("nft", *flows, check=False))
        if entry is not None and entry["mode"] == "egress":
            # Out of egress first (before its rules go, which would leave it unfiltered),
            # and the resolver's file: it answers this sandbox no more.
            element = f"{{ {host_if} }}"
            await _run(
                "nft", "delete", "element", "inet", TABLE, "egress_ifs", element, check=False
            )
            await _on_disk(egress_rules.remove_rules, self._store.directory, host_if)
            removals.append(_remove_own_rules(host_if))
            removals += [
                _run("nft", "-f", "-", stdin=f"{line}\n", check=False)
                for line in dns_elements(host_if, dns_port or 0, "delete")
            ]
            # Apart: a set that lacks the elements (reloaded meanwhile) fails alone.
            policy = recorded_policy(entry)
            for which in ("deny", "allow"):
                batch = policy_sets(host_if, policy, "delete", only=which)
                if batch:
                    removals.append(_run("nft", "-f", "-", stdin=batch, check=False))
        await asyncio.gather(*removals)
        if entry is not None:
            # Its veth is gone, so no new flow can start; the /30 is free only after this.
            await _forget_flows(slot(subnet, entry["index"]))
        async with self._locked() as state:
            state["attachments"].pop(sandbox_id, None)
            egress_left = any(e["mode"] == "egress" for e in state["attachments"].values())
            if entry is not None and entry["mode"] == "egress" and not egress_left:
                await egress_rules.stop_resolver(self._store.directory)
                state.pop("dns_port", None)
        logger.debug("network of %s removed", sandbox_id)

    async def _remove_links(self, netns: str, host_if: str) -> None:
        """Delete the netns and with it the veth pair; fine if either is gone.

        The kernel removes the veth once the namespace's last user has gone,
        which takes milliseconds; ``ip link del`` would wait far longer. A veth
        still there after ``VETH_WAIT`` (a process still in the namespace) is
        deleted explicitly."""
        if await anyio.Path(NETNS_DIR / netns).exists():
            await _run("ip", "netns", "del", netns, check=False)
        link = anyio.Path(SYS_NET / host_if)
        deadline = time.monotonic() + VETH_WAIT
        while await link.exists():
            if time.monotonic() > deadline:
                await _run("ip", "link", "del", host_if, check=False)
                break
            await asyncio.sleep(0.002)
        left = [
            str(path)
            for path in (NETNS_DIR / netns, SYS_NET / host_if)
            if await anyio.Path(path).exists()
        ]
        if left:
            raise errors.ProviderError(f"could not remove {', '.join(left)}")

    async def readdress(self, sandbox_id: str) -> None:
        """Put the sandbox's address and default route back into its namespace (idempotent).

        gVisor's own network stack (``runsc --network=sandbox``) takes them from the
        namespace into itself when it starts, so a restore of the same sandbox in the
        same namespace would find none, and its daemon would be unreachable."""
        attachment = await self.get(sandbox_id)
        if attachment is None:
            raise errors.ProviderError(f"sandbox {sandbox_id} has no network to readdress")
        netns, _ = names(sandbox_id)
        await _run(
            "ip", "-n", netns, "-batch", "-",
            stdin=(
                f"addr replace {attachment.sandbox_ip}/30 dev {SANDBOX_INTERFACE}\n"
                f"link set {SANDBOX_INTERFACE} up\n"
                f"route replace default via {attachment.host_ip}\n"
            ),
        )  # fmt: skip

    # -- list / reset -------------------------------------------------------

    async def list(self) -> builtins.list[str]:
        """The ids of the sandboxes that have network state (for the reconciler)."""
        async with self._locked() as state:
            return sorted(state["attachments"])

    async def get(self, sandbox_id: str) -> NetworkAttachment | None:
        """The recorded attachment of a sandbox, or None."""
        async with self._locked() as state:
            entry = state["attachments"].get(sandbox_id)
        if entry is None:
            return None
        host_ip, sandbox_ip = slot(ipaddress.IPv4Network(state["subnet"]), entry["index"])
        return NetworkAttachment(
            netns_path=str(NETNS_DIR / entry["netns"]),
            sandbox_ip=sandbox_ip,
            host_ip=host_ip,
            host_interface=entry["host_interface"],
        )

    async def reset(self) -> None:
        """Tear down every network of this manager; then, if no sandbox interface is left on
        the host (another manager's included), remove the tables and restore ``ip_forward``
        if a manager changed it."""
        for sandbox_id in await self.list():
            await self.teardown(sandbox_id)
        async with _host_lock(shared=False):
            async with self._locked() as state:
                if state["attachments"]:
                    return  # another process of ours added one meanwhile
                state["uplinks"] = []
            others = await _sandbox_links()
            if others:
                logger.debug("keeping the sandman tables: %d sandbox interfaces left", len(others))
                return
            for table in sorted(await _our_tables()):
                await _run("nft", "delete", *table.split())
            original = await anyio.to_thread.run_sync(_take_ip_forward)
            if original is not None:
                await anyio.Path(IP_FORWARD).write_text(f"{original}\n")


async def _owned_objects(host_if: str) -> tuple[builtins.list[str], builtins.list[str]]:
    """The chains and sets of ``host_if``'s rules that are loaded (any generation)."""
    found: tuple[builtins.list[str], builtins.list[str]] = ([], [])
    for kind, argv in (
        ("chain", ("list", "chains", "inet")),
        ("set", ("-t", "list", "sets", "inet")),
    ):
        _, out = await _run("nft", "-j", *argv, check=False)
        for item in json.loads(out or '{"nftables": []}').get("nftables", []):
            thing = item.get(kind)
            if thing and thing.get("table") == TABLE and egress_rules.owned(thing["name"], host_if):
                found[0 if kind == "chain" else 1].append(thing["name"])
    return found


async def _remove_own_rules(host_if: str) -> None:
    """Remove ``host_if``'s chain (its map entry first) and sets, whatever generation."""
    await _run("nft", "-f", "-", stdin=chain_element(host_if, 0, "delete") + "\n", check=False)
    chains, sets = await _owned_objects(host_if)
    if chains or sets:
        batch = egress_rules.undefine(TABLE, chains, sets)
        await _run("nft", "-f", "-", stdin="\n".join(batch) + "\n")


def _record_ip_forward(value: str) -> None:
    """Remember ip_forward's value from before the first change (the first record wins)."""
    HOST_STATE.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        fd = os.open(
            HOST_STATE / "ip_forward.original", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
        )
        with os.fdopen(fd, "w") as handle:
            handle.write(value)


def _take_ip_forward() -> str | None:
    path = HOST_STATE / "ip_forward.original"
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        return None
    path.unlink()
    return value
