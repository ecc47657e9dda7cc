"""The layers of the image store: each unpacked once, by chain id, in overlayfs' form.

On disk, under the store's root::

    layers/<chain>/        one layer, as overlayfs stores it (`sandman.images.overlay`)
    layers/<chain>.json    its metadata, written last: present means complete
    digests/<hex>          a layer blob's digest (as a registry has it) → its diff id
    aliases/<hex>          a chain id → the stored layer with the same files (a push's)

A layer's *chain id* is its diff id for a bottom layer, else the sha256 of
``"<parent chain id> <diff id>"`` (docker's ChainID): how a layer unpacks depends on
the layers below (directories it only implies, hard links to their files, paths
through their symlinks), so equal content over different layers is two layers.

A push exports each stored layer as a new tar (other bytes than the blob it came in:
another diff id, so another chain id); it records that chain id as an *alias* of the
stored layer (`LayerStore.add_alias`), so that pulling the pushed image back finds its
layers stored (`LayerStore.resolve`) and downloads and stores nothing twice.

Everything here blocks and expects the caller's locks (`ImageStore` holds the layer's
lock around `unpack` + `commit`, and ``layers.lock`` around `remove_unused`). Scratch
work goes to the store's ``tmp/`` under names that start with the caller's lock key
(`tag`), so start-up cleanup knows whose it is.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from sandman.errors import ImageError
from sandman.images.digests import digest_bytes, hex_of
from sandman.images.formats import Layer
from sandman.images.layers import apply_layer, disk_usage, rmtree
from sandman.images.merged import MergedView
from sandman.images.names import is_id_prefix

__all__ = ["LayerRecord", "LayerStore", "PruneReport", "chain_id", "discard", "write_atomic"]

logger = logging.getLogger(__name__)


def chain_id(parent: str | None, diff_id: str) -> str:
    """The chain id of a layer with diff id `diff_id` over the layer `parent` (None: bottom)."""
    if parent is None:
        return diff_id
    return digest_bytes(f"{parent} {diff_id}".encode())


class LayerRecord(BaseModel):
    """What ``layers/<chain>.json`` holds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    """The chain id."""
    diff_id: str
    size: int
    created: datetime


@dataclass(frozen=True)
class PruneReport:
    """What `ImageStore.prune` removed: layer chain ids and the bytes their files took."""

    layers: list[str]
    bytes: int


