"""The layer store: layers kept once by chain id, in overlayfs' form; images as lists of
layers; dedupe on import and pull; prune; stores from before layers."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sandman.errors import ImageError
from sandman.images import ImageStore, resolve_user
from sandman.images.layers import apply_layer
from sandman.images.layerstore import chain_id
from sandman.images.merged import MergedView
from sandman.images.overlay import OVL_MAX_STACK, is_opaque, is_whiteout, lowerdir_fits
from tests.images.builders import (
    GROUP,
    PASSWD,
    OciLayout,
    check_sample_rootfs,
    directory,
    docker_archive,
    file,
    layer_tar,
    oci_layout,
    opaque,
    sample_layers,
    sha256,
    symlink,
    whiteout,
)
from tests.images.registry_server import Registry, blob_fetches, missing_tools, push, start_registry

pytestmark = pytest.mark.anyio

BASE = [
    directory("etc"),
    file("etc/passwd", PASSWD.encode()),
    file("etc/group", GROUP.encode()),
    file("etc/removeme", b"gone above"),
    directory("data"),
    file("data/old", b"old"),
    directory("home/user", mode=0o700, uid=1000, gid=1000),
    file("home/user/notes", b"notes", uid=1000, gid=1000),
    directory("usr/lib"),
    file("usr/lib/libx.so", b"lib"),
    symlink("lib", "usr/lib"),
    file("big", os.urandom(1 << 16)),
]


def own_layer(n: int) -> bytes:
    """Image `n`'s own layer over `BASE`: deletes, an opaque dir, a user, a lib via /lib."""
    return layer_tar(
        [
            whiteout("etc/removeme"),
            opaque("data"),
            file("data/new", f"image {n}".encode()),
            file("etc/passwd", (PASSWD + f"app:x:{2000 + n}:{2000 + n}::/:/bin/sh\n").encode()),
            file("home/user/more", b"more"),  # its parent only implied: mode comes from below
            file("lib/liby.so", b"through the /lib symlink of the layer below"),
            file(f"own-{n}", bytes([n]) * 4096),
        ]
    )


def shared_base_layout(path: Path, n: int, *, tag: str = "latest") -> Path:
    return oci_layout(path, [layer_tar(BASE), own_layer(n)], ref_name=tag)


