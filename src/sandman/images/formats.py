"""Recognising image archives and reading what to unpack from them.

(About 650 lines, one reader: the three formats share the hostile-input bounds
and the digest checks, which must not differ between them.)

Three inputs, one result (a `Plan`):

- a ``docker save`` archive: ``manifest.json`` ``[{Config, RepoTags, Layers}]``,
  legacy (``<id>/layer.tar``) or docker 25+ (``blobs/sha256/...``) layout;
- an OCI image layout, as a directory or inside a tar: ``oci-layout``,
  ``index.json`` (nested indexes allowed) → manifest → config + layers;
- anything else that is a tar: a plain rootfs tarball.

The outer archive may be gzip, bzip2 or xz compressed; it is then decompressed
to an anonymous temporary file first, for random access. Everything here
blocks: call it from a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import posixpath
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol, cast

from pydantic import ValidationError

from sandman.errors import ImageError
from sandman.images.compression import CORRUPT, decompressed
from sandman.images.digests import CHUNK, HashingReader, check_digest, digest_bytes, hex_of
from sandman.images.image import DEFAULT_PATH, ImageConfig
from sandman.images.names import normalize_name, tag_of

__all__ = [
    "ArchiveSource",
    "Layer",
    "LayoutSource",
    "Plan",
    "RemoteImage",
    "choose_platform",
    "plan_archive",
    "plan_layout",
    "remote_manifest",
]

logger = logging.getLogger(__name__)

MAX_JSON = 32 << 20
"""Manifests and configs are small; refuse to read a huge "JSON" blob into memory."""
MAX_NESTING = 8

REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"

INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
CONFIG_TYPES = {
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
}
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}

# Reading an outer archive: damaged compression or tar, or an I/O error.
_CORRUPT = (*CORRUPT, OSError)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}
HOST_ARCH = _ARCH.get(platform.machine(), platform.machine())


@dataclass(frozen=True)
class Layer:
    """One layer to apply: how to open it and what its digests must be."""

    what: str
    open: Callable[[], BinaryIO]
    digest: str | None = None
    diff_id: str | None = None


@dataclass(frozen=True)
class Plan:
    """Everything needed to unpack one image, read and checked but not yet unpacked."""

    id: str
    kind: Literal["docker-archive", "oci-archive", "oci-layout", "rootfs"]
    config: ImageConfig
    names: list[str]
    layers: list[Layer]
    blobs: dict[str, bytes] = field(default_factory=dict)
    """Small verified blobs to keep in the store (manifest, config), by digest."""


@dataclass(frozen=True)
class RemoteImage:
    """What an image manifest in a registry says, before any blob is fetched."""

    config: str
    """The config's digest: the image's id."""
    layers: list[tuple[str, int]]
    """Each layer blob's digest and size, bottom first."""


def remote_manifest(data: bytes) -> RemoteImage | None:
    """Read an image manifest (OCI or docker v2 schema 2); None when it is something
    else (then the pull just downloads everything)."""
    try:
        document = json.loads(data)
        config = _descriptor(document["config"], "manifest config")
        layers = [_descriptor(layer, "manifest layer") for layer in document["layers"]]
    except (ValueError, KeyError, TypeError, ImageError):
        return None
    if any(layer.size is None for layer in layers):
        return None
    return RemoteImage(config.digest, [(layer.digest, layer.size or 0) for layer in layers])


def choose_platform(data: bytes) -> str | None:
    """The digest of this host's (linux) image in an image index; None when `data` is
    no index or lists no such image."""
    try:
        document = json.loads(data)
        manifests = document["manifests"]
        candidates: list[tuple[_Descriptor, dict[str, str]]] = [
            (_descriptor(m, "index"), {}) for m in manifests
        ]
    except (ValueError, KeyError, TypeError, ImageError):
        return None
    try:
        descriptor, _ = _choose(_Named("registry"), candidates, None)
    except ImageError:
        return None
    return descriptor.digest


class _Named:
    def __init__(self, label: str) -> None:
        self.label = label

    def exists(self, name: str) -> bool:
        return False

    def open(self, name: str) -> BinaryIO:
        raise ImageError(f"{self.label}: {name!r} is missing")