class LayerStore:
    """The ``layers/`` and ``digests/`` of the store at `root`; scratch work in `tmp`."""

    def __init__(self, root: Path, tmp: Path) -> None:
        self.layers = root / "layers"
        self.digests = root / "digests"
        self.aliases = root / "aliases"
        self.tmp = tmp
        for directory in (self.layers, self.digests, self.aliases):
            directory.mkdir(parents=True, exist_ok=True)

    def path(self, layer_id: str) -> Path:
        """The directory of layer `layer_id` (a chain id)."""
        return self.layers / hex_of(layer_id)

    def complete(self, layer_id: str) -> bool:
        layer_hex = hex_of(layer_id)
        return (self.layers / f"{layer_hex}.json").is_file() and (self.layers / layer_hex).is_dir()

    def read(self, layer_id: str) -> LayerRecord:
        path = self.layers / f"{hex_of(layer_id)}.json"
        try:
            return LayerRecord.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise ImageError(f"layer metadata {path} is unreadable: {exc}") from exc

    def stored(self) -> list[str]:
        """The chain ids of every complete layer."""
        return [
            f"sha256:{p.stem}"
            for p in self.layers.iterdir()
            if p.name.endswith(".json") and is_id_prefix(p.stem)
        ]

    def diff_of(self, digest: str) -> str | None:
        """The diff id of the layer blob `digest`, if a layer from it was ever stored."""
        try:
            text = (self.digests / hex_of(digest)).read_text().strip()
        except FileNotFoundError:
            return None
        hex_of(text)
        return text

    def index_digest(self, digest: str, diff_id: str, tag: str) -> None:
        """Remember that blob `digest` holds diff `diff_id`."""
        path = self.digests / hex_of(digest)
        if not path.exists():
            write_atomic(path, diff_id.encode(), self.tmp, tag)

    def add_alias(self, layer_id: str, diff_id: str, target: str, tag: str) -> None:
        """Make chain id `layer_id` (of a layer with diff id `diff_id`) stand for the
        stored layer `target`: the same files, exported as another tar (a push)."""
        if layer_id != target:
            data = f"{target}\n{diff_id}\n".encode()
            write_atomic(self.aliases / hex_of(layer_id), data, self.tmp, tag)

    def resolve(self, layer_id: str) -> str:
        """The stored layer chain id `layer_id` stands for: its alias's target when that
        is stored, else `layer_id` itself."""
        try:
            target = (self.aliases / hex_of(layer_id)).read_text().split("\n")[0]
        except FileNotFoundError:
            return layer_id
        hex_of(target)
        return target if self.complete(target) else layer_id

    def unpack(self, layer: Layer, chain: Sequence[str], tag: str) -> tuple[Path, str]:
        """Unpack `layer` over the stored layers `chain` (bottom first) into a new
        directory in tmp/; that directory and the layer's diff id."""
        work = self.tmp / f"{tag}.{secrets.token_hex(6)}"
        lower = MergedView([self.path(c) for c in reversed(chain)])
        try:
            os.mkdir(work)
            with layer.open() as stream:
                diff_id = apply_layer(
                    work,
                    stream,
                    what=layer.what,
                    digest=layer.digest,
                    diff_id=layer.diff_id,
                    lower=lower,
                )
            os.chmod(work, 0o755)
        except BaseException:
            discard(work, self.tmp, tag)
            raise
        return work, diff_id

    def commit(self, work: Path, layer_id: str, diff_id: str, digest: str | None, tag: str) -> bool:
        """Move an unpacked layer into layers/ (its lock held); False when it was there."""
        layer_hex = hex_of(layer_id)
        if self.complete(layer_id):
            discard(work, self.tmp, tag)
            return False
        final = self.layers / layer_hex
        try:
            size = disk_usage(work)
            # Left by a crash after the rename but before the metadata: not trusted.
            discard(final, self.tmp, tag)
            os.rename(work, final)
        except BaseException:
            discard(work, self.tmp, tag)
            raise
        record = LayerRecord(id=layer_id, diff_id=diff_id, size=size, created=datetime.now(UTC))
        data = record.model_dump_json(indent=2).encode()
        write_atomic(self.layers / f"{layer_hex}.json", data, self.tmp, tag)
        if digest is not None:
            self.index_digest(digest, diff_id, tag)
        logger.debug("stored layer %s (diff id %s, %d bytes)", layer_id, diff_id, size)
        return True

    def placeholders(self, blobs: Path, layers: Sequence[tuple[str, int]]) -> int:
        """Put an empty stand-in (sparse, of the blob's size) in `blobs` (an OCI layout's
        ``blobs/sha256``) for each layer blob whose layer is stored, so that skopeo takes
        it as present and skips it; how many.

        Only the bottom run of stored layers: a layer over one we lack unpacks anew,
        and needs its blob.
        """
        parent: str | None = None
        count = 0
        for digest, size in layers:
            diff_id = self.diff_of(digest)
            if diff_id is None:
                break
            layer_id = self.resolve(chain_id(parent, diff_id))
            if not self.complete(layer_id):
                break
            blobs.mkdir(parents=True, exist_ok=True)
            with open(blobs / hex_of(digest), "wb") as stand_in:
                stand_in.truncate(size)
            parent = layer_id
            count += 1
        return count

    def remove_unused(self, used: set[str], only: set[str] | None, tag: str) -> PruneReport:
        """Delete every layer (of `only`, or all) not in `used`, complete or not, the
        digest index entries of diff ids no layer has any more, and the aliases of
        layers that went."""
        removed: list[str] = []
        freed = 0
        for entry in sorted(os.listdir(self.layers)):
            layer_hex = entry.removesuffix(".json")
            layer_id = f"sha256:{layer_hex}"
            if not is_id_prefix(layer_hex) or len(layer_hex) != 64 or layer_id in used:
                continue
            if (only is not None and layer_id not in only) or layer_id in removed:
                continue
            path = self.layers / layer_hex
            freed += disk_usage(path) if path.is_dir() else 0
            (self.layers / f"{layer_hex}.json").unlink(missing_ok=True)
            discard(path, self.tmp, tag)
            removed.append(layer_id)
            logger.info("removed layer %s", layer_id)
        if removed:
            # Aliases first: the diff ids of those left keep their blobs' digests.
            diff_ids = {self.read(c).diff_id for c in self.stored()}
            for entry in os.listdir(self.aliases):
                path = self.aliases / entry
                with suppress(OSError):
                    target, _, diff_id = path.read_text().partition("\n")
                    if target in removed:
                        path.unlink()
                    else:
                        diff_ids.add(diff_id.strip())
            for entry in os.listdir(self.digests):
                path = self.digests / entry
                with suppress(OSError, ImageError):
                    if path.read_text().strip() not in diff_ids:
                        path.unlink()
        return PruneReport(layers=removed, bytes=freed)


def write_atomic(path: Path, data: bytes, tmp: Path, tag: str) -> None:
    """Write `path` whole or not at all, through a file in `tmp` named for `tag`."""
    part = tmp / f"{tag}.{secrets.token_hex(6)}.part"
    try:
        with open(part, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def discard(path: Path, tmp: Path, tag: str) -> None:
    """Remove a directory tree, renaming it into `tmp` first so it vanishes at once."""
    if not path.exists():
        return
    if path.parent != tmp:
        trash = tmp / f"{tag}.{secrets.token_hex(6)}.removing"
        os.rename(path, trash)
        path = trash
    rmtree(path)
