"""The images of ``/run_code``'s default languages, built offline by debootstrap and cached.

``fusion-python`` (python, bash) is the Debian image with python3 and git the other
tests use (`tests.images.debian`); ``fusion-polyglot`` (cpp, go, nodejs, java) adds
g++, golang-go, nodejs and a headless JDK. Cold, the polyglot build downloads about
300 MB of packages and takes a few minutes; later runs on the machine reuse the
tarball under ``$SANDMAN_TEST_CACHE`` (`sandman.images.debootstrap`).
"""

from __future__ import annotations

from pathlib import Path

from sandman.images.debootstrap import build_debian_rootfs
from tests.images.debian import SUITE, cache_dir

POLYGLOT = ("python3", "g++", "golang-go", "nodejs", "default-jdk-headless")
# Bump when the recipe changes, so stale caches are not reused.
RECIPE = 1


def polyglot_tar() -> Path:
    """The cached polyglot rootfs tarball, built first if missing."""
    return build_debian_rootfs(POLYGLOT, suite=SUITE, recipe=RECIPE, cache_dir=cache_dir())
