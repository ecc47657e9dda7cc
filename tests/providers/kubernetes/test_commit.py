"""The layer a pod's snapshot becomes over its image's (`sandman.providers.kubernetes.commit`):
its entries as they are, its listings turned into whiteouts for what the image held and
the sandbox removed; and the scratch directory an image is made in. No cluster: streams
made here, checked as the pool checks a daemon's (the whole route is on the harness:
tests/kube/test_snapshot_images.py)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from sandman import errors
from sandman.daemon.changes import PRUNE, ChangesChecker
from sandman.images.export import MEDIA_LAYER_GZIP, LayerBlob
from sandman.providers.kubernetes.commit import (
    BaseImage,
    BaseTree,
    base_reference,
    changes_layer,
    finish_layout,
    read_base,
    repository_of,
)
from sandman.providers.kubernetes.snapshots import SnapshotStore

DIGEST = "sha256:" + "a" * 64


def tree(*layers: list[tuple[str, bool]]) -> BaseTree:
    made = BaseTree()
    for layer in layers:
        made.add_layer(layer)
    return made


def test_the_base_tree_applies_whiteouts_and_opaque_directories_to_lower_layers_only() -> None:
    base = tree(
        [("bin", True), ("bin/ls", False), ("bin/yes", False), ("etc/passwd", False),
         ("etc/group", False), ("opt/a/b", False), ("f", False)],
        [("bin/.wh.yes", False), ("etc/.wh..wh..opq", False), ("etc/hosts", False),
         ("opt/.wh.a", False), ("opt/a", False), ("f", True), ("f/g", False)],
    )  # fmt: skip
    assert base.children(["bin"]) == {"ls": None}
    assert base.children(["etc"]) == {"hosts": None}  # the lower names hidden, its own kept
    assert base.children(["opt"]) == {"a": None}  # a directory below, removed; a file now
    assert base.children(["f"]) == {"g": None}  # a file below, a directory now
    assert base.children(["bin", "ls"]) is None and base.children(["nothing"]) is None


def stream(*entries: tuple[str, bytes, bytes]) -> bytes:
    """A tar as the daemon writes one: (name, kind, body)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, body in entries:
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, len(body) if kind == tarfile.REGTYPE else 0
            info.linkname = body.decode() if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            tar.addfile(info, io.BytesIO(body) if kind == tarfile.REGTYPE else None)
    return buffer.getvalue()


def listing(directory: str, *names: str) -> tuple[str, bytes, bytes]:
    body = directory.encode() + b"\0" + b"".join(n.encode() + b"\0" for n in names)
    return PRUNE, tarfile.REGTYPE, body


def checked(path: Path, data: bytes) -> Path:
    with path.open("wb") as sink:
        checker = ChangesChecker(sink, max_bytes=2**30, max_entries=10_000)
        checker.feed(data)
        checker.close()
    return path


def layer_entries(blobs: Path, blob: LayerBlob) -> list[tuple[str, bytes, bytes]]:
    """(name, kind, body or link target) of each entry of a layer blob."""
    found = []
    with tarfile.open(blobs / blob.digest.removeprefix("sha256:")) as tar:
        for member in tar:
            body = tar.extractfile(member) if member.isreg() else None
            data = body.read() if body is not None else member.linkname.encode()
            found.append((member.name, member.type, data))
    return found


def test_listings_become_whiteouts_for_what_the_image_held(tmp_path: Path) -> None:
    base = tree(
        [("bin/ls", False), ("bin/yes", False), ("root/.profile", False), ("base/dir/x", False),
         ("base/keep", False), ("base/was-dir/y", False), ("base/was-file", False)],
    )  # fmt: skip
    changes = checked(
        tmp_path / "files.tar",
        stream(
            (".", tarfile.DIRTYPE, b""),
            listing("", "dbin", "dbase", "dwork", "oroot-fifo"),
            ("bin", tarfile.DIRTYPE, b""),
            listing("bin", "fls"),
            ("base", tarfile.DIRTYPE, b""),
            # A directory made a file (sent), a file made a directory (not sent: the
            # listing's kind says it; the fork's daemon would remove the file).
            listing("base", "fkeep", "fwas-dir", "dwas-file"),
            ("base/was-dir", tarfile.REGTYPE, b"now a file"),
            ("work", tarfile.DIRTYPE, b""),
            listing("work", "ff", "lrel", "flink"),
            ("work/f", tarfile.REGTYPE, b"hello"),
            ("work/rel", tarfile.SYMTYPE, b"../etc/passwd"),
            ("work/link", tarfile.LNKTYPE, b"work/f"),
        ),
    )
    blob = changes_layer(changes, base, tmp_path / "blobs", what="the changes")
    assert blob.media_type == MEDIA_LAYER_GZIP
    entries = layer_entries(tmp_path / "blobs", blob)
    names = [name for name, _, _ in entries]
    assert names == [
        ".wh.root", "bin", "bin/.wh.yes", "base", "base/.wh.dir", "base/.wh.was-file",
        "base/was-dir", "work", "work/f", "work/rel", "work/link",
    ]  # fmt: skip
    assert ("work/f", tarfile.REGTYPE, b"hello") in entries
    assert ("work/rel", tarfile.SYMTYPE, b"../etc/passwd") in entries
    assert ("work/link", tarfile.LNKTYPE, b"work/f") in entries
    assert PRUNE not in names and "." not in names
    # The same stream over the same image: the same blob (pushed once).
    again = changes_layer(changes, base, tmp_path / "again", what="the changes")
    assert again == blob


