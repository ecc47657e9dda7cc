"""The watchdog's sweep: only its own process's sandboxes, and past failures."""

from __future__ import annotations

import logging

import pytest

from sandman import errors
from sandman.client.watchdog import sweep
from sandman.models import SandboxSpec
from sandman.pool.owner import LABEL_OWNER
from sandman.providers.base import SandboxInfo
from sandman.testing import FakeProvider

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image="task")
DEAD = "p.000000000000.1.1.1"  # the watchdog's own pool process, by now gone
SUCCESSOR = "p.000000000000.1.2.2"


class FailsOnce(FakeProvider):
    """Each delete of ``stubborn`` fails the first ``times`` times."""

    def __init__(self, stubborn: set[str], times: int = 1) -> None:
        super().__init__(daemon=False)
        self.stubborn = stubborn
        self.failures: dict[str, int] = {}
        self.times = times

    async def delete(self, sandbox_id: str) -> None:
        if sandbox_id in self.stubborn and self.failures.get(sandbox_id, 0) < self.times:
            self.failures[sandbox_id] = self.failures.get(sandbox_id, 0) + 1
            raise errors.ProviderError(f"cgroups of {sandbox_id} still busy")
        await super().delete(sandbox_id)


async def test_a_successor_of_the_same_name_keeps_its_sandboxes() -> None:
    async with FakeProvider(daemon=False) as provider:
        old = {LABEL_OWNER: DEAD, "sandman.io/pool": "serve-host"}
        new = {LABEL_OWNER: SUCCESSOR, "sandman.io/pool": "serve-host"}
        for labels in (old, new, old, new):
            await provider.create(SPEC, labels=labels)
        assert await sweep(provider, old, backoff=0.01) == 2
        assert [info.labels for info in await provider.list()] == [new, new]


async def test_one_failed_delete_does_not_stop_the_sweep(caplog: pytest.LogCaptureFixture) -> None:
    labels = {LABEL_OWNER: DEAD, "sandman.io/pool": "p"}
    ids = [f"sb-{n}" for n in range(4)]
    async with FailsOnce({ids[0], ids[2]}) as provider:
        for sandbox_id in ids:
            await provider.create(SPEC, sandbox_id=sandbox_id, labels=labels)
        with caplog.at_level(logging.WARNING, logger="sandman.client.watchdog"):
            assert await sweep(provider, labels, backoff=0.01) == 4
        assert await provider.list() == []
        assert provider.failures == {ids[0]: 1, ids[2]: 1}
        assert f"delete {ids[0]} failed" in caplog.text


async def test_a_sweep_gives_up_after_its_rounds_and_says_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    labels = {LABEL_OWNER: DEAD, "sandman.io/pool": "p"}
    async with FailsOnce({"sb-stubborn"}, times=100) as provider:
        await provider.create(SPEC, sandbox_id="sb-stubborn", labels=labels)
        await provider.create(SPEC, sandbox_id="sb-easy", labels=labels)
        with caplog.at_level(logging.WARNING, logger="sandman.client.watchdog"):
            assert await sweep(provider, labels, attempts=3, backoff=0.01) == 1
        assert provider.failures == {"sb-stubborn": 3}
        assert "gave up after 3 rounds; left: sb-stubborn" in caplog.text
        provider.times = 0
        await provider.delete("sb-stubborn")


async def test_a_sandbox_relabelled_meanwhile_is_spared() -> None:
    """A successor adopted it between the sweep's list and its delete."""

    class Adopting(FakeProvider):
        async def inspect(self, sandbox_id: str) -> SandboxInfo:
            await self.relabel(sandbox_id, {LABEL_OWNER: SUCCESSOR})
            return await super().inspect(sandbox_id)

    labels = {LABEL_OWNER: DEAD, "sandman.io/pool": "p"}
    async with Adopting(daemon=False) as provider:
        adopted = await provider.create(SPEC, labels=labels)
        assert await sweep(provider, labels, backoff=0.01) == 0
        assert [info.id for info in await provider.list()] == [adopted.id]
