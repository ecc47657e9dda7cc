"""A snapshot of a pod's files made an image: its changes as one more layer over its
image's layers, as an OCI layout that skopeo pushes (`PodSnapshots.save_image`).

The snapshot holds what the sandbox changed (`sandman.daemon.changes`: checked and
rewritten by the pool when it was taken), each changed directory followed by the
list of every name it holds. An OCI layer says a removal with a whiteout
(``.wh.<name>``) for a name of the layers below, so the base image's layers are
read (their tar headers only) for the names each listed directory held there
(`BaseTree`): what the listing lacks becomes a whiteout, as the fork's daemon would
remove it (`changes_layer`). The image's own layers are referenced, never rewritten:
the new manifest is the base's with the layer added, its config the base's with the
layer's diff id, a history entry and the label ``io.sandman.source``
(`finish_layout`). The pure parts take paths and return values; the caller runs them
in a worker thread.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sandman import errors
from sandman.daemon.changes import PRUNE
from sandman.images.compression import CORRUPT, decompressed
from sandman.images.export import LayerBlob, export_stream, write_layout
from sandman.images.names import normalize_name

__all__ = [
    "BaseImage",
    "BaseTree",
    "base_reference",
    "base_tree",
    "changes_layer",
    "finish_layout",
    "read_base",
    "repository_of",
]

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_DIRECTORY_KIND = ord("d")
SOURCE_LABEL = "io.sandman.source"
"""The config label naming the snapshot an image was made from (as the local provider's)."""

_Node = dict[str, "_Node | None"]
"""A directory of `BaseTree`: its names, each a directory (a dict) or not (None)."""


def repository_of(name: str) -> str:
    """The repository of a normalised image name (its tag or digest taken off)."""
    if "@" in name:
        return name.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def base_reference(image: str, image_id: str) -> tuple[str, str | None]:
    """Where to fetch the image a snapshot's pod ran: ``image`` (as the spec named it,
    normalised) pinned to the digest the node resolved (``imageID`` ``repo@sha256:...``),
    so a tag that moved since does not matter; and, when the node reported only an image
    id (``sha256:<config digest>``), that id, which the fetched image's config must have.
    `ImageError` for an image name that is none."""
    image = normalize_name(image)
    if "@" in image_id:
        digest = image_id.rsplit("@", 1)[1]
        if _DIGEST.match(digest):
            return f"{repository_of(image)}@{digest}", None
    if _DIGEST.match(image_id):
        return image, image_id
    return image, None


# -- the base image's names --------------------------------------------------------------


class BaseTree:
    """The names of an image's layers merged (whiteouts and opaque directories applied),
    as a tree of directories: what `changes_layer` needs to say a removal."""

    def __init__(self) -> None:
        self.root: _Node = {}

    def add_layer(self, members: Iterable[tuple[str, bool]]) -> None:
        """Put a layer over the tree: its entries as (name, is a directory), in order.
        Its whiteouts and opaque markers hide what the layers below hold, not its own."""
        entries: list[tuple[list[str], bool]] = []
        hidden: list[list[str]] = []
        opaque: list[list[str]] = []
        for name, is_dir in members:
            parts = [part for part in name.split("/") if part not in ("", ".")]
            if not parts or ".." in parts:
                continue
            last = parts[-1]
            if last == _OPAQUE:
                opaque.append(parts[:-1])
            elif last.startswith(_WHITEOUT):
                hidden.append([*parts[:-1], last[len(_WHITEOUT) :]])
            else:
                entries.append((parts, is_dir))
        for parts in opaque:
            node = self.children(parts)
            if node is not None:
                node.clear()
        for parts in hidden:
            parent = self.children(parts[:-1])
            if parent is not None:
                parent.pop(parts[-1], None)
        for parts, is_dir in entries:
            parent = self._make(parts[:-1])
            if not is_dir:
                parent[parts[-1]] = None
            elif parent.get(parts[-1]) is None:
                parent[parts[-1]] = {}

    def children(self, parts: Iterable[str]) -> _Node | None:
        """The names directory ``parts`` holds (name: its node, None for a non-directory);
        None when the tree has no such directory."""
        node: _Node | None = self.root
        for part in parts:
            if node is None:
                return None
            node = node.get(part)
        return node

    def _make(self, parts: list[str]) -> _Node:
        node = self.root
        for part in parts:
            child = node.get(part)
            if child is None:  # implied by a deeper entry (or a non-directory replaced)
                child = node[part] = {}
            node = child
        return node


def _layer_members(path: Path, what: str) -> Iterator[tuple[str, bool]]:
    """The (name, is a directory) of each entry of a layer blob, headers only."""
    with path.open("rb") as raw:
        head = raw.read(8)
        raw.seek(0)
        stream: BinaryIO = decompressed(head, raw, what) or raw
        try:
            with tarfile.open(
                fileobj=stream, mode="r|", encoding="utf-8", errors="surrogateescape"
            ) as tar:
                for member in tar:
                    yield member.name, member.isdir()
        except CORRUPT as exc:
            raise errors.ImageError(f"{what} is not a readable layer: {exc}") from exc


@dataclass(frozen=True)
class BaseImage:
    """The image a snapshot's pod ran, as skopeo fetched it into an OCI layout."""

    manifest: dict[str, Any]
    config: dict[str, Any]
    config_digest: str
    layers: list[dict[str, Any]]
    """Their descriptors in the manifest, bottom first."""


def _blob(layout: Path, digest: object, what: str) -> Path:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise errors.ImageError(f"{what}: not a sha256 digest: {digest!r}")
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _json_of(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise errors.ImageError(f"{what} cannot be read: {exc}") from exc
    if not isinstance(value, dict):
        raise errors.ImageError(f"{what} is not a JSON object")
    return value


def read_base(layout: Path, what: str) -> BaseImage:
    """The manifest, config and layers of the one image of the OCI layout at ``layout``."""
    index = _json_of(layout / "index.json", f"the layout of {what}")
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or len(manifests) != 1 or not isinstance(manifests[0], dict):
        raise errors.ImageError(f"the layout of {what} does not hold one image")
    manifest = _json_of(_blob(layout, manifests[0].get("digest"), what), f"the manifest of {what}")
    config_descriptor = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(config_descriptor, dict) or not isinstance(layers, list):
        raise errors.ImageError(f"the manifest of {what} has no config or layers")
    config_digest = config_descriptor.get("digest")
    config = _json_of(_blob(layout, config_digest, what), f"the config of {what}")
    for layer in layers:
        if not isinstance(layer, dict):
            raise errors.ImageError(f"the manifest of {what} has a bad layer descriptor")
        _blob(layout, layer.get("digest"), what)
    return BaseImage(manifest, config, str(config_digest), layers)


def base_tree(layout: Path, base: BaseImage, what: str) -> BaseTree:
    """The names of ``base``'s layers (in ``layout``), merged."""
    tree = BaseTree()
    for number, layer in enumerate(base.layers, 1):
        label = f"layer {number} of {what}"
        tree.add_layer(_layer_members(_blob(layout, layer.get("digest"), label), label))
    return tree


# -- the snapshot's layer ----------------------------------------------------------------


def _listing(body: bytes) -> tuple[list[str], dict[str, bool]]:
    """A checked listing (`sandman.daemon.changes`): its directory, and each name it holds
    with whether it is a directory."""
    fields = body.split(b"\0")
    directory = [part for part in os.fsdecode(fields[0]).split("/") if part not in ("", ".")]
    names = {os.fsdecode(field[1:]): field[0] == _DIRECTORY_KIND for field in fields[1:-1]}
    return directory, names


def _open_changes(path: Path) -> tarfile.TarFile:
    return tarfile.open(path, mode="r|", encoding="utf-8", errors="surrogateescape")


def _whiteout(parts: list[str], name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo("/".join([*parts, f"{_WHITEOUT}{name}"]))
    info.mode, info.uname, info.gname, info.mtime = 0o600, "", "", 0
    return info


def changes_layer(changes: Path, base: BaseTree, blobs: Path, *, what: str) -> LayerBlob:
    """The layer blob (gzipped, in ``blobs``) of the checked stream of changes in file
    ``changes`` over an image whose names are ``base``: every entry as it is (the root's
    own entry left out, as layers do), each listing turned into a whiteout for every name
    of the image's directory that the listing lacks, or lists as the other of directory
    and non-directory while the stream brings nothing of that name (the fork's daemon
    removes exactly those)."""
    sent: set[str] = set()
    with _open_changes(changes) as tar:
        for member in tar:
            if member.name != PRUNE:
                sent.add(member.name)

    def write(sink: Any) -> None:
        with (
            _open_changes(changes) as source,
            tarfile.TarFile(
                fileobj=sink, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8",
                errors="surrogateescape",
            ) as out,
        ):  # fmt: skip
            for member in source:
                if member.name == PRUNE:
                    body = source.extractfile(member)
                    assert body is not None
                    directory, names = _listing(body.read())
                    below = base.children(directory) or {}
                    for name in sorted(below):
                        path = "/".join([*directory, name])
                        kept = names.get(name)
                        if kept is None or (kept != (below[name] is not None) and path not in sent):
                            out.addfile(_whiteout(directory, name))
                elif member.name != ".":
                    out.addfile(member, source.extractfile(member) if member.isreg() else None)

    return export_stream(write, blobs, what=what)


def finish_layout(
    layout: Path, base: BaseImage, layer: LayerBlob, *, tag: str, source: str, created_by: str
) -> str:
    """Make ``layout`` (holding ``base``'s blobs and ``layer``'s) the image of ``base``
    plus ``layer``, tagged ``tag``: the config is the base's with the layer's diff id, a
    history entry and the label naming ``source``; the manifest's digest."""
    config = json.loads(json.dumps(base.config))  # a copy
    rootfs = config.setdefault("rootfs", {"type": "layers", "diff_ids": []})
    rootfs.setdefault("diff_ids", []).append(layer.diff_id)
    if isinstance(config.get("history"), list):
        config["history"].append(
            {
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "created_by": created_by,
                "comment": f"the files of {source}",
            }
        )
    settings = config.setdefault("config", {})
    labels = settings.get("Labels") or {}
    settings["Labels"] = {**labels, SOURCE_LABEL: source}
    layers = [*base.layers, layer.descriptor()]
    return write_layout(layout, json.dumps(config).encode(), layers, tag=tag)
