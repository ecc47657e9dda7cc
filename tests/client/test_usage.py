"""What a rollout cost: `sb.usage()` and the result of `sb.release()`, embedded and over the
service, from the kernel's accounting of a real sandbox."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import sandman
from sandman.providers.local import LocalProvider
from sandman.server import TenantLimits
from tests.client.test_snapshots import local_service
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import KEY_A
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

WORK = (
    "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; "  # CPU
    "x=$(head -c 40000000 /dev/zero | tr '\\0' a); "  # ~40 MB held for a moment
    "head -c 10485760 /dev/urandom > /root/written; sync; "  # 10 MiB on its disk
    "gw=$(ip route | awk '/default/ {print $3}'); echo hi | nc -w 1 $gw 9 || true"  # packets out
)


def check(used: sandman.Usage | None) -> None:
    assert used is not None
    assert used.cpu_seconds is not None and used.cpu_seconds > 0.1
    assert used.memory_peak_bytes is not None and used.memory_peak_bytes > 40_000_000
    average = used.memory_average_bytes
    assert average is not None and 0 < average <= used.memory_peak_bytes
    assert used.disk_bytes is not None and used.disk_bytes >= 10 * 2**20
    assert used.net_tx_bytes is not None and used.net_tx_bytes > 0
    assert used.at > 0


async def test_a_rollout_says_what_it_used(
    local_state: Path, imported: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    read = LocalProvider.usage

    async def counted(self: LocalProvider, sandbox_id: str) -> sandman.Usage:
        reads.append(sandbox_id)
        return await read(self, sandbox_id)

    monkeypatch.setattr(LocalProvider, "usage", counted)
    async with sandman.local(state_dir=local_state) as client:
        sb = await client.acquire("busybox", network="isolated", memory="256Mi")
        before = await sb.usage()
        assert before is not None and before.disk_bytes is not None
        await sb.exec(["sh", "-c", WORK], timeout=60, check=True)
        check(await sb.usage())
        reads.clear()
        check(await sb.release())
        assert await sb.release() is None  # released already

        async def deleted() -> bool:
            return not await imported.list()

        await eventually(deleted, what="the released sandbox deleted")
        assert reads == [sb.id]  # the release's read stands for the delete's


async def test_over_the_service_too(local_state: Path, imported: LocalProvider) -> None:
    async with (
        local_service(imported, {"a": TenantLimits()}) as url,
        sandman.connect(url, api_key=KEY_A) as client,
    ):
        sb = await client.acquire("busybox", network="isolated", memory="256Mi")
        await sb.exec(["sh", "-c", WORK], timeout=60, check=True)
        check(await sb.usage())
        check(await sb.release())
        # Counted when its delete reads it, in the background after the release.
        async with httpx.AsyncClient(base_url=url) as http:

            async def counted() -> bool:
                text = (await http.get("/metrics")).text
                lines = [
                    x for x in text.splitlines() if x.startswith("sandman_usage_cpu_seconds_total")
                ]
                return bool(lines) and float(lines[0].split()[-1]) > 0.1

            await eventually(counted, what="the rollout's CPU in sandman_usage_cpu_seconds_total")
