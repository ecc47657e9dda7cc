"""Waiting in tests: on a condition, with a deadline, never a fixed sleep.

A test that sleeps a fixed time either wastes it or, on a loaded 2-core
machine, asserts before the thing it waits for happened. These poll instead
and fail with what they waited for.
"""

from __future__ import annotations

import builtins
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

import anyio

from sandman.models import SandboxSpec
from sandman.pool.owner import LABEL_OWNER
from sandman.providers.base import BackendOwners, OwnerStatus, Provider, SandboxInfo

__all__ = ["Delegating", "alive", "eventually", "until", "wait_for"]

T = TypeVar("T")


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (what waits for a death polls)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone; or reaped between the open and the read (ESRCH)
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    *,
    what: str = "the condition",
    interval: float = 0.005,
) -> None:
    """Return once ``condition()`` (plain or async) is true; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(interval)


async def wait_for(
    what: str, timeout: float, check: Callable[[], Awaitable[T | None]], *, interval: float = 0.2
) -> T:
    """The first truthy answer of ``check()``; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(interval)


def until(
    what: str,
    condition: Callable[[], bool],
    timeout: float = 10.0,
    why: Callable[[], str] | None = None,
    *,
    interval: float = 0.01,
) -> None:
    """`eventually` for synchronous code; ``why()`` adds detail to the failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            detail = f": {why()}" if why is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


class Delegating:
    """A provider that passes each call of the base `Provider` protocol to ``inner``, and
    has nothing more (no `WatchesLost`): override what a test changes."""

    name = "delegating"

    def __init__(self, inner: Provider) -> None:
        self.inner = inner

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        return await self.inner.create(spec, sandbox_id=sandbox_id, labels=labels)

    async def delete(self, sandbox_id: str) -> None:
        await self.inner.delete(sandbox_id)

    def progress(self, sandbox_id: str) -> str | None:
        return self.inner.progress(sandbox_id)

    async def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        return await self.inner.list(labels=labels)

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        await self.inner.relabel(sandbox_id, labels)

    async def inspect(self, sandbox_id: str) -> SandboxInfo:
        return await self.inner.inspect(sandbox_id)

    async def aclose(self) -> None:
        await self.inner.aclose()


class OwnerRecords(Delegating):
    """A provider that keeps owner records on its backend (`KeepsOwners`, as Kubernetes'
    Leases): ``statuses`` and ``versions`` by owner, set by the test; this process's
    pool is ``OwnerRecords.ME``."""

    ME = "k.me"

    def __init__(self, inner: Provider) -> None:
        super().__init__(inner)
        self.statuses: dict[str, OwnerStatus] = {}
        self.versions: dict[str, str] = {}
        self.forgotten: list[str] = []

    async def open_owner(self) -> str | None:
        self.statuses[self.ME], self.versions[self.ME] = "alive", "1"
        return self.ME

    async def close_owner(self) -> None:
        self.statuses.pop(self.ME, None)

    async def owners(self) -> BackendOwners:
        return BackendOwners(
            statuses=dict(self.statuses), prefix="k.", versions=dict(self.versions), longest=0.5
        )

    async def forget_owner(self, owner: str, version: str | None = None) -> bool:
        if await self.inner.list(labels={LABEL_OWNER: owner}):
            return False
        self.statuses.pop(owner, None)
        self.forgotten.append(owner)
        return True
