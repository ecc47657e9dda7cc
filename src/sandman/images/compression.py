"""Recognising compressed streams by their magic bytes, and decompressing them (stdlib only)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import tarfile
import zlib
from typing import BinaryIO, cast

from sandman.errors import ImageError

__all__ = ["CORRUPT", "decompressed"]

_ZSTD = b"\x28\xb5\x2f\xfd"

CORRUPT = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)
"""What a damaged compressed stream or tar raises while we read it."""


def decompressed(head: bytes, stream: BinaryIO, what: str) -> BinaryIO | None:
    """A decompressing reader over `stream` if `head` (its first bytes) says it is compressed.

    None when it is not compressed. gzip, bzip2 and xz are handled; zstd is
    refused with an `ImageError` that says what to do instead.
    """
    if head.startswith(_ZSTD):
        raise ImageError(
            f"{what} is zstd-compressed, which this image store does not support; "
            "re-export it with gzip or without compression"
        )
    if head.startswith(b"\x1f\x8b"):
        return cast(BinaryIO, gzip.GzipFile(fileobj=stream, mode="rb"))
    if head.startswith(b"BZh"):
        return cast(BinaryIO, bz2.BZ2File(stream, mode="rb"))
    if head.startswith(b"\xfd7zXZ\x00"):
        return cast(BinaryIO, lzma.LZMAFile(stream, mode="rb"))
    return None
