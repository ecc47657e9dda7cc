"""Importing, naming, finding and removing images in the local store."""

from __future__ import annotations

import bz2
import json
import logging
import lzma
import os
from pathlib import Path
from typing import Literal

import anyio
import pytest

import sandman
from sandman.errors import ImageError, ImageNotFound
from sandman.images import Image, ImageConfig, ImageStore
from sandman.images.image import DEFAULT_PATH
from tests.images.builders import (
    OciLayout,
    busybox_rootfs_tar,
    check_sample_rootfs,
    docker_archive,
    file,
    image_config,
    layer_tar,
    oci_archive,
    oci_layout,
    rootfs_tar,
    sample_layers,
    sha256,
)
from tests.images.conftest import assert_store_empty

pytestmark = pytest.mark.anyio

SAMPLE_CONFIG = ImageConfig(
    env=["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], working_dir="/home/user", user="user",
    cmd=["/bin/sh"],
)  # fmt: skip


def unpacks(caplog: pytest.LogCaptureFixture) -> int:
    return sum("unpacking image" in r.getMessage() for r in caplog.records)


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sandman.images")


@pytest.mark.parametrize("layout", ["legacy", "blobs"])
@pytest.mark.parametrize("compress", [False, True])
async def test_docker_archive(
    store: ImageStore, tmp_path: Path, layout: Literal["legacy", "blobs"], compress: bool
) -> None:
    layers = sample_layers()
    archive = docker_archive(
        tmp_path / "sample.tar",
        layers,
        layout=layout,
        compress=compress,
    )
    image = await store.import_archive(archive)
    expected_id = sha256(image_config([sha256(layer) for layer in layers]))
    assert image.id == expected_id
    assert image.names == ["sample:latest"]
    assert image.rootfs == store.root / "rootfs" / expected_id.removeprefix("sha256:")
    assert image.config == SAMPLE_CONFIG
    assert image.size > 0
    check_sample_rootfs(image.rootfs)
    hex_id = expected_id.removeprefix("sha256:")
    assert (store.root / "images" / f"{hex_id}.json").is_file()
    assert (store.root / "blobs/sha256" / hex_id).is_file()  # the config, verified
    assert list((store.root / "tmp").iterdir()) == []
    assert json.loads((store.root / "names.json").read_text())["names"] == {
        "sample:latest": expected_id
    }


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("compress_layers", [False, True])
async def test_oci_archive(
    store: ImageStore, tmp_path: Path, compress: bool, compress_layers: bool
) -> None:
    archive = oci_archive(
        tmp_path / "oci.tar", sample_layers(), compress=compress, compress_layers=compress_layers,
        image_name="docker.io/library/sample:2",
    )  # fmt: skip
    image = await store.import_archive(archive)
    assert image.names == ["sample:2"]
    assert image.config == SAMPLE_CONFIG
    check_sample_rootfs(image.rootfs)
    # The manifest and the config are kept as verified blobs.
    assert len(list((store.root / "blobs/sha256").iterdir())) == 2


async def test_oci_layout_dir(store: ImageStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", sample_layers())
    image = await store.import_oci_layout(layout, name="mine")
    assert image.names == ["mine:latest"]
    check_sample_rootfs(image.rootfs)
    # A bare ref.name ("latest") is a tag, not a name.
    other = await ImageStore(tmp_path / "other").import_oci_layout(layout)
    assert other.names == [] and other.id == image.id


async def test_the_same_image_in_any_format_is_unpacked_once(
    store: ImageStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layers = sample_layers()
    first = await store.import_archive(docker_archive(tmp_path / "d.tar", layers))
    inode = first.rootfs.stat().st_ino
    again = await store.import_archive(docker_archive(tmp_path / "d.tar", layers))
    oci = await store.import_archive(oci_archive(tmp_path / "o.tar", layers), name="oci:1")
    layout = await store.import_oci_layout(oci_layout(tmp_path / "l", layers), name="dir:1")
    assert first.id == again.id == oci.id == layout.id
    assert layout.names == ["dir:1", "oci:1", "sample:latest"]
    assert layout.rootfs.stat().st_ino == inode
    assert unpacks(caplog) == 1
    assert len(await store.list()) == 1


async def test_plain_rootfs_tarball(store: ImageStore, tmp_path: Path) -> None:
    for compress in (False, True):
        tarball = rootfs_tar(
            tmp_path / f"rootfs{compress}.tar",
            [file("etc/os-release", b"ID=test")],
            compress=compress,
        )
        image = await store.import_archive(tarball, name=f"plain:{compress}")
        assert image.id == sha256(tarball.read_bytes())
        assert image.config == ImageConfig(env=[DEFAULT_PATH])
        assert image.config.working_dir == "/" and image.config.user == ""
        assert (image.rootfs / "etc/os-release").read_bytes() == b"ID=test"
    # Without a name it is found by id only.
    nameless = await store.import_archive(rootfs_tar(tmp_path / "n.tar", [file("x", b"")]))
    assert nameless.names == []
    assert (await store.get(nameless.id)) == nameless


@pytest.mark.parametrize("compression", ["bz2", "xz"])
async def test_bzip2_and_xz_outer_archives(
    store: ImageStore, tmp_path: Path, compression: str
) -> None:
    plain = layer_tar([file("etc/os-release", b"ID=test")])
    packed = bz2.compress(plain) if compression == "bz2" else lzma.compress(plain)
    (tmp_path / "r.tar.x").write_bytes(packed)
    image = await store.import_archive(tmp_path / "r.tar.x")
    assert image.id == sha256(packed)
    assert (image.rootfs / "etc/os-release").read_bytes() == b"ID=test"


async def test_busybox_rootfs_runs(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_archive(busybox_rootfs_tar(tmp_path / "bb.tar"), name="busybox")
    assert os.readlink(image.rootfs / "bin/sh") == "busybox"
    for applet in ("ls", "cat", "echo", "sleep", "ps", "seq", "kill", "pwd", "id", "head"):
        assert (image.rootfs / "bin" / applet).is_symlink()
    assert sandman.images.resolve_user(image.rootfs, "nobody") == (65534, 65534)
    if os.geteuid() != 0:
        pytest.skip("running the rootfs needs chroot (root)")
    result = await anyio.run_process(
        ["chroot", str(image.rootfs), "/bin/sh", "-c", "echo hi; seq 3 | wc -l; id -u nobody"]
    )
    assert result.stdout.decode().split() == ["hi", "3", "65534"]


# -- names ---------------------------------------------------------------------------------


async def test_get_by_name_and_id(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", sample_layers()))
    hex_id = image.id.removeprefix("sha256:")
    for ref in (
        "sample", "sample:latest", "docker.io/library/sample", " sample ",
        image.id, hex_id, hex_id[:12], f"sha256:{hex_id[:5]}", image.short_id,
    ):  # fmt: skip
        assert await store.get(ref) == image, ref
    with pytest.raises(ImageNotFound) as caught:
        await store.get("sample:other")
    assert isinstance(caught.value, LookupError) and isinstance(caught.value, ImageError)
    message = str(caught.value)
    # What is here, and what to do; never the store's path (a service's callers see it).
    assert "Pull, build or import it first" in message and "sample:latest" in message
    assert str(store.root) not in message
    for ref in ("nope", "sha256:", "", "ffff" if not hex_id.startswith("ffff") else "0000"):
        with pytest.raises(ImageNotFound):
            await store.get(ref)


async def test_ambiguous_id_prefix(store: ImageStore, tmp_path: Path) -> None:
    first = await store.import_archive(rootfs_tar(tmp_path / "0.tar", [file("n", b"0")]))
    for i in range(1, 200):
        tarball = rootfs_tar(tmp_path / f"{i}.tar", [file("n", str(i).encode())])
        if sha256(tarball.read_bytes())[7] == first.id[7]:
            await store.import_archive(tarball)
            break
    with pytest.raises(ImageError, match="ambiguous"):
        await store.get(first.id[7])
    assert (await store.get(first.id)).id == first.id


async def test_tag_and_remove(tmp_path: Path) -> None:
    used: set[str] = set()
    store = ImageStore(tmp_path / "store", in_use=lambda image: image.id in used)
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", sample_layers()))
    tagged = await store.tag("sample", "registry.local:5000/team/sample:v1")
    assert tagged.names == ["registry.local:5000/team/sample:v1", "sample:latest"]
    assert (await store.get("registry.local:5000/team/sample:v1")).id == image.id

    await store.remove("sample:latest")  # another name is left: only the name goes
    assert (await store.get(image.id)).names == ["registry.local:5000/team/sample:v1"]
    with pytest.raises(ImageNotFound):
        await store.get("sample")

    used.add(image.id)
    with pytest.raises(ImageError, match="in use"):
        await store.remove("registry.local:5000/team/sample:v1")
    assert (await store.get(image.id)).names == ["registry.local:5000/team/sample:v1"]
    used.clear()

    await store.remove("registry.local:5000/team/sample:v1")
    assert await store.list() == []
    assert not image.rootfs.exists()
    assert_store_empty(store.root)
    with pytest.raises(ImageNotFound):
        await store.remove(image.id)


async def test_remove_by_id_drops_every_name(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", sample_layers()))
    await store.tag(image.id, "b")
    await store.remove(image.short_id)
    assert_store_empty(store.root)


async def test_a_name_moves_to_the_newer_image(store: ImageStore, tmp_path: Path) -> None:
    old = await store.import_archive(rootfs_tar(tmp_path / "1.tar", [file("v", b"1")]), name="t")
    new = await store.import_archive(rootfs_tar(tmp_path / "2.tar", [file("v", b"2")]), name="t")
    assert (await store.get("t")).id == new.id
    # The old image stays (a sandbox may use it), nameless, until removed by id.
    listed = await store.list()
    assert [i.id for i in listed] == [new.id, old.id] and listed[1].names == []
    await store.remove(old.id)
    assert not old.rootfs.exists() and new.rootfs.exists()


async def test_invalid_names(store: ImageStore, tmp_path: Path) -> None:
    archive = docker_archive(tmp_path / "a.tar", sample_layers())
    for name in ("", "has space", "sha256:abcd", "-x"):
        with pytest.raises(ImageError, match="invalid image name"):
            await store.import_archive(archive, name=name)
    assert_store_empty(store.root)


async def test_list_and_state_survive_a_new_store(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", sample_layers()))
    assert await ImageStore(store.root).list() == [image]
    assert isinstance(image, Image)


# -- choosing an image in archives with several --------------------------------------------


async def test_docker_archive_with_several_images(store: ImageStore, tmp_path: Path) -> None:
    other = [layer_tar([file("which", b"other")])]
    archive = docker_archive(
        tmp_path / "multi.tar", [layer_tar([file("which", b"first")])], repo_tags=["first:1"],
        extra_images=[(other, ["other:1", "other:latest"])],
    )  # fmt: skip
    first = await store.import_archive(archive)
    assert (first.rootfs / "which").read_bytes() == b"first" and first.names == ["first:1"]
    picked = await store.import_archive(archive, name="other")
    assert (picked.rootfs / "which").read_bytes() == b"other" and picked.names == ["other:latest"]


def _which(tag: str) -> list[bytes]:
    return [layer_tar([file("which", tag.encode())])]


async def test_oci_index_picks_by_ref_name(store: ImageStore, tmp_path: Path) -> None:
    layout = OciLayout()
    for tag in ("v1", "v2"):
        layout.index.append(
            layout.image(_which(tag), annotations={"org.opencontainers.image.ref.name": tag})
        )
    path = layout.write_dir(tmp_path / "layout")
    picked = await store.import_oci_layout(path, name="app:v2")
    assert (picked.rootfs / "which").read_bytes() == b"v2" and picked.names == ["app:v2"]
    # No tag matches: the first for this platform.
    fallback = await store.import_oci_layout(path, name="app:v9")
    assert (fallback.rootfs / "which").read_bytes() == b"v1"


async def test_oci_nested_index_picks_the_host_platform(store: ImageStore, tmp_path: Path) -> None:
    layout = OciLayout()
    manifests = [
        layout.image(_which("arm"), platform=("linux", "arm64")),
        layout.image(_which("attestation"), platform=("unknown", "unknown")),
        layout.image(_which("amd"), platform=("linux", "amd64")),
    ]
    layout.index.append(
        layout.nested_index(manifests, {"io.containerd.image.name": "ghcr.io/x/multi:3"})
    )
    image = await store.import_archive(layout.write_tar(tmp_path / "multi.tar"))
    assert (image.rootfs / "which").read_bytes() == b"amd"
    assert image.names == ["ghcr.io/x/multi:3"]


async def test_oci_no_image_for_this_platform(store: ImageStore, tmp_path: Path) -> None:
    layout = OciLayout()
    for arch in ("arm64", "s390x"):
        layout.index.append(layout.image(_which(arch), platform=("linux", arch)))
    with pytest.raises(ImageError, match=r"no image for linux/amd64 \(found: linux/arm64"):
        await store.import_oci_layout(layout.write_dir(tmp_path / "l"))
    assert_store_empty(store.root)


# -- concurrency and crashes ---------------------------------------------------------------


async def test_concurrent_imports_unpack_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archive = docker_archive(tmp_path / "a.tar", sample_layers())
    layout = oci_layout(tmp_path / "l", sample_layers())
    store = ImageStore(tmp_path / "store")
    # A second store on the same root stands for another process: only flock protects it.
    other = ImageStore(tmp_path / "store")
    results: list[Image] = []

    async def run(coro_store: ImageStore, oci: bool, name: str) -> None:
        if oci:
            results.append(await coro_store.import_oci_layout(layout, name=name))
        else:
            results.append(await coro_store.import_archive(archive, name=name))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(run, store if i % 2 else other, i % 3 == 0, f"n{i}")
    assert unpacks(caplog) == 1
    assert len({r.id for r in results}) == 1
    final = await store.get("n0")
    assert final.names == [f"n{i}:latest" for i in range(6)]
    assert list((store.root / "tmp").iterdir()) == []


async def test_stale_temp_dirs_are_removed_at_start(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", sample_layers()))
    hex_id = "ab" * 32
    (store.root / "tmp" / f"{hex_id}.123456").mkdir()  # a crashed unpack
    (store.root / "tmp" / f"{hex_id}.123456/file").write_text("half")
    (store.root / "tmp" / "names.abc.json").write_text("{}")  # a crashed name update
    (store.root / "rootfs" / hex_id).mkdir()  # renamed, but its metadata never written
    restarted = ImageStore(store.root)
    assert await restarted.list() == [image]
    assert list((store.root / "tmp").iterdir()) == []
    assert sorted(os.listdir(store.root / "rootfs")) == [image.id.removeprefix("sha256:")]


async def test_half_unpacked_rootfs_is_not_reused(store: ImageStore, tmp_path: Path) -> None:
    layers = sample_layers()
    hex_id = sha256(image_config([sha256(layer) for layer in layers])).removeprefix("sha256:")
    assert await store.list() == []  # started: start-up cleanup is not what removes it
    (store.root / "rootfs" / hex_id).mkdir()
    (store.root / "rootfs" / hex_id / "junk").write_text("")
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", layers))
    assert not (image.rootfs / "junk").exists()
    check_sample_rootfs(image.rootfs)
