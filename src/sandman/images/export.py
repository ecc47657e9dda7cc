"""The store's images out again, as OCI: reproducible layer tars, configs and layouts.

`write_tar` turns a directory of the store (a stored layer, or an image's merged
rootfs) into a tar, the same bytes every time for the same tree:

- entries depth first, each directory's sorted by name (bytes), the directory before
  them (GNU tar's ``--sort=name``); no ``./`` entry (the root's mode is the unpacker's);
- numeric owners only (no user or group names), each file's own mode and mtime (a
  fractional mtime as a PAX record, to the nanosecond), no atime or ctime;
- hard links inside the tree as tar hard links to the first name (sorted order);
- file capabilities and ``user.*`` extended attributes as ``SCHILY.xattr.*`` PAX
  records (`sandman.images.overlay.kept_xattr`; never overlayfs' own);
- overlayfs' form turned back into OCI's: a whiteout (a character device 0/0) becomes
  an empty ``.wh.<name>`` file (mode 0600, root, mtime 0: the marker's own metadata
  means nothing, so it is fixed), an opaque directory (its ``*.overlay.opaque`` xattr)
  an empty ``.wh..wh..opq`` file right after the directory's entry (the directory's
  mode, owner and mtime, as docker writes it).

`export_layer` writes one such tar into an OCI layout's ``blobs/sha256`` (gzip-
compressed when asked, on every CPU and reproducibly) and says what it is: its digest,
diff id and size; `image_config` and `write_layout` finish an OCI image layout around
such blobs, and `export_image` does all three for `ImageStore.push`. Builds export their
base images (`sandman.images.build.export_base`) with the same code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import struct
import tarfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandman.errors import ImageError
from sandman.images.digests import CHUNK
from sandman.images.formats import HOST_ARCH
from sandman.images.image import Image
from sandman.images.overlay import is_opaque, is_whiteout, kept_xattr

__all__ = [
    "COMPRESS_LEVEL",
    "MEDIA_CONFIG",
    "MEDIA_LAYER",
    "MEDIA_LAYER_GZIP",
    "MEDIA_MANIFEST",
    "LayerBlob",
    "export_image",
    "export_layer",
    "export_stream",
    "image_config",
    "write_blob",
    "write_layout",
    "write_tar",
]

logger = logging.getLogger(__name__)

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

COMPRESS_LEVEL = 6
"""gzip's level for pushed layers: zlib's default, as docker and skopeo use."""

WHITEOUT_PREFIX = ".wh."
WHITEOUT_OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class LayerBlob:
    """A layer written as a blob: what a manifest and a config say of it."""

    digest: str
    """The blob's digest (of the gzip stream when compressed)."""
    diff_id: str
    """The uncompressed tar's digest."""
    size: int
    media_type: str

    def descriptor(self) -> dict[str, Any]:
        """Its descriptor in a manifest."""
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


# -- the tar ----------------------------------------------------------------------------------


def write_tar(root: Path, out: Any, *, check: Callable[[], None] | None = None) -> None:
    """Write the tree at `root` to `out` (a binary file with ``write`` and ``tell``) as a
    reproducible OCI layer tar (see the module's docstring). `check` is called between
    entries and chunks (to stop a cancelled export: it raises). `ImageError` when a
    file cannot be read."""
    with tarfile.TarFile(
        fileobj=out,
        mode="w",
        format=tarfile.PAX_FORMAT,
        encoding="utf-8",
        errors="surrogateescape",
        copybufsize=CHUNK,
    ) as tar:
        _Writer(root, tar, check).run()


