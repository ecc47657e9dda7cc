"""The egress resolver's DNS parsing and judging, without a network: hostile messages
are refused (never a loop, never a read past the end), and answers are filtered."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from sandman.providers.local import resolver
from sandman.providers.local.resolver import CNAME, A, FormatError, Record

HEADER = struct.pack("!6H", 7, 0x0100, 1, 0, 0, 0)


def _q(name: bytes) -> bytes:
    return HEADER + name + struct.pack("!HH", A, 1)


@pytest.mark.parametrize(
    "message",
    [
        b"",
        HEADER,
        _q(b"\x03abc"),  # no end
        HEADER + b"\xc0\x0c" + struct.pack("!HH", A, 1),  # a pointer to itself
        HEADER + b"\xc0\x20" + struct.pack("!HH", A, 1),  # a pointer forward
        HEADER + b"\x40abc\x00" + struct.pack("!HH", A, 1),  # a reserved label type
        _q(b"".join(b"\x3f" + b"a" * 63 for _ in range(5)) + b"\x00"),  # over 255 bytes
        struct.pack("!6H", 7, 0x8100, 1, 0, 0, 0) + b"\x00" + struct.pack("!HH", A, 1),  # an answer
        struct.pack("!6H", 7, 0x0100, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01" * 2,  # two questions
    ],
)
def test_hostile_queries_are_refused(message: bytes) -> None:
    with pytest.raises(FormatError):
        resolver.parse_query(message)


def test_a_query_is_answered_in_the_clients_case_and_size() -> None:
    query = resolver.parse_query(_q(b"\x04PyPi\x03org\x00"))
    assert query.name == (b"pypi", b"org") and resolver.text(query.name) == "pypi.org"
    answer = resolver.build_answer(query, resolver.NXDOMAIN)
    assert b"\x04PyPi\x03org\x00" in answer and answer[3] & 0xF == resolver.NXDOMAIN
    assert resolver.text((b"a.b", b"org")) is None  # a dot inside a label matches no rule


def test_the_chain_is_followed_and_strangers_left_out() -> None:
    name = (b"pkg", b"test")
    edge = (b"edge", b"cdn", b"test")
    answers = [
        Record(name, CNAME, 1, 60, b"", edge),
        Record(edge, A, 1, 30, bytes([198, 18, 0, 10])),
        Record((b"other", b"test"), A, 1, 30, bytes([198, 18, 0, 11])),  # not on the chain
        Record(edge, A, 1, 30, b"\x01\x02"),  # the wrong size
    ]
    chain, found = resolver._follow(name, A, answers)
    assert chain == [name, edge]
    assert [str(ip) for _, ip in found] == ["198.18.0.10", "None"]


def test_walls_deny_and_exceptions() -> None:
    config = resolver.Config(
        host_if="smhx", host_ip="10.0.0.1", sandbox_ip="10.0.0.2", open=False,
        allow=(("suffix", "test"),), deny=(("domain", "bad.test"),),
        deny_cidrs=(ipaddress.ip_network("198.18.0.11/32"),),
        walls=(ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("169.254.0.0/16")),
        wall_exceptions=(ipaddress.ip_network("10.9.9.9/32"),),
        table="sandman", set4="n4", set6="n6", upstreams=(), ttl_min=60, ttl_max=3600,
    )  # fmt: skip
    ok = ipaddress.ip_address
    assert config.admissible(ok("198.18.0.10"))
    assert not config.admissible(ok("198.18.0.11"))
    assert not config.admissible(ok("169.254.169.254"))
    assert not config.admissible(ok("::ffff:169.254.169.254"))  # IPv4-mapped
    assert config.admissible(ok("10.9.9.9"))  # the operator's exception
    assert config.allowed("a.test") and not config.allowed("test") and config.denied("bad.test")
