"""Pushing images of the store to a real registry on 127.0.0.1 (Debian's docker-registry)
with skopeo, and pulling them back: the same files, layer by layer; layers uploaded once;
credentials (API and CLI) that never show; failures that are fast and leave nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from sandman.cli import build as cli
from sandman.errors import ConfigError, ImageError, ImageNotFound
from sandman.images import ImageStore, RegistryAuth
from sandman.images.export import export_layer, image_config, write_tar
from sandman.images.overlay import is_opaque, is_whiteout
from sandman.images.registry import parse_reference, push_error, skopeo_push_command
from tests.images import builders
from tests.images.builders import (
    check_sample_rootfs,
    file,
    layer_tar,
    oci_layout,
    sample_layers,
)
from tests.images.registry_server import Registry, free_port, missing_tools, start_registry
from tests.images.test_layer_store import flattened
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or ""),
]

USER, PASSWORD = "alice", "s3cret-Pa55"
WRONG = "not-the-Pa55word"


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sandman")


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry with htpasswd auth."""
    server = start_registry(tmp_path_factory.mktemp("private"), username=USER, password=PASSWORD)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def sample(store: ImageStore, tmp_path: Path) -> ImageStore:
    """The store with ``sample:1``: three layers with whiteouts (a file, a directory), an
    opaque directory, hard and symbolic links, a fifo, a device node, odd modes."""
    layout = oci_layout(tmp_path / "layout", sample_layers(), ref_name="1")
    await store.import_oci_layout(layout, name="sample:1")
    return store


def uploads(registry: Registry) -> list[str]:
    """The digests of the blobs uploaded so far, in order: an upload ends with
    ``PUT /v2/<repository>/blobs/uploads/<id>?...&digest=<digest>``."""
    found = re.findall(
        r'"PUT /v2/\S+/blobs/uploads/\S*?[?&]digest=(sha256(?::|%3A)[0-9a-f]{64})', registry.log()
    )
    return [digest.replace("%3A", ":") for digest in found]


def assert_no_scratch(store: ImageStore) -> None:
    assert list((store.root / "tmp").iterdir()) == []


def tree(root: Path, *, layer: bool = False) -> dict[str, tuple[Any, ...]]:
    """Everything under `root` that an image says: type, mode, owner, mtime and content
    (a file's sha256, a link's target, a device's numbers); with `layer`, also
    overlayfs' whiteouts and opaque markers. Hard links: by the first path of the inode."""
    found: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        st = path.lstat()
        mode = st.st_mode
        if layer and is_whiteout(st):
            found[name] = ("whiteout",)
            continue
        head: tuple[int, ...] = (stat.S_IFMT(mode), stat.S_IMODE(mode), st.st_uid, st.st_gid)
        if stat.S_ISLNK(mode):
            found[name] = (*head, os.readlink(path))  # a symlink's own mtime is not kept
            continue
        head = (*head, st.st_mtime_ns)
        if stat.S_ISDIR(mode):
            found[name] = (*head, layer and is_opaque(path))
        elif stat.S_ISREG(mode):
            first = inodes.setdefault(st.st_ino, name) if st.st_nlink > 1 else name
            found[name] = (*head, hashlib.sha256(path.read_bytes()).hexdigest(), first)
        else:
            found[name] = (*head, st.st_rdev)
    return found


async def assert_same_image(pushed: ImageStore, name: str, pulled: ImageStore, ref: str) -> None:
    """The image `ref` of `pulled` has the files of `name` of `pushed`: merged, and
    layer by layer in overlayfs' form (whiteouts, opaque directories)."""
    original, copy = await pushed.get(name), await pulled.get(ref)
    assert copy.config == original.config
    assert len(copy.layers) == len(original.layers)
    assert tree(copy.rootfs) == tree(original.rootfs)
    for mine, theirs in zip(original.lowers, copy.lowers, strict=True):
        assert tree(theirs, layer=True) == tree(mine, layer=True)


