"""A Debian image with Python and git, built offline from the OS package mirror.

``debootstrap`` is slow (a minute or more), so the result is cached as a
rootfs tarball under ``$SANDMAN_TEST_CACHE`` (default
``/var/cache/sandman/test-images``) and reused by later runs on the same
machine. Concurrent builders serialise on a lock file.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

SUITE = "bookworm"
PACKAGES = ("python3", "git")
# Bump when the recipe changes, so stale caches are not reused.
RECIPE = 1


def cache_dir() -> Path:
    return Path(os.environ.get("SANDMAN_TEST_CACHE", "/var/cache/sandman/test-images"))


def mirror() -> str:
    """The Debian mirror apt already uses on this machine."""
    for source in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if source.exists():
            match = re.search(r"(?:URIs:|deb)\s+(https?://\S+/debian)\b", source.read_text())
            if match:
                return match[1]
    return "http://deb.debian.org/debian"


def debian_python_tar() -> Path:
    """The cached rootfs tarball, built first if missing."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"debian-{SUITE}-{'-'.join(PACKAGES)}-r{RECIPE}.tar"
    if target.exists():
        return target
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache))
        try:
            root = work / "root"
            subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                 SUITE, str(root), mirror()],
                check=True, capture_output=True, timeout=1500,
            )  # fmt: skip
            # Trim what a task image does not need: apt lists and caches.
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                shutil.rmtree(root / junk, ignore_errors=True)
            partial = work / "rootfs.tar"
            subprocess.run(
                ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
                check=True, capture_output=True, timeout=600,
            )  # fmt: skip
            partial.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target
