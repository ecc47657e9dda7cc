"""The egress resolver: the DNS server of the local provider's egress sandboxes.

(About 860 lines in one file: it runs as a script by its path, ``python -S -E
resolver.py DIR`` (`egress.ensure_resolver`), where no module of ours can be
imported, so its DNS wire format, rules and server live together.)

A process of its own, one per network state directory (``<state_dir>/network``),
started by the first `NetworkManager` that needs it and outliving it (a sandbox made
by ``sandman create`` keeps its DNS after the command exits); it exits once no
sandbox needs it. It imports only the standard library and runs as a script
(``python -S resolver.py DIR``), so it starts in tens of milliseconds and holds a few
MiB.

Each egress sandbox's ``/etc/resolv.conf`` names its gateway; nftables redirects what
it sends to port 53 there to this process's port (``dns/port``). A query is
judged by the sandbox's rules file (``dns/<host interface>.json``, written by the
manager; the interface comes from the packet's ``IP_PKTINFO``, or for TCP from the
connection's two addresses) and:

- a name under a ``deny`` rule, or one no ``allow`` rule covers (when the sandbox
  has an allow list), is answered NXDOMAIN without asking anyone: no lookup leaves
  the host for it, so DNS carries nothing out to a domain of the workload's choice;
- an allowed name's A and AAAA records are asked of the upstream (the host's
  ``/etc/resolv.conf``, or the provider's ``dns_upstream``), the CNAME chain from
  the name followed (a name on it under ``deny`` refuses the whole answer), every
  address checked against the walls (metadata, private ranges... unless the
  operator excepted them) and the sandbox's denied CIDRs, and what passes is added
  to the sandbox's nftables set (``timeout``: the record's TTL, bounded to
  ``ttl_min``..``ttl_max``) *before* the answer goes back, which holds only those
  addresses (TTL at most the set's). An address that fails the check is left out:
  a name that turns into a private or metadata address (DNS rebinding) gains
  nothing;
- other record types of an allowed name get an empty answer; with no allow list
  (``open``), they are relayed as the upstream gave them.

The rules name the set of the sandbox's current rules generation: rules changed
meanwhile (`NetworkManager.set_egress`) deleted that set, so an admission made under
old rules fails (SERVFAIL) instead of outliving them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Config",
    "Query",
    "Record",
    "main",
    "parse_query",
    "parse_response",
]

logger = logging.getLogger("sandman.resolver")

VERSION = 1
A, NS, CNAME, SOA, AAAA, OPT = 1, 2, 5, 6, 28, 41
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
UDP_SIZE = 1232
"""The largest UDP answer we send or ask for (the DNS flag day's size)."""
MAX_CHAIN = 16
UPSTREAM_TIMEOUT = 2.0
QUERY_DEADLINE = 5.0
MAX_INFLIGHT = 512
MAX_INFLIGHT_PER_SANDBOX = 64
TCP_IDLE = 10.0
MAX_TCP = 256
IDLE_EXIT = 2.0
"""Seconds with no sandbox's rules before the resolver exits."""

IP_PKTINFO = 8
"""Linux's, which the socket module may not name."""
_CLEAN = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_")


class FormatError(ValueError):
    """Bytes that are not the DNS message they claim to be."""


# -- wire format --------------------------------------------------------------------------

Name = tuple[bytes, ...]
"""A DNS name as its labels (lower case), root excluded."""


def read_name(message: bytes, offset: int) -> tuple[Name, int]:
    """The name at ``offset`` (compression pointers followed, backwards only) and the
    offset just past it where it was written."""
    labels: list[bytes] = []
    end = None
    size = 0
    hops = 0
    while True:
        if offset >= len(message):
            raise FormatError("name runs past the message")
        length = message[offset]
        if length == 0:
            offset += 1
            break
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(message):
                raise FormatError("pointer runs past the message")
            target = ((length & 0x3F) << 8) | message[offset + 1]
            if end is None:
                end = offset + 2
            if target >= offset or hops > 64:
                raise FormatError("compression pointer loops or points forward")
            hops += 1
            offset = target
            continue
        if length & 0xC0:
            raise FormatError("unknown label type")
        label = message[offset + 1 : offset + 1 + length]
        if len(label) != length:
            raise FormatError("label runs past the message")
        size += length + 1
        if size > 254:
            raise FormatError("name longer than 255 bytes")
        labels.append(label.lower())
        offset += 1 + length
    return tuple(labels), end if end is not None else offset


def encode_name(name: Name) -> bytes:
    return b"".join(bytes([len(label)]) + label for label in name) + b"\x00"


def text(name: Name) -> str | None:
    """``a.b.c`` for a name of letters, digits, '-' and '_' only, else None (a label
    holding a dot or other bytes matches no rule)."""
    if not name or not all(label and set(label) <= _CLEAN for label in name):
        return None
    return b".".join(name).decode()


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: Name
    qtype: int
    qclass: int
    question: bytes
    """The question as the client wrote it (its letter case), echoed in the answer."""
    udp_size: int
    edns: bool


def parse_query(message: bytes) -> Query:
    """A client's query: one question; FormatError otherwise."""
    if len(message) < 12:
        raise FormatError("shorter than a header")
    qid, flags, qd, an, ns, ar = struct.unpack("!6H", message[:12])
    if flags & 0x8000:
        raise FormatError("an answer, not a query")
    if qd != 1:
        raise FormatError(f"{qd} questions")
    name, offset = read_name(message, 12)
    if offset + 4 > len(message):
        raise FormatError("question runs past the message")
    qtype, qclass = struct.unpack("!HH", message[offset : offset + 4])
    question_end = offset + 4
    # The question's own bytes: a pointer in it (legal, if odd) is written out in full.
    question = encode_name(_original_case(message, 12, name)) + message[offset : offset + 4]
    udp_size, edns = 512, False
    try:
        records, _ = _records(message, question_end, an + ns + ar)
    except FormatError:
        records = []
    for record in records[an + ns :]:
        if record.rtype == OPT:
            edns = True
            udp_size = max(512, min(record.rclass, UDP_SIZE))
    return Query(qid, flags, name, qtype, qclass, question, udp_size, edns)


def _original_case(message: bytes, offset: int, name: Name) -> Name:
    """The name at ``offset`` in the letter case the client used (0x20 randomisation)."""
    labels: list[bytes] = []
    while message[offset] and len(labels) < len(name):
        if message[offset] & 0xC0 == 0xC0:
            return name
        length = message[offset]
        labels.append(message[offset + 1 : offset + 1 + length])
        offset += 1 + length
    return tuple(labels)


@dataclass(frozen=True)
class Record:
    name: Name
    rtype: int
    rclass: int
    ttl: int
    rdata: bytes
    target: Name | None = None
    """A CNAME's target."""


def _records(message: bytes, offset: int, count: int) -> tuple[list[Record], int]:
    records = []
    for _ in range(count):
        name, offset = read_name(message, offset)
        if offset + 10 > len(message):
            raise FormatError("record runs past the message")
        rtype, rclass, ttl, length = struct.unpack("!HHIH", message[offset : offset + 10])
        start = offset + 10
        rdata = message[start : start + length]
        if len(rdata) != length:
            raise FormatError("record data runs past the message")
        target = read_name(message, start)[0] if rtype == CNAME else None
        records.append(Record(name, rtype, rclass, min(ttl, 2**31 - 1), rdata, target))
        offset = start + length
    return records, offset


@dataclass(frozen=True)
class Response:
    id: int
    flags: int
    name: Name
    qtype: int
    answers: list[Record]

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    @property
    def truncated(self) -> bool:
        return bool(self.flags & 0x0200)


def parse_response(message: bytes) -> Response:
    """An upstream's answer: its question and answer section (FormatError if malformed)."""
    if len(message) < 12:
        raise FormatError("shorter than a header")
    qid, flags, qd, an, _, _ = struct.unpack("!6H", message[:12])
    if not flags & 0x8000 or qd != 1:
        raise FormatError("not an answer to one question")
    name, offset = read_name(message, 12)
    if offset + 4 > len(message):
        raise FormatError("question runs past the message")
    (qtype,) = struct.unpack("!H", message[offset : offset + 2])
    answers: list[Record] = []
    if not flags & 0x0200:
        answers, _ = _records(message, offset + 4, an)
    return Response(qid, flags, name, qtype, answers)


def build_query(qid: int, name: Name, qtype: int) -> bytes:
    header = struct.pack("!6H", qid, 0x0100, 1, 0, 0, 1)  # RD
    opt = b"\x00" + struct.pack("!HHIH", OPT, UDP_SIZE, 0, 0)
    return header + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN) + opt


