"""Corrupt and malicious archives fail with ImageError and leave nothing behind."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sandman.errors import ImageError
from sandman.images import ImageStore
from tests.images.builders import (
    OciLayout,
    docker_archive,
    file,
    gz,
    hardlink,
    image_config,
    layer_tar,
    oci_archive,
    rootfs_tar,
    sample_layers,
    sha256,
    symlink,
    whiteout,
)
from tests.images.conftest import assert_store_empty, snapshot

pytestmark = pytest.mark.anyio


def rewrite(archive: Path, change: Callable[[dict[str, bytes]], object]) -> Path:
    """Rewrite the members of an (uncompressed) archive."""
    with tarfile.open(archive) as tar:
        files = {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isreg()
        }
    change(files)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive.write_bytes(buffer.getvalue())
    return archive


async def expect_failure(store: ImageStore, archive: Path, match: str, tmp_path: Path) -> None:
    before = snapshot(tmp_path)
    with pytest.raises(ImageError, match=match):
        await store.import_archive(archive, name="bad")
    assert_store_empty(store.root)
    assert snapshot(tmp_path) == before  # nothing appeared anywhere else either


async def test_truncated_archives(store: ImageStore, tmp_path: Path) -> None:
    whole = docker_archive(tmp_path / "whole.tar", sample_layers()).read_bytes()
    for cut in (100, len(whole) // 3, len(whole) // 2, len(whole) - 12000):
        (tmp_path / "cut.tar").write_bytes(whole[:cut])
        await expect_failure(store, tmp_path / "cut.tar", ".", tmp_path)
    gzipped = gz(whole)
    (tmp_path / "cut.tar.gz").write_bytes(gzipped[: len(gzipped) // 2])
    await expect_failure(store, tmp_path / "cut.tar.gz", "cannot decompress", tmp_path)


@pytest.mark.parametrize("cut", [512 * 3, 512 * 3 + 100])
async def test_truncated_rootfs_tarball(store: ImageStore, tmp_path: Path, cut: int) -> None:
    data = rootfs_tar(tmp_path / "r.tar", [file("a", b"a"), file("b", b"b")]).read_bytes()
    (tmp_path / "r.tar").write_bytes(data[:cut])  # "a" is complete, "b"'s header is cut
    await expect_failure(store, tmp_path / "r.tar", "truncated", tmp_path)


@pytest.mark.parametrize(
    "content", [b"", b"hello, not a tar\n" * 100, gzip.compress(b"not a tar either" * 100)]
)
async def test_not_a_tar(store: ImageStore, tmp_path: Path, content: bytes) -> None:
    (tmp_path / "junk.tar").write_bytes(content)
    await expect_failure(store, tmp_path / "junk.tar", "empty|not a tar", tmp_path)


async def test_zstd_outer_archive(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "a.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 64)
    await expect_failure(store, tmp_path / "a.tar.zst", "zstd", tmp_path)


async def test_missing_archive(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="cannot open image archive"):
        await store.import_archive(tmp_path / "nope.tar")
    with pytest.raises(ImageError, match="use import_oci_layout"):
        await store.import_archive(tmp_path)
    assert_store_empty(store.root)


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        (b"{not json", "manifest.json is not valid JSON"),
        (b'{"Config": "x"}', "not a list"),
        (b"[]", "not a list"),
        (b'[{"Config": 1, "Layers": []}]', "needs Config, Layers"),
        (b'[{"Config": "missing.json", "Layers": []}]', "missing"),
    ],
)
async def test_bad_docker_manifest(
    store: ImageStore, tmp_path: Path, manifest: bytes, match: str
) -> None:
    archive = docker_archive(tmp_path / "a.tar", sample_layers())
    rewrite(archive, lambda files: files.__setitem__("manifest.json", manifest))
    await expect_failure(store, archive, match, tmp_path)


async def test_docker_missing_layer(store: ImageStore, tmp_path: Path) -> None:
    layers = sample_layers()
    archive = docker_archive(tmp_path / "a.tar", layers)
    missing = sha256(layers[1]).removeprefix("sha256:") + "/layer.tar"
    rewrite(archive, lambda files: files.pop(missing))
    await expect_failure(store, archive, "layer 2/3 .* is missing", tmp_path)


async def test_docker_layer_digest_mismatch(store: ImageStore, tmp_path: Path) -> None:
    layers = sample_layers()
    # The config promises other layers than the archive holds; the last one fails its check
    # after the first two were unpacked: those must go too.
    config = image_config([sha256(layers[0]), sha256(layers[1]), sha256(b"other")])
    archive = docker_archive(tmp_path / "a.tar", layers, config=config)
    await expect_failure(store, archive, r"layer 3/3 .*digest mismatch", tmp_path)


async def test_docker_config_digest_mismatch(store: ImageStore, tmp_path: Path) -> None:
    archive = docker_archive(tmp_path / "a.tar", sample_layers())

    def tamper(files: dict[str, bytes]) -> None:
        name = next(n for n in files if n.endswith(".json") and n != "manifest.json")
        files[name] = files[name].replace(b"/home/user", b"/root/user")

    rewrite(archive, tamper)
    await expect_failure(store, archive, "image config .*digest mismatch", tmp_path)


async def test_oci_blob_digest_mismatch(store: ImageStore, tmp_path: Path) -> None:
    archive = oci_archive(tmp_path / "o.tar", sample_layers())

    def tamper(files: dict[str, bytes]) -> None:
        # The biggest blob is a layer: flip bytes inside it, keeping its size.
        name = max((n for n in files if n.startswith("blobs/")), key=lambda n: len(files[n]))
        data = bytearray(files[name])
        data[len(data) // 2] ^= 0xFF
        files[name] = bytes(data)

    rewrite(archive, tamper)
    await expect_failure(store, archive, "corrupt|digest mismatch", tmp_path)


async def test_oci_missing_manifest_and_bad_index(store: ImageStore, tmp_path: Path) -> None:
    archive = oci_archive(tmp_path / "o.tar", sample_layers())
    original = archive.read_bytes()

    def drop_manifest(files: dict[str, bytes]) -> None:
        index = json.loads(files["index.json"])
        files.pop("blobs/sha256/" + index["manifests"][0]["digest"].removeprefix("sha256:"))

    rewrite(archive, drop_manifest)
    await expect_failure(store, archive, "manifest .* is missing", tmp_path)
    archive.write_bytes(original)
    rewrite(archive, lambda files: files.__setitem__("index.json", b'{"manifests": 3}'))
    await expect_failure(store, archive, "no manifests list", tmp_path)
    archive.write_bytes(original)
    rewrite(archive, lambda files: files.__setitem__("index.json", b'{"manifests": ['))
    await expect_failure(store, archive, "index.json is not valid JSON", tmp_path)
    archive.write_bytes(original)
    rewrite(archive, lambda files: files.__setitem__("index.json", b'{"manifests": []}'))
    await expect_failure(store, archive, "no image manifest", tmp_path)


async def test_oci_zstd_layer_is_refused(store: ImageStore, tmp_path: Path) -> None:
    layout = OciLayout()
    layout.index.append(
        layout.image(
            [layer_tar([file("a", b"")])],
            compress_layers=False,
            layer_media_type="application/vnd.oci.image.layer.v1.tar+zstd",
        )
    )
    await expect_failure(store, layout.write_tar(tmp_path / "z.tar"), "zstd", tmp_path)


async def test_oci_not_a_container_image(store: ImageStore, tmp_path: Path) -> None:
    layout = OciLayout()
    config = layout.blob(b"{}", "application/vnd.cncf.helm.config.v1+json")
    manifest = {"schemaVersion": 2, "config": config, "layers": []}
    layout.index.append(
        layout.blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    )
    await expect_failure(store, layout.write_tar(tmp_path / "h.tar"), "not a container", tmp_path)


async def test_oci_layout_dir_needs_its_files(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="not an OCI image layout"):
        await store.import_oci_layout(tmp_path / "empty")
    with pytest.raises(ImageError, match="not a directory"):
        await store.import_oci_layout(tmp_path / "nothing")
    assert_store_empty(store.root)


# -- malicious layers through the whole import ---------------------------------------------


@pytest.mark.parametrize(
    "evil",
    [
        [file("../../escaped", b"x")],
        [file("ok", b"fine"), file("a/../../../escaped", b"x")],
        [hardlink("stolen", "../../../outside/victim")],
        [file("/../escaped", b"x")],
    ],
    ids=["dotdot", "dotdot-after-good-entries", "hardlink-dotdot", "absolute-dotdot"],
)
async def test_escaping_layers_fail_and_leave_nothing(
    store: ImageStore, tmp_path: Path, evil: list[object]
) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/victim").write_text("host data")
    layers = [layer_tar([file("base", b"b")]), layer_tar(evil)]  # type: ignore[arg-type]
    archive = docker_archive(tmp_path / "evil.tar", layers)
    await expect_failure(store, archive, "outside the root filesystem", tmp_path)
    assert (tmp_path / "outside/victim").stat().st_nlink == 1


async def test_symlink_tricks_land_inside(store: ImageStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("host data")
    layers = [
        layer_tar([symlink("etc", str(outside)), symlink("up", "../../../../.."), file("x", b"")]),
        layer_tar(
            [
                file("etc/victim", b"pwned"),
                file("up/escaped", b"pwned"),
                whiteout("etc/nothing"),
                symlink("x", str(outside / "victim")),
            ]
        ),
        layer_tar([file("x", b"replaced, not written through")]),
    ]
    archive = docker_archive(tmp_path / "tricks.tar", layers)
    before = snapshot(tmp_path)
    image = await store.import_archive(archive)
    assert {p for p in snapshot(tmp_path) - before if not p.startswith("store/")} == set()
    assert (outside / "victim").read_text() == "host data"
    assert (image.rootfs / str(outside).lstrip("/") / "victim").read_bytes() == b"pwned"
    assert (image.rootfs / "escaped").read_bytes() == b"pwned"
    assert (image.rootfs / "x").read_bytes() == b"replaced, not written through"
