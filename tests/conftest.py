from __future__ import annotations

from pathlib import Path

import pytest

from tests.images.builders import busybox_rootfs_tar


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def busybox_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rootfs tarball of a tiny image made from the host's static busybox."""
    return busybox_rootfs_tar(tmp_path_factory.mktemp("images") / "busybox-rootfs.tar")
