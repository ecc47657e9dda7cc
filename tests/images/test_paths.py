"""Untrusted paths are joined onto a root with chroot semantics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandman.errors import ImageError
from sandman.images.paths import clean_name, secure_join


@pytest.mark.parametrize(
    ("name", "cleaned"),
    [
        ("etc/passwd", "etc/passwd"),
        ("/etc/passwd", "etc/passwd"),
        ("./etc/passwd", "etc/passwd"),
        ("//etc//passwd/", "etc/passwd"),
        ("a/../b", "b"),
        ("./", "."),
        ("/", "."),
        ("", "."),
    ],
)
def test_clean_name(name: str, cleaned: str) -> None:
    assert clean_name(name) == cleaned


@pytest.mark.parametrize("name", ["..", "../x", "a/../../x", "/../x", "./../x", "a/b/../../../x"])
def test_clean_name_refuses_escapes(name: str) -> None:
    with pytest.raises(ImageError, match="outside"):
        clean_name(name)


def test_secure_join_resolves_symlinks_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "real/dir").mkdir(parents=True)
    os.symlink("/real", root / "abs")
    os.symlink("../../../../..", root / "up")
    os.symlink("real/dir", root / "rel")
    os.symlink("/", root / "slash")
    os.symlink("abs", root / "chain")
    os.symlink("loop", root / "loop")
    assert secure_join(root, "abs/dir/x") == root / "real/dir/x"
    assert secure_join(root, "up/etc/passwd") == root / "etc/passwd"
    assert secure_join(root, "rel/../y") == root / "real/y"
    assert secure_join(root, "slash/tmp") == root / "tmp"
    assert secure_join(root, "chain/dir") == root / "real/dir"
    assert secure_join(root, "../../etc") == root / "etc"
    assert secure_join(root, "missing/../real") == root / "real"
    assert secure_join(root, "") == root
    with pytest.raises(ImageError, match="too many levels"):
        secure_join(root, "loop/x")
