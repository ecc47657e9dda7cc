"""The image's User setting becomes numeric ids, from the rootfs's own passwd and group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandman.errors import ImageError
from sandman.images import resolve_user


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\n# comment\nnobody:x:65534:65534::/:/bin/false\n"
        "app:x:1000:1001::/home/app:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\nstaff:x:50:app\n")
    return root


@pytest.mark.parametrize(
    ("user", "ids"),
    [
        ("", (0, 0)),
        ("root", (0, 0)),
        ("0", (0, 0)),
        ("nobody", (65534, 65534)),
        ("app", (1000, 1001)),
        ("1000", (1000, 1001)),
        ("4242", (4242, 0)),
        ("4242:7", (4242, 7)),
        ("app:staff", (1000, 50)),
        ("nobody:nogroup", (65534, 65534)),
        ("1000:staff", (1000, 50)),
        ("app:0", (1000, 0)),
    ],
)
def test_resolve_user(rootfs: Path, user: str, ids: tuple[int, int]) -> None:
    assert resolve_user(rootfs, user) == ids


@pytest.mark.parametrize(
    ("user", "message"), [("ghost", "not in the image's /etc/passwd"), ("app:ghosts", "group")]
)
def test_unknown_names(rootfs: Path, user: str, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        resolve_user(rootfs, user)


def test_numeric_ids_need_no_files(tmp_path: Path) -> None:
    assert resolve_user(tmp_path, "12:34") == (12, 34)
    assert resolve_user(tmp_path, "12") == (12, 0)
    with pytest.raises(ImageError):
        resolve_user(tmp_path, "app")


def test_passwd_symlink_is_resolved_inside_the_rootfs(rootfs: Path, tmp_path: Path) -> None:
    host = tmp_path / "host-passwd"
    host.write_text("evil:x:0:0::/:/bin/sh\n")
    (rootfs / "etc/passwd").unlink()
    os.symlink(str(host), rootfs / "etc/passwd")  # absolute: /<tmp>/host-passwd inside the rootfs
    with pytest.raises(ImageError):
        resolve_user(rootfs, "evil")


def test_passwd_must_be_a_regular_file(rootfs: Path) -> None:
    (rootfs / "etc/passwd").unlink()
    os.mkfifo(rootfs / "etc/passwd")
    with pytest.raises(ImageError, match="not a regular file"):
        resolve_user(rootfs, "app")