def manifest(registry: Registry, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
    """The registry's manifest of `repository:reference`: its digest and document."""
    request = urllib.request.Request(
        f"http://{registry.host}/v2/{repository}/manifests/{reference}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Docker-Content-Digest"], json.loads(response.read())


# -- round trips -------------------------------------------------------------------------------


async def test_a_pushed_image_pulls_back_with_the_same_files(
    sample: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    reference = f"{registry.host}/team/sample:1"
    digest = await sample.push("sample:1", reference, tls_verify=False)
    assert_no_scratch(sample)
    found, document = manifest(registry, "team/sample", "1")
    assert found == digest
    layers = document["layers"]
    assert [layer["mediaType"] for layer in layers] == [
        "application/vnd.oci.image.layer.v1.tar+gzip"
    ] * 3
    assert sorted(uploads(registry)) == sorted(
        [*(layer["digest"] for layer in layers), document["config"]["digest"]]
    )

    fresh = ImageStore(tmp_path / "fresh")
    image = await fresh.pull(reference, tls_verify=False)
    check_sample_rootfs(image.rootfs)
    await assert_same_image(sample, "sample:1", fresh, reference)
    # Same files, new layer tars: another config, another image id (docs/images.md).
    original = await sample.get("sample:1")
    assert image.id != original.id and image.layers != original.layers
    # By digest too, as a pod would name it.
    by_digest = await ImageStore(tmp_path / "third").pull(
        f"{registry.host}/team/sample@{digest}", tls_verify=False
    )
    assert by_digest.id == image.id


async def test_a_second_push_uploads_no_layer(sample: ImageStore, registry: Registry) -> None:
    first = await sample.push("sample:1", f"{registry.host}/sample:1", tls_verify=False)
    assert len(uploads(registry)) == 4  # three layers and the config
    # Again, and under another tag: the same bytes, found by digest, nothing uploaded.
    assert await sample.push("sample:1", f"{registry.host}/sample:1", tls_verify=False) == first
    assert await sample.push("sample:1", f"{registry.host}/sample:2", tls_verify=False) == first
    assert len(uploads(registry)) == 4
    # An image over the same layers with one more: only that one (and its config) go up.
    (sample.root.parent / "more").mkdir()
    more = oci_layout(
        sample.root.parent / "more",
        [*sample_layers(), layer_tar([file("extra", b"one more layer")])],
        ref_name="2",
    )
    await sample.import_oci_layout(more, name="sample:more")
    await sample.push("sample:more", f"{registry.host}/sample:more", tls_verify=False)
    assert len(uploads(registry)) == 6
    assert_no_scratch(sample)


async def test_an_image_pulled_from_a_registry_is_pushed_to_another(
    sample: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    """Pulled, then pushed elsewhere: what a cluster's own registry gets."""
    await sample.push("sample:1", f"{registry.host}/a:1", tls_verify=False)
    middle = ImageStore(tmp_path / "middle")
    await middle.pull(f"{registry.host}/a:1", tls_verify=False)
    other = start_registry(tmp_path / "other")
    try:
        await middle.push(f"{registry.host}/a:1", f"{other.host}/b:1", tls_verify=False)
        last = ImageStore(tmp_path / "last")
        await last.pull(f"{other.host}/b:1", tls_verify=False)
        await assert_same_image(sample, "sample:1", last, f"{other.host}/b:1")
    finally:
        other.stop()


async def test_images_of_one_layer_and_from_rootfs_tarballs(
    store: ImageStore, registry: Registry, busybox_tar: Path, tmp_path: Path
) -> None:
    image = await store.import_archive(busybox_tar, name="busybox")
    reference = f"{registry.host}/busybox:1"
    await store.push("busybox", reference, tls_verify=False)
    _, document = manifest(registry, "busybox", "1")
    assert len(document["layers"]) == 1
    fresh = ImageStore(tmp_path / "fresh")
    copy = await fresh.pull(reference, tls_verify=False)
    assert copy.config == image.config
    assert tree(copy.rootfs) == tree(image.rootfs)


BUILT = """\
FROM busybox
RUN mkdir -p /data/old && echo one > /data/old/f && ln -s old/f /data/link && chmod 0700 /data/old
RUN rm -rf /data/old /etc/group && mkdir /data/old && echo two > /data/old/g && touch -d @5 /data/t
COPY hello.txt /srv/hello.txt
"""


@pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah")
async def test_a_built_image_goes_up_over_its_pushed_base(
    store: ImageStore, registry: Registry, busybox_tar: Path, tmp_path: Path
) -> None:
    await store.import_archive(busybox_tar, name="busybox")
    context = tmp_path / "context"
    context.mkdir()
    (context / "hello.txt").write_text("hello\n")
    (context / "Dockerfile").write_text(BUILT)
    built = await store.build(context / "Dockerfile", context, name="built:1")
    assert len(built.layers) == 4  # busybox, two RUN, COPY
    # Deleted and made again: an opaque directory; deleted: a whiteout.
    middle = built.lowers[1]
    assert is_opaque(middle / "data/old") and is_whiteout((middle / "etc/group").lstat())

    await store.push("busybox", f"{registry.host}/busybox:1", tls_verify=False)
    base_uploads = len(uploads(registry))
    await store.push("built:1", f"{registry.host}/built:1", tls_verify=False)
    # Its base layer was there (another repository of that registry, same digest): skopeo
    # mounts it from there or finds it; only the build's three layers and its config go up.
    assert len(uploads(registry)) - base_uploads == 4

    fresh = ImageStore(tmp_path / "fresh")
    copy = await fresh.pull(f"{registry.host}/built:1", tls_verify=False)
    await assert_same_image(store, "built:1", fresh, f"{registry.host}/built:1")
    assert (copy.rootfs / "data/old/g").read_text() == "two\n"
    assert not (copy.rootfs / "data/old/f").exists() and not (copy.rootfs / "etc/group").exists()
    assert (copy.rootfs / "data/t").stat().st_mtime == 5
    assert (copy.rootfs / "srv/hello.txt").read_text() == "hello\n"


@needs_root_and_crun
async def test_a_prepared_sandbox_saved_as_an_image_is_pushed(
    busybox_tar: Path, registry: Registry, tmp_path: Path
) -> None:
    """``snapshot save --as-image`` then ``images push``: what a cluster then runs."""
    async with fresh_local_provider(busybox_tar) as provider:
        env = {"SANDMAN_CGROUP_PARENT": provider.config.cgroup_parent}
        state = provider.config.state_dir

        async def ok(*args: str) -> str:
            result = await asyncio.to_thread(sandman, state, *args, env=env)
            assert result.exit_code == 0, result.output
            return result.stdout

        sandbox = (await ok("create", "busybox", "--memory", "64Mi")).strip()
        await ok("exec", sandbox, "--", "sh", "-c", "echo prepared > /root/state; rm /etc/hostname")
        await ok("snapshot", "save", sandbox, "--as-image", "task:ready")
        await ok("rm", sandbox)
        pinned = (
            await ok("images", "push", "task:ready", f"{registry.host}/task:ready", "--insecure")
        ).strip()
        assert pinned.startswith(f"{registry.host}/task@sha256:")
    copy = await ImageStore(tmp_path / "fresh").pull(pinned, tls_verify=False)
    assert (copy.rootfs / "root/state").read_text() == "prepared\n"
    assert not (copy.rootfs / "etc/hostname").exists()
    assert (copy.rootfs / "bin/busybox").is_file()


async def test_an_image_stored_before_layers_goes_up_as_one_layer(
    registry: Registry, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    config = builders.image_config([builders.sha256(layer) for layer in sample_layers()])
    hex_id = hashlib.sha256(config).hexdigest()
    (root / "rootfs").mkdir(parents=True)
    flattened(sample_layers(), root / "rootfs" / hex_id)
    for sub, name, data in (
        ("images", f"{hex_id}.json", json.dumps({
            "id": f"sha256:{hex_id}", "kind": "docker-archive", "config": {"user": "user"},
            "size": 1, "created": "2026-01-01T00:00:00Z", "blobs": [f"sha256:{hex_id}"],
            "layers": [],
        }).encode()),
        ("blobs/sha256", hex_id, config),
        (".", "names.json", json.dumps({"names": {"old:1": f"sha256:{hex_id}"}}).encode()),
    ):  # fmt: skip
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / name).write_bytes(data)
    old = ImageStore(root)
    await old.push("old:1", f"{registry.host}/old:1", tls_verify=False)
    copy = await ImageStore(tmp_path / "fresh").pull(f"{registry.host}/old:1", tls_verify=False)
    assert len(copy.layers) == 1
    assert tree(copy.rootfs) == tree((await old.get("old:1")).rootfs)
    check_sample_rootfs(copy.rootfs)


# -- the layer tars ----------------------------------------------------------------------------


async def test_layer_tars_are_oci_and_reproducible(sample: ImageStore, tmp_path: Path) -> None:
    image = await sample.get("sample:1")
    middle = image.lowers[1]  # topmost first: the layer with the opaque directory
    first = export_layer(middle, tmp_path / "a")
    again = export_layer(middle, tmp_path / "b")
    assert first == again
    plain = export_layer(middle, tmp_path / "c", compress=False)
    assert plain.diff_id == plain.digest == first.diff_id != first.digest
    with tarfile.open(tmp_path / "c" / plain.digest.removeprefix("sha256:")) as tar:
        members = {m.name: m for m in tar.getmembers()}
        names = [m.name for m in tar.getmembers()]
    # Depth first, each directory sorted, its opaque marker right after it.
    opaque = names.index("var/lib/app/.wh..wh..opq")
    assert names[opaque - 1] == "var/lib/app"
    rest = [n for n in names if not n.endswith("/.wh..wh..opq")]
    assert rest == sorted(rest, key=lambda n: n.split("/"))
    assert "etc/.wh.removeme" in members and members["etc/.wh.removeme"].isreg()
    assert not any(m.ischr() and m.devmajor == 0 for m in members.values())
    assert all(m.uname == m.gname == "" for m in members.values())
    assert not any(n.startswith(("./", "/")) or n == "." for n in names)
    assert members["bin/hello"].mtime == 1_700_000_000  # the file's own, not the export's


def test_gzip_pieces_make_one_stream_whatever_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces compressed apart (as pigz does) make one standard gzip stream, the same bytes
    with one CPU or many, that gzip itself reads back to the tar."""
    root = tmp_path / "root"
    root.mkdir()
    # Repeats across the 1 MiB pieces: back-references into the piece before.
    pattern = os.urandom(20_000)
    (root / "big").write_bytes(pattern * 150 + os.urandom(1_500_000) + pattern * 50)
    blobs = tmp_path / "blobs"
    plain = export_layer(root, blobs, compress=False)
    digests = set()
    for cpus in (1, 3):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        blob = export_layer(root, blobs)
        digests.add(blob.digest)
        assert blob.diff_id == plain.digest
        assert blob.size < plain.size // 2
    assert len(digests) == 1
    unzipped = subprocess.run(
        ["gzip", "-dc", str(blobs / digests.pop().removeprefix("sha256:"))],
        capture_output=True,
        check=True,
    ).stdout
    assert unzipped == (blobs / plain.digest.removeprefix("sha256:")).read_bytes()


async def test_a_layer_that_hides_everything_below(
    store: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    """A top-level ``.wh..wh..opq`` (the layer's root opaque) goes up as it came (what it
    means is another matter: overlayfs ignores the opaque mark on a layer's root, and so
    does the merged rootfs; docker's unpacker would empty the root)."""
    layers = [
        layer_tar([file("old", b"old"), file("keep/x", b"x")]),
        layer_tar([file(".wh..wh..opq"), file("new", b"new")]),
    ]
    await store.import_oci_layout(oci_layout(tmp_path / "layout", layers, ref_name="1"), name="o:1")
    assert is_opaque((await store.get("o:1")).lowers[0])
    await store.push("o:1", f"{registry.host}/o:1", tls_verify=False)
    fresh = ImageStore(tmp_path / "fresh")
    copy = await fresh.pull(f"{registry.host}/o:1", tls_verify=False)
    assert is_opaque(copy.lowers[0])
    await assert_same_image(store, "o:1", fresh, f"{registry.host}/o:1")


def test_fractional_mtimes_and_xattrs_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"x")
    os.utime(root / "d" / "f", ns=(0, 1_700_000_000_123_456_789))
    os.setxattr(root / "d" / "f", "user.note", b"\xffbinary")
    out = tmp_path / "out.tar"
    with open(out, "wb") as sink:
        write_tar(root, sink)
    with tarfile.open(out) as tar:
        member = tar.getmember("d/f")
    assert member.pax_headers["mtime"] == "1700000000.123456789"
    assert member.pax_headers["SCHILY.xattr.user.note"].encode("utf-8", "surrogateescape") == (
        b"\xffbinary"
    )


def test_a_config_keeps_every_field_but_the_layers(sample_config: bytes) -> None:
    from sandman.images import Image, ImageConfig

    image = Image(id="sha256:" + "a" * 64, names=[], rootfs=Path("/"), config=ImageConfig(), size=0)
    new = json.loads(image_config(image, sample_config, ["sha256:" + "b" * 64]))
    old = json.loads(sample_config)
    assert new["rootfs"]["diff_ids"] == ["sha256:" + "b" * 64]
    assert new["history"] == old["history"]
    assert {k: v for k, v in new.items() if k != "rootfs"} == {
        k: v for k, v in old.items() if k != "rootfs"
    }
    # A history of other layers (a flattened image's) is made anew; none stays none.
    two = json.loads(image_config(image, sample_config, ["sha256:" + "b" * 64] * 2))
    assert [h["comment"] for h in two["history"]] == ["layer 1", "layer 2"]
    del old["history"]
    assert "history" not in json.loads(image_config(image, json.dumps(old).encode(), []))
    # No config at all (a rootfs tarball's image): made from its run settings.
    made = json.loads(image_config(image, None, ["sha256:" + "b" * 64]))
    assert made["config"]["WorkingDir"] == "/" and len(made["history"]) == 1


@pytest.fixture
def sample_config() -> bytes:
    return json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["A=1"], "Labels": {"team": "rl"}, "ExposedPorts": {"80/tcp": {}}},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "c" * 64]},
            "history": [{"created_by": "RUN x"}, {"created_by": "ENV A=1", "empty_layer": True}],
        }
    ).encode()


