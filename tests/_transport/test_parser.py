"""The lean transport's response parser under Hypothesis.

The daemon is inside the sandbox, so its answers are hostile input. Whatever
arrives, split into reads at any points, cut short anywhere, or malformed
(chunk sizes, status lines, lengths, heads too large), the parser either
gives the caller exactly the answer that was sent, or raises `ConnectionLost`:
no other exception, no wrong bytes, and no wait that nothing will end.

Most properties feed the bytes straight into the connection's protocol
callbacks (no socket), so every split is a real read boundary, and the
caller is modelled as the transport's task is: it reads what is there and
then sleeps until the connection wakes it. A caller asleep when the bytes or
the close it waits for have come, with no wake-up on the way, is a hang.
The last property runs the same answers through a real socket and the whole
transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandman._transport import ConnectionLost, HTTPTransport
from sandman._transport.lean import _HIGH_WATER, _MAX_HEAD, _TOKEN, _Connection

# Bounded, so that CI runs it every time: a few seconds on a loaded machine. (A one-off
# run with max_examples=3000 found nothing more.) An example takes milliseconds: the
# deadline fails only one that hangs on the parser's own work.
FUZZ = settings(
    max_examples=100,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow],
)

# -- the caller, modelled -------------------------------------------------------------


class _Socket(asyncio.Transport):
    """What a connection sees of its socket: close and pause are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class _Caller:
    """The transport's task: `head_arrived`, then `take` until the end, asleep in between."""

    conn: _Connection
    loop: asyncio.AbstractEventLoop
    body: bytearray = field(default_factory=bytearray)
    head: bool = False
    done: bool = False
    asleep: asyncio.Future[None] | None = None

    def run(self) -> None:
        """Run if awake: read what is there; go to sleep if it needs more."""
        if self.done or (self.asleep is not None and not self.asleep.done()):
            return
        self.asleep = None
        if not self.head:
            if not self.conn.head_arrived():
                return self._sleep()
            self.head = True
        while (piece := self.conn.take()) is not None:
            if not piece:
                return self._sleep()
            self.body += piece
        self.done = True

    def _sleep(self) -> None:
        # What `_Connection.wait` does, without a running loop.
        self.asleep = self.conn._waiter = self.loop.create_future()


def exchange(
    loop: asyncio.AbstractEventLoop, reads: Sequence[bytes], *, eof: bool, head: bool = False
) -> Answer | ConnectionLost | None:
    """Deliver ``reads`` one by one, then the peer's close if ``eof``.

    The answer, the ConnectionLost the caller got, or None when it still
    waits for bytes (an answer not yet whole, the connection still open).
    """
    conn = _Connection(loop)
    sock = _Socket()
    conn.connection_made(sock)
    conn.send(b"GET / HTTP/1.1\r\n\r\n", no_body=head)
    caller = _Caller(conn, loop)
    try:
        for data in reads:
            if sock.closed:
                break  # a closed transport reads no more
            assert not sock.paused, "bytes delivered to a connection that paused reading"
            conn.data_received(data)
            caller.run()
        if eof or sock.closed:
            conn.connection_lost(None)
        caller.run()
    except ConnectionLost as exc:
        return exc
    if caller.done:
        return Answer(conn.status, conn.headers, bytes(caller.body))
    assert not (eof or sock.closed), "the caller waits on a closed connection: it would hang"
    if caller.asleep is not None and not caller.asleep.done():
        # Asleep on an open connection: only right if the answer is not whole yet.
        return None
    raise AssertionError("woken with nothing to read")  # pragma: no cover


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for the connections' futures; never run."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


