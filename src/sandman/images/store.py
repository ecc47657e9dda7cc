"""The local, content-addressed image store.

On disk, under ``root``::

    blobs/sha256/<hex>     verified manifests and configs
    rootfs/<hex>/          the flattened root filesystem of image <hex>
    images/<hex>.json      its metadata; written last, so its presence means "complete"
    names.json             name → image id, replaced atomically
    locks/<xx>.lock        flock files: images by the first two hex digits of their id;
                           names.lock for the table; pulls.lock, held shared by every pull
    tmp/                   unpacks and pulls (``pulls.<random>/``) in progress; stale
                           entries go at the next start

An image is unpacked once, under its id's lock, into ``tmp/`` and renamed into
``rootfs/``. Importing it again (under any name) reuses it. Layer blobs are
checked while they stream and are not kept: the unpacked rootfs is what
sandboxes use, and keeping both would double the disk taken by large images.
"""

from __future__ import annotations

import builtins
import fcntl
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, ValidationError

from sandman import _flock
from sandman.errors import ImageError, ImageNotFound
from sandman.images.digests import hex_of
from sandman.images.formats import ArchiveSource, LayoutSource, Plan, plan_archive, plan_layout
from sandman.images.image import Image, ImageConfig
from sandman.images.layers import apply_layer, disk_usage, rmtree
from sandman.images.locks import StoreLock, try_lock_file
from sandman.images.names import is_id_prefix, normalize_name, read_names, write_names
from sandman.images.registry import RegistryAuth, parse_reference, run_skopeo

__all__ = ["ImageStore"]

logger = logging.getLogger(__name__)

NAMES_KEY = "names"
PULLS_KEY = "pulls"

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


async def _run(function: Callable[[*Ts], T], *args: *Ts) -> T:
    """Run blocking file work in a worker thread, never on the event loop."""
    return await anyio.to_thread.run_sync(function, *args)