# -- credentials and failures ------------------------------------------------------------------


async def test_credentials_and_a_wrong_password(
    sample: ImageStore,
    private_registry: Registry,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    skopeo_shim: Path,
) -> None:
    reference = f"{private_registry.host}/team/sample:1"
    with pytest.raises(ImageError, match=r"authentication failed for user 'alice'") as caught:
        await sample.push(
            "sample:1",
            reference,
            auth=RegistryAuth(username=USER, password=WRONG),
            tls_verify=False,
        )
    assert not isinstance(caught.value, ImageNotFound)
    assert "push" in str(caught.value)
    assert WRONG not in str(caught.value) and WRONG not in caplog.text
    assert_no_scratch(sample)
    with pytest.raises(ImageError, match=r"wants credentials \(pass auth=RegistryAuth"):
        await sample.push("sample:1", reference, tls_verify=False)

    auth = RegistryAuth(username=USER, password=PASSWORD)
    digest = await sample.push("sample:1", reference, auth=auth, tls_verify=False)
    assert PASSWORD not in caplog.text
    # In a private file for skopeo, not on its command line; gone with the push.
    args = (skopeo_shim / "args").read_text().splitlines()
    assert PASSWORD not in " ".join(args) and "--dest-creds" not in args
    assert args[args.index("--dest-authfile") + 1] == "auth.json"
    assert (skopeo_shim / "authfile-mode").read_text().strip() == "600"
    assert not Path((skopeo_shim / "cwd").read_text().strip()).exists()
    # An auth file of the caller's, as `podman login` writes it: the same image.
    token = "YWxpY2U6czNjcmV0LVBhNTU="  # alice:s3cret-Pa55
    authfile = tmp_path / "auth.json"
    authfile.write_text(json.dumps({"auths": {private_registry.host: {"auth": token}}}))
    assert await sample.push("sample:1", reference, auth=authfile, tls_verify=False) == digest
    fresh = ImageStore(tmp_path / "fresh")
    await fresh.pull(reference, auth=authfile, tls_verify=False)
    await assert_same_image(sample, "sample:1", fresh, reference)
    with pytest.raises(ConfigError, match="auth file"):
        await sample.push("sample:1", reference, auth=tmp_path / "nope.json", tls_verify=False)
    assert_no_scratch(sample)


