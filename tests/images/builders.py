"""Build image archives for tests, offline, in Python: layers, ``docker save`` archives,
OCI archives and layout directories, plain rootfs tarballs (one from the host's busybox).

The provider tests reuse these, so they take plain arguments and return paths.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from sandman.errors import ImageError
from sandman.images.busybox import busybox_rootfs_tar as _busybox_rootfs_tar
from sandman.images.busybox import find_static_busybox

MTIME = 1_700_000_000
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "daemon:x:1:1:daemon:/usr/sbin:/bin/false\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\ndaemon:x:1:\nnogroup:x:65534:\n"


# -- layer entries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One tar entry: its header, and its content for regular files."""

    info: tarfile.TarInfo
    data: bytes | None = None


def _info(name: str, kind: bytes, *, mode: int, uid: int, gid: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, mtime
    return info


def file(
    name: str, data: bytes = b"", *, mode: int = 0o644, uid: int = 0, gid: int = 0,
    mtime: int = MTIME,
) -> Entry:  # fmt: skip
    """A regular file."""
    info = _info(name, tarfile.REGTYPE, mode=mode, uid=uid, gid=gid, mtime=mtime)
    info.size = len(data)
    return Entry(info, data)


def directory(
    name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = MTIME
) -> Entry:
    """A directory."""
    return Entry(_info(name, tarfile.DIRTYPE, mode=mode, uid=uid, gid=gid, mtime=mtime))


def symlink(name: str, target: str, *, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Entry:
    """A symlink; `target` is stored as given (absolute targets too)."""
    info = _info(name, tarfile.SYMTYPE, mode=0o777, uid=uid, gid=gid, mtime=mtime)
    info.linkname = target
    return Entry(info)


def hardlink(name: str, target: str) -> Entry:
    """A hard link to `target`, a path in this or a lower layer."""
    info = _info(name, tarfile.LNKTYPE, mode=0o644, uid=0, gid=0, mtime=MTIME)
    info.linkname = target
    return Entry(info)


def whiteout(path: str) -> Entry:
    """Delete `path` from the lower layers (``dir/.wh.name``)."""
    parent, _, base = path.rpartition("/")
    return file(f"{parent}/.wh.{base}" if parent else f".wh.{base}")


def opaque(path: str) -> Entry:
    """Hide everything lower layers put in directory `path` (``path/.wh..wh..opq``)."""
    return file(f"{path}/.wh..wh..opq")


def fifo(name: str, *, mode: int = 0o644) -> Entry:
    """A named pipe."""
    return Entry(_info(name, tarfile.FIFOTYPE, mode=mode, uid=0, gid=0, mtime=MTIME))


def chardev(name: str, major: int, minor: int, *, mode: int = 0o666) -> Entry:
    """A character device node."""
    info = _info(name, tarfile.CHRTYPE, mode=mode, uid=0, gid=0, mtime=MTIME)
    info.devmajor, info.devminor = major, minor
    return Entry(info)


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """An uncompressed layer tarball holding `entries`, in order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            tar.addfile(entry.info, io.BytesIO(entry.data) if entry.data is not None else None)
    return buffer.getvalue()


def gz(data: bytes) -> bytes:
    """gzip `data` reproducibly (no name, fixed mtime)."""
    return gzip.compress(data, mtime=0)


def sha256(data: bytes) -> str:
    """``sha256:<hex>`` of `data`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- the sample image ------------------------------------------------------------------------


def sample_layers() -> list[bytes]:
    """Three layers exercising whiteouts, opaque dirs, hard and symbolic links, setuid/setgid,
    ownership, mtimes, type changes, fifos and device nodes. `tests.images.test_layers`
    describes the tree they make."""
    base = [
        directory("bin"),
        directory("etc"),
        directory("usr"),
        directory("usr/bin"),
        directory("tmp", mode=0o1777),
        directory("home"),
        directory("home/user", mode=0o750, uid=1000, gid=1000),
        file("etc/passwd", PASSWD.encode() + b"user:x:1000:1000::/home/user:/bin/sh\n"),
        file("etc/group", GROUP.encode() + b"users:x:100:\nuser:x:1000:\n"),
        file("etc/removeme", b"gone soon"),
        directory("etc/dir-to-file"),
        file("etc/dir-to-file/child", b"child"),
        file("etc/file-to-dir", b"a file first"),
        file("bin/hello", b"hello-v1", mode=0o755, mtime=1_600_000_000),
        hardlink("bin/hello-link", "bin/hello"),
        symlink("bin/sh", "hello"),
        symlink("link-abs", "/etc/passwd"),
        file("usr/bin/su", b"su", mode=0o4755),
        file("usr/bin/wall", b"wall", mode=0o2755, gid=5),
        file("home/user/notes.txt", b"notes", mode=0o600, uid=1000, gid=1000),
        directory("var"),
        directory("var/lib"),
        directory("var/lib/app"),
        file("var/lib/app/old1", b"old1"),
        directory("var/lib/app/sub"),
        file("var/lib/app/sub/old2", b"old2"),
        directory("var/cache"),
        file("var/cache/x", b"x"),
    ]
    middle = [
        whiteout("etc/removeme"),
        file("etc/dir-to-file", b"now a file"),
        directory("etc/file-to-dir", mode=0o700),
        file("etc/file-to-dir/inner", b"inner"),
        # Entries of this layer before and after the opaque marker both stay.
        file("var/lib/app/before", b"before"),
        opaque("var/lib/app"),
        file("var/lib/app/new", b"new"),
        file("bin/hello", b"hello-v2", mode=0o755),
        symlink("home/user/link", "notes.txt", uid=1000, gid=1000),
    ]
    top = [
        hardlink("usr/bin/su-copy", "usr/bin/su"),
        whiteout("var/cache"),
        fifo("run/fifo"),
        chardev("dev/null", 1, 3),
        file("/abs/path", b"absolute names land inside"),
        file("./dot/path", b"so do ./ names"),
    ]
    return [layer_tar(base), layer_tar(middle), layer_tar(top)]


def image_config(
    diff_ids: Sequence[str], *, env: Sequence[str] = ("PATH=/usr/bin:/bin", "LANG=C.UTF-8"),
    working_dir: str = "/home/user", user: str = "user", entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = ("/bin/sh",),
) -> bytes:  # fmt: skip
    """An image config (the same bytes for docker and OCI, so both give the same image id)."""
    run: dict[str, Any] = {"Env": list(env), "WorkingDir": working_dir, "User": user}
    run["Entrypoint"] = list(entrypoint) if entrypoint is not None else None
    run["Cmd"] = list(cmd) if cmd is not None else None
    document = {
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
    }
    return json.dumps(document, sort_keys=True).encode()


# -- archives --------------------------------------------------------------------------------


def _write_tar(path: Path, files: dict[str, bytes], *, compress: bool = False) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), MTIME
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(gz(buffer.getvalue()) if compress else buffer.getvalue())
    return path


def docker_archive(
    path: Path, layers: Sequence[bytes], *, repo_tags: Sequence[str] = ("sample:latest",),
    config: bytes | None = None, layout: Literal["legacy", "blobs"] = "legacy",
    compress: bool = False, extra_images: Sequence[tuple[Sequence[bytes], Sequence[str]]] = (),
) -> Path:  # fmt: skip
    """A ``docker save`` archive of uncompressed `layers` (legacy ``<id>/layer.tar`` layout or
    docker 25+'s ``blobs/sha256``); `extra_images` adds more (layers, tags) images after it."""
    files: dict[str, bytes] = {}
    manifest = []
    for image_layers, tags, image_config_bytes in [
        (layers, repo_tags, config),
        *((lay, tg, None) for lay, tg in extra_images),
    ]:
        cfg = image_config_bytes or image_config([sha256(layer) for layer in image_layers])
        paths = []
        for layer in image_layers:
            hex_digest = sha256(layer).removeprefix("sha256:")
            name = f"{hex_digest}/layer.tar" if layout == "legacy" else f"blobs/sha256/{hex_digest}"
            files[name] = layer
            paths.append(name)
        cfg_hex = sha256(cfg).removeprefix("sha256:")
        cfg_name = f"{cfg_hex}.json" if layout == "legacy" else f"blobs/sha256/{cfg_hex}"
        files[cfg_name] = cfg
        manifest.append({"Config": cfg_name, "RepoTags": list(tags), "Layers": paths})
    files["manifest.json"] = json.dumps(manifest).encode()
    return _write_tar(path, files, compress=compress)


class OciLayout:
    """Assemble an OCI image layout: blobs, image manifests, nested indexes, the top index."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        """Store a blob; its descriptor."""
        digest = sha256(data)
        self.blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(
        self, layers: Sequence[bytes], *, compress_layers: bool = True, config: bytes | None = None,
        platform: tuple[str, str] | None = ("linux", "amd64"), annotations: dict[str, str] | None = None,
        layer_media_type: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Store an image (its layers, config and manifest); the manifest's descriptor."""
        cfg = config or image_config([sha256(layer) for layer in layers])
        media_type = layer_media_type or (OCI_LAYER_GZIP if compress_layers else OCI_LAYER)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.blob(cfg, OCI_CONFIG),
            "layers": [
                self.blob(gz(layer) if compress_layers else layer, media_type) for layer in layers
            ],
        }
        descriptor = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        if platform is not None:
            descriptor["platform"] = {"os": platform[0], "architecture": platform[1]}
        if annotations:
            descriptor["annotations"] = annotations
        return descriptor

    def nested_index(
        self, manifests: Sequence[dict[str, Any]], annotations: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Store an image index over `manifests`; its descriptor."""
        document = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(manifests)}
        descriptor = self.blob(json.dumps(document).encode(), OCI_INDEX)
        if annotations:
            descriptor["annotations"] = annotations
        return descriptor

    def files(self) -> dict[str, bytes]:
        """Every file of the layout, by path."""
        files = {f"blobs/sha256/{d.removeprefix('sha256:')}": b for d, b in self.blobs.items()}
        files["oci-layout"] = b'{"imageLayoutVersion": "1.0.0"}'
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.index}
        files["index.json"] = json.dumps(index).encode()
        return files

    def write_dir(self, path: Path) -> Path:
        """Write the layout as a directory."""
        for name, data in self.files().items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        return path

    def write_tar(self, path: Path, *, compress: bool = False) -> Path:
        """Write the layout as an OCI image archive."""
        return _write_tar(path, self.files(), compress=compress)


def sample_oci(
    layers: Sequence[bytes], *, ref_name: str | None = "latest", compress_layers: bool = True,
    image_name: str | None = None,
) -> OciLayout:  # fmt: skip
    """A layout with one image made of `layers`, tagged `ref_name`."""
    layout = OciLayout()
    annotations = {REF_NAME: ref_name} if ref_name else {}
    if image_name:
        annotations["io.containerd.image.name"] = image_name
    layout.index.append(
        layout.image(layers, compress_layers=compress_layers, annotations=annotations)
    )
    return layout


def oci_archive(path: Path, layers: Sequence[bytes], *, compress: bool = False, **kw: Any) -> Path:
    """An OCI image archive (tar of a layout) with one image made of `layers`."""
    return sample_oci(layers, **kw).write_tar(path, compress=compress)


def oci_layout(path: Path, layers: Sequence[bytes], **kw: Any) -> Path:
    """An OCI image layout directory with one image made of `layers`."""
    return sample_oci(layers, **kw).write_dir(path)


def rootfs_tar(path: Path, entries: Iterable[Entry], *, compress: bool = False) -> Path:
    """A plain rootfs tarball."""
    data = layer_tar(entries)
    path.write_bytes(gz(data) if compress else data)
    return path


# -- busybox ---------------------------------------------------------------------------------


def busybox_rootfs_tar(path: Path, *, compress: bool = False) -> Path:
    """A plain rootfs tarball from the host's static busybox (see
    `sandman.images.busybox.busybox_rootfs_tar`); skips the test when the host has none."""
    try:
        busybox = find_static_busybox()
    except ImageError as exc:
        pytest.skip(str(exc))
    return _busybox_rootfs_tar(path, busybox=busybox, compress=compress)


def check_sample_rootfs(rootfs: Path) -> None:
    """Assert that `rootfs` is what `sample_layers` make, flattened."""
    import stat

    def read(name: str) -> bytes:
        return (rootfs / name).read_bytes()

    assert read("etc/passwd").startswith(b"root:x:0:0:")
    # Whiteouts: a file and a directory, and no .wh. file is ever created.
    assert not (rootfs / "etc/removeme").exists()
    assert not (rootfs / "var/cache").exists()
    assert not any(p.name.startswith(".wh.") for p in rootfs.rglob("*"))
    # The opaque directory kept only this layer's entries, from before and after the marker.
    assert sorted(p.name for p in (rootfs / "var/lib/app").iterdir()) == ["before", "new"]
    # Type changes both ways.
    assert read("etc/dir-to-file") == b"now a file"
    assert (rootfs / "etc/file-to-dir").is_dir() and read("etc/file-to-dir/inner") == b"inner"
    assert stat.S_IMODE((rootfs / "etc/file-to-dir").stat().st_mode) == 0o700
    # Replacing a hard-linked file breaks the link, as overlayfs would.
    assert read("bin/hello") == b"hello-v2" and read("bin/hello-link") == b"hello-v1"
    # Hard link to a file of a lower layer (a merged rootfs links to the layers' files:
    # its link counts are higher than the image's).
    su, su_copy = (rootfs / "usr/bin/su").stat(), (rootfs / "usr/bin/su-copy").stat()
    assert su.st_ino == su_copy.st_ino and su.st_nlink >= 2
    # Symlinks are stored as given, never followed.
    assert os.readlink(rootfs / "bin/sh") == "hello"
    assert os.readlink(rootfs / "link-abs") == "/etc/passwd"
    assert os.readlink(rootfs / "home/user/link") == "notes.txt"
    # Modes, setuid/setgid and sticky bits, mtimes.
    assert stat.S_IMODE(su.st_mode) == 0o4755
    assert stat.S_IMODE((rootfs / "usr/bin/wall").stat().st_mode) == 0o2755
    assert stat.S_IMODE((rootfs / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE((rootfs / "home/user/notes.txt").stat().st_mode) == 0o600
    assert (rootfs / "bin/hello-link").stat().st_mtime == 1_600_000_000
    assert (rootfs / "home").stat().st_mtime == MTIME
    assert stat.S_ISFIFO((rootfs / "run/fifo").lstat().st_mode)
    # Absolute and ./ names land inside.
    assert read("abs/path") == b"absolute names land inside"
    assert read("dot/path") == b"so do ./ names"
    if os.geteuid() == 0:
        assert (rootfs / "usr/bin/wall").stat().st_gid == 5
        notes = (rootfs / "home/user/notes.txt").stat()
        assert (notes.st_uid, notes.st_gid) == (1000, 1000)
        link = (rootfs / "home/user/link").lstat()
        assert (link.st_uid, link.st_gid) == (1000, 1000)
        null = (rootfs / "dev/null").lstat()
        assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1
    assert stat.S_IMODE(rootfs.stat().st_mode) == 0o755
