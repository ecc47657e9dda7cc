"""Any httpx transport behind the seam: `HttpxTransport`.

For what the lean transport is not: a caller's ``httpx.ASGITransport(app)``
(the service in this process), ``httpx.MockTransport(handler)`` in a test,
or plain httpx over the same socket, to measure what the lean transport
saves (``benchmarks/latency.py``). httpx's errors leave as the seam's:
a connection that cannot be made as `ConnectionError`, anything else that
went wrong on the way as `ConnectionLost`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx

from sandman._transport.base import ConnectionLost, Response, ResponseStream

__all__ = ["HttpxTransport"]


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ConnectionError(str(exc) or repr(exc)) from exc
    except httpx.RequestError as exc:  # transport, protocol and decoding errors
        raise ConnectionLost(str(exc) or repr(exc)) from exc


def _lower(headers: httpx.Headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


class _Streamed:
    """An httpx response as a `ResponseStream`."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = _lower(response.headers)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for piece in self._response.aiter_bytes():
                yield piece

    async def read(self) -> bytes:
        # Through iter_bytes, so that a wrapper replacing it sees every byte.
        return b"".join([piece async for piece in self.iter_bytes()])


class HttpxTransport:
    """An `AsyncTransport` over an httpx transport, to ``base_url`` with ``headers``.

    Requests have no deadline of their own (the caller's ``asyncio.timeout``
    bounds them), except ``connect_timeout`` for opening a connection.
    `aclose` closes the httpx transport too.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        *,
        base_url: str | httpx.URL = "http://sandmand",
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self._where = str(base_url)
        self._client = httpx.AsyncClient(
            transport=transport, base_url=base_url, headers=dict(headers or {}),
            timeout=httpx.Timeout(None, connect=connect_timeout),
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"HttpxTransport({self._where!r})"

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> Response:
        headers = None if content_type is None else {"Content-Type": content_type}
        with _mapped():
            response = await self._client.request(method, target, content=body, headers=headers)
        return Response(response.status_code, _lower(response.headers), response.content)

    def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | AsyncIterable[bytes] | None = None,
        content_type: str | None = None,
    ) -> AbstractAsyncContextManager[ResponseStream]:
        return self._stream(method, target, body, content_type)

    @asynccontextmanager
    async def _stream(
        self,
        method: str,
        target: str,
        body: bytes | AsyncIterable[bytes] | None,
        content_type: str | None,
    ) -> AsyncIterator[ResponseStream]:
        headers = None if content_type is None else {"Content-Type": content_type}
        async with contextlib.AsyncExitStack() as stack:
            with _mapped():
                response = await stack.enter_async_context(
                    self._client.stream(method, target, content=body, headers=headers)
                )
            yield _Streamed(response)

    async def aclose(self) -> None:
        await self._client.aclose()