async def test_an_unreachable_registry_fails_at_once(sample: ImageStore) -> None:
    host = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ImageError, match=rf"cannot push .*registry {host} is unreachable"):
        await sample.push("sample:1", f"{host}/sample:1", tls_verify=False)
    assert time.monotonic() - started < 3
    assert_no_scratch(sample)


async def test_what_cannot_be_pushed(sample: ImageStore, registry: Registry) -> None:
    with pytest.raises(ImageNotFound, match="no image 'nothere:1'"):
        await sample.push("nothere:1", f"{registry.host}/x:1", tls_verify=False)
    with pytest.raises(ImageError, match="names a tag"):
        await sample.push("sample:1", f"{registry.host}/x@sha256:" + "a" * 64, tls_verify=False)
    with pytest.raises(ConfigError, match="timeout"):
        await sample.push("sample:1", f"{registry.host}/x:1", timeout=0)
    with pytest.raises(ImageError, match="plain HTTP; pass tls_verify=False"):
        await sample.push("sample:1", f"{registry.host}/x:1")
    with pytest.raises(ImageError, match="timed out after 0.01s"):
        await sample.push("sample:1", f"{registry.host}/x:1", tls_verify=False, timeout=0.01)
    assert uploads(registry) == []
    assert_no_scratch(sample)