class _Source(Protocol):
    label: str

    def exists(self, name: str) -> bool: ...

    def open(self, name: str) -> BinaryIO: ...


class LayoutSource:
    """An OCI image layout directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = str(path)
        if not path.is_dir():
            raise ImageError(f"{path} is not a directory (expected an OCI image layout)")

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def open(self, name: str) -> BinaryIO:
        return open(self.path / name, "rb")


class ArchiveSource:
    """A tar archive (maybe compressed), its members indexed by normalised name.

    Only members at most three levels deep are indexed: that is where image
    archives keep everything, and a rootfs tarball may have millions of entries.
    """

    def __init__(self, path: Path, scratch: Path) -> None:
        self.path = path
        self.label = str(path)
        self.members: dict[str, tarfile.TarInfo] = {}
        self.entries = 0
        self._digest: str | None = None
        self.compressed = False
        if path.is_dir():
            raise ImageError(f"{path} is a directory; use import_oci_layout for an OCI layout")
        try:
            self._file: BinaryIO = open(path, "rb")  # noqa: SIM115 (closed by close())
        except OSError as exc:
            raise ImageError(f"cannot open image archive {path}: {exc}") from exc
        try:
            self._decompress(scratch)
            self._index()
        except BaseException:
            self.close()
            raise

    def _decompress(self, scratch: Path) -> None:
        head = self._file.read(8)
        self._file.seek(0)
        if not head:
            raise ImageError(f"{self.path} is empty")
        raw = HashingReader(self._file)
        stream = decompressed(head, cast(BinaryIO, raw), str(self.path))
        if stream is None:
            return
        # An anonymous file (O_TMPFILE): a crash leaves nothing behind to clean.
        plain = cast(BinaryIO, tempfile.TemporaryFile(dir=scratch))  # noqa: SIM115 (kept open)
        try:
            shutil.copyfileobj(stream, plain, CHUNK)
            raw.drain()
        except _CORRUPT as exc:
            plain.close()
            raise ImageError(f"{self.path}: cannot decompress: {exc}") from exc
        self._file.close()
        self._file = plain
        self._digest = raw.digest
        self.compressed = True

    def _index(self) -> None:
        self._file.seek(0)
        try:
            self._tar = tarfile.open(  # noqa: SIM115 (closed with the file, by close())
                fileobj=self._file, mode="r:", encoding="utf-8", errors="surrogateescape"
            )
            while (member := self._tar.next()) is not None:
                self._tar.members.clear()  # type: ignore[attr-defined]
                self.entries += 1
                name = posixpath.normpath(member.name.lstrip("/")) if member.name else "."
                if name.count("/") < 3 and not name.startswith(".."):
                    self.members[name] = member
        except _CORRUPT as exc:
            raise ImageError(f"{self.path} is not a tar archive, or is corrupt: {exc}") from exc
        if self.entries == 0:
            raise ImageError(f"{self.path} is an empty tar archive")

    def _member(self, name: str) -> tarfile.TarInfo | None:
        # Follow links inside the archive (docker 25+ may link legacy paths to blobs/).
        for _ in range(MAX_NESTING):
            member = self.members.get(name)
            if member is None or member.isreg():
                return member
            if member.issym():
                name = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
            elif member.islnk():
                name = posixpath.normpath(member.linkname.lstrip("/"))
            else:
                return None
        return None

    def exists(self, name: str) -> bool:
        return self._member(name) is not None

    def open(self, name: str) -> BinaryIO:
        member = self._member(name)
        reader = self._tar.extractfile(member) if member is not None else None
        if reader is None:
            raise ImageError(f"{self.label}: {name!r} is missing")
        return cast(BinaryIO, reader)

    def open_whole(self) -> BinaryIO:
        """The whole (decompressed) archive, from its start, as a new handle."""
        if not self.compressed:
            return open(self.path, "rb")
        reader = os.fdopen(os.dup(self._file.fileno()), "rb")
        reader.seek(0)
        return reader

    def digest(self) -> str:
        """sha256 of the archive file as given (compressed or not)."""
        if self._digest is None:
            with open(self.path, "rb") as file:
                reader = HashingReader(file)
                reader.drain()
            self._digest = reader.digest
        return self._digest

    def close(self) -> None:
        self._file.close()


def plan_archive(source: ArchiveSource, name: str | None) -> Plan:
    """Detect what the archive holds and read its plan (`name` is normalised, or None)."""
    if source.exists("manifest.json"):
        return _plan_docker(source, name)
    if source.exists("index.json") and source.exists("oci-layout"):
        return _plan_oci(source, name, "oci-archive")
    return Plan(
        id=source.digest(),
        kind="rootfs",
        config=ImageConfig(env=[DEFAULT_PATH]),
        names=[name] if name else [],
        # Checked again as it is unpacked: the file may change after we hashed it.
        layers=[
            Layer(
                what=f"rootfs tarball {source.path}",
                open=source.open_whole,
                digest=None if source.compressed else source.digest(),
            )
        ],
    )


def plan_layout(source: LayoutSource, name: str | None) -> Plan:
    """Read the plan of an OCI image layout directory."""
    if not source.exists("oci-layout") or not source.exists("index.json"):
        raise ImageError(f"{source.label} is not an OCI image layout (no oci-layout or index.json)")
    return _plan_oci(source, name, "oci-layout")


# -- docker save ---------------------------------------------------------------------------


def _plan_docker(source: _Source, name: str | None) -> Plan:
    document = _json(
        _read(source, "manifest.json", "manifest.json"), f"{source.label}: manifest.json"
    )
    if not isinstance(document, list) or not document:
        raise ImageError(f"{source.label}: manifest.json is not a list of images")
    entries = [_docker_entry(source, entry) for entry in document]
    chosen = entries[0]
    if name is not None:
        chosen = next((e for e in entries if name in e[2]), chosen)
    config_path, layer_paths, repo_tags = chosen
    config_bytes = _read(source, config_path, "image config")
    image_id = digest_bytes(config_bytes)
    match = re.search(r"(?:^|/)([0-9a-f]{64})(?:\.json)?$", config_path)
    if match:
        check_digest(f"{source.label}: image config {config_path}", f"sha256:{match[1]}", image_id)
    config, diff_ids = _parse_config(config_bytes, source.label)
    if diff_ids is not None and len(diff_ids) != len(layer_paths):
        raise ImageError(
            f"{source.label}: the config lists {len(diff_ids)} layers, the manifest {len(layer_paths)}"
        )
    layers = []
    for i, path in enumerate(layer_paths):
        what = f"{source.label}: layer {i + 1}/{len(layer_paths)} ({path})"
        if not source.exists(path):
            raise ImageError(f"{what} is missing from the archive")
        blob = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", path)
        layers.append(
            Layer(
                what=what,
                open=partial(source.open, path),
                digest=f"sha256:{blob[1]}" if blob else None,
                diff_id=diff_ids[i] if diff_ids is not None else None,
            )
        )
    return Plan(
        id=image_id,
        kind="docker-archive",
        config=config,
        names=[name] if name else repo_tags,
        layers=layers,
        blobs={image_id: config_bytes},
    )


def _docker_entry(source: _Source, entry: object) -> tuple[str, list[str], list[str]]:
    if not isinstance(entry, dict):
        raise ImageError(f"{source.label}: manifest.json entries must be objects")
    config, layers, tags = entry.get("Config"), entry.get("Layers"), entry.get("RepoTags") or []
    if (
        not isinstance(config, str)
        or not isinstance(layers, list)
        or not all(isinstance(x, str) for x in layers)
        or not isinstance(tags, list)
        or not all(isinstance(x, str) for x in tags)
    ):
        raise ImageError(f"{source.label}: manifest.json entry needs Config, Layers and RepoTags")
    names = []
    for tag in tags:
        try:
            names.append(normalize_name(tag))
        except ImageError:
            logger.debug("%s: ignoring invalid RepoTag %r", source.label, tag)
    return _member_name(config), [_member_name(x) for x in layers], names


def _member_name(name: str) -> str:
    return posixpath.normpath(name.lstrip("/"))


# -- OCI -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Descriptor:
    digest: str
    media_type: str | None
    size: int | None
    annotations: dict[str, str]
    platform: dict[str, Any] | None

    @property
    def blob(self) -> str:
        return f"blobs/sha256/{hex_of(self.digest)}"


def _descriptor(value: object, what: str) -> _Descriptor:
    if not isinstance(value, dict) or not isinstance(value.get("digest"), str):
        raise ImageError(f"{what}: malformed descriptor (no digest)")
    media_type, size = value.get("mediaType"), value.get("size")
    annotations, platform_ = value.get("annotations") or {}, value.get("platform")
    if (
        (media_type is not None and not isinstance(media_type, str))
        or (size is not None and not isinstance(size, int))
        or not isinstance(annotations, dict)
        or (platform_ is not None and not isinstance(platform_, dict))
    ):
        raise ImageError(f"{what}: malformed descriptor {value!r}")
    hex_of(value["digest"])
    return _Descriptor(
        value["digest"],
        media_type,
        size,
        {str(k): str(v) for k, v in annotations.items()},
        platform_,
    )


def _read_blob(source: _Source, descriptor: _Descriptor, what: str) -> bytes:
    data = _read(source, descriptor.blob, f"{what} {descriptor.digest}")
    if descriptor.size is not None and len(data) != descriptor.size:
        raise ImageError(
            f"{source.label}: {what} {descriptor.digest}: size {len(data)}, expected {descriptor.size}"
        )
    check_digest(f"{source.label}: {what}", descriptor.digest, digest_bytes(data))
    return data


def _plan_oci(
    source: _Source, name: str | None, kind: Literal["oci-archive", "oci-layout"]
) -> Plan:
    layout = _json(_read(source, "oci-layout", "oci-layout"), f"{source.label}: oci-layout")
    if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
        raise ImageError(f"{source.label}: oci-layout has no imageLayoutVersion")
    index = _json(_read(source, "index.json", "index.json"), f"{source.label}: index.json")
    candidates = _manifests(source, index, {}, 0)
    descriptor, annotations = _choose(source, candidates, name)
    manifest_bytes = _read_blob(source, descriptor, "manifest")
    manifest = _json(manifest_bytes, f"{source.label}: manifest {descriptor.digest}")
    if not isinstance(manifest, dict) or "manifests" in manifest:
        raise ImageError(f"{source.label}: {descriptor.digest} is not an image manifest")
    config_descriptor = _descriptor(manifest.get("config"), f"{source.label}: manifest config")
    if config_descriptor.media_type not in (None, *CONFIG_TYPES):
        raise ImageError(
            f"{source.label}: not a container image (config media type "
            f"{config_descriptor.media_type})"
        )
    config_bytes = _read_blob(source, config_descriptor, "image config")
    image_id = config_descriptor.digest
    config, diff_ids = _parse_config(config_bytes, source.label)
    raw_layers = manifest.get("layers")
    if not isinstance(raw_layers, list):
        raise ImageError(f"{source.label}: manifest {descriptor.digest} has no layers list")
    if diff_ids is not None and len(diff_ids) != len(raw_layers):
        raise ImageError(
            f"{source.label}: the config lists {len(diff_ids)} layers, the manifest {len(raw_layers)}"
        )
    layers = []
    for i, raw in enumerate(raw_layers):
        what = f"{source.label}: layer {i + 1}/{len(raw_layers)}"
        layer = _descriptor(raw, what)
        what = f"{what} ({layer.digest})"
        media_type = layer.media_type or ""
        if "zstd" in media_type:
            raise ImageError(
                f"{what} is zstd-compressed ({media_type}), which this image store does not "
                "support; re-export the image with gzip layers"
            )
        if media_type not in LAYER_TYPES:
            raise ImageError(f"{what}: unsupported layer media type {media_type!r}")
        if not source.exists(layer.blob):
            raise ImageError(f"{what} is missing")
        layers.append(
            Layer(
                what=what,
                open=partial(source.open, layer.blob),
                digest=layer.digest,
                diff_id=diff_ids[i] if diff_ids is not None else None,
            )
        )
    return Plan(
        id=image_id,
        kind=kind,
        config=config,
        names=[name] if name else _names_from(annotations),
        layers=layers,
        blobs={descriptor.digest: manifest_bytes, image_id: config_bytes},
    )


def _manifests(
    source: _Source, index: object, inherited: dict[str, str], depth: int
) -> list[tuple[_Descriptor, dict[str, str]]]:
    """The image manifests an index points to, nested indexes flattened.

    Each comes with its annotations, the outer descriptor's winning: that is
    where the tag (``org.opencontainers.image.ref.name``) lives.
    """
    if depth > MAX_NESTING:
        raise ImageError(f"{source.label}: image indexes nested too deep")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list):
        raise ImageError(f"{source.label}: index has no manifests list")
    found = []
    for raw in manifests:
        descriptor = _descriptor(raw, f"{source.label}: index")
        annotations = {**descriptor.annotations, **inherited}
        if descriptor.media_type in INDEX_TYPES:
            nested = _json(_read_blob(source, descriptor, "image index"), f"{source.label}: index")
            found += _manifests(source, nested, annotations, depth + 1)
        elif descriptor.media_type in (None, *MANIFEST_TYPES):
            found.append((descriptor, annotations))
    return found


def _choose(
    source: _Source, candidates: list[tuple[_Descriptor, dict[str, str]]], name: str | None
) -> tuple[_Descriptor, dict[str, str]]:
    if not candidates:
        raise ImageError(f"{source.label}: index.json lists no image manifest")
    pool = candidates
    if name is not None:
        tag = tag_of(name)
        matching = [c for c in candidates if _ref_matches(c[1], name, tag)]
        pool = matching or candidates
    if len(pool) == 1:
        return pool[0]
    for candidate in pool:
        platform_ = candidate[0].platform
        if platform_ is None or (
            platform_.get("os") == "linux" and platform_.get("architecture") == HOST_ARCH
        ):
            return candidate
    found = sorted({f"{p.get('os')}/{p.get('architecture')}" for d, _ in pool if (p := d.platform)})
    raise ImageError(f"{source.label}: no image for linux/{HOST_ARCH} (found: {', '.join(found)})")


def _ref_matches(annotations: dict[str, str], name: str, tag: str | None) -> bool:
    ref = annotations.get(REF_NAME)
    if ref is not None and ref == tag:
        return True
    return any(
        _normalized_or_none(annotations.get(key)) == name for key in (REF_NAME, CONTAINERD_NAME)
    )


def _names_from(annotations: dict[str, str]) -> list[str]:
    for key in (CONTAINERD_NAME, REF_NAME):
        value = annotations.get(key)
        # A bare ref.name is only a tag ("latest"), not a name.
        if value and ("/" in value or ":" in value) and (found := _normalized_or_none(value)):
            return [found]
    return []


def _normalized_or_none(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return normalize_name(value)
    except ImageError:
        return None


# -- shared --------------------------------------------------------------------------------


def _parse_config(data: bytes, label: str) -> tuple[ImageConfig, list[str] | None]:
    document = _json(data, f"{label}: image config")
    if not isinstance(document, dict):
        raise ImageError(f"{label}: the image config is not a JSON object")
    run = document.get("config") or {}
    if not isinstance(run, dict):
        raise ImageError(f"{label}: the image config's 'config' is not an object")
    try:
        config = ImageConfig(
            env=run.get("Env") or [],
            working_dir=run.get("WorkingDir") or "/",
            user=run.get("User") or "",
            entrypoint=run.get("Entrypoint"),
            cmd=run.get("Cmd"),
        )
    except ValidationError as exc:
        raise ImageError(f"{label}: invalid image config: {exc}") from exc
    rootfs = document.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if diff_ids is None:
        return config, None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise ImageError(f"{label}: the image config's rootfs.diff_ids is malformed")
    for diff_id in diff_ids:
        hex_of(diff_id)
    return config, diff_ids


def _read(source: _Source, name: str, what: str) -> bytes:
    if not source.exists(name):
        raise ImageError(f"{source.label}: {what} ({name}) is missing")
    try:
        with source.open(name) as file:
            data = file.read(MAX_JSON + 1)
    except (tarfile.TarError, OSError) as exc:
        raise ImageError(f"{source.label}: cannot read {what}: {exc}") from exc
    if len(data) > MAX_JSON:
        raise ImageError(f"{source.label}: {what} is larger than {MAX_JSON} bytes")
    return data


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what} is not valid JSON: {exc}") from exc
