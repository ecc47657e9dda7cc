"""Content digests: hashing while reading, and checking what we were promised."""

from __future__ import annotations

import hashlib
import re
from typing import BinaryIO

from sandman.errors import ImageError

__all__ = ["DIGEST_RE", "HashingReader", "check_digest", "digest_bytes", "hex_of"]

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
"""The only digest algorithm images in the wild use, and the only one we accept."""

CHUNK = 1 << 20


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of `data`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hex_of(digest: str) -> str:
    """The hex part of a ``sha256:<hex>`` digest, refusing anything else."""
    if not DIGEST_RE.fullmatch(digest):
        raise ImageError(f"unsupported or malformed digest {digest!r} (expected sha256:<64 hex>)")
    return digest.removeprefix("sha256:")


def check_digest(what: str, expected: str | None, actual: str) -> None:
    """Raise `ImageError` when `actual` is not the `expected` digest (None: nothing promised)."""
    if expected is not None and expected != actual:
        raise ImageError(f"{what}: digest mismatch: expected {expected}, got {actual}")


class HashingReader:
    """A read-only file wrapper that hashes and counts every byte read through it."""

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self._hash = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        self._hash.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        """Read to the end, so the digest covers everything (tar stops at its end marker)."""
        while self.read(CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()