def test_a_layout_is_the_base_plus_one_layer(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["A=1"]},
              "rootfs": {"type": "layers", "diff_ids": [DIGEST]},
              "history": [{"created_by": "base"}]}  # fmt: skip
    layer = {"mediaType": MEDIA_LAYER_GZIP, "digest": DIGEST, "size": 3}
    base = BaseImage({}, config, "sha256:" + "c" * 64, [layer])
    new = LayerBlob("sha256:" + "b" * 64, "sha256:" + "d" * 64, 5, MEDIA_LAYER_GZIP)
    finish_layout(tmp_path, base, new, tag="push", source="sn-1", created_by="test")
    (blobs / DIGEST.removeprefix("sha256:")).write_bytes(b"abc")
    (blobs / ("b" * 64)).write_bytes(b"12345")
    read = read_base(tmp_path, "the result")
    assert [d["digest"] for d in read.layers] == [DIGEST, new.digest]
    assert read.config["rootfs"]["diff_ids"] == [DIGEST, new.diff_id]
    assert read.config["config"] == {"Env": ["A=1"], "Labels": {"io.sandman.source": "sn-1"}}
    assert len(read.config["history"]) == 2
    assert json.loads((tmp_path / "index.json").read_text())["manifests"][0]["annotations"] == {
        "org.opencontainers.image.ref.name": "push"
    }


def test_a_layout_that_names_a_path_for_a_digest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "index.json").write_text(json.dumps({"manifests": [{"digest": "../../x"}]}))
    with pytest.raises(errors.ImageError, match="not a sha256 digest"):
        read_base(tmp_path, "the image")


@pytest.mark.parametrize(
    ("image", "image_id", "expected"),
    [
        ("127.0.0.1:5000/t/base:1", f"127.0.0.1:5000/t/base@{DIGEST}", (f"127.0.0.1:5000/t/base@{DIGEST}", None)),
        ("busybox", f"docker.io/library/busybox@{DIGEST}", (f"busybox@{DIGEST}", None)),
        ("sandman.local/busybox:1.35", DIGEST, ("sandman.local/busybox:1.35", DIGEST)),
        ("ghcr.io/x/y:2", "", ("ghcr.io/x/y:2", None)),
    ],
)  # fmt: skip
def test_the_base_is_fetched_by_the_digest_the_node_ran(
    image: str, image_id: str, expected: tuple[str, str | None]
) -> None:
    assert base_reference(image, image_id) == expected


def test_repositories() -> None:
    assert repository_of("127.0.0.1:5000/a/b:1") == "127.0.0.1:5000/a/b"
    assert repository_of(f"a/b@{DIGEST}") == "a/b"
    assert repository_of("busybox:latest") == "busybox"


def test_a_scratch_directory_is_removed_only_once_its_maker_is_gone(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    with store.scratch() as scratch:
        (scratch / "blob").write_bytes(b"x")
        old = time.time() - 3600
        os.utime(scratch, (old, old))
        assert store.remove_strays() == []  # locked: its maker lives, however old
        assert scratch.is_dir()
    assert not scratch.exists()  # removed by its maker
    # A maker killed: its directory stays, unlocked; gone once past the grace.
    dead = tmp_path / "store" / ".image-dead"
    dead.mkdir()
    (dead / "layer").write_bytes(b"x")
    assert store.remove_strays() == []  # young: a maker may be about to lock it
    os.utime(dead, (time.time() - 60, time.time() - 60))
    assert store.remove_strays() == [".image-dead"]
    assert list((tmp_path / "store").iterdir()) == []
