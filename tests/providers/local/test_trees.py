"""remove_tree against trees no recursion, descriptor per level or path can remove."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from sandman.providers.local.trees import remove_tree


def _chain(top: Path, depth: int, name: str) -> None:
    """``depth`` directories, each inside the last, made relative to descriptors
    (their whole path is far beyond PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            os.mkdir(name, dir_fd=fd)
            if i % 100 == 0:
                os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_chain_deeper_than_any_recursion_and_path_goes(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    top.mkdir()
    _chain(top, 5000, "d" * 255)  # ~1.3 MB of path: no path-based call could reach the end
    before = _open_fds()
    remove_tree(top)
    assert not top.exists()
    assert _open_fds() == before


def test_unreadable_directories_and_odd_modes_go(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    (top / "a" / "b" / "c").mkdir(parents=True)
    (top / "a" / "b" / "c" / "file").write_text("x")
    (top / "a" / "b" / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(top / "a" / "b" / "fifo")
    for path in (top / "a" / "b" / "c", top / "a" / "b", top / "a"):
        path.chmod(0o000)
    (top / "sticky").mkdir(mode=0o1000)
    remove_tree(top)
    assert not top.exists()


def test_symlinks_out_of_the_tree_are_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "file").write_text("precious")
    top = tmp_path / "tree"
    (top / "deep").mkdir(parents=True)
    (top / "link").symlink_to(outside)
    (top / "deep" / "up").symlink_to("../..")
    (top / "deep" / "file-link").symlink_to(outside / "keep" / "file")
    remove_tree(top)
    assert not top.exists()
    assert (outside / "keep" / "file").read_text() == "precious"


def test_a_tree_already_gone_is_no_error(tmp_path: Path) -> None:
    remove_tree(tmp_path / "never-made")


def test_a_symlink_given_as_the_tree_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError) as caught:
        remove_tree(tmp_path / "link")
    assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert (tmp_path / "real" / "file").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_a_mount_point_inside_is_not_crossed(tmp_path: Path) -> None:
    top = tmp_path / "tree"
    mounted = top / "a" / "mnt"
    mounted.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True, timeout=30)
    try:
        (mounted / "file").write_text("not ours")
        with pytest.raises(OSError) as caught:
            remove_tree(top)
        assert caught.value.errno == errno.EXDEV
        assert (mounted / "file").read_text() == "not ours"
    finally:
        subprocess.run(["umount", str(mounted)], check=True, timeout=30)
    remove_tree(top)
    assert not top.exists()