def build_answer(query: Query, rcode: int, answers: Sequence[Record] = ()) -> bytes:
    """Our answer to ``query``: RA and the client's RD, the records given (names written
    in full, no compression), an OPT record if the client sent one."""
    flags = 0x8000 | 0x0080 | (query.flags & 0x0100) | (rcode & 0xF)
    body = b"".join(
        encode_name(r.name) + struct.pack("!HHIH", r.rtype, r.rclass, r.ttl, len(r.rdata)) + r.rdata
        for r in answers
    )
    opt = b"\x00" + struct.pack("!HHIH", OPT, UDP_SIZE, 0, 0) if query.edns else b""
    header = struct.pack("!6H", query.id, flags, 1, len(answers), 0, 1 if opt else 0)
    return header + query.question + body + opt


def truncated(query: Query) -> bytes:
    """The answer that tells a UDP client to ask again over TCP."""
    message = bytearray(build_answer(query, NOERROR))
    message[2] |= 0x02
    return bytes(message)


# -- rules --------------------------------------------------------------------------------


Net = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Config:
    """One sandbox's rules file (``dns/<host interface>.json``), as the manager wrote it."""

    host_if: str
    host_ip: str
    sandbox_ip: str
    open: bool
    allow: tuple[tuple[str, str], ...]
    """Domain rules: (``domain`` | ``suffix``, name)."""
    deny: tuple[tuple[str, str], ...]
    deny_cidrs: tuple[Net, ...]
    walls: tuple[Net, ...]
    wall_exceptions: tuple[Net, ...]
    table: str
    set4: str | None
    set6: str | None
    upstreams: tuple[tuple[str, int], ...]
    ttl_min: int
    ttl_max: int
    generation: int = 0

    @classmethod
    def load(cls, path: Path) -> Config:
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: unknown version {data.get('version')}")
        return cls(
            host_if=data["host_if"],
            host_ip=data["host_ip"],
            sandbox_ip=data["sandbox_ip"],
            open=bool(data["open"]),
            allow=tuple((k, v) for k, v in data["allow"]),
            deny=tuple((k, v) for k, v in data["deny"]),
            deny_cidrs=tuple(ipaddress.ip_network(n) for n in data["deny_cidrs"]),
            walls=tuple(ipaddress.ip_network(n) for n in data["walls"]),
            wall_exceptions=tuple(ipaddress.ip_network(n) for n in data["wall_exceptions"]),
            table=data["table"],
            set4=data.get("set4"),
            set6=data.get("set6"),
            upstreams=tuple(_upstream(u) for u in data.get("upstreams", ())),
            ttl_min=int(data["ttl_min"]),
            ttl_max=int(data["ttl_max"]),
            generation=int(data.get("generation", 0)),
        )

    def denied(self, name: str | None) -> bool:
        return name is not None and _matches(self.deny, name)

    def allowed(self, name: str | None) -> bool:
        if name is None:
            return False
        return self.open or _matches(self.allow, name)

    def admissible(self, address: Address) -> bool:
        """Whether a domain rule may open ``address``: not behind a wall (unless the
        operator excepted it), not denied by a CIDR."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in net for net in self.deny_cidrs if net.version == address.version):
            return False
        walled = any(address in net for net in self.walls if net.version == address.version)
        return not walled or any(
            address in net for net in self.wall_exceptions if net.version == address.version
        )


def _matches(rules: Iterable[tuple[str, str]], name: str) -> bool:
    for kind, value in rules:
        if (kind == "domain" and name == value) or (
            kind == "suffix" and name.endswith("." + value)
        ):
            return True
    return False


def _upstream(text: str) -> tuple[str, int]:
    """``1.2.3.4``, ``1.2.3.4:5353``, ``::1``, ``[::1]:5353``."""
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
        return host.rstrip("]"), int(port or 53)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    return text, 53


def host_upstreams(path: Path = Path("/etc/resolv.conf")) -> tuple[tuple[str, int], ...]:
    """The ``nameserver`` lines of the host's resolv.conf."""
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    found.append((str(ipaddress.ip_address(words[1].split("%")[0])), 53))
    return tuple(found)