# -- answers --------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """An answer as parts (kind, bytes), and what the caller must get from it."""

    parts: tuple[tuple[str, bytes], ...]
    expected: Answer
    framing: str  # "length", "chunked", "close"
    head: bool  # the request was HEAD
    no_body: bool  # HEAD, 204 or 304

    @property
    def raw(self) -> bytes:
        return b"".join(data for _, data in self.parts)

    @property
    def head_end(self) -> int:
        """Where the final answer's head ends."""
        end = 0
        for kind, data in self.parts:
            end += len(data)
            if kind == "end-head":
                return end
        raise AssertionError("no head")

    def indices(self, kind: str) -> list[int]:
        return [i for i, (k, _) in enumerate(self.parts) if k == kind]

    def replaced(self, index: int, data: bytes) -> bytes:
        parts = [d for _, d in self.parts]
        parts[index] = data
        return b"".join(parts)


TOKEN = st.from_regex(r"\AX-[A-Za-z0-9-]{1,12}\Z")


def not_a_trailer(pair: bytes) -> bool:
    """Two bytes no trailer line (nor the empty line ending them) begins with."""
    return pair != b"\r\n" and re.fullmatch(_TOKEN, pair[:1]) is None


VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)
REASON = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=16)
OWS = st.sampled_from([b"", b" ", b"  ", b"\t"])
SMALL_BODY = st.binary(max_size=120)
# Past the high-water mark: the connection pauses reading until the caller takes.
LARGE_BODY = st.integers(_HIGH_WATER + 1, _HIGH_WATER + 5000).map(
    lambda n: (bytes(range(256)) * (n // 256 + 1))[:n]
)
# One body in ten is large: they cost most of the time.
BODY = st.integers(0, 9).flatmap(lambda i: LARGE_BODY if i == 9 else SMALL_BODY)


@st.composite
def header_lines(draw: st.DrawFn, names: Sequence[str]) -> tuple[list[bytes], dict[str, str]]:
    lines: list[bytes] = []
    seen: dict[str, str] = {}
    for name in names:
        value = draw(VALUE)
        lines.append(b"%s:%s%s%s\r\n" % (name.encode(), draw(OWS), value.encode(), draw(OWS)))
        seen[name.lower()] = value
    return lines, seen


def _cased(name: bytes, draw: st.DrawFn) -> bytes:
    return draw(st.sampled_from([name, name.lower(), name.upper()]))


@st.composite
def messages(draw: st.DrawFn) -> Message:
    parts: list[tuple[str, bytes]] = []
    for code in draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2)):
        interim, _ = draw(header_lines(draw(st.lists(TOKEN, max_size=2, unique_by=str.lower))))
        parts.append(("interim", b"HTTP/1.1 %d Interim\r\n%s\r\n" % (code, b"".join(interim))))
    status = draw(st.sampled_from([200, 201, 204, 304, 400, 404, 500, 503]) | st.integers(200, 599))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    reason = draw(REASON).encode("latin-1")
    parts.append(("status", b"%s %d %s" % (version, status, reason)))
    parts.append(("crlf", b"\r\n"))
    lines, headers = draw(header_lines(draw(st.lists(TOKEN, max_size=4, unique_by=str.lower))))
    head = draw(st.booleans())
    no_body = head or status in (204, 304)
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    body = b"" if no_body and draw(st.booleans()) else draw(BODY)
    if framing == "length":
        size = str(len(body))
        lines.insert(draw(st.integers(0, len(lines))), b"%s: %s\r\n" % (
            _cased(b"Content-Length", draw), size.encode()))  # fmt: skip
        headers["content-length"] = size
    elif framing == "chunked":
        coding = draw(st.sampled_from(["chunked", "Chunked", "CHUNKED"]))
        lines.insert(draw(st.integers(0, len(lines))), b"%s: %s\r\n" % (
            _cased(b"Transfer-Encoding", draw), coding.encode()))  # fmt: skip
        headers["transfer-encoding"] = coding
    parts += [("header", line) for line in lines]
    parts.append(("end-head", b"\r\n"))
    if not no_body:
        if framing == "chunked":
            parts += draw(chunked(body))
        else:
            parts.append(("data", body))
    expected = Answer(status, headers, b"" if no_body else body)
    return Message(tuple(parts), expected, framing, head, no_body)


