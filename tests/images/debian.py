"""A Debian image with Python and git, built offline from the OS package mirror.

``debootstrap`` is slow (a minute or more), so the result is cached as a
rootfs tarball under ``$SANDMAN_TEST_CACHE`` (default
``/var/cache/sandman/test-images``) and reused by later runs on the same
machine (`sandman.images.debootstrap.build_debian_rootfs`). Concurrent
builders serialise on a lock file.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandman.images.debootstrap import DEFAULT_CACHE, apt_mirror, build_debian_rootfs

SUITE = "bookworm"
PACKAGES = ("python3", "git")
# Bump when the recipe changes, so stale caches are not reused.
RECIPE = 1


def cache_dir() -> Path:
    return Path(os.environ.get("SANDMAN_TEST_CACHE", DEFAULT_CACHE))


def mirror() -> str:
    """The Debian mirror apt already uses on this machine."""
    return apt_mirror()


def debian_python_tar() -> Path:
    """The cached rootfs tarball, built first if missing."""
    return build_debian_rootfs(PACKAGES, suite=SUITE, recipe=RECIPE, cache_dir=cache_dir())
