"""Owners: a pool's process by pid and start time, and what pools do with dead ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import pytest

from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, owner
from sandman.pool.owner import LABEL_OWNER
from sandman.testing import FakeProvider
from tests.support import eventually

SPEC = SandboxSpec(image="task")
# A Kubernetes label value: at most 63 of [A-Za-z0-9-_.], alphanumeric at both ends.
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@pytest.fixture
def dead_owner() -> Iterator[str]:
    """The owner value of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["sleep", "600"])
    value = owner.of_process(process.pid)
    process.kill()
    process.wait()
    yield value


def test_this_process_is_alive_and_its_name_is_a_label_value() -> None:
    me = owner.current()
    assert LABEL_VALUE.match(me) and len(me) <= 63
    assert owner.status(me) == "alive"
    assert owner.describe(me) == f"process {os.getpid()}"


def test_an_exited_process_is_dead(dead_owner: str) -> None:
    assert owner.status(dead_owner) == "dead"


def test_a_zombie_is_dead() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    value = owner.of_process(process.pid)
    try:
        # Exited, not yet waited for: its pid and start time are still there.
        stat = Path(f"/proc/{process.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert owner.status(value) == "dead"
    finally:
        process.wait()


def test_a_reused_pid_is_not_its_old_owner() -> None:
    boot, namespace, pid, started = owner.current().split(".")[1:]
    reused = f"p.{boot}.{namespace}.{pid}.{int(started) + 1}"
    assert owner.status(reused) == "dead"


@pytest.mark.parametrize(
    "value",
    [
        "p.000000000000.1.1.1",  # another boot, or another host
        "p.{boot}.1.1.1",  # another pid namespace
        "lease.pool-a",  # a kind this version does not read
        "",
    ],
)
def test_what_cannot_be_told_here_is_unknown(value: str) -> None:
    boot = owner.current().split(".")[1]
    assert owner.status(value.format(boot=boot)) == "unknown"


# -- pools ------------------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=3)
    yield provider
    await provider.aclose()


def labels_of(pool: str, who: str | None) -> dict[str, str]:
    labels = {"sandman.io/pool": pool, "sandman.io/session": "s-1", "sandman.io/expires-at": "1e12"}
    if who is not None:
        labels[LABEL_OWNER] = who
    return labels


@pytest.mark.anyio
async def test_every_sandbox_names_its_pool_process_as_owner(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t")) as pool:
        record = await pool.acquire(SPEC, session=pool.open_session())
        assert record.labels[LABEL_OWNER] == pool.owner == owner.current()
        [info] = await fake.list()
        assert info.labels[LABEL_OWNER] == pool.owner


@pytest.mark.anyio
async def test_reconcile_reaps_dead_owners_of_any_pool_and_nothing_else(
    fake: FakeProvider, dead_owner: str
) -> None:
    # Lies about where the owners come from: another boot, another pid namespace.
    unknown = "p.000000000000.1.1.1"
    made = {
        name: (await fake.create(SPEC, labels=labels)).id
        for name, labels in {
            "dead, other pool": labels_of("other", dead_owner),
            "dead, no pool": {LABEL_OWNER: dead_owner},
            "alive, other pool": labels_of("other", owner.current()),
            "unknown, other pool": labels_of("other", unknown),
            "no owner, other pool": labels_of("other", None),
            "no labels at all": {},
        }.items()
    }
    async with Pool(fake, PoolConfig(name="t", reap_dead_owners=True)) as pool:
        await eventually(lambda: fake.live == 4)
        left = {info.id for info in await fake.list()}
        assert left == {
            made[name]
            for name in (
                "alive, other pool", "unknown, other pool", "no owner, other pool",
                "no labels at all",
            )
        }  # fmt: skip
        assert pool.list() == []


@pytest.mark.anyio
async def test_reaping_dead_owners_is_the_local_providers_default(
    fake: FakeProvider, dead_owner: str
) -> None:
    await fake.create(SPEC, labels=labels_of("other", dead_owner))
    async with Pool(fake, PoolConfig(name="t")) as pool:
        await pool.reconcile()
        assert fake.live == 1  # a fake is no local provider: its owners are not checked


@pytest.mark.anyio
async def test_same_name_in_another_live_process_is_left_alone(
    fake: FakeProvider, dead_owner: str
) -> None:
    other = owner.of_process(os.getppid())  # alive, and not this process
    theirs = await fake.create(SPEC, labels=labels_of("t", other))
    dead = await fake.create(SPEC, labels=labels_of("t", dead_owner))
    legacy = await fake.create(SPEC, labels=labels_of("t", None))
    async with Pool(fake, PoolConfig(name="t")) as pool:
        await eventually(lambda: fake.live == 1)
        assert [info.id for info in await fake.list()] == [theirs.id]
        assert {dead.id, legacy.id}.isdisjoint(r.id for r in pool.list())


@pytest.mark.anyio
async def test_adoption_makes_the_adopter_the_owner(fake: FakeProvider, dead_owner: str) -> None:
    left = await fake.create(SPEC, labels=labels_of("t", dead_owner))
    async with Pool(fake, PoolConfig(name="t", adopt_orphans=True)) as pool:
        assert pool.get(left.id).state == "leased"
        assert pool.get(left.id).labels[LABEL_OWNER] == pool.owner
        assert (await fake.inspect(left.id)).labels[LABEL_OWNER] == pool.owner
        pool.heartbeat("s-1")


class Unpatchable(FakeProvider):
    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        raise errors.ProviderError("fake: the backend refused the patch")


@pytest.mark.anyio
async def test_what_cannot_be_relabelled_is_not_adopted(dead_owner: str) -> None:
    async with Unpatchable(daemon=False) as fake:
        left = await fake.create(SPEC, labels=labels_of("t", dead_owner))
        async with Pool(fake, PoolConfig(name="t", adopt_orphans=True)) as pool:
            await eventually(lambda: fake.live == 0)
            assert left.id not in {r.id for r in pool.list()}


@pytest.mark.anyio
async def test_what_a_pool_leaves_at_close_is_no_longer_its_process_s(
    fake: FakeProvider,
) -> None:
    """Left for the next pool of the name: this process's exit must not make them a
    dead owner's, which any pool (and gc) would reap before the successor adopts them."""
    pool = Pool(fake, PoolConfig(name="t"))
    await pool.start()
    session = pool.open_session()
    held = await pool.acquire(SPEC, session=session)
    await pool.aclose(release=False)
    [left] = await fake.list()
    assert left.id == held.id and LABEL_OWNER not in left.labels
    async with Pool(fake, PoolConfig(name="t", adopt_orphans=True)) as successor:
        assert successor.get(held.id).state == "leased"
        assert (await fake.inspect(held.id)).labels[LABEL_OWNER] == successor.owner
