"""The OCI runtime driver (`OCIRuntime`): how many runtime processes run at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sandman.providers.local import runtime, spawn
from sandman.providers.local.runtime import OCIRuntime

pytestmark = pytest.mark.anyio


async def test_a_thousand_deletes_run_at_most_max_processes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pool closing with thousands of sandboxes deletes them all at once: the host
    # gets them a few dozen runtime processes at a time, not thousands.
    running = most = 0

    async def fake(argv: Sequence[str], **_: Any) -> spawn.Completed:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001)
        running -= 1
        return spawn.Completed(0, b"", b"")

    monkeypatch.setattr(spawn, "run", fake)
    oci = OCIRuntime("crun", tmp_path, kind="crun", timeout=10)
    await asyncio.gather(*(oci.delete(f"sb-{i}") for i in range(1000)))
    assert most == runtime.MAX_PROCESSES

    # Another event loop (a second asyncio.run) gets a gate of its own.
    def again() -> None:
        asyncio.run(oci.delete("sb-x"))

    await asyncio.to_thread(again)