@st.composite
def chunked(draw: st.DrawFn, body: bytes) -> list[tuple[str, bytes]]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=5))))
    bounds = [0, *[c for c in cuts if c < len(body)], len(body)]
    parts: list[tuple[str, bytes]] = []
    for start, end in itertools.pairwise(bounds):
        if start == end:
            continue
        size = draw(st.sampled_from(["%x", "%X", "%04x"])) % (end - start)
        parts.append(("size", size.encode() + draw(extension())))
        parts += [("crlf", b"\r\n"), ("data", body[start:end]), ("chunk-end", b"\r\n")]
    parts += [("size", b"0" + draw(extension())), ("crlf", b"\r\n")]
    trailers, _ = draw(header_lines(draw(st.lists(TOKEN, max_size=2))))
    parts += [("trailer", line) for line in trailers]
    parts.append(("end", b"\r\n"))
    return parts


@st.composite
def extension(draw: st.DrawFn) -> bytes:
    if not draw(st.booleans()):
        return b""
    return b"%s;%sname=%s" % (draw(OWS), draw(OWS), draw(st.sampled_from([b"v", b'"q s"', b""])))


@st.composite
def reads(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split into reads at arbitrary points (a byte at a time, sometimes)."""
    if len(data) < 400 and draw(st.integers(0, 9)) == 0:
        return [data[i : i + 1] for i in range(len(data))]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=12))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if a != b]


# -- properties -----------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_a_whole_answer_in_any_reads_is_read_exactly(
    loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    message = data.draw(messages())
    pieces = data.draw(reads(message.raw))
    until_close = message.framing == "close" and not message.no_body
    # Whole: read without waiting for the close (except a body that the close ends).
    assert exchange(loop, pieces, eof=until_close, head=message.head) == message.expected
    # And the close after a whole answer takes nothing from it.
    assert exchange(loop, pieces, eof=True, head=message.head) == message.expected


@FUZZ
@given(st.data())
def test_an_answer_cut_short_is_connection_lost(
    loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    message = data.draw(messages())
    raw = message.raw
    cut = data.draw(st.integers(0, len(raw) - 1))
    got = exchange(loop, data.draw(reads(raw[:cut])), eof=True, head=message.head)
    if message.framing == "close" and not message.no_body and cut >= message.head_end:
        # Nothing marks the end of such a body but the close: what came is the body.
        body = message.expected.body[: cut - message.head_end]
        assert got == Answer(message.expected.status, message.expected.headers, body)
    else:
        assert isinstance(got, ConnectionLost)
    # Still open, the caller waits for the rest (or has already refused the answer).
    open_ = exchange(loop, data.draw(reads(raw[:cut])), eof=False, head=message.head)
    assert open_ is None or isinstance(open_, ConnectionLost)


BAD_STATUS_LINES = st.sampled_from(
    [b"", b"garbage", b"HTTP/1.1", b"HTTP/1.1 ", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK",
     b"HTTP/1.1 -20 OK", b"HTTP/1.1 +20 OK", b"HTTP/1.1 2_0 OK", b"HTTP/1.1 0x1 OK",
     b"HTTP/1.1 600 Nope", b"HTTP/1.1 099 Nope", b"HTTP/1.1 101 Switching Protocols",
     b"HTTP/2 200 OK", b"HTTP/1.1  200 OK", b"HTP/1.1 200 OK", b" HTTP/1.1 200 OK",
     b"http/1.1 200 OK", b"HTTP/1.1 \xb2\xb2\xb2 OK", b"ICY 200 OK"]
) | st.binary(max_size=30).filter(lambda b: b"\r\n" not in b and not b.startswith(b"HTTP/1."))  # fmt: skip
BAD_SIZES = st.sampled_from(
    [b"", b" ", b"-1", b"+a", b"0x10", b"1_0", b" a", b"g", b"a b", b"\xb2", b";ext",
     b"1" * 17, b"f" * 40, b"10000000000000000", b"1a\x00"]
) | st.binary(min_size=1, max_size=20).filter(
    lambda b: b"\r\n" not in b and not b.split(b";")[0].rstrip(b" \t").isalnum()
)  # fmt: skip
BAD_LENGTHS = st.sampled_from(
    [b"", b"-1", b"+5", b"5_0", b"0x10", b"1 2", b"abc", b"1.5", b"\xb2", b"9" * 19,
     b"9" * 5000, b"5, 6"]
)  # fmt: skip


@FUZZ
@given(st.data())
def test_a_malformed_answer_is_refused_when_it_arrives(
    loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    message = data.draw(messages())
    flaws = ["status", "huge-head", "conflicting-framing"]
    if not message.no_body and message.framing == "chunked":
        flaws += ["size", "chunk-end"]
    if not message.no_body and message.framing == "length":
        flaws += ["length"]
    flaw = data.draw(st.sampled_from(flaws))
    if flaw == "status":
        raw = message.replaced(message.indices("status")[0], data.draw(BAD_STATUS_LINES))
    elif flaw == "huge-head":
        size = data.draw(st.integers(_MAX_HEAD + 1, _MAX_HEAD + 100))
        where = data.draw(st.sampled_from(message.indices("header") + message.indices("crlf")[:1]))
        raw = message.replaced(where, message.parts[where][1] + b"X-Big: " + b"b" * size + b"\r\n")
    elif flaw == "conflicting-framing":
        extra = data.draw(
            st.sampled_from([b"Content-Length: 1\r\nContent-Length: 2\r\n",
                             b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
                             b"Transfer-Encoding: gzip\r\n", b"Transfer-Encoding: gzip, chunked\r\n",
                             b"no colon here\r\n"])
        )  # fmt: skip
        if message.no_body and not extra.startswith(b"no colon"):
            return  # no body to frame: nothing conflicts
        end = message.indices("end-head")[0]
        raw = message.replaced(end, extra + b"\r\n")  # beside the answer's own framing
    elif flaw == "size":
        index = data.draw(st.sampled_from(message.indices("size")))
        raw = message.replaced(index, data.draw(BAD_SIZES))
    elif flaw == "chunk-end":
        ends = message.indices("chunk-end")
        if ends:  # any two bytes but CRLF after a chunk's data
            index = data.draw(st.sampled_from(ends))
            bad = data.draw(st.binary(min_size=2, max_size=2)).replace(b"\r\n", b"\r\r")
        else:  # after the last chunk: two bytes that cannot begin a trailer line either
            index = message.indices("end")[0]
            bad = data.draw(st.binary(min_size=2, max_size=2).filter(not_a_trailer))
        raw = message.replaced(index, bad)
    else:
        line = next(i for i in message.indices("header")
                    if message.parts[i][1][:15].lower() == b"content-length:")  # fmt: skip
        raw = message.replaced(line, b"Content-Length: " + data.draw(BAD_LENGTHS) + b"\r\n")
    # Refused as soon as the flaw arrives: no waiting on the connection for a deadline.
    got = exchange(loop, data.draw(reads(raw)), eof=False, head=message.head)
    assert isinstance(got, ConnectionLost), (flaw, raw[:200], got)


@FUZZ
@given(st.data())
def test_bytes_after_a_whole_answer_leave_it_standing(
    loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    message = data.draw(messages().filter(lambda m: m.framing != "close" or m.no_body))
    extra = data.draw(st.binary(min_size=1, max_size=40))
    got = exchange(loop, data.draw(reads(message.raw + extra)), eof=False, head=message.head)
    assert got == message.expected


@FUZZ
@given(st.data())
def test_any_bytes_end_in_an_answer_or_connection_lost(
    loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    message = data.draw(messages())
    raw = bytearray(message.raw)
    choice = data.draw(st.sampled_from(["noise", "flip", "insert"]))
    if choice == "noise":
        raw = bytearray(data.draw(st.binary(max_size=300)))
    elif choice == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.sampled_from([b"\r\n", b"\r\n\r\n", b"0\r\n\r\n", b":", b";"]))
    got = exchange(loop, data.draw(reads(bytes(raw))), eof=True, head=message.head)
    assert isinstance(got, Answer | ConnectionLost)


# What the parser read wrong before these properties existed: int() takes "0x3", "+3",
# "1_0"; the first header of a pair won; any coding containing "chunked" was chunked; a
# 1xx answer was the answer (the real one its body); a head of any size in one read.
REFUSED = {
    "chunk size 0x3": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    "chunk size +3": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+3\r\nabc\r\n0\r\n\r\n",
    "chunk size past 64 bits": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\n" % (b"1" * 17),
    "length 1_0": b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n0123456789",
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 2\r\n\r\nabc",
    "length and chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    "coding notchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: notchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "coding gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc",
    "status 20": b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n",
    "status -1": b"HTTP/1.1 -1 OK\r\nContent-Length: 0\r\n\r\n",
    "not HTTP": b"ICY 200 OK\r\nContent-Length: 0\r\n\r\n",
    "101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    "header without colon": b"HTTP/1.1 200 OK\r\nnonsense\r\nContent-Length: 0\r\n\r\n",
    "head too large": b"HTTP/1.1 200 OK\r\nX: %s\r\nContent-Length: 0\r\n\r\n" % (b"a" * _MAX_HEAD),
}  # fmt: skip


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
def test_answers_once_misread_are_refused(loop: asyncio.AbstractEventLoop, raw: bytes) -> None:
    assert isinstance(exchange(loop, [raw], eof=False), ConnectionLost)


def test_an_interim_answer_is_skipped(loop: asyncio.AbstractEventLoop) -> None:
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    assert exchange(loop, [raw], eof=False) == Answer(200, {"content-length": "2"}, b"ok")


# -- through a socket and the whole transport -----------------------------------------


@contextlib.asynccontextmanager
async def _serving(pieces: Sequence[bytes], close: bool) -> AsyncIterator[str]:
    """A unix socket server answering one request with ``pieces``, each its own write."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
            if not close:
                await reader.read()  # until the client hangs up
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    with tempfile.TemporaryDirectory(prefix="sandman-fuzz-") as tmp:
        path = str(Path(tmp) / "s")
        server = await asyncio.start_unix_server(handle, path=path)
        try:
            yield path
        finally:
            server.close()
            await server.wait_closed()


async def _request(pieces: Sequence[bytes], *, close: bool, head: bool) -> Answer | ConnectionLost:
    async with _serving(pieces, close) as path:
        transport = HTTPTransport(uds=path)
        try:
            async with asyncio.timeout(5):  # a hang fails the test, it does not stall it
                response = await transport.request("HEAD" if head else "GET", "/")
        except ConnectionLost as exc:
            return exc
        finally:
            await transport.aclose()
    return Answer(response.status, dict(response.headers), response.body)


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_through_a_socket(data: st.DataObject) -> None:
    message = data.draw(messages())
    raw = message.raw
    cut = data.draw(st.sampled_from([len(raw), len(raw), data.draw(st.integers(0, len(raw)))]))
    until_close = message.framing == "close" and not message.no_body
    pieces = data.draw(reads(raw[:cut]))
    got = asyncio.run(_request(pieces, close=cut < len(raw) or until_close, head=message.head))
    if cut == len(raw):
        assert got == message.expected
    elif until_close and cut >= message.head_end:
        body = message.expected.body[: cut - message.head_end]
        assert got == Answer(message.expected.status, message.expected.headers, body)
    else:
        assert isinstance(got, ConnectionLost)
