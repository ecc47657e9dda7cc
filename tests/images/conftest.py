from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandman.images import ImageStore


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def assert_store_empty(root: Path) -> None:
    """Nothing of a failed import is left: no blob, layer, rootfs, metadata, temp or name."""
    for sub in ("blobs/sha256", "layers", "digests", "rootfs", "images", "tmp"):
        assert list((root / sub).iterdir()) == [], sub
    names = root / "names.json"
    assert not names.exists() or json.loads(names.read_text())["names"] == {}


def snapshot(path: Path) -> set[str]:
    """Every path under `path`, to compare before and after (lock files are meant to stay)."""
    found = {str(p.relative_to(path)) for p in path.rglob("*")}
    return {p for p in found if not p.startswith("store/locks/")}