def listing(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under `root` with its type, mode, owner and content or link target."""
    found: dict[str, tuple[object, ...]] = {}
    for directory_, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory_) / name
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                what: object = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            else:
                what = None
            found[str(path.relative_to(root))] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                what,
            )
    return found


# -- layers in overlayfs' form ------------------------------------------------------------------


async def test_layers_are_stored_once_and_stacked(store: ImageStore, tmp_path: Path) -> None:
    one = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1), name="one")
    two = await store.import_oci_layout(shared_base_layout(tmp_path / "2", 2), name="two")
    base = sha256(layer_tar(BASE))
    assert one.layers[0] == two.layers[0] == base
    assert len(one.lowers) == 2 and one.lowers[1] == two.lowers[1]  # topmost first
    assert one.lowers[1] == store.root / "layers" / base.removeprefix("sha256:")
    assert one.lowers[0] == store.root / "layers" / chain_id(base, one.layers[1])[7:]
    stored = sorted(p.name for p in (store.root / "layers").iterdir() if p.is_dir())
    assert len(stored) == 3
    # The merged rootfs links to the layers' files: the base's data is on disk once.
    assert (one.rootfs / "big").stat().st_ino == (one.lowers[1] / "big").stat().st_ino
    assert (two.rootfs / "big").stat().st_ino == (one.lowers[1] / "big").stat().st_ino
    assert (one.rootfs / "own-1").exists() and not (one.rootfs / "own-2").exists()


async def test_whiteouts_and_opaque_dirs_as_overlayfs_stores_them(
    store: ImageStore, tmp_path: Path
) -> None:
    image = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1))
    top, base = image.lowers
    assert is_whiteout((top / "etc/removeme").lstat())
    assert (base / "etc/removeme").read_bytes() == b"gone above"  # the base is untouched
    assert is_opaque(top / "data") and not is_opaque(base / "data")
    assert not any(p.name.startswith(".wh.") for p in top.rglob("*"))
    # A directory the layer only implies keeps the mode and owner it has below.
    home = (top / "home/user").stat()
    assert stat.S_IMODE(home.st_mode) == 0o700
    if os.geteuid() == 0:
        assert (home.st_uid, home.st_gid) == (1000, 1000)
    # /lib is a symlink of the layer below: the file lands where it points.
    assert (top / "usr/lib/liby.so").is_file() and not (top / "lib").exists()
    # The merged view: deleted, emptied, replaced; and the same as the merged rootfs.
    view = MergedView(image.lowers)
    assert view.find("etc/removeme") is None
    assert sorted(p.name for d in view.dir_layers("data") for p in d.iterdir()) == ["new"]
    found = view.find("lib/libx.so")
    assert found is not None and found.read_bytes() == b"lib"
    assert not (image.rootfs / "etc/removeme").exists()
    assert sorted(os.listdir(image.rootfs / "data")) == ["new"]
    assert sorted(os.listdir(image.rootfs / "usr/lib")) == ["libx.so", "liby.so"]


async def test_sample_layers_stacked_are_the_flattened_image(
    store: ImageStore, tmp_path: Path
) -> None:
    """The sample (type changes, hard links across layers, whiteouts, opaque dirs) merged
    from its stored layers is what applying the layers onto one directory gives."""
    layers = sample_layers()
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", layers))
    check_sample_rootfs(image.rootfs)
    assert listing(image.rootfs) == listing(flattened(layers, tmp_path / "flat"))


def flattened(layers: list[bytes], flat: Path) -> Path:
    """`layers` applied one over the other onto one directory (the store before layers)."""
    flat.mkdir()
    for i, layer in enumerate(layers):
        apply_layer(flat, io.BytesIO(layer), what=f"layer {i}")
    os.chmod(flat, 0o755)
    return flat


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounting overlayfs needs root"
)
async def test_overlayfs_mounts_the_layers_as_the_image(store: ImageStore, tmp_path: Path) -> None:
    """The kernel's own merge of `Image.lowers` equals the merged rootfs."""
    layers = sample_layers()
    image = await store.import_archive(docker_archive(tmp_path / "a.tar", layers))
    sample = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1))
    remade = [
        layer_tar([directory("d"), file("d/a", b"a"), file("keep", b"k")]),
        layer_tar([whiteout("d"), directory("d", mode=0o750), file("d/b", b"b")]),
        layer_tar([file("d/c", b"c"), whiteout("keep")]),
    ]
    again = await store.import_oci_layout(oci_layout(tmp_path / "remade", remade, ref_name="1"))
    assert sorted(os.listdir(again.rootfs / "d")) == ["b", "c"]
    assert not (again.rootfs / "keep").exists()
    assert listing(again.rootfs) == listing(flattened(remade, tmp_path / "flat"))
    for each in (image, sample, again):
        assert listing(mounted(each.lowers, tmp_path)) == listing(each.rootfs)


def mounted(lowers: list[Path], tmp_path: Path) -> Path:
    """A copy of what overlayfs shows with `lowers` stacked (mounted in a namespace of its own)."""
    merged, copy = tmp_path / "merged", tmp_path / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    merged.mkdir(exist_ok=True)
    script = 'mount -t overlay overlay -o "ro,lowerdir=$1" "$2" && cp -a "$2/." "$3"'
    lowerdir = ":".join(str(p) for p in lowers)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "x",
         lowerdir, str(merged), str(copy)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return copy


async def test_resolve_user_over_layers(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 7))
    assert resolve_user(image.lowers, "app") == (2007, 2007)
    assert resolve_user(image.rootfs, "app") == (2007, 2007)
    assert resolve_user(image.lowers, "daemon:nogroup") == (1, 65534)
    # /etc/passwd deleted by the top layer: names are unknown again.
    gone = oci_layout(
        tmp_path / "gone", [layer_tar(BASE), layer_tar([whiteout("etc/passwd")])], ref_name="x"
    )
    deleted = await store.import_oci_layout(gone)
    with pytest.raises(ImageError, match="not in the image's /etc/passwd"):
        resolve_user(deleted.lowers, "daemon")
    assert resolve_user(deleted.lowers, "5:6") == (5, 6)


# -- dedupe --------------------------------------------------------------------------------------


def stored_layers(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage().startswith("stored layer") for r in caplog.records)


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sandman.images")


