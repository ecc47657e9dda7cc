"""A real ResourceQuota refusal is a CapacityError at once, on the hack/kube cluster.

The quota (made and removed by the admin identity, under a name of this run)
limits ``requests.ephemeral-storage`` to 1Mi: only pods asking for ephemeral
storage count against it (a quota makes pods specify only cpu and memory),
so pods of others in the namespace that do not are untouched. The sandbox
asks for 256Mi and is refused at create, as the ordinary identity ``sandman``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from sandman import errors
from sandman.providers.kubernetes import KubernetesProvider
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

START_TIMEOUT = 120.0


@pytest.fixture
async def quota(kube_cluster: KubeCluster, admin: Admin) -> AsyncIterator[str]:
    """A ResourceQuota of this test only, enforced when yielded, gone (not just deleted) after."""
    name = f"t7q-{uuid.uuid4().hex[:8]}"
    url = f"/api/v1/namespaces/{kube_cluster.namespace}/resourcequotas"
    body = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": name, "labels": {"sandman.io/test": "quota"}},
        "spec": {"hard": {"requests.ephemeral-storage": "1Mi"}},
    }
    created = await admin.http.post(url, json=body)
    assert created.status_code == 201, created.text
    try:

        async def enforced() -> dict[str, Any] | None:
            # Admission refuses with "status unknown" until the quota controller counted.
            response = await admin.http.get(f"{url}/{name}")
            response.raise_for_status()
            status: dict[str, Any] = response.json().get("status") or {}
            return status if "used" in status else None

        await wait_for(f"quota {name} to be counted", 30, enforced)
        yield name
    finally:
        with anyio.CancelScope(shield=True):
            await admin.http.delete(f"{url}/{name}")

            async def gone() -> bool:
                return (await admin.http.get(f"{url}/{name}")).status_code == 404

            await wait_for(f"quota {name} to go", 30, gone)


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_a_quota_refusal_is_a_capacity_error_at_once(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, quota: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster, start_timeout=START_TIMEOUT))
    try:
        spec = real_node_spec(kube_cluster)
        assert spec.kubernetes.ephemeral_storage == 256 * 2**20
        started = time.monotonic()
        with pytest.raises(errors.CapacityError, match=f"exceeded quota: {quota}") as refused:
            await provider.create(spec, labels={POOL: pool_name})
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"the refusal took {elapsed:.1f} s"
        assert "requests.ephemeral-storage" in str(refused.value)
        assert refused.value.retryable
        assert await admin.names(pool_name) == []  # refused at admission: no pod at all
    finally:
        await provider.aclose()
