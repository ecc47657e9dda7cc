"""KubernetesProvider: one pod per sandbox, from the unmodified task image.

Create posts the pod (its labels are the recorded intent: a crash right
after leaves a pod that `list` finds by label), then waits on the shared
namespace watch until the pod runs with an IP, or fails with a typed error
as soon as its status says why (image, capacity). A transient image pull
failure (the registry's 429 or 5xx, a network error) waits on while the
kubelet retries, and the timeout names it. The pool then waits for the
daemon's health over the pod IP.

The daemon comes from an init container or, with ``daemon_delivery="image-volume"``,
an image volume; where the cluster cannot deliver it that way (the API server
dropped the volume, or the node's runtime cannot mount it), create fails at once
with a ConfigError that says to use the init container.

The same watch tells of a running sandbox's loss at once (`watch_lost`, `lost`):
its pod evicted, preempted, OOM-killed, exited or deleted by someone else.

The pool process is the owner of its pods through a Lease (`KeepsOwners`, see
`sandman.providers.kubernetes.owners`): one per provider, renewed in the background.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

import anyio

from sandman import errors
from sandman.egress import Egress
from sandman.images.registry import Credentials
from sandman.models import SandboxSpec
from sandman.providers.base import (
    BackendOwners,
    DaemonEndpoint,
    LostReports,
    SandboxInfo,
    SnapshotInfo,
)
from sandman.providers.kubernetes import egress, owners, pods
from sandman.providers.kubernetes.api import Forbidden, KubeAPI
from sandman.providers.kubernetes.credentials import load_credentials
from sandman.providers.kubernetes.snapshots import PodSnapshots, SnapshotStore
from sandman.providers.kubernetes.steering import NodeImages
from sandman.providers.kubernetes.watch import PodFacts, PodWatch
from sandman.providers.losses import LossFeed
from sandman.settings import KubernetesConfig

__all__ = ["KubernetesProvider"]

logger = logging.getLogger(__name__)

SECRET_SYNC_GRACE = 20.0
"""Seconds after a create in which an unauthorized pull of a pod naming pull secrets
is waited on: the kubelet's first retry comes 10 s after its first try."""


_UNSEEN_MAX = 500
"""Listed pods the watch has not seen (created a moment ago) read one by one, at most."""


def new_sandbox_id() -> str:
    """A fresh pod name."""
    return f"sb-{secrets.token_hex(6)}"


