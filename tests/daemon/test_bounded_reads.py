"""Reads of files the workload controls stay bounded on the host (issue 12, item 2)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import sandman
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio

GiB = 1024**3


async def test_a_device_or_fifo_is_refused_not_streamed(
    client: DaemonClient, tmp_path: Path
) -> None:
    tmp_path = tmp_path / "box"  # beside the daemon's socket and log
    tmp_path.mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "zero", tmp_path / "fifo"):
        with pytest.raises(sandman.NotARegularFile, match=str(path)) as caught:
            await client.read_file(str(path), max_bytes=GiB)
        assert caught.value.code == "not_a_regular_file"
        with pytest.raises(sandman.NotARegularFile):
            async with client.read_file_stream(str(path)) as chunks:
                async for _ in chunks:
                    pass
    with pytest.raises(sandman.NotARegularFile):
        await client.download_file(str(tmp_path / "zero"), tmp_path / "copy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "zero"]


async def test_a_huge_sparse_file_is_refused_by_its_size(
    client: DaemonClient, tmp_path: Path
) -> None:
    tmp_path = tmp_path / "box"
    tmp_path.mkdir()
    sparse = tmp_path / "sparse"
    with sparse.open("wb") as f:
        f.truncate(64 * GiB)
    with pytest.raises(sandman.FileTooLarge, match=rf"{sparse} has {64 * GiB} bytes") as caught:
        await client.read_file(str(sparse))
    assert "max_bytes=67108864" in str(caught.value)
    with pytest.raises(sandman.FileTooLarge, match="max_bytes=1048576"):
        await client.download_file(str(sparse), tmp_path / "copy", max_bytes=1024**2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sparse"]
    # The streaming form reads any size in bounded pieces; stopping early is fine.
    received = 0
    async with client.read_file_stream(str(sparse)) as chunks:
        async for piece in chunks:
            assert len(piece) <= 1024**2
            received += len(piece)
            if received >= 8 * 1024**2:
                break
    assert received < 10 * 1024**2


async def test_the_client_cap_holds_where_the_daemon_cannot_know_the_size(
    client: DaemonClient,
) -> None:
    # procfs files say size 0: the daemon streams them, cut after max_bytes + 1.
    with pytest.raises(sandman.FileTooLarge, match="/proc/self/status is larger than max_bytes=10"):
        await client.read_file("/proc/self/status", max_bytes=10)
    assert len(await client.read_file("/proc/self/status", max_bytes=1024**2)) > 10


async def test_a_hostile_daemon_streaming_forever_is_cut_at_the_limit(tmp_path: Path) -> None:
    """A daemon that ignores max_bytes and sends zeros without end (fault injection:
    the real daemon never does): the client stops at the limit, having held at
    most one piece past it."""
    sent = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (65536, bytes(65536))
        try:
            while sent < 256 * 1024**2:  # a bound for the test itself
                writer.write(piece)
                sent += 65536
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()

    socket = str(tmp_path / "fake.sock")
    server = await asyncio.start_unix_server(endless, socket)
    try:
        async with DaemonClient(uds=socket, token="t") as client:
            with pytest.raises(sandman.FileTooLarge, match="max_bytes=4194304"):
                await client.read_file("/dev/zero", max_bytes=4 * 1024**2)
            with pytest.raises(sandman.FileTooLarge):
                await client.download_archive("/", max_bytes=4 * 1024**2)
            # Zeros are an end-of-archive marker: nothing is unpacked, and the
            # rest of the stream is not read.
            result = await client.download_tree("/", tmp_path / "tree")
            assert (result.files, result.bytes) == (0, 0)
            assert list((tmp_path / "tree").iterdir()) == []
    finally:
        server.close()
        await server.wait_closed()
    # The connection was dropped, so the fake stopped sending long before its own bound.
    assert sent < 64 * 1024**2
