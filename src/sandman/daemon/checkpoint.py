"""The host's own calls around a memory checkpoint (gVisor's ``runsc checkpoint``):
quiescing the daemon before one, and giving a restored copy a token of its own.

Not a sandbox's vocabulary (`DaemonClient`): only the provider that made the
sandbox makes them. Each is one request on a connection of its own, read to the
end: when `prepare_checkpoint` returns, the daemon has closed that connection too,
and holds no TCP socket a checkpoint could trip on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from sandman import errors
from sandman.daemon import protocol

__all__ = ["CHECKPOINT_PREPARE", "TOKEN", "prepare_checkpoint", "replace_token"]

CHECKPOINT_PREPARE = "/v1/checkpoint/prepare"
TOKEN = "/v1/token"
_MAX_ANSWER = 64 * 1024


async def prepare_checkpoint(
    *,
    token: str,
    host: str | None = None,
    port: int | None = None,
    uds: str | None = None,
    timeout: float = 10.0,
) -> None:
    """Ask the daemon to stop serving for a checkpoint; returns once it has closed every
    connection it had. A sandbox whose processes hold TCP sockets (or with requests in
    flight) is refused: `DaemonError` with ``code == "not_checkpointable"``, the pids
    named in its message; the daemon then goes on serving. After the restore, the host
    sends the daemon SIGUSR2 and it listens again."""
    await _exchange("POST", CHECKPOINT_PREPARE, None, token, host, port, uds, timeout)


async def replace_token(
    new_token: str,
    *,
    token: str,
    host: str | None = None,
    port: int | None = None,
    uds: str | None = None,
    timeout: float = 10.0,
) -> None:
    """Replace the daemon's bearer token ``token`` with ``new_token``: from the answer
    on, the old one is `Unauthorized`."""
    body = json.dumps({"token": new_token}).encode()
    await _exchange("POST", TOKEN, body, token, host, port, uds, timeout)


async def _exchange(
    method: str,
    target: str,
    body: bytes | None,
    token: str,
    host: str | None,
    port: int | None,
    uds: str | None,
    timeout: float,
) -> None:
    """One request on a connection of its own. The answer read, the host shuts its side
    down first and reads to the daemon's end: a TCP endpoint that closes first lingers
    (TIME_WAIT), and gVisor cannot checkpoint a sandbox holding one. A non-2xx answer
    raises."""
    address = f"unix:{uds}" if uds is not None else f"tcp:{host}:{port}"
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: sandmand\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {len(body or b'')}\r\n"
    )
    if body is not None:
        head += "Content-Type: application/json\r\n"
    request = (head + "\r\n").encode() + (body or b"")
    try:
        async with asyncio.timeout(timeout):
            if uds is not None:
                reader, writer = await asyncio.open_unix_connection(uds)
            elif host is not None and port is not None:
                reader, writer = await asyncio.open_connection(host, port)
            else:
                raise errors.ConfigError("a daemon address needs uds=, or host= and port=")
            try:
                writer.write(request)
                await writer.drain()
                status, payload = await _answer(reader)
                writer.write_eof()
                with contextlib.suppress(ConnectionResetError):
                    while await reader.read(_MAX_ANSWER):
                        pass
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        raise errors.DaemonUnavailable(
            f"sandmand at {address} did not answer {method} {target} within {timeout} s"
        ) from None
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        raise errors.DaemonUnavailable(
            f"sandmand at {address} did not answer {method} {target}: {exc!r}"
        ) from exc
    if status >= 300:
        raise protocol.error_from_response(status, payload)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of one HTTP/1.1 answer (Content-Length, chunked or none)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 204 or status < 200:
        return status, b""
    if "content-length" in headers:
        return status, await reader.readexactly(min(int(headers["content-length"]), _MAX_ANSWER))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return status, bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    return status, b""