class _Writer:
    def __init__(self, root: Path, tar: tarfile.TarFile, check: Callable[[], None] | None) -> None:
        self.root = root
        self.tar = tar
        self.check = check or (lambda: None)
        self.links: dict[tuple[int, int], str] = {}

    def run(self) -> None:
        if is_opaque(self.root):  # a layer that hides everything below it
            st = os.lstat(self.root)
            self.tar.addfile(self.info(WHITEOUT_OPAQUE, tarfile.REGTYPE, st))
        # One iterator per directory on the way down: depth first, each sorted.
        stack = [self.children(str(self.root), "")]
        while stack:
            found = next(stack[-1], None)
            if found is None:
                stack.pop()
                continue
            self.check()
            child, name = found
            st = child.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self.directory(child.path, name, st)
                stack.append(self.children(child.path, f"{name}/"))
            else:
                self.entry(child.path, name, st)

    @staticmethod
    def children(path: str, prefix: str) -> Iterator[tuple[os.DirEntry[str], str]]:
        """The entries of directory `path` by their names in the tar (bytes; a whiteout's
        is ``.wh.<name>``), with their paths in the tar."""

        def key(entry: os.DirEntry[str]) -> bytes:
            whiteout = is_whiteout(entry.stat(follow_symlinks=False))
            return os.fsencode(f"{WHITEOUT_PREFIX}{entry.name}" if whiteout else entry.name)

        try:
            with os.scandir(path) as entries:
                found = sorted(entries, key=key)
        except OSError as exc:
            raise ImageError(f"cannot read {path} to export it: {exc}") from exc
        return iter([(entry, f"{prefix}{entry.name}") for entry in found])

    def directory(self, path: str, name: str, st: os.stat_result) -> None:
        info = self.info(name, tarfile.DIRTYPE, st)
        self.xattrs(path, info)
        self.tar.addfile(info)
        if is_opaque(Path(path)):
            marker = self.info(f"{name}/{WHITEOUT_OPAQUE}", tarfile.REGTYPE, st)
            self.tar.addfile(marker)

    def entry(self, path: str, name: str, st: os.stat_result) -> None:
        mode = st.st_mode
        if is_whiteout(st):
            parent, _, base = name.rpartition("/")
            whiteout = f"{WHITEOUT_PREFIX}{base}"
            info = tarfile.TarInfo(f"{parent}/{whiteout}" if parent else whiteout)
            info.mode, info.uname, info.gname = 0o600, "", ""
            self.tar.addfile(info)
            return
        if stat.S_ISSOCK(mode):
            logger.debug("not exporting socket %s (tar has no sockets)", name)
            return
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:
            info = self.info(name, tarfile.LNKTYPE, st)
            info.linkname = self.links[key]
            self.tar.addfile(info)
            return
        if st.st_nlink > 1:
            self.links[key] = name
        if stat.S_ISREG(mode):
            info = self.info(name, tarfile.REGTYPE, st)
            info.size = st.st_size
            self.xattrs(path, info)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise ImageError(f"cannot read {path} to export it: {exc}") from exc
            with os.fdopen(fd, "rb") as source:
                self.tar.addfile(info, _Checked(source, self.check))
            return
        if stat.S_ISLNK(mode):
            info = self.info(name, tarfile.SYMTYPE, st)
            info.linkname = os.readlink(path)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            info = self.info(name, tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE, st)
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        elif stat.S_ISFIFO(mode):
            info = self.info(name, tarfile.FIFOTYPE, st)
        else:
            logger.debug("not exporting %s of unknown type %o", name, stat.S_IFMT(mode))
            return
        self.xattrs(path, info)
        self.tar.addfile(info)

    @staticmethod
    def info(name: str, kind: bytes, st: os.stat_result) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.uid, info.gid = st.st_uid, st.st_gid
        info.uname = info.gname = ""
        info.mtime = st.st_mtime_ns // 1_000_000_000
        if st.st_mtime_ns % 1_000_000_000:
            # Exact, where a float (what tarfile would write) is not.
            info.pax_headers = {"mtime": _pax_time(st.st_mtime_ns)}
        return info

    @staticmethod
    def xattrs(path: str, info: tarfile.TarInfo) -> None:
        try:
            names = sorted(os.listxattr(path, follow_symlinks=False))
        except OSError:
            return  # a filesystem without xattrs
        headers = dict(info.pax_headers)
        for name in names:
            if not kept_xattr(name):
                continue
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            # Bytes kept as they are (tarfile writes them back with surrogateescape).
            headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
        info.pax_headers = headers


def _pax_time(nanoseconds: int) -> str:
    """A time in nanoseconds as a PAX decimal (``-1.5`` is 1.5 s before the epoch)."""
    seconds, nanos = divmod(abs(nanoseconds), 1_000_000_000)
    sign = "-" if nanoseconds < 0 else ""
    return f"{sign}{seconds}.{nanos:09d}".rstrip("0").rstrip(".")


class _Checked:
    """A file whose reads call `check` first (so a cancelled export stops mid-file)."""

    def __init__(self, inner: Any, check: Callable[[], None]) -> None:
        self._inner = inner
        self._check = check

    def read(self, size: int = -1) -> bytes:
        self._check()
        data: bytes = self._inner.read(size)
        return data


