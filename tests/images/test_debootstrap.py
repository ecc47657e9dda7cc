"""`build_debian_rootfs` without running debootstrap: names, the cache, the mirror.

The real build runs in the tests that need a Debian image (tests/eval,
tests/providers/local/test_debian.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.images.debootstrap import apt_mirror, build_debian_rootfs


def test_a_cached_tarball_is_reused_by_name(tmp_path: Path) -> None:
    cached = tmp_path / "debian-trixie-python3-git-r3.tar"
    cached.write_bytes(b"not really a tarball")
    # The mirror is never asked: nothing is built.
    found = build_debian_rootfs(
        ["python3", "git"], suite="trixie", recipe=3, cache_dir=tmp_path, mirror="http://x.invalid"
    )
    assert found == cached and found.read_bytes() == b"not really a tarball"


def test_bad_package_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not Debian package names: \['python3 git'\]"):
        build_debian_rootfs(["python3 git"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not Debian package names: none given"):
        build_debian_rootfs([], cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"\['--foo'\]"):
        build_debian_rootfs(["python3", "--foo"], cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_mirror_comes_from_apt_sources(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb http://other.example/debian bookworm main\n")
    assert apt_mirror([tmp_path / "missing", deb822, one_line]) == "http://mirror.example/debian"
    assert apt_mirror([one_line]) == "http://other.example/debian"
    assert apt_mirror([tmp_path / "missing"]) == "http://deb.debian.org/debian"
