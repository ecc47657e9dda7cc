from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.integrations.images import BUSYBOX, INSPECT_IMAGE, inspect_rootfs_tar

needs_local = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("crun") is None,
    reason="the adapters' end-to-end tests use the local provider: root and crun",
)


async def _leftovers(provider: LocalProvider) -> list[str]:
    """What the provider still holds; deleted here so that one test's leak fails only it."""
    left = await provider.list()
    for info in left:
        await provider.delete(info.id)
    return [info.id for info in left]


@pytest.fixture(scope="session")
def local_state(busybox_tar: Path) -> Iterator[Path]:
    """A state directory (short: the daemons' sockets live under it) with ``busybox``
    and ``busybox-inspect`` imported; nothing may be left in it at the end."""
    path = Path(tempfile.mkdtemp(prefix="sm-it-", dir="/tmp"))
    provider = LocalProvider(LocalConfig(state_dir=path))
    inspect_tar = inspect_rootfs_tar(busybox_tar, path.parent / f"{path.name}-inspect.tar")

    async def imports() -> None:
        await provider.images.import_archive(busybox_tar, name=BUSYBOX)
        await provider.images.import_archive(inspect_tar, name=INSPECT_IMAGE)

    try:
        asyncio.run(imports())
        yield path
        assert asyncio.run(_leftovers(provider)) == [], "sandboxes were left behind"
    finally:
        asyncio.run(provider.aclose())  # unmounts the state dir's disk filesystem
        inspect_tar.unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nothing_left(local_state: Path) -> Iterator[LocalProvider]:
    """The provider over ``local_state``, to assert a test left no sandbox in it."""
    provider = LocalProvider(LocalConfig(state_dir=local_state))
    yield provider
    left = asyncio.run(_leftovers(provider))
    asyncio.run(provider.aclose())
    assert left == [], "the test left sandboxes behind"
