"""``/v1/snapshots`` and a sandbox's snapshot, restore, pause and resume."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sandman.models import Snapshot
from sandman.pool.snapshots import to_snapshot
from sandman.server.routes._deps import Tenant, errors, service
from sandman.server.schemas import (
    PauseRequest,
    RestoreRequest,
    SandboxOut,
    SnapshotList,
    SnapshotRequest,
    sandbox_out,
)

router = APIRouter(tags=["snapshots"])

_HELD = ("sandbox_not_found", "sandbox_lost", "provider_error")


@router.post(
    "/v1/sandboxes/{sandbox_id}/snapshot",
    status_code=201,
    response_model=Snapshot,
    responses=errors(*_HELD, "invalid_request", "tenant_snapshot_limit", "shutting_down"),
)
async def snapshot(
    tenant: Tenant, sandbox_id: str, body: SnapshotRequest, request: Request
) -> Snapshot:
    """Keep the leased sandbox's files (and with ``memory``, its processes) as a snapshot;
    the sandbox goes on. Acquire with ``spec.snapshot`` set to its id to make sandboxes
    from it (a fork)."""
    info = await service(request).snapshot(tenant, sandbox_id, memory=body.memory, ttl=body.ttl)
    return to_snapshot(info)


@router.post(
    "/v1/sandboxes/{sandbox_id}/restore",
    response_model=SandboxOut,
    responses=errors(*_HELD, "snapshot_not_found", "invalid_request", "image_not_found"),
)
async def restore(tenant: Tenant, sandbox_id: str, body: RestoreRequest, request: Request) -> Any:
    """Reset the leased sandbox to the snapshot in place: same id and lease, its daemon's
    new endpoint in the answer."""
    record = await service(request).restore(tenant, sandbox_id, body.snapshot)
    return sandbox_out(record, endpoint=True)


@router.post("/v1/sandboxes/{sandbox_id}/pause", status_code=204, responses=errors(*_HELD))
async def pause(
    tenant: Tenant, sandbox_id: str, request: Request, body: PauseRequest | None = None
) -> Response:
    """Stop every process of the leased sandbox (no CPU) until resumed; with ``memory``,
    checkpointed to disk (no memory held either; gVisor with its own network stack)."""
    await service(request).pause(tenant, sandbox_id, memory=body.memory if body else False)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/resume", status_code=204, responses=errors(*_HELD))
async def resume(tenant: Tenant, sandbox_id: str, request: Request) -> Response:
    """Let the paused sandbox run again."""
    await service(request).pause(tenant, sandbox_id, resume=True)
    return Response(status_code=204)


@router.get("/v1/snapshots", response_model=SnapshotList, responses=errors())
async def list_snapshots(tenant: Tenant, request: Request) -> SnapshotList:
    """The tenant's snapshots, oldest first."""
    return SnapshotList(snapshots=[to_snapshot(s) for s in service(request).snapshots(tenant)])


@router.get(
    "/v1/snapshots/{snapshot_id}",
    response_model=Snapshot,
    responses=errors("snapshot_not_found"),
)
async def get_snapshot(tenant: Tenant, snapshot_id: str, request: Request) -> Snapshot:
    """One of the tenant's snapshots."""
    return to_snapshot(service(request).get_snapshot(tenant, snapshot_id))


@router.delete(
    "/v1/snapshots/{snapshot_id}",
    status_code=204,
    responses=errors("snapshot_not_found", "provider_error"),
)
async def delete_snapshot(tenant: Tenant, snapshot_id: str, request: Request) -> Response:
    """Delete the tenant's snapshot; sandboxes made from it keep their files."""
    await service(request).delete_snapshot(tenant, snapshot_id)
    return Response(status_code=204)
