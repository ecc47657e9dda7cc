"""Debian root filesystems built by ``debootstrap`` from the OS package mirror, cached as tarballs.

``debootstrap`` takes a minute or more, so each result is kept as a rootfs
tarball in a cache directory and reused by later builds on the same machine;
concurrent builders of the same tarball serialise on a lock file beside it.
The tarball can be imported as an image (`ImageStore.import_archive`). Needs
root and the ``debootstrap`` command.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_CACHE", "apt_mirror", "build_debian_rootfs"]

DEFAULT_CACHE = Path("/var/cache/sandman/test-images")
"""Where `build_debian_rootfs` keeps its tarballs unless told otherwise."""

_SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
_MIRROR = re.compile(r"(?:URIs:|deb)\s+(https?://\S+/debian)\b")
# What a task image does not need: the downloaded packages and apt's lists.
_JUNK = ("var/cache/apt/archives", "var/lib/apt/lists")


def apt_mirror(sources: Sequence[Path] = _SOURCES) -> str:
    """The Debian mirror apt already uses on this machine (else ``deb.debian.org``)."""
    for source in sources:
        if source.exists():
            match = _MIRROR.search(source.read_text())
            if match:
                return match[1]
    return "http://deb.debian.org/debian"


def build_debian_rootfs(
    packages: Sequence[str],
    *,
    suite: str = "bookworm",
    recipe: int = 1,
    cache_dir: Path = DEFAULT_CACHE,
    mirror: str | None = None,
    timeout: float = 1500.0,
) -> Path:
    """The cached rootfs tarball of a minimal Debian ``suite`` with ``packages``, built if missing.

    The tarball is ``<cache_dir>/debian-<suite>-<packages joined by ->-r<recipe>.tar``;
    bump ``recipe`` when what goes into it changes, so a stale tarball is not
    reused. Its members are sorted by name with numeric owners and keep their
    mtimes (the ``.pyc`` files compiled at install time stay valid), so one
    tarball is the same bytes every time it is read. ``mirror`` defaults to
    `apt_mirror`. Raises `ValueError` for a bad package name and
    `subprocess.CalledProcessError` (with debootstrap's output) if it fails.
    """
    bad = [p for p in packages if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]*", p)]
    if not packages or bad:
        raise ValueError(f"not Debian package names: {bad or 'none given'}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"debian-{suite}-{'-'.join(packages)}-r{recipe}.tar"
    if target.exists():
        return target
    # One lock per tarball: a build of another recipe does not wait for this one.
    with (cache_dir / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache_dir))
        try:
            root = work / "root"
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(packages)}",
                    suite,
                    str(root),
                    mirror or apt_mirror(),
                ],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            for junk in _JUNK:
                shutil.rmtree(root / junk, ignore_errors=True)
            partial = work / "rootfs.tar"
            subprocess.run(
                [
                    "tar",
                    "-cf",
                    str(partial),
                    "--sort=name",
                    "--numeric-owner",
                    "-C",
                    str(root),
                    ".",
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
            partial.rename(target)  # whole or not at all: a killed build leaves no tarball
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target
