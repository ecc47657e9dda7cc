"""The chaos run's host inventory finds every kind of thing a sandbox holds, and only the run's."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.chaos import inventory
from tests.chaos.inventory import Scope, Tracker
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [pytest.mark.anyio, pytest.mark.chaos, needs_root_and_crun]


@pytest.fixture
async def scoped(busybox_tar: Path) -> AsyncIterator[tuple[Scope, LocalProvider]]:
    state = Path(tempfile.mkdtemp(prefix="smc-", dir="/tmp"))
    token = uuid.uuid4().hex[:8]
    scope = Scope(state, f"/sandman-chaos/{token}", f"chaos-{token}")
    provider = LocalProvider(LocalConfig(state_dir=state, cgroup_parent=scope.cgroup_parent))
    await provider.images.import_archive(busybox_tar, name="busybox")
    try:
        yield scope, provider
    finally:
        left = await asyncio.to_thread(inventory.scrub, scope, Tracker())
        shutil.rmtree(state, ignore_errors=True)
        assert left == []


async def test_every_kind_of_resource_is_found_and_goes(
    scoped: tuple[Scope, LocalProvider],
) -> None:
    scope, provider = scoped
    tracker = Tracker()
    assert await asyncio.to_thread(inventory.take, scope, tracker) == []
    made = [
        await provider.create(SandboxSpec(image="busybox", memory="64Mi", network=network))
        for network in ("none", "isolated", "egress")
    ]
    found = await asyncio.to_thread(inventory.take, scope, tracker)
    kinds = {item.kind for item in found}
    assert kinds >= {
        "container", "process", "mount", "cgroup", "dir", "runtime state", "disk layer",
        "disk mount", "loop", "net alloc", "netns", "veth", "nft",
    }, kinds  # fmt: skip
    assert {item.sandbox for item in found if item.sandbox} == {info.id for info in made}
    assert inventory.count(found) == 4, inventory.describe(found)  # three sandboxes, the disk
    for info in made:
        await provider.delete(info.id)
    await provider.aclose()
    assert await asyncio.to_thread(inventory.settle, scope, tracker, timeout=10) == []


async def test_what_is_left_is_named_by_its_sandbox(scoped: tuple[Scope, LocalProvider]) -> None:
    scope, provider = scoped
    tracker = Tracker()
    info = await provider.create(SandboxSpec(image="busybox", memory="64Mi", network="isolated"))
    # The record goes, the rest stays: as if a delete died half-way.
    shutil.rmtree(scope.sandboxes / info.id)
    left = await asyncio.to_thread(inventory.settle, scope, tracker, timeout=0.5)
    assert {item.sandbox for item in left} == {info.id, ""}  # "": the disk filesystem
    lines = inventory.describe(left)
    assert any(line.startswith(f"{info.id}: ") and "netns" in line for line in lines), lines
    assert await asyncio.to_thread(inventory.scrub, scope, tracker) == []
