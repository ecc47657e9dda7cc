"""A deleted sandbox's disk blocks go back to the host, even when the pool closes at
once (red team, walls 20): the sparse image kept them when discards were still queued
at the unmount, and nothing trimmed at the next mount."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

MIB = 2**20
WRITTEN = 256 * MIB  # bounded: the red team wrote 1 GiB


def _allocated(image: Path) -> int:
    """Host bytes the sparse image takes."""
    return image.stat().st_blocks * 512


async def test_a_deleted_sandbox_s_blocks_are_freed_when_the_pool_closes_at_once(
    state_dir: Path, busybox_tar: Path
) -> None:
    image = state_dir / "disk.img"
    async with provider_for(config_for(state_dir), busybox_tar) as provider:
        info = await provider.create(SandboxSpec(image="busybox", disk="512Mi"))
        before = _allocated(image)
        sb = await ready(info)
        try:
            # Random data: nothing for btrfs to compress or share.
            done = await sb.exec(f"head -c {WRITTEN} /dev/urandom >/data.bin && sync", timeout=120)
            assert done.exit_code == 0, done.stderr
        finally:
            await sb.aclose()
        written = _allocated(image)
        assert written - before >= WRITTEN * 0.9, (before, written)
        await provider.delete(info.id)
    # The pool closed right after the delete: the filesystem is unmounted.
    assert _allocated(image) < before + 32 * MIB, (before, written, _allocated(image))
