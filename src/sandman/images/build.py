"""Building images from a Dockerfile with buildah, into the layer store.

buildah (Debian 12: 1.28, ``apt-get install -y buildah``) does the building; this module
only feeds it and takes its result back:

1. every ``FROM`` that names an image of our store is exported once as an OCI layout of
   one layer (a reproducible tar of the image's merged rootfs), pulled into buildah's
   storage as ``localhost/sandman-base:<hex id>``, and the ``FROM`` rewritten to that
   name: nothing comes from a registry (``--pull-never``);
2. ``buildah build --layers --isolation oci --network none`` runs in buildah's own
   storage (overlay driver): ``<store>/buildah/`` when cached, kept between builds as
   buildah's layer cache (and its copy of each base), else a scratch directory removed
   afterwards;
3. ``buildah push --disable-compression`` writes the result as an OCI layout (the base's
   blob is an empty stand-in, so it is not copied out), and its bottom layer, the
   exported base (buildah keeps a base layer's bytes exactly), is swapped for the base
   image's own stored layers (`assemble`): the store then finds them stored by chain id
   and keeps only the build's new layers.

Whatever happens, buildah's containers are removed and whatever it left mounted under
its storage is unmounted before a build returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread

from sandman.errors import ConfigError, ImageError
from sandman.images.digests import hex_of
from sandman.images.export import export_layer, image_config, write_layout
from sandman.images.image import Image

__all__ = [
    "BUILDAH_HINT",
    "Base",
    "BuildRequest",
    "BuildahStorage",
    "assemble",
    "base_refs",
    "export_base",
    "filesystem_type",
    "find_buildah",
    "isolation",
    "mounts_under",
    "rewrite_from",
    "run_buildah_build",
    "storage_driver",
    "unmount_under",
]

logger = logging.getLogger(__name__)

BUILDAH_HINT = "apt-get install -y buildah (Debian/Ubuntu), or run scripts/setup"
BUILD_TAG = "localhost/sandman-build:latest"
"""The name of a build's result inside buildah's storage (each build retags it)."""
BASE_NAME = "localhost/sandman-base"
"""A store image in buildah's storage is ``BASE_NAME:<hex of its id>``."""
BASE_TAG = "base"
OUTPUT_TAG = "build"
TERM_GRACE = 10.0
"""Seconds a cancelled buildah gets to stop its container after SIGTERM."""
ERROR_LINES = 25
"""How many of buildah's last output lines an `ImageError` quotes."""

# A build runs model-written Dockerfiles too, so each RUN step is walled as far as buildah
# 1.28 allows. Not in a user namespace: with --userns-uid-map it writes COPY and WORKDIR
# files as the host's root over idmapped base layers (a step then cannot write them),
# and, told to shift the base instead, drops the whiteouts of what a step deletes.
BUILD_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
]  # fmt: skip
"""A RUN step's capabilities, the sandboxes' set (Docker's default without MKNOD and
NET_RAW); every other one is dropped."""
BUILD_MEMORY = 4 * 2**30
"""Bytes of memory (and swap) a RUN step may use unless the build says otherwise."""

_FROM = re.compile(
    r"^(?P<head>\s*FROM\s+(?:--\S+\s+)*)(?P<ref>\S+)(?P<tail>(?:\s+AS\s+(?P<stage>\S+))?\s*)$",
    re.IGNORECASE,
)


def find_buildah() -> str:
    """The path of the buildah binary; `ImageError` with the install command when missing."""
    found = shutil.which("buildah")
    if found is None:
        raise ImageError(f"building images needs buildah, which is not on PATH: {BUILDAH_HINT}")
    return found


# -- the Dockerfile ------------------------------------------------------------------------


def base_refs(dockerfile: str) -> list[str]:
    """The images the ``FROM`` lines of `dockerfile` name, in order, once each: not
    ``scratch``, not an earlier stage, not a reference with a ``$`` (an ``ARG``)."""
    refs: list[str] = []
    stages: set[str] = set()
    for line in dockerfile.splitlines():
        match = _FROM.match(line)
        if match is None:
            continue
        ref = match["ref"]
        named = ref.lower() != "scratch" and ref.lower() not in stages and "$" not in ref
        if named and ref not in refs:
            refs.append(ref)
        if match["stage"]:
            stages.add(match["stage"].lower())
    return refs


