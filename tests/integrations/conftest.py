"""Fixtures for the adapters' tests: a local state directory with the busybox image, made
the adapters' own (``SANDMAN_STATE_DIR``), and checked empty afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.integrations._client import ENV_API_KEY, ENV_STATE_DIR, ENV_URL, close_shared
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.integrations.images import BUSYBOX, INSPECT_IMAGE, inspect_rootfs_tar
from tests.support import until

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent's banner at import


def leftovers(provider: LocalProvider) -> list[str]:
    """What the state directory still holds: sandboxes listed, their directories, containers."""
    state = provider.config.state_dir
    listed = [info.id for info in asyncio.run(provider.list())]
    dirs = (
        [p.name for p in (state / "sandboxes").iterdir()] if (state / "sandboxes").exists() else []
    )
    crun = state / "runtime" / "crun"
    containers = [p.name for p in crun.iterdir()] if crun.exists() else []
    return listed + dirs + containers


def assert_gone(provider: LocalProvider, timeout: float = 30.0) -> None:
    """Wait until nothing is left (a released sandbox is deleted in the background)."""
    until(
        "the sandboxes to be gone",
        lambda: not leftovers(provider),
        timeout,
        why=lambda: f"left: {leftovers(provider)}",
    )


@contextlib.contextmanager
def state_with(archives: dict[str, Path]) -> Iterator[LocalProvider]:
    """A fresh state directory with ``archives`` imported (name: archive), and the provider
    on it; at the end whatever is left is deleted, its disk unmounted, the directory removed."""
    path = Path(tempfile.mkdtemp(prefix="sm-int-", dir="/tmp"))
    provider = LocalProvider(LocalConfig(state_dir=path))
    try:

        async def load() -> None:
            for name, archive in archives.items():
                await provider.images.import_archive(archive, name=name)

        asyncio.run(load())
        yield provider
    finally:

        async def sweep() -> None:
            for info in await provider.list():
                await provider.delete(info.id)
            await provider.aclose()  # unmounts the state dir's disk filesystem

        asyncio.run(sweep())
        shutil.rmtree(path, ignore_errors=True)
    assert f" {path}/" not in Path("/proc/self/mountinfo").read_text(), "a mount is left"


@contextlib.contextmanager
def adapters_on(provider: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The adapters' embedded pool on ``provider``'s state directory for the block; at its end
    the shared clients are closed and nothing may be left: no sandbox, no sandbox directory,
    no container."""
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    monkeypatch.setenv(ENV_STATE_DIR, str(provider.config.state_dir))
    try:
        yield
        close_shared()
        assert leftovers(provider) == [], "the adapter left sandboxes behind"
    finally:
        close_shared()


@pytest.fixture
def local_provider(busybox_tar: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalProvider]:
    """The provider behind the adapters' embedded pool, on a fresh state directory with
    busybox imported as ``busybox``; nothing may be left at the end (`adapters_on`)."""
    with state_with({"busybox": busybox_tar}) as provider, adapters_on(provider, monkeypatch):
        yield provider


# -- the inspect_ai and Harbor adapters' ------------------------------------------------------

needs_local = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("crun") is None,
    reason="the adapters' end-to-end tests use the local provider: root and crun",
)


@pytest.fixture(scope="session")
def inspect_tar(busybox_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``busybox-inspect`` image's rootfs (`tests.integrations.images`)."""
    return inspect_rootfs_tar(busybox_tar, tmp_path_factory.mktemp("images") / "inspect.tar")


@contextlib.contextmanager
def busybox_state(busybox_tar: Path, inspect_tar: Path) -> Iterator[LocalProvider]:
    """`local_provider` for a longer scope: ``busybox`` and ``busybox-inspect`` imported."""
    with (
        state_with({BUSYBOX: busybox_tar, INSPECT_IMAGE: inspect_tar}) as provider,
        pytest.MonkeyPatch.context() as monkeypatch,
        adapters_on(provider, monkeypatch),
    ):
        yield provider


@pytest.fixture
def busybox_provider(busybox_tar: Path, inspect_tar: Path) -> Iterator[LocalProvider]:
    """A fresh state directory with both busybox images, the adapters' (`adapters_on`)."""
    with busybox_state(busybox_tar, inspect_tar) as provider:
        yield provider
