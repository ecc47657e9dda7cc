"""Layers are applied in order onto one flattened tree, and never write outside it."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from sandman.errors import ImageError
from sandman.images.layers import apply_layer
from tests.images.builders import (
    check_sample_rootfs,
    directory,
    file,
    gz,
    hardlink,
    layer_tar,
    opaque,
    sample_layers,
    sha256,
    symlink,
    whiteout,
)


def apply(root: Path, *layers: bytes) -> None:
    for i, layer in enumerate(layers):
        apply_layer(root, io.BytesIO(layer), what=f"layer {i}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "rootfs").mkdir(mode=0o755)
    return tmp_path / "rootfs"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory with a file that layers try to reach; it must stay as it is."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/victim").write_text("host data")
    return tmp_path / "outside"


def assert_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_text() == "host data"
    assert (outside / "victim").stat().st_nlink == 1


def test_sample_layers_flatten(root: Path) -> None:
    apply(root, *sample_layers())
    check_sample_rootfs(root)


def test_gzip_layers_and_digests(root: Path) -> None:
    layer = layer_tar([file("a", b"a")])
    apply_layer(
        root, io.BytesIO(gz(layer)), what="l", digest=sha256(gz(layer)), diff_id=sha256(layer)
    )
    assert (root / "a").read_bytes() == b"a"


@pytest.mark.parametrize("which", ["digest", "diff_id"])
def test_digest_mismatch(root: Path, which: str) -> None:
    layer = gz(layer_tar([file("a", b"a")]))
    wrong = sha256(b"something else")
    with pytest.raises(ImageError, match="digest mismatch"):
        if which == "digest":
            apply_layer(root, io.BytesIO(layer), what="l", digest=wrong)
        else:
            apply_layer(root, io.BytesIO(layer), what="l", diff_id=wrong)


# a: header 512 + data 1024; b: header 512 + data 512; then the end-of-archive blocks.
@pytest.mark.parametrize("cut", [100, 512, 1024 + 200, 1536, 2000, 2560])
def test_truncated_layer(root: Path, cut: int) -> None:
    layer = layer_tar([file("a", b"a" * 700), file("b", b"b")])
    with pytest.raises(ImageError, match="truncated|corrupt"):
        apply(root, layer[:cut])


def test_truncated_gzip_layer(root: Path) -> None:
    layer = gz(layer_tar([file("a", os.urandom(5000))]))
    with pytest.raises(ImageError, match="corrupt or truncated"):
        apply(root, layer[: len(layer) // 2])


def test_not_a_tar(root: Path) -> None:
    with pytest.raises(ImageError, match="corrupt"):
        apply(root, b"this is not a tar archive at all" * 40)


def test_zstd_layer_is_refused_clearly(root: Path) -> None:
    with pytest.raises(ImageError, match="zstd"):
        apply(root, b"\x28\xb5\x2f\xfd" + b"\0" * 100)


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/../evil", "./../evil"])
def test_dotdot_escape_is_refused(root: Path, name: str) -> None:
    with pytest.raises(ImageError, match="outside"):
        apply(root, layer_tar([file(name, b"x")]))
    assert not (root.parent / "evil").exists()


def test_hardlink_escape_is_refused(root: Path, outside: Path) -> None:
    with pytest.raises(ImageError, match="outside"):
        apply(root, layer_tar([hardlink("stolen", "../outside/victim")]))
    assert_untouched(outside)


def test_absolute_hardlink_target_is_inside(root: Path, outside: Path) -> None:
    # "/<tmp>/outside/victim" is a path in the image, which has no such file.
    with pytest.raises(ImageError, match="missing"):
        apply(root, layer_tar([hardlink("stolen", str(outside / "victim"))]))
    assert_untouched(outside)


def test_hardlink_through_a_symlink_is_inside(root: Path, outside: Path) -> None:
    layer = layer_tar([symlink("host", str(outside)), hardlink("stolen", "host/victim")])
    with pytest.raises(ImageError, match="missing"):
        apply(root, layer)
    assert_untouched(outside)


@pytest.mark.parametrize("target", ["ABS", "../../../../../../../..", "/", "/../../.."])
def test_writes_through_symlinked_parents_stay_inside(
    root: Path, outside: Path, target: str
) -> None:
    target = target.replace("ABS", str(outside))
    layer = layer_tar([symlink("etc", target), file("etc/victim", b"pwned"), file("etc/new", b"n")])
    apply(root, layer)
    assert_untouched(outside)
    inside = root / str(outside).lstrip("/") if target == str(outside) else root
    assert (inside / "victim").read_bytes() == b"pwned"
    assert (inside / "new").read_bytes() == b"n"


def test_symlink_chain_to_the_host_stays_inside(root: Path, outside: Path) -> None:
    layer = layer_tar([symlink("a", "b"), symlink("b", str(outside)), file("a/victim", b"pwned")])
    apply(root, layer)
    assert_untouched(outside)
    assert (root / str(outside).lstrip("/") / "victim").read_bytes() == b"pwned"


def test_a_symlink_in_a_lower_layer_is_replaced_not_followed(root: Path, outside: Path) -> None:
    apply(
        root,
        layer_tar([symlink("victim", str(outside / "victim")), symlink("dir", str(outside))]),
        layer_tar([file("victim", b"pwned"), directory("dir")]),
    )
    assert_untouched(outside)
    assert (root / "victim").read_bytes() == b"pwned" and not (root / "victim").is_symlink()
    assert (root / "dir").is_dir() and not (root / "dir").is_symlink()


def test_whiteouts_through_symlinks_stay_inside(root: Path, outside: Path) -> None:
    apply(
        root,
        layer_tar([symlink("host", str(outside)), symlink("up", "../..")]),
        layer_tar([whiteout("host/victim"), opaque("host"), whiteout("up/outside")]),
    )
    assert_untouched(outside)


def test_whiteout_of_a_symlink_removes_the_link_only(root: Path, outside: Path) -> None:
    apply(root, layer_tar([symlink("host", str(outside))]), layer_tar([whiteout("host")]))
    assert not os.path.lexists(root / "host")
    assert_untouched(outside)


def test_opaque_dir_keeps_this_layers_nested_entries(root: Path) -> None:
    apply(
        root,
        layer_tar([file("d/old", b""), file("d/sub/old", b""), file("d/sub/keep", b"1")]),
        layer_tar([file("d/sub/keep", b"2"), file("d/sub/added", b""), opaque("d")]),
    )
    found = sorted(str(p.relative_to(root / "d")) for p in (root / "d").rglob("*"))
    assert found == ["sub", "sub/added", "sub/keep"]
    assert (root / "d/sub/keep").read_bytes() == b"2"


def test_hardlink_to_a_symlink_links_the_symlink(root: Path, outside: Path) -> None:
    apply(root, layer_tar([symlink("s", str(outside / "victim")), hardlink("h", "s")]))
    assert os.readlink(root / "h") == str(outside / "victim")
    assert_untouched(outside)


def test_implicit_parents_are_created_0755(root: Path) -> None:
    old = os.umask(0o077)
    try:
        apply(root, layer_tar([file("a/b/c", b"c")]))
    finally:
        os.umask(old)
    assert (root / "a/b").stat().st_mode & 0o777 == 0o755


def test_a_file_as_parent_is_an_error(root: Path) -> None:
    with pytest.raises(ImageError, match="not a directory"):
        apply(root, layer_tar([file("a", b""), file("a/b", b"")]))


def test_root_entry_does_not_change_the_root(root: Path) -> None:
    apply(root, layer_tar([directory("./", mode=0o700, uid=1234)]))
    assert root.stat().st_mode & 0o777 == 0o755 and root.stat().st_uid == os.geteuid()


def test_unknown_whiteout_names_are_refused(root: Path) -> None:
    with pytest.raises(ImageError, match="invalid whiteout"):
        apply(root, layer_tar([file("a/.wh.", b"")]))


def test_many_entries_stream(root: Path) -> None:
    entries = [file(f"d{i % 10}/f{i}", b"x") for i in range(3000)]
    apply(root, layer_tar(entries))
    assert sum(1 for _ in root.rglob("f*")) == 3000


def test_pax_long_names(root: Path) -> None:
    name = "/".join(["d" * 100] * 5) + "/file"
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    apply(root, layer.getvalue())
    assert (root / name).read_bytes() == b"ok"