def noise_tar(path: Path, size: int) -> Path:
    """A rootfs tarball of one file of `size` random bytes (which gzip cannot shrink)."""
    with tarfile.open(path, "w") as tar, open("/dev/urandom", "rb") as noise:
        info = tarfile.TarInfo("big")
        info.size = size
        tar.addfile(info, noise)
    return path


async def test_a_push_that_times_out_while_exporting_leaves_nothing(
    store: ImageStore, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One CPU: gzip takes over a second for the 96 MiB, however fast the machine.
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    await store.import_archive(noise_tar(tmp_path / "data.tar", 96 * 2**20), name="big:1")
    started = time.monotonic()
    with pytest.raises(ImageError, match=r"timed out after 0.5s while its layers were exported"):
        await store.push("big:1", f"{registry.host}/big:1", tls_verify=False, timeout=0.5)
    assert time.monotonic() - started < 3  # the export stopped, not just the wait for it
    assert uploads(registry) == []
    assert_no_scratch(store)


# -- the CLI -----------------------------------------------------------------------------------


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state directory whose image store (the CLI's) holds ``sample:1``."""
    state = tmp_path / "state"
    layout = oci_layout(tmp_path / "layout", sample_layers(), ref_name="1")
    asyncio.run(ImageStore(state / "images").import_oci_layout(layout, name="sample:1"))
    return state


def sandman(state: Path, *args: str, env: dict[str, str] | None = None, stdin: str = "") -> Result:
    return CliRunner().invoke(cli(), ["--state-dir", str(state), *args], env=env, input=stdin)


def test_cli_push_and_pull_with_credentials(
    state: Path, private_registry: Registry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = private_registry.host
    clean = {"SANDMAN_REGISTRY_USER": "", "SANDMAN_REGISTRY_PASSWORD": ""}
    # The password asked for, not echoed.
    pushed = sandman(
        state, "images", "push", "sample:1", f"{host}/cli/sample:1", "--insecure",
        "--creds", USER, env=clean, stdin=f"{PASSWORD}\n",
    )  # fmt: skip
    assert pushed.exit_code == 0, pushed.output
    assert "Password for alice at " + host in pushed.stderr
    assert PASSWORD not in pushed.output
    assert re.fullmatch(rf"{re.escape(host)}/cli/sample@sha256:[0-9a-f]{{64}}\n", pushed.stdout)
    pinned = pushed.stdout.strip()
    # From the environment, to another tag: the same digest.
    env = {"SANDMAN_REGISTRY_USER": USER, "SANDMAN_REGISTRY_PASSWORD": PASSWORD}
    again = sandman(
        state, "images", "push", "sample:1", f"{host}/cli/sample:2", "--insecure", env=env
    )
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == pinned
    # Pulled back by digest into another state directory, with an auth file.
    authfile = tmp_path / "auth.json"
    authfile.write_text(json.dumps({"auths": {host: {"auth": "YWxpY2U6czNjcmV0LVBhNTU="}}}))
    other = tmp_path / "other"
    pulled = sandman(other, "images", "pull", pinned, "--insecure", "--authfile", str(authfile))
    assert pulled.exit_code == 0, pulled.output
    check_sample_rootfs(asyncio.run(ImageStore(other / "images").get(pinned)).rootfs)
    assert PASSWORD not in caplog.text


def test_cli_errors_name_the_cli_options_and_never_the_password(
    state: Path, private_registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    host = private_registry.host
    clean = {"SANDMAN_REGISTRY_USER": "", "SANDMAN_REGISTRY_PASSWORD": ""}
    target = f"{host}/cli/sample:1"
    wrong = sandman(
        state, "images", "push", "sample:1", target, "--insecure", "--creds", f"{USER}:{WRONG}",
        env=clean,
    )  # fmt: skip
    assert wrong.exit_code == 1
    assert "authentication failed for user 'alice'" in wrong.stderr
    assert WRONG not in wrong.output and WRONG not in caplog.text
    assert "Traceback" not in wrong.output
    anonymous = sandman(state, "images", "push", "sample:1", target, "--insecure", env=clean)
    assert anonymous.exit_code == 1
    assert "give --creds USER or --authfile PATH" in anonymous.stderr
    assert "RegistryAuth" not in anonymous.stderr
    plain = sandman(state, "images", "pull", target, "--creds", f"{USER}:{PASSWORD}", env=clean)
    assert plain.exit_code == 1
    assert "pass --insecure if you trust it" in plain.stderr
    assert "tls_verify" not in plain.stderr and PASSWORD not in plain.output
    both = sandman(
        state, "images", "push", "sample:1", target, "--creds", USER, "--authfile", __file__
    )
    assert both.exit_code == 2 and "not both" in both.output
    empty = sandman(state, "images", "push", "sample:1", target, "--creds", f":{WRONG}")
    assert empty.exit_code == 2 and WRONG not in empty.output
    lone = sandman(
        state, "images", "push", "sample:1", target, env={"SANDMAN_REGISTRY_PASSWORD": WRONG}
    )
    assert lone.exit_code == 2 and "SANDMAN_REGISTRY_USER" in lone.output
    assert WRONG not in lone.output


# -- the pure parts ----------------------------------------------------------------------------


def test_skopeo_push_command() -> None:
    command = skopeo_push_command(
        "skopeo", parse_reference("localhost:5000/x:1"), tls_verify=False, authfile="auth.json"
    )
    assert command == [
        "skopeo", "copy", "--retry-times", "0", "--preserve-digests",
        "--dest-tls-verify=false", "--dest-authfile", "auth.json",
        "oci:push:push", "docker://localhost:5000/x:1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("stderr", "auth", "words"),
    [
        ("denied: requested access to the resource is denied", RegistryAuth(
            username="bob", password="hunter2"), "for user 'bob': wrong credentials, or no right"),
        ("unauthorized: authentication required", Path("/home/bob/auth.json"),
         "with the credentials in /home/bob/auth.json"),
        ("unauthorized: authentication required", None, "(pass auth=RegistryAuth(...))"),
        ('Get "https://r:5000/v2/": http: server gave HTTP response to HTTPS client', None,
         "plain HTTP; pass tls_verify=False"),
    ],
)  # fmt: skip
def test_push_errors_say_what_to_do(stderr: str, auth: Any, words: str) -> None:
    error = push_error(
        parse_reference("r:5000/team/x:1"), f'level=fatal msg="{stderr} hunter2"', auth=auth,
        tls_verify=True,
    )  # fmt: skip
    assert str(error).startswith("cannot push r:5000/team/x:1 to r:5000")
    assert words in str(error)
    if auth is not None and not isinstance(auth, Path):
        assert "hunter2" not in str(error)
    assert not isinstance(error, ImageNotFound)