def rewrite_from(dockerfile: str, replace: Mapping[str, str]) -> str:
    """`dockerfile` with each ``FROM`` reference in `replace` replaced (stage names, flags
    and every other line kept as they are)."""
    lines = []
    stages: set[str] = set()
    for line in dockerfile.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        match = _FROM.match(body)
        if match is not None:
            ref = match["ref"]
            if ref.lower() not in stages and ref in replace:
                line = f"{match['head']}{replace[ref]}{match['tail']}{line[len(body) :]}"
            if match["stage"]:
                stages.add(match["stage"].lower())
        lines.append(line)
    return "".join(lines)


# -- the base, out -------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """A store image as buildah has it: one layer, a tar of the image's merged rootfs."""

    image: Image
    reference: str
    """What its ``FROM`` becomes: ``oci:<layout>:base`` or its name in buildah's storage."""
    diff_id: str
    """The diff id of the exported layer: how its place in buildah's result is found."""
    descriptors: list[dict[str, Any]]
    """The layer descriptors of the stored image, bottom first (one per `Image.layers`)."""


async def export_base(image: Image, descriptors: list[dict[str, Any]], path: Path) -> Base:
    """Write `image` as an OCI layout at `path`: one uncompressed layer, its merged rootfs
    as `sandman.images.export.write_tar` writes it (sorted, numeric owners, the files'
    own mtimes: the same bytes every time), so that an unchanged image exports to the
    same digest and buildah's cache keeps matching."""

    def export() -> str:
        blobs = path / "blobs" / "sha256"
        layer = export_layer(
            image.rootfs, blobs, compress=False, check=anyio.from_thread.check_cancelled
        )
        config = image_config(image, None, [layer.diff_id])
        write_layout(path, config, [layer.descriptor()], tag=BASE_TAG)
        return layer.diff_id

    try:
        diff_id = await anyio.to_thread.run_sync(export)
    except OSError as exc:
        raise ImageError(f"exporting image {image.short_id} for the build failed: {exc}") from exc
    return Base(image, f"oci:{path}:{BASE_TAG}", diff_id, descriptors)


# -- the result, in ------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ImageError(f"buildah's output {path} is unreadable: {exc}") from exc


def assemble(output: Path, final: Path, bases: Sequence[Base]) -> Base | None:
    """Write at `final` the OCI layout to import: buildah's result (the layout at
    `output`) with its bottom layer, when it is one of `bases` exported, replaced by
    that base image's stored layers. Those get empty stand-ins (the store skips stored
    layers by diff id without reading them, as for a pull). The base used, if any."""
    index = _read_json(output / "index.json")
    blobs = output / "blobs" / "sha256"
    manifest = _read_json(blobs / hex_of(index["manifests"][0]["digest"]))
    config = _read_json(blobs / hex_of(manifest["config"]["digest"]))
    diff_ids: list[str] = config["rootfs"]["diff_ids"]
    layers: list[dict[str, Any]] = manifest["layers"]
    base = next((b for b in bases if diff_ids and diff_ids[0] == b.diff_id), None)
    if base is not None and base.image.layers:
        stored = base.image.layers
        config["rootfs"]["diff_ids"] = [*stored, *diff_ids[1:]]
        manifest["layers"] = [*base.descriptors, *layers[1:]]
        history: list[dict[str, Any]] = config.get("history") or []
        first = next((i for i, h in enumerate(history) if not h.get("empty_layer")), None)
        if first is not None:
            ours = [
                {"created_by": f"sandman image {base.image.id}", "comment": f"layer {i + 1}"}
                for i in range(len(stored))
            ]
            config["history"] = [*history[:first], *ours, *history[first + 1 :]]
    else:
        base = None
    new_blobs = final / "blobs" / "sha256"
    new_blobs.mkdir(parents=True)
    for layer in manifest["layers"]:
        target = new_blobs / hex_of(layer["digest"])
        source = blobs / hex_of(layer["digest"])
        if target.exists():
            continue
        if base is not None and layer in base.descriptors:
            with open(target, "wb") as stand_in:
                stand_in.truncate(layer.get("size") or 0)
        else:
            os.link(source, target)
    write_layout(final, json.dumps(config).encode(), manifest["layers"])
    return base


