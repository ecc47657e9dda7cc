"""Reports of lost sandboxes fanned out to their readers: the plumbing of `WatchesLost`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Self

from sandman.providers.base import Lost

__all__ = ["LossFeed", "LossReader"]


class LossFeed:
    """A provider `report` s each loss once; every open `LossReader` receives it."""

    def __init__(self, *, start: Callable[[], Awaitable[None]] | None = None) -> None:
        self._readers: set[LossReader] = set()
        self._start = start

    def report(self, lost: Lost) -> None:
        """Hand ``lost`` to every reader (none: it is dropped). Never blocks."""
        for reader in self._readers:
            reader._queue.put_nowait(lost)

    def reader(self) -> LossReader:
        """A new reader: it receives every report from now on, until closed."""
        reader = LossReader(self, self._start)
        self._readers.add(reader)
        return reader

    def close(self) -> None:
        """End every reader (after the reports it holds)."""
        for reader in list(self._readers):
            reader._end()


class LossReader:
    """``async for lost in reader``; `aclose` (or the feed's `LossFeed.close`) ends it."""

    def __init__(self, feed: LossFeed, start: Callable[[], Awaitable[None]] | None) -> None:
        self._feed = feed
        self._start = start
        # A report never waits on a reader: a slow one holds them, bounded by the sandboxes.
        self._queue: asyncio.Queue[Lost | None] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Lost:
        if self._start is not None:
            start, self._start = self._start, None
            await start()
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        lost = await self._queue.get()
        if lost is None:
            raise StopAsyncIteration
        return lost

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._feed._readers.discard(self)
            self._queue.put_nowait(None)

    async def aclose(self) -> None:
        """Stop receiving reports."""
        self._end()