# -- the server ---------------------------------------------------------------------------


class Rules:
    """The rules files of a directory, read again when the directory changes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stamp: int | None = None
        self.by_if: dict[str, Config] = {}
        self.by_ip: dict[str, Config] = {}

    def refresh(self) -> None:
        try:
            stamp = self.directory.stat().st_mtime_ns
        except FileNotFoundError:
            stamp = -1
        if stamp == self._stamp:
            return
        by_if: dict[str, Config] = {}
        for path in self.directory.glob("smh*.json") if stamp != -1 else ():
            try:
                config = Config.load(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("skipping %s: %s", path, exc)
                continue
            by_if[config.host_if] = config
        self._stamp = stamp
        self.by_if = by_if
        self.by_ip = {c.sandbox_ip: c for c in by_if.values()}

    def changed(self, config: Config) -> bool:
        """Whether ``config``'s file now says something else (or is gone)."""
        self.refresh()
        return self.by_if.get(config.host_if) != config


@dataclass
class Resolver:
    directory: Path
    rules: Rules = field(init=False)
    inflight: int = 0
    per_sandbox: dict[str, int] = field(default_factory=dict)
    tcp_connections: int = 0

    def __post_init__(self) -> None:
        self.rules = Rules(self.directory)
        self._host_upstreams: tuple[float, tuple[tuple[str, int], ...]] | None = None

    # -- judging a query ------------------------------------------------------------------

    async def answer(self, config: Config, message: bytes) -> bytes | None:
        """The answer to ``message`` from the sandbox of ``config`` (None: drop it)."""
        try:
            query = parse_query(message)
        except FormatError:
            return None
        count = self.per_sandbox.get(config.host_if, 0)
        if self.inflight >= MAX_INFLIGHT or count >= MAX_INFLIGHT_PER_SANDBOX:
            return build_answer(query, REFUSED)
        self.inflight += 1
        self.per_sandbox[config.host_if] = count + 1
        try:
            async with asyncio.timeout(QUERY_DEADLINE):
                return await self._judge(config, query)
        except TimeoutError:
            return build_answer(query, SERVFAIL)
        finally:
            self.inflight -= 1
            left = self.per_sandbox[config.host_if] - 1
            if left:
                self.per_sandbox[config.host_if] = left
            else:
                del self.per_sandbox[config.host_if]

    async def _judge(self, config: Config, query: Query) -> bytes:
        if query.flags & 0x7800:  # an opcode other than QUERY
            return build_answer(query, NOTIMP)
        if query.qclass != CLASS_IN:
            return build_answer(query, REFUSED)
        name = text(query.name)
        if config.denied(name) or not config.allowed(name):
            return build_answer(query, NXDOMAIN)
        if query.qtype not in (A, AAAA):
            if not config.open:
                return build_answer(query, NOERROR)
            raw = await self._ask(config, query.name, query.qtype)
            if raw is None:
                return build_answer(query, SERVFAIL)
            return struct.pack("!H", query.id) + raw[2:]
        raw = await self._ask(config, query.name, query.qtype)
        if raw is None:
            return build_answer(query, SERVFAIL)
        try:
            response = parse_response(raw)
        except FormatError:
            return build_answer(query, SERVFAIL)
        if response.rcode != NOERROR:
            return build_answer(query, response.rcode if response.rcode == NXDOMAIN else SERVFAIL)
        chain, addresses = _follow(query.name, query.qtype, response.answers)
        if any(config.denied(text(n)) for n in chain):
            return build_answer(query, NXDOMAIN)
        kept = [(r, ip) for r, ip in addresses if ip is not None and config.admissible(ip)]
        ttl = min([r.ttl for r in response.answers if r.name in chain] or [0])
        timeout = max(config.ttl_min, min(ttl, config.ttl_max))
        admitted = (
            not kept or config.open or await self._admit(config, [ip for _, ip in kept], timeout)
        )
        if not admitted:
            return build_answer(query, SERVFAIL)
        records = [
            Record(r.name, r.rtype, CLASS_IN, min(r.ttl, timeout), r.rdata)
            for r in response.answers
            if r.rtype == CNAME and r.name in chain
        ] + [Record(r.name, r.rtype, CLASS_IN, min(r.ttl, timeout), r.rdata) for r, _ in kept]
        return build_answer(query, NOERROR, records)

    # -- upstream -------------------------------------------------------------------------

    def _upstreams(self, config: Config) -> tuple[tuple[str, int], ...]:
        if config.upstreams:
            return config.upstreams
        now = time.monotonic()
        if self._host_upstreams is None or now - self._host_upstreams[0] > 5:
            self._host_upstreams = (now, host_upstreams())
        return self._host_upstreams[1]

    async def _ask(self, config: Config, name: Name, qtype: int) -> bytes | None:
        """The raw answer of the first upstream that gives one (TCP when UDP's is cut)."""
        for host, port in self._upstreams(config):
            qid = secrets.randbelow(1 << 16)
            query = build_query(qid, name, qtype)
            with contextlib.suppress(OSError, TimeoutError, FormatError):
                raw = await _udp_exchange(host, port, query, qid, name, qtype)
                if raw is not None and parse_response(raw).truncated:
                    raw = await _tcp_exchange(host, port, query, qid, name, qtype)
                if raw is not None:
                    return raw
        return None

    async def _admit(self, config: Config, addresses: list[Address], timeout: int) -> bool:
        """Add ``addresses`` to the sandbox's sets, each for ``timeout`` seconds (an
        address already there starts its timeout again). False if nftables refused:
        the sandbox (or that generation of its rules) is gone."""
        lines = []
        for version, set_name in ((4, config.set4), (6, config.set6)):
            chosen = sorted({str(a) for a in addresses if a.version == version})
            if not chosen or set_name is None:
                continue
            timed = ", ".join(f"{a} timeout {timeout}s" for a in chosen)
            bare = ", ".join(chosen)
            target = f"inet {config.table} {set_name}"
            lines += [
                f"add element {target} {{ {timed} }}",
                f"delete element {target} {{ {bare} }}",
                f"add element {target} {{ {timed} }}",
            ]
        if not lines:
            return True
        process = await asyncio.create_subprocess_exec(
            "nft",
            "-f",
            "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await process.communicate(("\n".join(lines) + "\n").encode())
        if process.returncode != 0:
            logger.info("admission for %s refused: %s", config.host_if, err.decode().strip())
            return False
        return True

    # -- sockets --------------------------------------------------------------------------

    def for_interface(self, ifindex: int, source: str) -> Config | None:
        try:
            name = socket.if_indextoname(ifindex)
        except OSError:
            return None
        self.rules.refresh()
        config = self.rules.by_if.get(name)
        return config if config is not None and config.sandbox_ip == source else None

    def for_connection(self, local: str, peer: str) -> Config | None:
        self.rules.refresh()
        config = self.rules.by_ip.get(peer)
        return config if config is not None and config.host_ip == local else None


def _follow(
    name: Name, qtype: int, answers: Sequence[Record]
) -> tuple[list[Name], list[tuple[Record, Address | None]]]:
    """The CNAME chain from ``name`` and the addresses of type ``qtype`` on it."""
    chain = [name]
    for _ in range(MAX_CHAIN):
        step = next((r.target for r in answers if r.rtype == CNAME and r.name == chain[-1]), None)
        if step is None or step in chain:
            break
        chain.append(step)
    found: list[tuple[Record, Address | None]] = []
    for record in answers:
        if record.rtype != qtype or record.rclass != CLASS_IN or record.name not in chain:
            continue
        size = 4 if qtype == A else 16
        address = ipaddress.ip_address(record.rdata) if len(record.rdata) == size else None
        found.append((record, address))
    return chain, found


async def _udp_exchange(
    host: str, port: int, query: bytes, qid: int, name: Name, qtype: int
) -> bytes | None:
    """Send ``query`` from a fresh socket (a random source port) and take the first
    datagram that answers it: from that upstream, with its id and question."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        sock.connect((host, port))
        await loop.sock_sendall(sock, query)
        async with asyncio.timeout(UPSTREAM_TIMEOUT):
            while True:
                raw = await loop.sock_recv(sock, 65535)
                if _answers(raw, qid, name, qtype):
                    return raw
    finally:
        sock.close()


async def _tcp_exchange(
    host: str, port: int, query: bytes, qid: int, name: Name, qtype: int
) -> bytes | None:
    async with asyncio.timeout(UPSTREAM_TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(struct.pack("!H", len(query)) + query)
            await writer.drain()
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            raw = await reader.readexactly(length)
        finally:
            writer.close()
    return raw if _answers(raw, qid, name, qtype) else None


def _answers(raw: bytes, qid: int, name: Name, qtype: int) -> bool:
    try:
        response = parse_response(raw)
    except FormatError:
        return False
    return response.id == qid and response.name == name and response.qtype == qtype


class _Udp:
    """The UDP socket: each datagram's interface from IP_PKTINFO."""

    def __init__(self, resolver: Resolver, sock: socket.socket) -> None:
        self.resolver = resolver
        self.sock = sock
        self.tasks: set[asyncio.Task[None]] = set()

    def readable(self) -> None:
        for _ in range(64):
            try:
                data, ancillary, _, peer = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            ifindex = None
            for level, kind, payload in ancillary:
                if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(payload) >= 4:
                    ifindex = struct.unpack("i", payload[:4])[0]
            if ifindex is None:
                continue
            config = self.resolver.for_interface(ifindex, peer[0])
            if config is None:
                continue  # not from one of our sandboxes: no answer at all
            task = asyncio.ensure_future(self._reply(config, data, peer))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _reply(self, config: Config, data: bytes, peer: tuple[str, int]) -> None:
        answer = await self.resolver.answer(config, data)
        if answer is None:
            return
        with contextlib.suppress(FormatError):
            query = parse_query(data)
            if len(answer) > query.udp_size:
                answer = truncated(query)
        with contextlib.suppress(OSError):
            self.sock.sendto(answer, peer)


async def _tcp_client(
    resolver: Resolver, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    peer = writer.get_extra_info("peername")
    local = writer.get_extra_info("sockname")
    config = resolver.for_connection(local[0], peer[0]) if peer and local else None
    if config is None or resolver.tcp_connections >= MAX_TCP:
        writer.close()
        return
    resolver.tcp_connections += 1
    try:
        while True:
            async with asyncio.timeout(TCP_IDLE):
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                data = await reader.readexactly(length)
            answer = await resolver.answer(config, data)
            if answer is None:
                break
            writer.write(struct.pack("!H", len(answer)) + answer)
            await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, OSError):
        pass
    finally:
        resolver.tcp_connections -= 1
        writer.close()


# -- the process --------------------------------------------------------------------------


def _bind(port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on 0.0.0.0:``port`` (0: any free port, the same for both)."""
    for _ in range(32):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
            udp.bind(("0.0.0.0", port))
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind(("0.0.0.0", udp.getsockname()[1]))
            tcp.listen(128)
            return udp, tcp
        except OSError:
            udp.close()
            tcp.close()
            if port:
                port = 0  # the recorded port is taken: any other
    raise OSError("no port free for the resolver")


def _cleanup(directory: Path) -> None:
    """Our files go (the lock last); the directory too if nothing else is in it."""
    for name in ("resolver.json", "resolver.lock"):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def _idle(directory: Path) -> bool:
    return not any(directory.glob("smh*.json"))


async def _serve(directory: Path, udp: socket.socket, tcp: socket.socket) -> None:
    resolver = Resolver(directory)
    loop = asyncio.get_running_loop()
    udp.setblocking(False)
    handler = _Udp(resolver, udp)
    loop.add_reader(udp.fileno(), handler.readable)
    server = await asyncio.start_server(
        lambda r, w: _tcp_client(resolver, r, w), sock=tcp, limit=1 << 17
    )
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    lock_path = directory.parent / "lock"
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_EXIT):
                    await stop.wait()
            if stop.is_set() or not _idle(directory):
                continue
            # Idle: exit under the managers' lock, so that none of them takes us for
            # alive while we go (it starts another after).
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if _idle(directory):
                _cleanup(directory)
                os.close(fd)
                return
            os.close(fd)
    finally:
        loop.remove_reader(udp.fileno())
        server.close()
        udp.close()
    _cleanup(directory)  # stopped by a manager (SIGTERM), which holds the lock


def main(argv: Sequence[str] | None = None) -> int:
    """``resolver.py DIR``: serve the rules files in DIR; print ``ready PORT`` once
    listening, then detach (the caller waits for this process to exit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: resolver.py DIR\n")
        return 2
    directory = Path(args[0])
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(directory / "resolver.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.stderr.write("busy: another resolver serves this directory\n")
        return 3
    recorded = 0
    with contextlib.suppress(OSError, ValueError, KeyError):
        recorded = int(json.loads((directory / "resolver.json").read_text())["port"])
    udp, tcp = _bind(recorded)
    port = udp.getsockname()[1]
    read_end, write_end = os.pipe()
    child = os.fork()
    if child:
        # The caller's child: report the port once the server runs, and leave.
        os.close(write_end)
        os.close(lock)
        udp.close()
        tcp.close()
        ready = os.read(read_end, 64)
        if not ready.startswith(b"ok"):
            sys.stderr.write("the resolver failed to start\n")
            return 1
        sys.stdout.write(f"ready {port}\n")
        sys.stdout.flush()
        return 0
    os.close(read_end)
    os.setsid()
    status = 0
    try:
        record = directory / "resolver.json"
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "port": port}))
        os.replace(tmp, record)
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(
            directory.parent / "resolver.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        os.write(write_end, b"ok")
        os.close(write_end)
        asyncio.run(_serve(directory, udp, tcp))
    except BaseException:
        logger.exception("the resolver stopped")
        status = 1
    finally:
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
