"""The provider's list on the hack/kube cluster while its watch runs: names from the API
server (a table, no pod objects), the rest from the watch; the same answer as a list of
whole pods, states and losses included. Pods on KWOK nodes (no daemon)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import pytest

from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import BUSYBOX, KWOK, POOL, Admin, provider_for
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 180)]


@pytest.fixture
async def provider(kube_cluster: KubeCluster) -> AsyncIterator[KubernetesProvider]:
    async with provider_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY) as provider:
        yield provider


@pytest.fixture
async def plain(kube_cluster: KubeCluster) -> AsyncIterator[KubernetesProvider]:
    """A provider whose watch never starts: it lists whole pods."""
    async with provider_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY) as provider:
        yield provider


def whole_pod_lists(provider: KubernetesProvider) -> list[str]:
    """Records each list of whole pods the provider's API client makes (its selectors)."""
    made: list[str] = []
    pages = provider.api.pod_pages

    def counted(
        selector: str, **kwargs: Any
    ) -> AsyncGenerator[tuple[list[dict[str, Any]], str], None]:
        made.append(selector)
        return pages(selector, **kwargs)

    provider.api.pod_pages = counted  # type: ignore[method-assign]
    return made


def fields(infos: list[SandboxInfo]) -> list[tuple[Any, ...]]:
    return sorted(
        (i.id, i.state, i.labels, i.created_at, i.image, i.endpoint, i.lost) for i in infos
    )


async def test_a_list_takes_names_from_the_api_server_and_the_rest_from_the_watch(
    provider: KubernetesProvider, plain: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    spec = SandboxSpec(image=BUSYBOX, kubernetes=KWOK)
    labels = {POOL: pool_name}

    async def create(n: int) -> None:
        await provider.create(spec, labels={**labels, "n": str(n)})

    async with anyio.create_task_group() as group:
        for n in range(5):
            group.start_soon(create, n)
    assert provider.watch.current
    whole = whole_pod_lists(provider)

    listed = await provider.list(labels=labels)
    assert len(listed) == 5
    assert fields(listed) == fields(await plain.list(labels=labels))
    assert {i.state for i in listed} == {"running"}
    assert whole == []  # names only: no pod read whole

    # The API server pages the table as it pages pods.
    sizes = [len(names) async for names in provider.api.pod_names(f"{POOL}={pool_name}", page=2)]
    assert sizes == [2, 2, 1]

    # A relabel is listed at once, before the watch tells of it: the PATCH's answer.
    first = min(listed, key=lambda i: i.labels["n"]).id
    await provider.relabel(first, {"n": "moved", "gone": None})
    moved = await provider.list(labels={**labels, "n": "moved"})
    assert [(i.id, i.labels["n"]) for i in moved] == [(first, "moved")]

    # A pod the watch has not seen (created a moment ago) is read whole, and listed.
    del provider.watch.facts[first]
    again = await provider.list(labels=labels)
    assert fields(again) == fields(await plain.list(labels=labels))
    assert whole == []  # read by name, not by a list

    # A pod that stopped by itself: its state and why, from the watch.
    oom = {"name": "sandbox", "ready": False, "restartCount": 0, "image": BUSYBOX,
           "imageID": "", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}  # fmt: skip
    status = {"status": {"phase": "Failed", "containerStatuses": [oom]}}
    response = await admin.http.patch(
        f"{admin.pods}/{first}/status", json=status,
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )  # fmt: skip
    response.raise_for_status()

    async def stopped() -> list[SandboxInfo] | None:
        infos = await provider.list(labels=labels)
        return infos if any(i.state == "stopped" for i in infos) else None

    infos = await wait_for("the watch to tell of the stopped pod", 30, stopped)
    lost = {i.id: i.lost.reason for i in infos if i.lost is not None}
    assert lost == {first: "oom"}
    assert fields(infos) == fields(await plain.list(labels=labels))

    # Deleted behind the provider's back: not listed (the names are the API server's).
    await admin.delete(first)

    async def gone() -> bool:
        return first not in {i.id for i in await provider.list(labels=labels)}

    await wait_for("the deleted pod to leave the list", 30, gone)
    assert whole == []

    # A watch that is not current (its stream failed, not yet heard from again): whole pods.
    provider.watch._current = False
    assert fields(await provider.list(labels=labels)) == fields(await plain.list(labels=labels))
    assert whole == [f"app.kubernetes.io/managed-by=sandman,{POOL}={pool_name}"]
    for info in await plain.list(labels=labels):
        await plain.delete(info.id)