class _Record(BaseModel):
    """What ``images/<hex>.json`` holds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    kind: str
    config: ImageConfig
    size: int
    created: datetime
    blobs: list[str]
    layers: list[str]


class ImageStore:
    """Images imported from archives, unpacked once, found by name or id.

    `root` (e.g. ``/var/lib/sandman/images``) is created if missing. Several
    stores, in one process or many, may share a root: writers take locks.
    `in_use` tells whether a sandbox still uses an image; `remove` refuses to
    delete an image it says is in use.
    """

    def __init__(self, root: Path, *, in_use: Callable[[Image], bool] | None = None) -> None:
        self.root = Path(root).absolute()
        self._in_use = in_use
        self._dirs = {
            name: self.root / name for name in ("blobs/sha256", "rootfs", "images", "locks", "tmp")
        }
        for directory in self._dirs.values():
            directory.mkdir(parents=True, exist_ok=True)
        self._names_path = self.root / "names.json"
        self._locks: dict[Path, StoreLock] = {}
        self._ready = False
        self._ready_lock = anyio.Lock()

    # -- public API ------------------------------------------------------------------------

    async def import_archive(self, path: Path, *, name: str | None = None) -> Image:
        """Import a ``docker save`` archive, an OCI image archive or a plain rootfs tarball.

        The format and the outer compression (gzip, bzip2, xz) are detected.
        `name` (e.g. ``"busybox:latest"``) names the image and picks it when
        the archive holds several; without it the archive's own names are used.
        A rootfs tarball gets an empty config (only ``PATH`` set) and the
        tarball's sha256 as id. Raises `ImageError` when the archive is
        corrupt or unsafe; nothing is then left behind.
        """
        await self._start()
        wanted = normalize_name(name) if name is not None else None
        source = await _run(ArchiveSource, Path(path), self._dirs["tmp"])
        try:
            plan = await _run(plan_archive, source, wanted)
            return await self._install(plan, wanted)
        finally:
            source.close()

    async def import_oci_layout(self, path: Path, *, name: str | None = None) -> Image:
        """Import an OCI image layout directory (``oci-layout``, ``index.json``, ``blobs/``).

        When the index lists several images, the one whose
        ``org.opencontainers.image.ref.name`` matches the tag of `name` is
        taken, else the only one or the first for this host's linux platform.
        """
        await self._start()
        wanted = normalize_name(name) if name is not None else None
        source = await _run(LayoutSource, Path(path))
        plan = await _run(plan_layout, source, wanted)
        return await self._install(plan, wanted)

    async def pull(
        self,
        reference: str,
        *,
        auth: RegistryAuth | None = None,
        tls_verify: bool = True,
        timeout: float = 600,
    ) -> Image:
        """Pull `reference` (``docker.io/library/python:3.11``, ``localhost:5000/x:1``) and import it.

        Needs skopeo (``apt-get install -y skopeo``). The image is named as
        `reference` says (``python:3.11``); one that is already unpacked is
        reused. `tls_verify=False` allows plain HTTP and unverified
        certificates (a registry on 127.0.0.1). `timeout` bounds the download,
        not the unpacking. Raises `ImageError`: at once when the registry is
        unreachable, `ImageNotFound` for an unknown repository or tag. The
        download's scratch directory and the credentials file are always removed.
        """
        await self._start()
        parsed = parse_reference(reference)
        async with self._scratch() as scratch:
            layout = await run_skopeo(
                parsed, scratch, auth=auth, tls_verify=tls_verify, timeout=timeout
            )
            return await self.import_oci_layout(layout, name=parsed.name)

    async def get(self, ref: str) -> Image:
        """The image named `ref` (``busybox`` means ``busybox:latest``) or with that id.

        An id may be given whole or as a unique prefix, with or without
        ``sha256:``. Raises `ImageNotFound` when there is none.
        """
        await self._start()
        return await _run(self._get, ref)

    async def list(self) -> builtins.list[Image]:
        """Every complete image in the store, named ones first, by name."""
        await self._start()
        return await _run(self._list)

    async def tag(self, ref: str, name: str) -> Image:
        """Give the image `ref` the name `name` too (taken from any image that had it)."""
        await self._start()
        new_name = normalize_name(name)
        image_id, _ = await _run(self._resolve, ref)
        async with self._lock(hex_of(image_id)):
            await _run(self._load_image, image_id)
            await self._update_names(lambda names: names.__setitem__(new_name, image_id))
            return await _run(self._load_image, image_id)

    async def remove(self, ref: str) -> None:
        """Remove the name `ref`, or, given an id, the image and all its names.

        The unpacked image is deleted once no name is left. Raises
        `ImageError` (and changes nothing) when that would delete an image the
        ``in_use`` hook reports as in use.
        """
        await self._start()
        image_id, name = await _run(self._resolve, ref)
        hex_id = hex_of(image_id)
        async with self._lock(hex_id):
            image = await _run(self._load_image, image_id)
            last = name is None or image.names == [name]
            # The hook is the provider's: call it here, on the event loop, not in a thread.
            if last and self._in_use is not None and self._in_use(image):
                raise ImageError(
                    f"image {image.short_id} ({', '.join(image.names) or 'no name'}) "
                    "is in use by a sandbox; release its sandboxes first"
                )
            deleted: builtins.list[bool] = []

            def drop(names: dict[str, str]) -> None:
                mine = [n for n, i in names.items() if i == image_id]
                doomed = mine if name is None else [n for n in mine if n == name]
                for n in doomed:
                    del names[n]
                # Only when the in-use check above covered it (names may move meanwhile).
                if last and len(doomed) == len(mine):
                    deleted.append(True)

            await self._update_names(drop)
            if deleted:
                await _run(self._delete, hex_id)
                logger.info("removed image %s", image_id)

    # -- import ----------------------------------------------------------------------------

    @asynccontextmanager
    async def _scratch(self) -> AsyncIterator[Path]:
        """A private directory in tmp/ for one pull, removed on the way out whatever happens.

        Pulls hold ``pulls.lock`` shared, so start-up cleanup (which needs it
        exclusively) removes ``pulls.*`` entries only when no pull is running.
        """
        fd = await _flock.lock(self._lock_path(PULLS_KEY), fcntl.LOCK_SH)
        try:
            path = self._dirs["tmp"] / f"{PULLS_KEY}.{secrets.token_hex(8)}"
            os.mkdir(path, 0o700)
            try:
                yield path
            finally:
                with anyio.CancelScope(shield=True):
                    await _run(rmtree, path)
        finally:
            os.close(fd)

    async def _install(self, plan: Plan, name: str | None) -> Image:
        hex_id = hex_of(plan.id)
        async with self._lock(hex_id):
            if not await _run(self._complete, hex_id):
                await _run(self._unpack, plan, hex_id)
            if plan.names:
                names = plan.names

                def add(table: dict[str, str]) -> None:
                    table.update(dict.fromkeys(names, plan.id))

                await self._update_names(add)
            return await _run(self._load_image, plan.id)

    def _unpack(self, plan: Plan, hex_id: str) -> None:
        started = time.monotonic()
        logger.debug("unpacking image %s (%s, %d layers)", plan.id, plan.kind, len(plan.layers))
        work = self._dirs["tmp"] / f"{hex_id}.{secrets.token_hex(6)}"
        final = self._dirs["rootfs"] / hex_id
        try:
            os.mkdir(work)
            for layer in plan.layers:
                with layer.open() as stream:
                    apply_layer(
                        work, stream, what=layer.what, digest=layer.digest, diff_id=layer.diff_id
                    )
            os.chmod(work, 0o755)
            size = disk_usage(work)
            # Left by a crash after the rename but before the metadata: not trusted.
            self._discard(final, hex_id)
            os.rename(work, final)
        except BaseException:
            self._discard(work, hex_id)
            raise
        try:
            for digest, data in plan.blobs.items():
                self._write_blob(digest, data, hex_id)
            record = _Record(
                id=plan.id,
                kind=plan.kind,
                config=plan.config,
                size=size,
                created=datetime.now(UTC),
                blobs=sorted(plan.blobs),
                layers=[layer.diff_id or layer.digest or "" for layer in plan.layers],
            )
            data = record.model_dump_json(indent=2).encode()
            self._write_atomic(self._record_path(hex_id), data, hex_id)
        except BaseException:
            self._delete(hex_id)
            raise
        logger.info(
            "unpacked image %s (%d bytes) in %.1fs", plan.id, size, time.monotonic() - started
        )

    def _write_blob(self, digest: str, data: bytes, hex_id: str) -> None:
        path = self._dirs["blobs/sha256"] / hex_of(digest)
        if not path.exists():
            self._write_atomic(path, data, hex_id)

    def _write_atomic(self, path: Path, data: bytes, hex_id: str) -> None:
        # Named for the image whose lock we hold, so start-up cleanup leaves it alone.
        tmp = self._dirs["tmp"] / f"{hex_id}.{secrets.token_hex(6)}.part"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _delete(self, hex_id: str) -> None:
        """Delete image `hex_id`: metadata first, so it is never seen half-deleted."""
        record = self._read_record(hex_id)
        self._record_path(hex_id).unlink(missing_ok=True)
        self._discard(self._dirs["rootfs"] / hex_id, hex_id)
        for digest in record.blobs if record is not None else []:
            with suppress(ImageError, FileNotFoundError):
                (self._dirs["blobs/sha256"] / hex_of(digest)).unlink()

    def _discard(self, path: Path, hex_id: str) -> None:
        """Remove a directory tree, renaming it into tmp/ first so it vanishes at once."""
        if not path.exists():
            return
        if path.parent != self._dirs["tmp"]:
            trash = self._dirs["tmp"] / f"{hex_id}.{secrets.token_hex(6)}.removing"
            os.rename(path, trash)
            path = trash
        rmtree(path)

    # -- lookup ----------------------------------------------------------------------------

    def _resolve(self, ref: str) -> tuple[str, str | None]:
        """The image id `ref` means, and the name it was found by (None: by id)."""
        names = read_names(self._names_path)
        text = ref.strip()
        if not text.startswith("sha256:"):
            with suppress(ImageError):
                name = normalize_name(text)
                if name in names:
                    return names[name], name
        prefix = text.removeprefix("sha256:")
        if is_id_prefix(prefix):
            found = [h for h in self._complete_ids() if h.startswith(prefix)]
            if len(found) == 1:
                return f"sha256:{found[0]}", None
            if len(found) > 1:
                raise ImageError(
                    f"image id prefix {ref!r} is ambiguous: it matches {len(found)} images"
                )
        known = sorted(names)
        listing = (
            f" Known names: {', '.join(known[:10])}{' …' if len(known) > 10 else ''}."
            if known
            else ""
        )
        raise ImageNotFound(
            f"no image {ref!r} in the image store at {self.root}.{listing} Import it first: "
            "`docker save IMAGE -o image.tar` (or an OCI archive, or a rootfs tarball), then "
            "ImageStore.import_archive(path, name=...); or ImageStore.import_oci_layout(dir)."
        )

    def _get(self, ref: str) -> Image:
        image_id, _ = self._resolve(ref)
        return self._load_image(image_id)

    def _load_image(self, image_id: str, names: dict[str, str] | None = None) -> Image:
        hex_id = hex_of(image_id)
        record = self._read_record(hex_id)
        if record is None:
            raise ImageNotFound(f"image {image_id} is no longer in the image store at {self.root}")
        if names is None:
            names = read_names(self._names_path)
        return Image(
            id=record.id,
            names=sorted(n for n, i in names.items() if i == record.id),
            rootfs=self._dirs["rootfs"] / hex_id,
            config=record.config,
            size=record.size,
        )

    def _list(self) -> builtins.list[Image]:
        names = read_names(self._names_path)
        images = []
        for hex_id in self._complete_ids():
            with suppress(ImageNotFound):
                images.append(self._load_image(f"sha256:{hex_id}", names))
        return sorted(images, key=lambda i: (not i.names, i.names, i.id))

    def _complete_ids(self) -> builtins.list[str]:
        return [
            p.name.removesuffix(".json")
            for p in self._dirs["images"].iterdir()
            if p.name.endswith(".json") and (self._dirs["rootfs"] / p.stem).is_dir()
        ]

    def _complete(self, hex_id: str) -> bool:
        return self._read_record(hex_id) is not None and (self._dirs["rootfs"] / hex_id).is_dir()

    def _record_path(self, hex_id: str) -> Path:
        return self._dirs["images"] / f"{hex_id}.json"

    def _read_record(self, hex_id: str) -> _Record | None:
        try:
            return _Record.model_validate_json(self._record_path(hex_id).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as exc:
            raise ImageError(
                f"image metadata {self._record_path(hex_id)} is unreadable: {exc}"
            ) from exc

    # -- locking, names, start-up ----------------------------------------------------------

    def _lock(self, key: str) -> AbstractAsyncContextManager[None]:
        # One StoreLock per lock file: tasks of this process queue on its anyio lock, so
        # a worker thread only ever waits in flock for another process.
        path = self._lock_path(key)
        lock = self._locks.get(path)
        if lock is None:
            lock = self._locks[path] = StoreLock(path)
        return lock.hold()

    def _lock_path(self, key: str) -> Path:
        # Lock files cannot be deleted safely, so images share 256 of them (by the first
        # two hex digits): a bounded set, and a rare wait between unrelated imports.
        whole = key in (NAMES_KEY, PULLS_KEY)
        return self._dirs["locks"] / f"{key if whole else key[:2]}.lock"

    async def _update_names(self, change: Callable[[dict[str, str]], None]) -> None:
        async with self._lock(NAMES_KEY):

            def update() -> None:
                names = read_names(self._names_path)
                change(names)
                write_names(self._names_path, names, self._dirs["tmp"])

            await _run(update)

    async def _start(self) -> None:
        """Once per store: remove what crashed imports and removals left behind."""
        if self._ready:
            return
        async with self._ready_lock:
            if not self._ready:
                await _run(self._clean_stale)
                self._ready = True

    def _clean_stale(self) -> None:
        # Every tmp entry starts with the key of the lock its writer holds; if we
        # can take that lock, the writer is gone.
        stale: dict[str, list[Path]] = {}
        for entry in self._dirs["tmp"].iterdir():
            stale.setdefault(entry.name.split(".")[0], []).append(entry)
        for hex_id in os.listdir(self._dirs["rootfs"]):
            if not self._record_path(hex_id).exists():
                stale.setdefault(hex_id, []).append(self._dirs["rootfs"] / hex_id)
        for key, entries in stale.items():
            if not (key in (NAMES_KEY, PULLS_KEY) or is_id_prefix(key)):
                continue
            fd = try_lock_file(self._lock_path(key))
            if fd is None:
                continue
            try:
                for entry in entries:
                    logger.info("removing stale %s", entry)
                    if entry.is_dir() and not entry.is_symlink():
                        rmtree(entry)
                    else:
                        entry.unlink(missing_ok=True)
            finally:
                os.close(fd)