# -- a layer blob -------------------------------------------------------------------------------


GZIP_BLOCK = 1 << 20
"""Bytes of tar compressed as one piece, in parallel with the next ones. Fixed: the gzip
stream depends on it (and on the level), never on how many threads there are."""
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"  # no name, mtime 0, unix
_WINDOW = 32 * 1024


def _deflate(data: bytes, dictionary: bytes, level: int, last: bool) -> bytes:
    """One piece of a raw deflate stream, as pigz makes them: primed with the 32 KiB before
    it, ended on a byte boundary (a sync flush) so the next piece follows it, or, the last,
    finished."""
    if dictionary:
        compressor = zlib.compressobj(
            level, zlib.DEFLATED, -15, 8, zlib.Z_DEFAULT_STRATEGY, dictionary
        )
    else:
        compressor = zlib.compressobj(level, zlib.DEFLATED, -15)
    return compressor.compress(data) + compressor.flush(
        zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
    )


class _BlobSink:
    """What `write_tar` writes to, in pieces of `GZIP_BLOCK` bytes: hashed (the diff id),
    gzipped when `pool` is given (the pieces in parallel on its threads, written in
    order: one gzip member, the same bytes whatever the number of threads), hashed again
    (the digest) and written to `file`."""

    def __init__(
        self, file: Any, pool: ThreadPoolExecutor | None, level: int, ahead: int = 2
    ) -> None:
        self.file = file
        self.pool = pool
        self.level = level
        self.diff = hashlib.sha256()
        self.blob = hashlib.sha256()
        self.buffer = bytearray()
        self.offset = 0
        self.size = 0
        self.crc = 0
        self.window = b""
        self.pending: deque[Future[bytes]] = deque()
        self.ahead = ahead  # pieces in flight at most: memory stays bounded
        if pool is not None:
            self._out(_GZIP_HEADER)

    def write(self, data: bytes) -> int:
        self.buffer += data
        self.offset += len(data)
        while len(self.buffer) >= GZIP_BLOCK:
            piece = bytes(self.buffer[:GZIP_BLOCK])
            del self.buffer[:GZIP_BLOCK]
            self._piece(piece, last=False)
        return len(data)

    def tell(self) -> int:
        return self.offset

    def close(self) -> None:
        """Write what is left (and gzip's trailer)."""
        self._piece(bytes(self.buffer), last=True)
        self.buffer.clear()
        while self.pending:
            self._out(self.pending.popleft().result())
        if self.pool is not None:
            self._out(struct.pack("<II", self.crc, self.offset & 0xFFFFFFFF))

    def _piece(self, data: bytes, *, last: bool) -> None:
        self.diff.update(data)
        if self.pool is None:
            self._out(data)
            return
        self.crc = zlib.crc32(data, self.crc)
        self.pending.append(self.pool.submit(_deflate, data, self.window, self.level, last))
        self.window = (self.window + data)[-_WINDOW:]
        while len(self.pending) > self.ahead:
            self._out(self.pending.popleft().result())

    def _out(self, data: bytes) -> None:
        if data:
            self.blob.update(data)
            self.file.write(data)
            self.size += len(data)


def export_layer(
    root: Path,
    blobs: Path,
    *,
    compress: bool = True,
    level: int = COMPRESS_LEVEL,
    check: Callable[[], None] | None = None,
) -> LayerBlob:
    """Write the tree at `root` as a layer blob in `blobs` (an OCI layout's
    ``blobs/sha256``, made if missing): `write_tar`'s tar, gzipped at `level` when
    `compress` (one gzip member; its 1 MiB pieces deflated on all CPUs, as pigz does,
    the same bytes on any machine with this zlib). Blocking (for a worker thread);
    `check` as for `write_tar`."""
    return export_stream(
        lambda sink: write_tar(root, sink, check=check),
        blobs,
        what=f"the layer {root}",
        compress=compress,
        level=level,
    )


