from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig


@pytest.fixture
def local_state(busybox_tar: Path) -> Iterator[Path]:
    """A short state dir with the busybox image imported as ``busybox``."""
    path = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def imported(local_state: Path, busybox_tar: Path) -> Iterator[LocalProvider]:
    """The provider behind ``sandman.local(state_dir=local_state)``; checks nothing is left.

    Sync on purpose (its own short event loops), so sync tests can use it too.
    """
    provider = LocalProvider(LocalConfig(state_dir=local_state))
    asyncio.run(provider.images.import_archive(busybox_tar, name="busybox"))
    yield provider

    async def sweep() -> list[str]:
        left = await provider.list()
        for info in left:
            await provider.delete(info.id)
        return [info.id for info in left]

    left = asyncio.run(sweep())
    asyncio.run(provider.aclose())  # unmounts the state dir's disk filesystem
    assert left == [], "the client left sandboxes behind"
    assert f" {local_state}/" not in Path("/proc/self/mountinfo").read_text(), "a mount is left"