async def test_imports_skip_stored_layers(
    store: ImageStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1))
    assert stored_layers(caplog) == 2
    # The base layer is not even read: a broken copy of it in the second archive passes.
    second = OciLayout()
    second.index.append(second.image([layer_tar(BASE), own_layer(2)], compress_layers=False))
    second.write_dir(tmp_path / "2")
    blob = tmp_path / "2" / "blobs" / "sha256" / sha256(layer_tar(BASE)).removeprefix("sha256:")
    blob.write_bytes(b"not read")
    image = await store.import_oci_layout(tmp_path / "2")
    assert stored_layers(caplog) == 3
    assert (image.rootfs / "own-2").exists()
    # Docker archives (uncompressed layers, other digests) share them too.
    await store.import_archive(docker_archive(tmp_path / "3.tar", [layer_tar(BASE), own_layer(3)]))
    assert stored_layers(caplog) == 4


async def test_concurrent_imports_share_the_base(tmp_path: Path) -> None:
    layouts = [shared_base_layout(tmp_path / str(n), n) for n in range(4)]
    # Two stores on one root: as two processes would.
    stores = [ImageStore(tmp_path / "store"), ImageStore(tmp_path / "store")]
    async with anyio.create_task_group() as tg:
        for n, layout in enumerate(layouts):
            tg.start_soon(stores[n % 2].import_oci_layout, layout)
    images = await stores[0].list()
    assert len(images) == 4 and len({i.lowers[1] for i in images}) == 1
    assert len([p for p in (tmp_path / "store" / "layers").iterdir() if p.is_dir()]) == 5
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


async def test_a_rootfs_tarball_is_one_layer_shared_by_content(
    store: ImageStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "r.tar").write_bytes(layer_tar(BASE))
    rootfs = await store.import_archive(tmp_path / "r.tar", name="r")
    assert rootfs.rootfs == rootfs.lowers[0] and len(rootfs.lowers) == 1
    layered = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1))
    assert layered.lowers[1] == rootfs.rootfs
    assert stored_layers(caplog) == 2


# -- prune and remove ----------------------------------------------------------------------------


async def test_remove_takes_the_layers_only_that_image_used(
    store: ImageStore, tmp_path: Path
) -> None:
    one = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1), name="one")
    two = await store.import_oci_layout(shared_base_layout(tmp_path / "2", 2), name="two")
    await store.remove("one")
    assert not one.lowers[0].exists() and not one.rootfs.exists()
    assert all(p.exists() for p in two.lowers) and two.rootfs.exists()
    assert (await store.prune()).layers == []
    await store.remove("two")
    assert list((store.root / "layers").iterdir()) == []
    assert list((store.root / "digests").iterdir()) == []


async def test_prune_removes_unreferenced_layers_only(store: ImageStore, tmp_path: Path) -> None:
    image = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1), name="one")
    # An image record lost (a crash, an older version): its layers are unreferenced.
    other = await store.import_oci_layout(shared_base_layout(tmp_path / "2", 2), name="two")
    (store.root / "images" / f"{other.id.removeprefix('sha256:')}.json").unlink()
    report = await store.prune()
    assert report.layers == [chain_id(other.layers[0], other.layers[1])]
    assert report.bytes > 4096
    assert all(p.exists() for p in image.lowers)
    assert (await store.get("one")).lowers == image.lowers
    assert (await store.prune()).layers == []


async def test_an_image_in_use_keeps_its_layers(tmp_path: Path) -> None:
    used: set[str] = set()
    store = ImageStore(tmp_path / "store", in_use=lambda image: image.id in used)
    image = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1), name="one")
    used.add(image.id)
    with pytest.raises(ImageError, match="in use"):
        await store.remove("one")
    assert (await store.prune()).layers == []
    assert all(p.exists() for p in image.lowers)


# -- limits --------------------------------------------------------------------------------------


def test_lowerdir_limits() -> None:
    short = [Path(f"/l/{i}") for i in range(OVL_MAX_STACK)]
    assert not lowerdir_fits(short)  # 500 fit the kernel, not one page of mount options
    assert lowerdir_fits(short[:100])
    assert not lowerdir_fits([Path("/l/x")] * (OVL_MAX_STACK + 1), reserve=-(1 << 20))
    assert not lowerdir_fits([])