def export_stream(
    write: Callable[[Any], None],
    blobs: Path,
    *,
    what: str,
    compress: bool = True,
    level: int = COMPRESS_LEVEL,
) -> LayerBlob:
    """A layer blob in `blobs` (made if missing) from a tar that `write` writes to the
    binary file-like it is given (``write`` and ``tell``), gzipped as by `export_layer`;
    for layers that are no tree on this host (a pod's changes). `what` names the layer
    in errors. Blocking."""
    blobs.mkdir(parents=True, exist_ok=True)
    part = blobs / f".{secrets.token_hex(8)}.part"
    threads = os.cpu_count() or 1
    pool = ThreadPoolExecutor(threads, thread_name_prefix="gzip") if compress else None
    try:
        with open(part, "wb") as file:
            sink = _BlobSink(file, pool, level, ahead=2 * threads)
            write(sink)
            sink.close()
        digest = sink.blob.hexdigest()
        os.replace(part, blobs / digest)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise ImageError(f"cannot export {what}: {exc}") from exc
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return LayerBlob(
        digest=f"sha256:{digest}",
        diff_id=f"sha256:{sink.diff.hexdigest()}",
        size=sink.size,
        media_type=MEDIA_LAYER_GZIP if compress else MEDIA_LAYER,
    )


# -- config and layout --------------------------------------------------------------------------


def image_config(image: Image, stored: bytes | None, diff_ids: Sequence[str]) -> bytes:
    """The config of `image` over layers `diff_ids`: its `stored` config (as imported,
    every field kept) with the new diff ids, or, without one (a rootfs tarball's image),
    one made from `Image.config`, with a history entry per layer (buildah's cache counts
    them). A stored history that no longer matches the layers (an image stored before
    layers were, now one layer) is replaced the same way."""
    document: dict[str, Any] | None = None
    if stored is not None:
        try:
            loaded = json.loads(stored)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            document = loaded
    made = document is None
    if document is None:
        settings = image.config
        document = {
            "architecture": HOST_ARCH,
            "os": "linux",
            "config": {
                "Env": settings.env,
                "WorkingDir": settings.working_dir,
                "User": settings.user,
                "Entrypoint": settings.entrypoint,
                "Cmd": settings.cmd,
            },
        }
    document["rootfs"] = {"type": "layers", "diff_ids": list(diff_ids)}
    history = document.get("history")
    stale = isinstance(history, list) and len(
        [h for h in history if not (isinstance(h, dict) and h.get("empty_layer"))]
    ) != len(diff_ids)
    if made or stale:
        document["history"] = [
            {"created_by": f"sandman image {image.id}", "comment": f"layer {i + 1}"}
            for i in range(len(diff_ids))
        ]
    return json.dumps(document).encode()


def write_blob(blobs: Path, data: bytes) -> dict[str, Any]:
    """Store `data` in `blobs` under its digest; its digest and size."""
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_layout(
    path: Path,
    config: bytes,
    layers: Sequence[dict[str, Any]],
    *,
    tag: str | None = None,
    platform: bool = False,
) -> str:
    """Finish the OCI image layout at `path` (its layer blobs already in ``blobs/sha256``):
    the config, a manifest over `layers` (their descriptors, bottom first), ``index.json``
    (the manifest tagged `tag`, with this machine's platform when `platform`) and
    ``oci-layout``. The manifest's digest: the image's digest in a registry."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, **write_blob(blobs, config)},
        "layers": list(layers),
    }
    descriptor = write_blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    entry: dict[str, Any] = {"mediaType": MEDIA_MANIFEST, **descriptor}
    if platform:
        entry["platform"] = {"architecture": HOST_ARCH, "os": "linux"}
    if tag is not None:
        entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return str(descriptor["digest"])


def export_image(
    image: Image,
    trees: Sequence[Path],
    stored_config: bytes | None,
    layout: Path,
    *,
    tag: str,
    check: Callable[[], None] | None = None,
) -> tuple[str, int, list[LayerBlob]]:
    """Write `image` as an OCI image layout at `layout`, tagged `tag`: each of `trees`
    (its stored layers, bottom first) a gzipped layer blob (`export_layer`), its config
    from `stored_config` (`image_config`), a manifest. Blocking; `check` as for
    `write_tar`. The manifest's digest, the layer blobs' bytes, and the blobs."""
    blobs = layout / "blobs" / "sha256"
    layers = [export_layer(tree, blobs, check=check) for tree in trees]
    config = image_config(image, stored_config, [layer.diff_id for layer in layers])
    descriptors = [layer.descriptor() for layer in layers]
    digest = write_layout(layout, config, descriptors, tag=tag, platform=True)
    return digest, sum(layer.size for layer in layers), layers
