"""The local, content-addressed image store.

(About 900 lines, one store: its writes, reads, removals and locks keep one
on-disk layout consistent; the layer store, merging, overlay stacking, builds and
formats are their own modules.)

On disk, under ``root``::

    blobs/sha256/<hex>     verified manifests and configs
    layers/<chain>/        one unpacked layer, in overlayfs' form (`sandman.images.layerstore`)
    layers/<chain>.json    its metadata, written last: present means complete
    digests/<hex>          a layer blob's digest (as a registry stores it) → its diff id
    aliases/<hex>          a pushed layer's chain id → the stored layer it was made from
    rootfs/<hex>/          image <hex> merged into one directory, of hard links to its
                           layers' files (images of several layers only); or, for images
                           stored before layers were, their flattened copy
    images/<hex>.json      its metadata; written last, so its presence means "complete"
    names.json             name → image id, replaced atomically
    locks/<xx>.lock        flock files: images by the first two hex digits of their id;
                           layer-<xx>.lock for layers; names.lock for the table;
                           pulls.lock, held shared by every pull; layers.lock, held shared
                           while an image is installed and exclusively to delete layers
    tmp/                   unpacks, pulls, pushes and builds (``pulls.<random>/``) in
                           progress; stale entries go at the next start
    buildah/               buildah's storage, its layer cache for `ImageStore.build`
                           (``build.lock`` held while a build uses it)

A layer is stored once, under its *chain id* (the digest of its diff id and those of
the layers below, as docker keys them: a layer's unpacked form depends on what it
lies on), and an image is the list of its layers. Importing or pulling an image skips
every layer already stored; a pull asks the registry for the manifest first and
downloads only the blobs of missing layers. Layer blobs are checked while they stream
and are not kept; a push (`ImageStore.push`) makes them again from the stored layers,
and records their digests and chain ids as aliases of those layers (``aliases/``), so
that the pushed image pulled back is not stored twice.
`Image.lowers` are the directories to stack as overlayfs lower layers; `Image.rootfs`
one directory with the whole tree, for callers that take one.
Layers no image refers to go with `ImageStore.prune`, or at once with the last image
that used them (`ImageStore.remove`).
"""

from __future__ import annotations

import builtins
import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import anyio
import anyio.from_thread
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, ValidationError

from sandman import _flock
from sandman.errors import ConfigError, ImageError, ImageNotFound
from sandman.images.build import (
    BUILD_MEMORY,
    BuildahStorage,
    BuildRequest,
    base_refs,
    find_buildah,
    run_buildah_build,
    storage_driver,
    unmount_under,
)
from sandman.images.digests import hex_of
from sandman.images.export import export_image
from sandman.images.formats import (
    ArchiveSource,
    Layer,
    LayoutSource,
    Plan,
    plan_archive,
    plan_layout,
    remote_manifest,
)
from sandman.images.image import Image, ImageConfig
from sandman.images.layers import disk_usage, rmtree
from sandman.images.layerstore import (
    LayerStore,
    PruneReport,
    chain_id,
    discard,
    write_atomic,
)
from sandman.images.locks import StoreLock, try_lock_file
from sandman.images.merged import flatten
from sandman.images.names import is_id_prefix, normalize_name, read_names, write_names
from sandman.images.overlay import lowerdir_fits
from sandman.images.registry import (
    LAYOUT_DIR,
    PROBE_TIMEOUT,
    PUSH_DIR,
    PUSH_TAG,
    Credentials,
    fetch_manifest,
    parse_reference,
    probe_registry,
    push_with_skopeo,
    run_skopeo,
)

__all__ = ["ImageStore", "PruneReport"]

logger = logging.getLogger(__name__)

