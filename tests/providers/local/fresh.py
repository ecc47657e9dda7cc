"""A local provider of a test's own: the state directory and cgroup parent nobody else uses."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.leaks import assert_nothing_left


@contextlib.asynccontextmanager
async def fresh_local_provider(
    image_tar: Path, images: tuple[str, ...] = ("busybox",)
) -> AsyncIterator[LocalProvider]:
    """A local provider with ``image_tar`` imported under each name of ``images``.

    At the end every sandbox is deleted, nothing of any kind may be left (see
    ``assert_nothing_left``), and then the state directory goes.
    """
    # Short on purpose: the daemon's socket path must fit in 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    config = LocalConfig(state_dir=state, cgroup_parent=f"/sandman-test/{uuid.uuid4().hex[:12]}")
    provider = LocalProvider(config)
    try:
        for name in images:
            await provider.images.import_archive(image_tar, name=name)
        yield provider
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        for snapshot in await provider.snapshots():
            await provider.delete_snapshot(snapshot.id)
        await provider.aclose()
        await assert_nothing_left(provider)
        shutil.rmtree(state, ignore_errors=True)