class KubernetesProvider:
    """Creates sandboxes as pods in one namespace; see `KubernetesConfig`."""

    name = "kubernetes"

    def __init__(self, config: KubernetesConfig | None = None) -> None:
        self.config = config or KubernetesConfig()
        credentials = load_credentials(self.config)
        self.namespace = credentials.namespace
        self.api = KubeAPI(
            credentials,
            timeout=self.config.request_timeout,
            max_connections=self.config.max_connections,
        )
        self._selector = "=".join(pods.MANAGED_BY)
        self.watch = PodWatch(self.api, self._selector, keep_facts=True)
        self.watch.others = self._on_pod
        self._watched: set[str] = set()  # pods whose loss `lost` reports
        self._losses = LossFeed(start=self.watch.ensure_started)
        self._progress: dict[str, str] = {}  # sandbox id -> what its start waits on
        self.node_images = NodeImages(self.api) if self.config.prefer_nodes_with_image else None
        self.lease: owners.LeaseKeeper | None = None
        self._owner_refused = False
        self._judge = owners.OwnerJudge(self.config.owner_grace)
        self._snapshots = PodSnapshots(self, credentials.server)

    def __repr__(self) -> str:
        return (
            f"KubernetesProvider(namespace={self.namespace!r}, readiness={self.config.readiness!r})"
        )

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        """Create the pod and wait until it runs (``readiness="pod"``: until it is Ready);
        with ``spec.snapshot``, until its daemon has the snapshot's files too."""
        if spec.snapshot is not None:
            return await self._snapshots.create_from(spec, sandbox_id=sandbox_id, labels=labels)
        return await self._create_pod(spec, sandbox_id=sandbox_id, labels=labels)

    async def _create_pod(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        token: str | None = None,
    ) -> SandboxInfo:
        name = sandbox_id or new_sandbox_id()
        token = token or secrets.token_urlsafe(32)
        preferred = await self.node_images.term(spec.image) if self.node_images else None
        body = pods.pod_manifest(
            name=name,
            spec=spec,
            labels=labels or {},
            token=token,
            config=self.config,
            preferred=preferred,
        )
        try:
            async with asyncio.timeout(self.config.start_timeout):
                await self.watch.ensure_started()
        except TimeoutError:
            raise errors.CreateTimeout(
                f"the pod watch did not list within {self.config.start_timeout} s"
            ) from None
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[pods.Started] = loop.create_future()
        pull_secrets = body["spec"].get("imagePullSecrets")
        began = loop.time()
        # The pull failure the kubelet retries, while the pod's status shows one: the
        # timeout names it (a sick registry, not a slow node).
        retrying: pods.PullRetrying | None = None

        def on_event(kind: str, pod: dict[str, Any]) -> None:
            nonlocal retrying
            if outcome.done():
                return
            if kind == "DELETED":
                outcome.set_exception(
                    errors.SandboxNotFound(f"pod {name} was deleted while starting")
                )
                return
            syncing = bool(pull_secrets) and loop.time() < began + SECRET_SYNC_GRACE
            result = pods.start_outcome(pod, self.config.readiness, secrets_syncing=syncing)
            self._progress[name] = (
                result.detail if isinstance(result, pods.PullRetrying) else pods.waiting_on(pod)
            )
            if isinstance(result, pods.Started):
                outcome.set_result(result)
            elif isinstance(result, errors.SandboxError):
                outcome.set_exception(result)
            else:
                retrying = result

        # The waiter comes first: the watch may see the pod before the POST returns.
        self.watch.add(name, on_event)
        self._progress[name] = "the pod is being created"
        try:
            try:
                created = await self.api.create_pod(body)
            except Forbidden as exc:
                # The Priority admission plugin's 403, not a missing permission.
                priority = body["spec"].get("priorityClassName")
                if priority and "no PriorityClass" in str(exc):
                    raise errors.ConfigError(
                        f"pod {name}: priority class {priority!r} does not exist in the "
                        "cluster (kubectl get priorityclasses)"
                    ) from None
                raise
            try:
                pods.check_delivery(created, self.config)
                await egress.start(self.api, created, spec)
                async with asyncio.timeout(self.config.start_timeout):
                    started = await outcome
            except BaseException as exc:
                # Also at the deadline: a pod whose pull the kubelet retries would stay.
                with anyio.CancelScope(shield=True):
                    try:
                        await self.api.delete_pod(name)
                    except errors.SandboxError:
                        # The pool deletes failed sandboxes with retries; the reconciler finds the rest.
                        logger.warning("cleanup of pod %s failed", name, exc_info=True)
                if isinstance(exc, TimeoutError):
                    late = f"pod {name} did not start within {self.config.start_timeout} s"
                    if retrying:
                        late += f"; the kubelet still retries the pull: {retrying.detail}"
                    raise errors.CreateTimeout(late) from None
                raise
        finally:
            self.watch.remove(name)
            self._progress.pop(name, None)
        info = self._info(created)
        endpoint = None
        if self.config.readiness == "daemon":
            endpoint = DaemonEndpoint(
                host=started.pod_ip, port=self.config.daemon_port, token=token
            )
        return info.model_copy(update={"state": "running", "endpoint": endpoint})

    async def set_egress(self, sandbox_id: str, rules: Egress) -> None:
        """Replace a running egress sandbox's rules: its NetworkPolicy (`egress`)."""
        await egress.set_egress(self.api, sandbox_id, rules)

    def progress(self, sandbox_id: str) -> str | None:
        """What the pod of a create in flight waits on, from the latest watch event."""
        return self._progress.get(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        """Delete the pod at once (grace 0); a missing pod is not an error."""
        self._watched.discard(sandbox_id)  # deleted here: no loss to tell of
        await self.api.delete_pod(sandbox_id)

    def watch_lost(self, sandbox: SandboxInfo) -> None:
        """Tell through `lost` when this sandbox's pod stops or is deleted by someone else."""
        self._watched.add(sandbox.id)

    def lost(self) -> LostReports:
        """Each watched sandbox whose pod stopped (evicted, OOM-killed...) or was deleted
        behind our back, from the namespace's pod watch, as it happens. Asking starts
        the watch (a pool asks before its first `list`, which then waits for the
        watch's read of every pod rather than making one of its own)."""
        with contextlib.suppress(RuntimeError):  # no event loop: the first read starts it
            self.watch.start()
        return self._losses.reader()

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = (pod.get("metadata") or {}).get("name", "")
        if name not in self._watched:
            return
        lost = pods.loss(pod, deleted=kind == "DELETED")
        if lost is not None:
            self._watched.discard(name)
            logger.info("sandbox %s lost (%s): %s", name, lost.reason, lost.detail)
            self._losses.report(lost)

    async def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """Every Sandman pod of the namespace whose labels include ``labels`` (a
        consistent, paged list).

        While the namespace's watch is current (a pool's), the API server is asked for
        the pods' names only and the rest is the watch's (`PodWatch.facts`): at 50,000
        pods, not 400 MB of pods to read and parse. A pod the watch has not seen yet is
        read whole. Without a current watch (`sandman gc`, the exit sweep, a pool's
        first pass) the pods are listed whole: their status is where states come from.
        """
        wanted = dict(labels or {})
        pods.validate_labels(wanted)
        selector = ",".join([self._selector, *(f"{k}={v}" for k, v in wanted.items())])
        if self.watch.started and not self.watch.current:
            # Started by `lost` for a pool: its list is the one read of whole pods.
            with contextlib.suppress(errors.SandboxError, TimeoutError):
                async with asyncio.timeout(self.config.start_timeout):
                    await self.watch.ensure_started()
        infos = await self._list_watched(selector) if self.watch.current else None
        if infos is None:
            infos = []
            async for chunk, _ in self.api.pod_pages(selector):
                infos.extend(self._info(pod) for pod in chunk)
        return sorted(infos, key=lambda info: info.created_at)

    async def _list_watched(self, selector: str) -> builtins.list[SandboxInfo] | None:
        """The pods' names listed, the rest from the watch; None when the watch knows too
        few of them (behind: a whole list is cheaper than reading them one by one)."""
        infos: builtins.list[SandboxInfo] = []
        unseen: builtins.list[str] = []
        facts = self.watch.facts
        async for names in self.api.pod_names(selector):
            facts = self.watch.facts  # a relist replaces them
            for name in names:
                known = facts.get(name)
                if known is None:
                    unseen.append(name)
                else:
                    infos.append(self._listed(name, known))
            if len(unseen) > _UNSEEN_MAX:
                return None
        gate = asyncio.Semaphore(32)

        async def read(name: str) -> None:
            async with gate:
                with contextlib.suppress(errors.SandboxNotFound):  # gone since: not listed
                    infos.append(self._info(await self.api.get_pod(name)))

        await asyncio.gather(*(read(name) for name in unseen))
        return infos

    def _listed(self, name: str, facts: PodFacts) -> SandboxInfo:
        endpoint = None
        if self.config.readiness == "daemon" and facts.ip and facts.token:
            endpoint = DaemonEndpoint(
                host=facts.ip, port=self.config.daemon_port, token=facts.token
            )
        return SandboxInfo(
            id=name, provider=self.name, state=facts.state, labels=facts.labels,
            created_at=facts.created_at, image=facts.image, endpoint=endpoint, lost=facts.lost,
        )  # fmt: skip

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        """Merge ``labels`` into the pod's labels (one PATCH)."""
        pods.validate_labels({k: v for k, v in labels.items() if v is not None})
        self.watch.saw(await self.api.patch_pod_labels(sandbox_id, labels))

    async def inspect(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox; SandboxNotFound when its pod is gone. A pod that was evicted,
        OOM-killed or exited is reported ``stopped`` (the SDK then says it is lost)."""
        return self._info(await self.api.get_pod(sandbox_id))

    def _info(self, pod: dict[str, Any]) -> SandboxInfo:
        daemon = self.config.readiness == "daemon"
        return pods.pod_info(pod, provider=self.name, port=self.config.daemon_port, daemon=daemon)

    async def open_owner(self) -> str | None:
        """This process's Lease (created on the first call, renewed until `close_owner`);
        None when the identity may not create Leases (logged once: its pods then name
        the local form of owner, which no other host can judge)."""
        if self.lease is not None:
            return self.lease.owner
        if self._owner_refused:
            return None
        keeper = owners.LeaseKeeper(self.api, duration=self.config.owner_lease)
        try:
            owner = await keeper.open()
        except Forbidden as exc:
            self._owner_refused = True
            logger.warning(
                "cannot create a Lease as this pool process's owner record (%s): its pods are "
                "reaped only by their lifetime if it dies; grant leases create/get/list/patch/"
                "delete (deploy/rbac.yaml)", exc,
            )  # fmt: skip
            return None
        self.lease = keeper
        return owner

    async def close_owner(self) -> None:
        """Stop renewing this process's Lease and delete it."""
        keeper, self.lease = self.lease, None
        if keeper is not None:
            await keeper.close()

    async def owners(self) -> BackendOwners:
        """Every Sandman Lease of the namespace, judged (`owners.OwnerJudge`): one list."""
        try:
            leases = await self.api.list_leases(self._selector)
        except BaseException:
            self._judge.interrupted()
            raise
        return self._judge.observe(leases, wall=time.time(), now=time.monotonic())

    async def forget_owner(self, owner: str, version: str | None = None) -> bool:
        """Delete a dead owner's Lease once no pod names it (a consistent list), and only
        at ``version`` (else its holder renewed it: it lives)."""
        return await owners.forget(self.api, owner, version, self._selector)

    # -- snapshots (sandman.providers.base.Snapshots; snapshots.py) ---------------------

    @property
    def snapshot_store(self) -> SnapshotStore:
        """Where this provider keeps its snapshots' files, on this host."""
        return self._snapshots.store

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        snapshot_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: bool = False,
    ) -> SnapshotInfo:
        """Keep the files the sandbox changed since it started, streamed by its daemon to
        ``config.snapshot_dir``; ``memory`` is a ConfigError (not on Kubernetes)."""
        return await self._snapshots.snapshot(
            sandbox_id, snapshot_id=snapshot_id, labels=labels, memory=memory
        )

    async def snapshots(
        self, *, labels: Mapping[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Every snapshot of this namespace kept on this host whose labels include ``labels``."""
        return await self._snapshots.snapshots(labels=labels)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot's files; waits for creates from it in flight. Idempotent."""
        await self._snapshots.delete_snapshot(snapshot_id)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Make the sandbox's pod again from the snapshot: same id, token and labels."""
        return await self._snapshots.restore(sandbox_id, snapshot_id)

    async def save_image(
        self,
        snapshot_id: str,
        reference: str,
        *,
        auth: Credentials | None = None,
        tls_verify: bool = True,
        timeout: float = 3600.0,
    ) -> str:
        """Push the snapshot's files over its image's to a registry as the image
        ``reference`` (a tag), which later creates can name; the pushed manifest's
        digest. Only the blobs the registry lacks are uploaded (`PodSnapshots.save_image`
        says what else it needs and raises)."""
        return await self._snapshots.save_image(
            snapshot_id, reference, auth=auth, tls_verify=tls_verify, timeout=timeout
        )

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Stop every process of the pod but its daemon (no CPU) until `resume`; the pod,
        id, lease and memory stay, and calls that would start a process raise
        `SandboxPaused`. ``memory``: a ConfigError that says what is supported."""
        await self._snapshots.pause(sandbox_id, memory=memory)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Continue the processes `pause` stopped."""
        return await self._snapshots.resume(sandbox_id)

    async def aclose(self) -> None:
        """Stop the watch and close the connections; pods are left as they are (and this
        process's Lease, unless `close_owner` deleted it, expires)."""
        if self.lease is not None:
            await self.lease.close(delete=False)
            self.lease = None
        self._losses.close()
        await self.watch.aclose()
        if self.node_images is not None:
            await self.node_images.aclose()
        await self.api.aclose()