NAMES_KEY = "names"
PULLS_KEY = "pulls"
LAYERS_KEY = "layers"
BUILD_KEY = "build"
LAYER_LOCK_PREFIX = "layer-"
BUILDAH_DIR = "buildah"

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
    chain: list[str] | None = None
    """The chain ids of its stored layers, bottom first; None: stored before layers were
    (then ``rootfs/<hex>`` is the whole, flattened image)."""


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
        self._layers = LayerStore(self.root, self._dirs["tmp"])
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
        auth: Credentials | None = None,
        tls_verify: bool = True,
        timeout: float = 600,
    ) -> Image:
        """Pull `reference` (``docker.io/library/python:3.11``, ``localhost:5000/x:1``) and import it.

        Needs skopeo (``apt-get install -y skopeo``). The image is named as
        `reference` says (``python:3.11``). The registry is asked for the
        manifest first: an image already in the store is then only named, with
        no blob downloaded, and of a new image only the layers not yet stored
        are downloaded. `auth` is a `RegistryAuth` (user and password) or the path of
        a containers-auth.json file. `tls_verify=False` allows plain HTTP and unverified
        certificates (a registry on 127.0.0.1). `timeout` bounds the download,
        not the unpacking. Raises `ImageError`: at once when the registry is
        unreachable, `ImageNotFound` for an unknown repository or tag. The
        download's scratch directory and the credentials file are always removed.
        """
        await self._start()
        parsed = parse_reference(reference)
        async with self._scratch() as scratch:
            manifest = await fetch_manifest(
                parsed, scratch, auth=auth, tls_verify=tls_verify, timeout=timeout
            )
            remote = remote_manifest(manifest)
            if remote is not None:
                config_hex = hex_of(remote.config)
                if await _run(self._complete, config_hex):
                    logger.info("%s is image %s, already stored", parsed.name, remote.config)
                    name = parsed.name

                    def add(table: dict[str, str]) -> None:
                        table[name] = remote.config

                    async with self._lock(config_hex):
                        await self._update_names(add)
                        return await _run(self._load_image, remote.config)
            # Held shared until the import is done: `prune` must not take a layer whose
            # blob skopeo was told it need not download.
            fd = await _flock.lock(self._lock_path(LAYERS_KEY), fcntl.LOCK_SH)
            try:
                if remote is not None:
                    blobs = scratch / LAYOUT_DIR / "blobs" / "sha256"
                    skipped = await _run(self._layers.placeholders, blobs, remote.layers)
                    logger.info(
                        "pulling %s: %d of %d layers already stored",
                        parsed.name,
                        skipped,
                        len(remote.layers),
                    )
                layout = await run_skopeo(
                    parsed, scratch, auth=auth, tls_verify=tls_verify, timeout=timeout
                )
                return await self.import_oci_layout(layout, name=parsed.name)
            finally:
                os.close(fd)

    async def push(
        self,
        name: str,
        reference: str,
        *,
        auth: Credentials | None = None,
        tls_verify: bool = True,
        timeout: float = 3600,
    ) -> str:
        """Push the image `name` (a name or id in this store) to a registry as `reference`
        (``registry.example/team/task:1``); the digest of the pushed manifest, by which
        the registry knows it (``registry.example/team/task@<digest>``).

        Needs skopeo. The store keeps layers unpacked, not their blobs, so each layer is
        exported as a reproducible tar, gzipped (`sandman.images.export`), into an OCI
        layout with the image's config (every field kept, the new diff ids in it), which
        skopeo uploads. skopeo asks the registry for each blob by digest first: a layer
        pushed before (to any repository of that registry) is not uploaded again, since
        a stored layer always exports to the same bytes. The pushed image's digest and
        diff ids are not those it was pulled with (docs/images.md says what that means).
        `auth` and `tls_verify` are as for `pull`; `timeout` bounds the whole push.
        Raises `ImageNotFound` for an image not in the store, `ImageError` at once when
        the registry is unreachable (before anything is exported), and with the
        registry's reason (never a password) when it refuses. The scratch directory
        and the credentials file are always removed.
        """
        await self._start()
        target = parse_reference(reference)
        if target.tag is None:
            raise ImageError(
                f"cannot push to {reference}: a push names a tag (REPOSITORY:TAG); the "
                "registry gives the digest"
            )
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {timeout}")
        image = await self.get(name)
        started = time.monotonic()
        uploading = False
        async with self._scratch() as scratch:
            with anyio.move_on_after(timeout) as deadline:
                await probe_registry(
                    target,
                    tls_verify=tls_verify,
                    timeout=min(PROBE_TIMEOUT, timeout),
                    action="push",
                )
                # Shared, as by a pull: `prune` cannot take the layers being exported.
                fd = await _flock.lock(self._lock_path(LAYERS_KEY), fcntl.LOCK_SH)
                try:
                    digest, size = await _run(self._export, image, scratch / PUSH_DIR)
                finally:
                    os.close(fd)
                logger.info(
                    "exported %s for a push: %d bytes in %.1fs",
                    image.id,
                    size,
                    time.monotonic() - started,
                )
                uploading = True
                await push_with_skopeo(
                    target, scratch, auth=auth, tls_verify=tls_verify, timeout=timeout
                )
        if deadline.cancelled_caught:
            where = "; skopeo was killed" if uploading else " while its layers were exported"
            raise ImageError(f"pushing {name} to {target.name} timed out after {timeout:g}s{where}")
        logger.info("pushed %s to %s as %s", image.id, target.name, digest)
        return digest

    def _export(self, image: Image, layout: Path) -> tuple[str, int]:
        """Write `image` as an OCI layout at `layout` for a push (blocking, for a worker
        thread that may be cancelled); the manifest's digest and the layers' bytes."""
        hex_id = hex_of(image.id)
        record = self._read_record(hex_id)
        if record is None:
            raise ImageNotFound(f"image {image.id} is no longer in the image store")
        if record.chain is not None:
            trees = [self._layers.path(c) for c in record.chain]
        else:
            trees = [image.rootfs]  # stored before layers were: one flattened tree
        config = self._dirs["blobs/sha256"] / hex_id  # absent for a rootfs tarball's image
        stored = config.read_bytes() if config.is_file() else None
        digest, size, blobs = export_image(
            image, trees, stored, layout, tag=PUSH_TAG, check=anyio.from_thread.check_cancelled
        )
        # The pushed image, pulled back, is found stored: its blobs' digests name their
        # diff ids, and the chain ids of those stand for the stored layers (aliases).
        chain = record.chain or []  # none for an image stored before layers were
        for index, (layer_id, blob) in enumerate(zip(chain, blobs, strict=False)):
            parent = chain[index - 1] if index else None
            self._layers.add_alias(
                chain_id(parent, blob.diff_id), blob.diff_id, layer_id, LAYERS_KEY
            )
            self._layers.index_digest(blob.digest, blob.diff_id, LAYERS_KEY)
        return digest, size

    async def build(
        self,
        dockerfile: Path,
        context: Path,
        *,
        name: str | None = None,
        build_args: Mapping[str, str] | None = None,
        network: bool = False,
        cache: bool = True,
        timeout: float = 3600,
        memory: int = BUILD_MEMORY,
    ) -> Image:
        """Build `dockerfile` over the directory `context` with buildah, and store the result.

        Needs buildah (``apt-get install -y buildah``). Each ``FROM`` names an image
        of this store (``FROM busybox``; ``scratch`` and earlier stages too): nothing
        is pulled. Each ``RUN`` step is walled like a sandbox (`sandman.images.build.isolation`:
        a user namespace of its own, the sandboxes' capabilities, seccomp, at most
        `memory` bytes) and gets no network unless `network` (then the host's).
        The result is named `name` and shares its base image's stored layers: only
        the build's own layers are added. With `cache`, buildah keeps its storage in
        ``buildah/`` under the store as a layer cache (an unchanged rebuild reruns no
        step) and builds take turns; without it each build starts from nothing in a
        scratch directory. Raises `ImageNotFound` for a ``FROM`` image not in the
        store, `ImageError` with buildah's message when the build fails; buildah's
        containers and mounts are gone either way, and nothing is stored.
        """
        await self._start()
        buildah = find_buildah()
        wanted = normalize_name(name) if name is not None else None
        dockerfile = Path(await anyio.Path(dockerfile).absolute())
        context = Path(await anyio.Path(context).absolute())
        if not await anyio.Path(context).is_dir():
            raise ImageError(f"the build context {context} is not a directory")
        try:
            text = await anyio.Path(dockerfile).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ImageError(f"cannot read the Dockerfile {dockerfile}: {exc}") from exc
        bases: dict[str, tuple[Image, builtins.list[dict[str, Any]]]] = {}
        for ref in base_refs(text):
            try:
                image = await self.get(ref)
            except ImageNotFound as exc:
                raise ImageNotFound(
                    f"{dockerfile}: FROM {ref}: no such image in the image store; pull or "
                    f"import it first (`sandman images pull {ref}`, `sandman images import`)"
                ) from exc
            bases[ref] = (image, await _run(self._layer_descriptors, image))
        request = BuildRequest(
            dockerfile=text,
            context=context,
            bases=bases,
            build_args=build_args or {},
            network=network,
            cache=cache,
            timeout=timeout,
            memory=memory,
        )
        # Held shared until the import is done, as by a pull: the bases' layers, which
        # the result refers to but does not carry, cannot be pruned meanwhile.
        layers_fd = await _flock.lock(self._lock_path(LAYERS_KEY), fcntl.LOCK_SH)
        try:
            async with self._scratch() as scratch:
                root = self.root / BUILDAH_DIR if cache else scratch / BUILDAH_DIR
                started = time.monotonic()
                # A kept storage serves one build at a time: each removes all containers.
                lock = await _flock.lock(self._lock_path(BUILD_KEY)) if cache else None
                try:
                    driver = await _run(storage_driver, self.root)
                    storage = BuildahStorage(root, buildah, driver)
                    final = await run_buildah_build(storage, request, scratch)
                finally:
                    if lock is not None:
                        os.close(lock)
                logger.info("buildah built %s in %.1fs", dockerfile, time.monotonic() - started)
                return await self.import_oci_layout(final, name=wanted)
        finally:
            os.close(layers_fd)

    async def drop_build_cache(self) -> int:
        """Delete buildah's storage (`build`'s layer cache and its copies of base
        images), waiting for a running build; the bytes freed. The next build starts cold."""
        await self._start()
        lock = await _flock.lock(self._lock_path(BUILD_KEY))
        try:
            path = self.root / BUILDAH_DIR
            if not await anyio.Path(path).exists():
                return 0
            if (buildah := shutil.which("buildah")) is not None:
                await BuildahStorage(path, buildah).clean()

            def drop() -> int:
                size = disk_usage(path)
                unmount_under(path)
                rmtree(path)
                return size

            freed = await _run(drop)
            logger.info("dropped the build cache (%d bytes)", freed)
            return freed
        finally:
            os.close(lock)

    def _layer_descriptors(self, image: Image) -> builtins.list[dict[str, Any]]:
        """The layer descriptors of `image`'s stored manifest, bottom first; made up from
        its diff ids (an uncompressed layer's digest) when no manifest was kept."""
        record = self._read_record(hex_of(image.id))
        for digest in record.blobs if record is not None else []:
            with suppress(OSError, ValueError):
                document = json.loads((self._dirs["blobs/sha256"] / hex_of(digest)).read_bytes())
                layers = document.get("layers") if isinstance(document, dict) else None
                if isinstance(layers, builtins.list) and len(layers) == len(image.layers):
                    return [dict(layer) for layer in layers]
        return [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": diff_id}
            for diff_id in image.layers
        ]

    async def prune(self) -> PruneReport:
        """Remove every stored layer no image refers to; what went, and the bytes freed.

        The layers of every image in the store are kept, so the layers of a live
        sandbox's image are (its image cannot be removed while the ``in_use``
        hook reports it in use). Imports wait while this runs, and this waits
        for imports in progress.
        """
        await self._start()
        fd = await _flock.lock(self._lock_path(LAYERS_KEY))
        try:
            return await _run(self._prune)
        finally:
            os.close(fd)

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
            chain: builtins.list[str] = []
            if deleted:
                chain = await _run(self._delete, hex_id)
                logger.info("removed image %s", image_id)
        if chain:
            # Its layers no other image shares go with it.
            await self._collect(set(chain))

    async def _collect(self, layers: set[str]) -> None:
        """Delete those of `layers` no image refers to, unless an import or a pull is
        running (it may be about to use them, and waiting for it could deadlock a pull
        of this process): `prune` then takes them later."""
        fd = await _run(try_lock_file, self._lock_path(LAYERS_KEY))
        if fd is None:
            logger.info("%d unreferenced layers left for `sandman images prune`", len(layers))
            return
        try:
            await _run(self._prune, layers)
        finally:
            os.close(fd)

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
                await self._store(plan, hex_id)
            if plan.names:
                names = plan.names

                def add(table: dict[str, str]) -> None:
                    table.update(dict.fromkeys(names, plan.id))

                await self._update_names(add)
            return await _run(self._load_image, plan.id)

    async def _store(self, plan: Plan, hex_id: str) -> None:
        """Store the layers of `plan` not stored yet, then the image (its id's lock held)."""
        started = time.monotonic()
        logger.debug("unpacking image %s (%s, %d layers)", plan.id, plan.kind, len(plan.layers))
        # Shared: `prune` (exclusive) never sees a layer we are about to refer to.
        fd = await _flock.lock(self._lock_path(LAYERS_KEY), fcntl.LOCK_SH)
        chain: builtins.list[str] = []
        diff_ids: builtins.list[str] = []
        added: set[str] = set()
        try:
            for layer in plan.layers:
                layer_id, diff_id, new = await self._store_layer(layer, chain, hex_id)
                chain.append(layer_id)
                diff_ids.append(diff_id)
                if new:
                    added.add(layer_id)
            size = await _run(self._finish, plan, hex_id, chain, diff_ids)
        except BaseException:
            os.close(fd)
            if added:
                # A failed import leaves nothing: the layers it stored go, unless another
                # image took them meanwhile.
                with anyio.CancelScope(shield=True):
                    await self._collect(added)
            raise
        os.close(fd)
        reused = len(chain) - len(added)
        logger.info(
            "stored image %s (%d bytes; %d of %d layers were already stored) in %.1fs",
            plan.id,
            size,
            reused,
            len(plan.layers),
            time.monotonic() - started,
        )

    async def _store_layer(
        self, layer: Layer, chain: builtins.list[str], hex_id: str
    ) -> tuple[str, str, bool]:
        """Store `layer` over `chain` unless it is; its chain id, its diff id, and whether
        it was new."""
        parent = chain[-1] if chain else None
        diff_id = layer.diff_id
        if diff_id is None and layer.digest is not None:
            diff_id = await _run(self._layers.diff_of, layer.digest)
        if diff_id is not None:
            layer_id = chain_id(parent, diff_id)
            async with self._lock(LAYER_LOCK_PREFIX + hex_of(layer_id)[:2]):
                # A layer this store pushed comes back under another chain id: its alias.
                stored = await _run(self._layers.resolve, layer_id)
                if await _run(self._layers.complete, stored):
                    if layer.digest is not None:
                        await _run(self._layers.index_digest, layer.digest, diff_id, hex_id)
                    if stored != layer_id:
                        diff_id = (await _run(self._layers.read, stored)).diff_id
                    return stored, diff_id, False
                work, _ = await _run(self._layers.unpack, layer, chain, hex_id)
                await _run(self._layers.commit, work, layer_id, diff_id, layer.digest, hex_id)
                return layer_id, diff_id, True
        # Its diff id is known only once it is unpacked (a rootfs tarball, say).
        work, found = await _run(self._layers.unpack, layer, chain, hex_id)
        layer_id = chain_id(parent, found)
        async with self._lock(LAYER_LOCK_PREFIX + hex_of(layer_id)[:2]):
            new = await _run(self._layers.commit, work, layer_id, found, layer.digest, hex_id)
        return layer_id, found, new

    def _finish(
        self,
        plan: Plan,
        hex_id: str,
        chain: builtins.list[str],
        diff_ids: builtins.list[str],
    ) -> int:
        """Write the image over its stored layers: merged rootfs (several layers), metadata."""
        lowers = [self._layers.path(c) for c in reversed(chain)]
        try:
            if len(chain) == 1:
                size = self._layers.read(chain[0]).size
            else:
                work = self._dirs["tmp"] / f"{hex_id}.{secrets.token_hex(6)}"
                final = self._dirs["rootfs"] / hex_id
                try:
                    flatten(lowers, work)
                    size = disk_usage(work)
                    self._discard(final, hex_id)
                    os.rename(work, final)
                except BaseException:
                    self._discard(work, hex_id)
                    raise
            for digest, data in plan.blobs.items():
                self._write_blob(digest, data, hex_id)
            record = _Record(
                id=plan.id,
                kind=plan.kind,
                config=plan.config,
                size=size,
                created=datetime.now(UTC),
                blobs=sorted(plan.blobs),
                layers=diff_ids,
                chain=chain,
            )
            data = record.model_dump_json(indent=2).encode()
            self._write_atomic(self._record_path(hex_id), data, hex_id)
        except BaseException:
            self._delete(hex_id)
            raise
        return size

    def _prune(self, only: set[str] | None = None) -> PruneReport:
        """Delete the layers (of `only`, or all) no image refers to; `LAYERS_KEY` held."""
        return self._layers.remove_unused(self._references(), only, LAYERS_KEY)

    def _references(self) -> set[str]:
        """The chain ids every image in the store refers to."""
        used: set[str] = set()
        for path in self._dirs["images"].iterdir():
            if path.name.endswith(".json") and is_id_prefix(path.stem):
                record = self._read_record(path.stem)
                if record is not None:
                    used.update(record.chain or [])
        return used

    def _write_blob(self, digest: str, data: bytes, hex_id: str) -> None:
        path = self._dirs["blobs/sha256"] / hex_of(digest)
        if not path.exists():
            self._write_atomic(path, data, hex_id)

    def _write_atomic(self, path: Path, data: bytes, hex_id: str) -> None:
        # Named for the image whose lock we hold, so start-up cleanup leaves it alone.
        write_atomic(path, data, self._dirs["tmp"], hex_id)

    def _delete(self, hex_id: str) -> builtins.list[str]:
        """Delete image `hex_id`: metadata first, so it is never seen half-deleted. Its
        layers stay (others may share them); their chain ids are returned."""
        record = self._read_record(hex_id)
        self._record_path(hex_id).unlink(missing_ok=True)
        self._discard(self._dirs["rootfs"] / hex_id, hex_id)
        for digest in record.blobs if record is not None else []:
            with suppress(ImageError, FileNotFoundError):
                (self._dirs["blobs/sha256"] / hex_of(digest)).unlink()
        return list(record.chain or []) if record is not None else []

    def _discard(self, path: Path, hex_id: str) -> None:
        discard(path, self._dirs["tmp"], hex_id)

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
        # No store path (a service's callers have no business with it) and no API
        # name: the CLI's hint says which command, the SDK's docs which method.
        raise ImageNotFound(
            f"no image {ref!r} in the image store.{listing} Pull, build or import it first."
        )

    def _get(self, ref: str) -> Image:
        image_id, _ = self._resolve(ref)
        return self._load_image(image_id)

    def _load_image(self, image_id: str, names: dict[str, str] | None = None) -> Image:
        hex_id = hex_of(image_id)
        record = self._read_record(hex_id)
        if record is None:
            raise ImageNotFound(f"image {image_id} is no longer in the image store")
        if names is None:
            names = read_names(self._names_path)
        rootfs = self._dirs["rootfs"] / hex_id
        lowers = [rootfs]
        if record.chain is not None:
            layers = [self._layers.path(c) for c in reversed(record.chain)]
            if len(layers) == 1:
                rootfs = layers[0]
            # Past the kernel's limits the merged rootfs is the one lower layer.
            lowers = layers if lowerdir_fits(layers) else [rootfs]
        return Image(
            id=record.id,
            names=sorted(n for n, i in names.items() if i == record.id),
            rootfs=rootfs,
            lowers=lowers,
            layers=record.layers if record.chain is not None else [],
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
        # The metadata is written last and deleted first: its presence means complete.
        return [
            p.name.removesuffix(".json")
            for p in self._dirs["images"].iterdir()
            if p.name.endswith(".json")
        ]

    def _complete(self, hex_id: str) -> bool:
        record = self._read_record(hex_id)
        if record is None:
            return False
        merged = record.chain is None or len(record.chain) != 1
        if merged and not (self._dirs["rootfs"] / hex_id).is_dir():
            return False
        return all(self._layers.complete(c) for c in record.chain or [])

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
        whole = key in (NAMES_KEY, PULLS_KEY, LAYERS_KEY, BUILD_KEY) or key.startswith(
            LAYER_LOCK_PREFIX
        )
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
        for entry_name in os.listdir(self._layers.layers):
            layer = self._layers.layers / entry_name
            if is_id_prefix(entry_name) and not layer.with_name(f"{entry_name}.json").exists():
                stale.setdefault(LAYER_LOCK_PREFIX + entry_name[:2], []).append(layer)
        for key, entries in stale.items():
            if not (
                key in (NAMES_KEY, PULLS_KEY, LAYERS_KEY)
                or key.startswith(LAYER_LOCK_PREFIX)
                or is_id_prefix(key)
            ):
                continue
            fd = try_lock_file(self._lock_path(key))
            if fd is None:
                continue
            try:
                for entry in entries:
                    logger.info("removing stale %s", entry)
                    if entry.is_dir() and not entry.is_symlink():
                        unmount_under(entry)  # a killed build's buildah mounts
                        rmtree(entry)
                    else:
                        entry.unlink(missing_ok=True)
            finally:
                os.close(fd)
