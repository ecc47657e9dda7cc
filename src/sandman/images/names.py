"""Image names: normalising references, and the ``names.json`` table that maps them to ids."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from sandman.errors import ImageError

__all__ = ["is_id_prefix", "normalize_name", "read_names", "tag_of", "write_names"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,383}")
_HEX_PREFIX_RE = re.compile(r"[0-9a-f]{1,64}")
_FAMILIAR_PREFIXES = (
    "docker.io/library/",
    "index.docker.io/library/",
    "docker.io/",
    "index.docker.io/",
)


def normalize_name(name: str) -> str:
    """The canonical form of an image name: docker's short form, with a tag.

    ``busybox`` and ``docker.io/library/busybox`` become ``busybox:latest``;
    ``ghcr.io/x/y:1`` stays. References by digest (``name@sha256:...``) keep
    their digest and get no tag. Raises `ImageError` for what is not a name.
    """
    cleaned = name.strip()
    if not _NAME_RE.fullmatch(cleaned) or cleaned.startswith("sha256:"):
        raise ImageError(f"invalid image name {name!r} (expected e.g. 'busybox' or 'repo/x:tag')")
    for prefix in _FAMILIAR_PREFIXES:
        if cleaned.startswith(prefix):
            cleaned = cleaned.removeprefix(prefix)
            break
    if "@" not in cleaned and ":" not in cleaned.rsplit("/", 1)[-1]:
        cleaned += ":latest"
    return cleaned


def tag_of(name: str) -> str | None:
    """The tag of a normalised name (``latest`` of ``busybox:latest``); None for digests."""
    if "@" in name:
        return None
    return name.rsplit(":", 1)[1]


def is_id_prefix(ref: str) -> bool:
    """Whether `ref` could be (the start of) an image id's hex part."""
    return _HEX_PREFIX_RE.fullmatch(ref) is not None


def read_names(path: Path) -> dict[str, str]:
    """The name → image id table; empty when the file does not exist yet."""
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ImageError(f"the image name table {path} is unreadable: {exc}") from exc
    names = document.get("names") if isinstance(document, dict) else None
    if not isinstance(names, dict):
        raise ImageError(f"the image name table {path} is malformed")
    return {str(k): str(v) for k, v in names.items()}


def write_names(path: Path, names: dict[str, str], tmp_dir: Path) -> None:
    """Replace the table atomically: readers see the old or the new one, never half.

    The temporary file lives in `tmp_dir` (same filesystem), named so that
    stale-file cleanup knows which lock guards it.
    """
    data = json.dumps({"version": 1, "names": dict(sorted(names.items()))}, indent=2).encode()
    tmp = tmp_dir / f"names.{secrets.token_hex(8)}.json"
    try:
        with open(tmp, "wb") as file:
            file.write(data + b"\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