async def test_past_the_limit_the_merged_rootfs_is_the_lower(
    store: ImageStore, tmp_path: Path
) -> None:
    layers = [
        layer_tar([file(f"f{i}", str(i).encode()), file("last", str(i).encode())])
        for i in range(60)
    ]
    image = await store.import_oci_layout(oci_layout(tmp_path / "many", layers, ref_name="x"))
    assert len(image.layers) == 60
    assert image.lowers == [image.rootfs]
    assert (image.rootfs / "last").read_text() == "59" and (image.rootfs / "f0").exists()


# -- stores from before layers -------------------------------------------------------------------


async def test_images_stored_before_layers_are_read_as_they_are(tmp_path: Path) -> None:
    root = tmp_path / "store"
    hex_id = "ab" * 32
    rootfs = root / "rootfs" / hex_id
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/passwd").write_text(PASSWD)
    (root / "images").mkdir(parents=True)
    record = {
        "id": f"sha256:{hex_id}", "kind": "docker-archive", "config": {"env": ["A=1"]},
        "size": 5, "created": "2026-01-01T00:00:00Z", "blobs": [], "layers": [],
    }  # fmt: skip
    (root / "images" / f"{hex_id}.json").write_text(json.dumps(record))
    (root / "names.json").write_text(json.dumps({"names": {"old:latest": f"sha256:{hex_id}"}}))
    store = ImageStore(root)
    image = await store.get("old")
    assert image.rootfs == rootfs and image.lowers == [rootfs] and image.layers == []
    assert resolve_user(image.lowers, "daemon") == (1, 1)
    new = await store.import_oci_layout(shared_base_layout(tmp_path / "1", 1), name="new")
    assert [i.names for i in await store.list()] == [["new:latest"], ["old:latest"]]
    assert (await store.prune()).layers == []
    assert all(p.exists() for p in new.lowers)
    await store.remove("old")
    assert not rootfs.exists()


# -- pulls ----------------------------------------------------------------------------------------

needs_registry = pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or "")


@pytest.fixture(scope="module")
def logged_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry with an access log, holding ``shared/one`` and ``shared/two`` (one base)."""
    server = start_registry(tmp_path_factory.mktemp("logged"), access_log=True)
    try:
        for n, name in ((1, "one"), (2, "two")):
            layout = shared_base_layout(tmp_path_factory.mktemp(name), n, tag="1")
            push(layout, "1", server, f"shared/{name}")
        yield server
    finally:
        server.stop()


@needs_registry
async def test_pulls_download_only_missing_layers(
    store: ImageStore, logged_registry: Registry
) -> None:
    host = logged_registry.host
    before = len(blob_fetches(logged_registry))
    one = await store.pull(f"{host}/shared/one:1", tls_verify=False)
    first = blob_fetches(logged_registry)[before:]
    assert len(first) == 3  # config, base, own layer
    # Same base: its blob is not downloaded again.
    two = await store.pull(f"{host}/shared/two:1", tls_verify=False)
    second = blob_fetches(logged_registry)[before + len(first) :]
    assert len(second) == 2 and not set(second) & set(first)
    assert one.lowers[1] == two.lowers[1]
    assert (two.rootfs / "data/new").read_text() == "image 2"
    # Everything present: the manifest only, 0 blobs.
    again = await store.pull(f"{host}/shared/one:1", tls_verify=False)
    assert again == one
    assert len(blob_fetches(logged_registry)) == before + len(first) + len(second)
    assert list((store.root / "tmp").iterdir()) == []


def test_cli_prune(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sandman.cli import build

    base = ["--state-dir", str(tmp_path / "state")]
    runner = CliRunner()
    for n in (1, 2):
        layout = shared_base_layout(tmp_path / str(n), n)
        done = runner.invoke(build(), [*base, "images", "import", str(layout), "--name", f"i{n}"])
        assert done.exit_code == 0, done.output
    assert (
        runner.invoke(build(), [*base, "images", "prune"]).output == "removed 0 layers, 0.0 MiB\n"
    )
    records = tmp_path / "state" / "images" / "images"
    for record in records.iterdir():  # records lost: every layer is unreferenced
        record.unlink()
    pruned = runner.invoke(build(), [*base, "images", "prune"])
    assert pruned.exit_code == 0 and pruned.output.startswith("removed 3 layers, 0.")