# -- buildah ---------------------------------------------------------------------------------


async def run_command(command: list[str], cwd: Path) -> tuple[int, str]:
    """Run `command`; its exit status and its output (stdout and stderr together).
    Killed and reaped if we are cancelled."""
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Its own process group: a step's processes (runc's children) go with it.
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise ImageError(f"cannot run {command[0]} ({exc}): {BUILDAH_HINT}") from exc
    try:
        out, _ = await process.communicate()
        returncode = await process.wait()
    finally:
        if process.returncode is None:
            # SIGTERM first: buildah then kills the step's container (SIGKILL would leave
            # it running); its whole process group is killed if it does not end in time.
            with anyio.CancelScope(shield=True):
                process.terminate()
                with anyio.move_on_after(TERM_GRACE):
                    await process.wait()
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    await process.wait()
    return returncode, out.decode(errors="replace")


def _tail(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return "\n".join(lines[-ERROR_LINES:])


def mounts_under(root: Path) -> list[Path]:
    """The mount points at or below `root` (from /proc/self/mountinfo), deepest first."""
    found = []
    prefix = str(root).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(root) or point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on (``ext4``, ``overlay``...), from
    /proc/self/mountinfo: the mount with the longest mount point above it."""
    best, found = -1, ""
    resolved = str(path.resolve())
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= best:
                best, found = len(point), fields[fields.index("-") + 1]
    return found


def storage_driver(path: Path) -> str:
    """buildah's storage driver for a storage at `path`: overlay, unless `path` is on
    overlayfs itself (a container's root), which overlay cannot stack on: then vfs,
    which copies a whole rootfs per step."""
    return "vfs" if filesystem_type(path) == "overlay" else "overlay"


def unmount_under(root: Path) -> None:
    """Lazily unmount everything mounted at or below `root` (blocking: for worker threads;
    what a killed build may leave in its scratch directory)."""
    for point in mounts_under(root):
        logger.info("unmounting %s, left by a build", point)
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)


@dataclass(frozen=True)
class BuildahStorage:
    """buildah's own storage: ``storage/`` (graph root) and ``run/`` (run root) in `root`."""

    root: Path
    buildah: str
    driver: str = "overlay"

    def command(self, *args: str) -> list[str]:
        return [
            self.buildah,
            f"--root={self.root / 'storage'}",
            f"--runroot={self.root / 'run'}",
            f"--storage-driver={self.driver}",
            *args,
        ]

    async def run(self, *args: str, what: str, cwd: Path | None = None) -> str:
        """Run ``buildah ARGS``; its output, or `ImageError` quoting it."""
        code, output = await run_command(self.command(*args), cwd or self.root)
        if code != 0:
            raise ImageError(f"{what} failed (exit {code}):\n{_tail(output)}")
        return output

    async def base(self, image: Image, descriptors: list[dict[str, Any]], scratch: Path) -> Base:
        """`image` in this storage as ``BASE_NAME:<hex>``: loaded from an export in
        `scratch` unless an earlier build left it (the same id, the same content)."""
        name = f"{BASE_NAME}:{hex_of(image.id)}"
        code, output = await run_command(self.command("inspect", "--type=image", name), self.root)
        if code == 0:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                diff_ids = json.loads(output)["OCIv1"]["rootfs"]["diff_ids"]
                if isinstance(diff_ids, list) and len(diff_ids) == 1:
                    return Base(image, name, str(diff_ids[0]), descriptors)
        exported = await export_base(image, descriptors, scratch)
        # buildah names what it pulls from an OCI layout after the layout's path, which
        # must then be a valid reference: so a relative one, ``base<n>``.
        source = f"oci:{scratch.name}:{BASE_TAG}"
        pulled = await self.run("pull", "--quiet", source, what="buildah pull", cwd=scratch.parent)
        await self.run("tag", pulled.split()[-1], name, what="buildah tag")
        # The name it gave goes (the image stays, as `name`).
        code, output = await run_command(
            self.command("rmi", f"localhost/{scratch.name}"), self.root
        )
        if code != 0:
            logger.warning("buildah rmi localhost/%s failed: %s", scratch.name, _tail(output))
        return Base(image, name, exported.diff_id, descriptors)

    async def clean(self) -> None:
        """Remove every buildah container (a failed step's included) and unmount what
        is mounted under `root`; errors are logged, not raised."""
        for args in (("rm", "--all"), ("umount", "--all")):
            code, output = await run_command(self.command(*args), self.root)
            if code != 0:
                logger.warning("buildah %s failed: %s", " ".join(args), _tail(output))
        for point in mounts_under(self.root):
            code, output = await run_command(["umount", "--lazy", str(point)], self.root)
            if code != 0:
                logger.warning("cannot unmount %s: %s", point, output.strip())


@dataclass(frozen=True)
class BuildRequest:
    """One build: the Dockerfile's text and where things are."""

    dockerfile: str
    context: Path
    bases: Mapping[str, tuple[Image, list[dict[str, Any]]]]
    """Each ``FROM`` reference of the store (`base_refs`): its image and layer descriptors."""
    build_args: Mapping[str, str]
    network: bool
    cache: bool
    timeout: float
    memory: int = BUILD_MEMORY


def isolation(request: BuildRequest) -> list[str]:
    """``buildah build``'s options that wall each RUN step of `request` like a sandbox, but
    for the user namespace (see above): the sandboxes' capabilities, buildah's default
    seccomp filter, no network unless asked, bounded memory. (No process limit: buildah
    1.28 has no ``--pids-limit``, and RLIMIT_NPROC would count all of the host's root.)"""
    return [
        "--isolation=oci",
        "--cap-drop=all",
        f"--cap-add={','.join(BUILD_CAPABILITIES)}",
        f"--memory={request.memory}",
        f"--memory-swap={request.memory}",
        f"--network={'host' if request.network else 'none'}",
    ]


async def run_buildah_build(storage: BuildahStorage, request: BuildRequest, scratch: Path) -> Path:
    """Build `request` in `storage` and write the OCI layout to import in `scratch`; its
    path. Each base image is loaded into `storage` (once, when the storage is kept),
    the ``FROM`` lines are pointed at it, buildah builds (each RUN step walled as
    `isolation` says) and pushes the result as a layout, and `assemble` swaps the base back
    for the store's layers. `ImageError` with buildah's own words when it fails; buildah
    is killed on timeout or cancellation; its containers and mounts go either way."""
    if request.timeout <= 0:
        raise ConfigError(f"timeout must be positive, not {request.timeout}")
    await anyio.Path(storage.root).mkdir(parents=True, exist_ok=True)
    output, final = scratch / "output", scratch / "layout"
    try:
        with anyio.move_on_after(request.timeout) as deadline:
            bases: list[Base] = []
            for i, (image, descriptors) in enumerate(request.bases.values()):
                bases.append(await storage.base(image, descriptors, scratch / f"base{i}"))
            replace = {ref: base.reference for ref, base in zip(request.bases, bases, strict=True)}
            dockerfile = scratch / "Dockerfile"
            await anyio.Path(dockerfile).write_text(rewrite_from(request.dockerfile, replace))
            await storage.run(
                "build",
                *isolation(request),
                "--pull-never",
                f"--layers={'true' if request.cache else 'false'}",
                "--force-rm",
                f"--file={dockerfile}",
                f"--tag={BUILD_TAG}",
                *(f"--build-arg={key}={value}" for key, value in request.build_args.items()),
                str(request.context),
                what="buildah build",
            )
            # buildah skips a blob the layout has: not the base, which `assemble` replaces
            # with the store's layers anyway.
            blobs = anyio.Path(output / "blobs" / "sha256")
            await blobs.mkdir(parents=True)
            for base in bases:
                if base.image.layers:
                    await (blobs / hex_of(base.diff_id)).touch()
            await storage.run(
                "push",
                "--quiet",
                "--disable-compression",
                "--format=oci",
                BUILD_TAG,
                f"oci:{output}:{OUTPUT_TAG}",
                what="buildah push of the built image",
            )
        if deadline.cancelled_caught:
            raise ImageError(f"the build timed out after {request.timeout:g}s; buildah was stopped")
    finally:
        with anyio.CancelScope(shield=True):
            await storage.clean()
    await anyio.to_thread.run_sync(assemble, output, final, bases)
    return final
