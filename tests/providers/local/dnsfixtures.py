"""Helpers for the egress-rules tests: a DNS server we control, more addresses in the fake
internet, and a stray resolver there.

Offline like netfixtures: the "upstream" DNS server is this test process on 127.0.0.1
(the provider's resolver forwards to it, ``LocalConfig.dns_upstream``); the names it
knows resolve to addresses of the fake internet (``PUBLIC``), a private address or
the metadata kind, as each test sets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

from tests.providers.local.netfixtures import _TOKEN, DEADLINE, FAKENET, FAKENET_IP, run

PUBLIC = [f"198.18.{_TOKEN}.{n}" for n in (10, 11, 12, 13)]
"""More addresses of the fake internet (public benchmark space: no wall covers it)."""
FAKENET6 = f"2001:2:0:{_TOKEN:x}::2"
"""The fake internet's IPv6 address (2001:2::/48, benchmarking: no wall covers it)."""
HOST6 = f"2001:2:0:{_TOKEN:x}::1"


def _name(text: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in text.split(".") if p) + b"\x00"


@dataclass
class FakeDNS:
    """An upstream DNS server on 127.0.0.1 (UDP and TCP) answering from ``zone``.

    ``zone[name]`` is a list of (type, value, ttl): ``A``, ``AAAA`` or ``CNAME``;
    a name not in it is NXDOMAIN. ``asked`` records every (name, qtype) it was asked.
    """

    zone: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)
    asked: list[tuple[str, int]] = field(default_factory=list)
    port: int = 0

    def reply(self, query: bytes) -> bytes:
        qid, _, _, _, _, _ = struct.unpack("!6H", query[:12])
        offset, labels = 12, []
        while query[offset]:
            labels.append(query[offset + 1 : offset + 1 + query[offset]].decode().lower())
            offset += 1 + query[offset]
        qtype, _ = struct.unpack("!HH", query[offset + 1 : offset + 5])
        question = query[12 : offset + 5]
        name = ".".join(labels)
        self.asked.append((name, qtype))
        answers: list[bytes] = []
        current, rcode = name, 0
        for _ in range(8):
            records = self.zone.get(current)
            if records is None:
                rcode = 0 if answers else 3
                break
            step = None
            for rtype, value, ttl in records:
                if rtype == "CNAME":
                    data = _name(value)
                    answers.append(
                        _name(current) + struct.pack("!HHIH", 5, 1, ttl, len(data)) + data
                    )
                    step = value
                elif (rtype, qtype) in (("A", 1), ("AAAA", 28)):
                    data = ipaddress.ip_address(value).packed
                    kind = 1 if rtype == "A" else 28
                    answers.append(
                        _name(current) + struct.pack("!HHIH", kind, 1, ttl, len(data)) + data
                    )
            if step is None:
                break
            current = step
        header = struct.pack("!6H", qid, 0x8180 | rcode, 1, len(answers), 0, 0)
        return header + question + b"".join(answers)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, dns: FakeDNS) -> None:
        self.dns = dns
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(self.dns.reply(data), addr)


@contextlib.asynccontextmanager
async def fake_dns(
    zone: dict[str, list[tuple[str, str, int]]] | None = None,
) -> AsyncIterator[FakeDNS]:
    """A `FakeDNS` on 127.0.0.1 (one free port for UDP and TCP)."""
    dns = FakeDNS(zone=dict(zone or {}))
    loop = asyncio.get_running_loop()

    async def over_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, OSError):
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            answer = dns.reply(await reader.readexactly(length))
            writer.write(struct.pack("!H", len(answer)) + answer)
            await writer.drain()
        writer.close()

    tcp = await asyncio.start_server(over_tcp, host="127.0.0.1", port=0)
    dns.port = tcp.sockets[0].getsockname()[1]
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _Udp(dns), local_addr=("127.0.0.1", dns.port)
    )
    try:
        yield dns
    finally:
        transport.close()
        tcp.close()
        await tcp.wait_closed()


_STRAY = """
import socket, struct, sys, threading
answer_ip = socket.inet_aton(sys.argv[1])
def reply(q):
    end = q.index(b"\\0", 12) + 5
    return q[:2] + b"\\x81\\x80\\x00\\x01\\x00\\x01\\x00\\x00\\x00\\x00" + q[12:end] + b"\\xc0\\x0c\\x00\\x01\\x00\\x01\\x00\\x00\\x00\\x3c\\x00\\x04" + answer_ip
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("0.0.0.0", 53))
tcp = socket.socket(); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); tcp.bind(("0.0.0.0", 853)); tcp.listen(8)
def dot():
    while True:
        c, _ = tcp.accept(); c.sendall(b"stray-dot"); c.close()
threading.Thread(target=dot, daemon=True).start()
print("ready", flush=True)
while True:
    data, peer = udp.recvfrom(4096)
    udp.sendto(reply(data), peer)
"""


@contextlib.asynccontextmanager
async def stray_resolver(answer: str) -> AsyncIterator[str]:
    """A resolver in the fake internet (``FAKENET_IP`` UDP 53, answering every name with
    ``answer``) and a DNS-over-TLS-like listener on its TCP 853; yields its address."""
    argv = ["ip", "netns", "exec", FAKENET, sys.executable, "-I", "-c", _STRAY, answer]
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(DEADLINE):
            line = await process.stdout.readline()
        assert line == b"ready\n", line
        yield FAKENET_IP
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def public_addresses() -> AsyncIterator[list[str]]:
    """`PUBLIC` on the fake internet's loopback, routed there from the host."""
    await run(
        "ip", "-n", FAKENET, "-batch", "-",
        stdin="".join(f"addr add {a}/32 dev lo\n" for a in PUBLIC),
    )  # fmt: skip
    await run(
        "ip", "-batch", "-", stdin="".join(f"route add {a}/32 via {FAKENET_IP}\n" for a in PUBLIC)
    )
    try:
        yield PUBLIC
    finally:
        await run(
            "ip", "-force", "-batch", "-",
            stdin="".join(f"route del {a}/32\n" for a in PUBLIC), check=False,
        )  # fmt: skip
