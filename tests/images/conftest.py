from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.images import ImageStore
from tests.images.registry_server import Registry, missing_tools, start_registry
from tests.providers.local.conftest import state_dir  # noqa: F401 (a fixture, shared)


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """An open registry of this test's own, logging every request."""
    if missing_tools() is not None:
        pytest.skip(missing_tools() or "")
    server = start_registry(tmp_path / "registry", access_log=True)
    try:
        yield server
    finally:
        server.stop()


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


@pytest.fixture
def skopeo_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put a ``skopeo`` first on PATH that records what it was given, then runs the real one.

    Returns the directory where it records: ``args``, ``cwd``, ``pid``, ``authfile-mode``
    and ``authfile`` (a copy of the auth file, when there was one).
    """
    real = _which("skopeo")
    record = tmp_path / "shim"
    bin_dir = tmp_path / "bin"
    record.mkdir()
    bin_dir.mkdir()
    shim = bin_dir / "skopeo"
    shim.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{record}/args"\n'
        f'pwd > "{record}/cwd"\n'
        "if [ -e auth.json ]; then\n"
        f'  stat -c %a auth.json > "{record}/authfile-mode"\n'
        f'  cp auth.json "{record}/authfile"\n'
        "fi\n"
        # Whole or not at all: a reader waits for it to exist, then reads it.
        f'echo $$ > "{record}/pid.new" && mv "{record}/pid.new" "{record}/pid"\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return record


def _which(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        pytest.skip(f"needs {tool}")
    return found
