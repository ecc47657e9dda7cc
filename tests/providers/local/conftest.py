from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from sandman.daemon import DaemonClient
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.leaks import assert_nothing_left

needs_root_and_crun = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("crun") is None,
    reason="the local provider needs root and crun (scripts/setup installs crun)",
)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short on purpose: the daemon's socket path must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config_for(state_dir: Path, **settings: Any) -> LocalConfig:
    """A provider's settings for one test: its own state dir and cgroup parent."""
    cgroup_parent = f"/sandman-test/{uuid.uuid4().hex[:12]}"
    return LocalConfig(state_dir=state_dir, cgroup_parent=cgroup_parent, **settings)


@asynccontextmanager
async def provider_for(config: LocalConfig, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    """A local provider with the busybox image imported as ``busybox``.

    At the end it deletes whatever a test left, then asserts that nothing of
    any kind (container, cgroup, mount, network, process, file) is left behind.
    """
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    try:
        yield provider
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        for snapshot in await provider.snapshots():
            await provider.delete_snapshot(snapshot.id)
        assert await provider.network.list() == []
        await provider.network.reset()
        await provider.aclose()
        await assert_nothing_left(provider)


@pytest.fixture
async def provider(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    """The default local provider (crun), checked for leftovers at the end."""
    async with provider_for(config_for(state_dir), busybox_tar) as made:
        yield made


async def ready(info: SandboxInfo) -> DaemonClient:
    """A client of ``info``'s daemon once it answers (close it with ``aclose``)."""
    assert info.endpoint is not None
    client = info.endpoint.client()
    await client.wait_ready(timeout=10)
    return client
