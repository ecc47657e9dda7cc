"""A spec asking for more than the host has (``memory="4Ti"`` on a 24 GiB host): a
warning by default, refused when the operator says so (`LocalConfig.beyond_host`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import beyond_host, host_size
from tests.providers.local.conftest import config_for, needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider

GiB = 2**30


@pytest.mark.parametrize(
    ("memory", "cpu", "said"),
    [
        (24 * GiB, 8.0, None),
        (4096 * GiB, 1.0, "memory 4096.0 GiB > the host's 24.0 GiB"),
        (GiB, 16.0, "cpu 16 > the host's 8 CPUs"),
        (48 * GiB, 8.5, "memory 48.0 GiB > the host's 24.0 GiB; cpu 8.5 > the host's 8 CPUs"),
    ],
)
def test_what_a_host_cannot_give(memory: int, cpu: float, said: str | None) -> None:
    assert beyond_host(memory, cpu, 24 * GiB, 8) == said


@needs_root_and_crun
@pytest.mark.anyio
async def test_refused_when_the_operator_says_so(state_dir: Path) -> None:
    provider = LocalProvider(config_for(state_dir, beyond_host="refuse"))
    memory, _ = host_size()
    spec = SandboxSpec(image="busybox", memory=memory + GiB)
    with pytest.raises(sandman.ConfigError, match="more than this host has: memory .* GiB"):
        await provider.create(spec)
    assert await provider.list() == []  # refused before anything was made
    await provider.aclose()


@needs_root_and_crun
@pytest.mark.anyio
async def test_warned_once_by_default_and_made(
    busybox_tar: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = SandboxSpec(image="busybox", memory="4Ti", pids=64)
    async with fresh_local_provider(busybox_tar) as provider:
        with caplog.at_level(logging.WARNING, logger="sandman.providers.local.provider"):
            first = await provider.create(spec)
            second = await provider.create(spec)
        warned = [r.getMessage() for r in caplog.records if "more than this host" in r.getMessage()]
        assert len(warned) == 1 and "memory 4096.0 GiB > the host's" in warned[0]
        assert "beyond_host='refuse'" in warned[0]
        assert [i.state for i in await provider.list()] == ["running", "running"]
        for info in (first, second):
            await provider.delete(info.id)
