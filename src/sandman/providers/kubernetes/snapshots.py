"""Snapshots of pods' files, kept by the pool (`sandman.providers.base.Snapshots` on
Kubernetes; docs/snapshots.md says why this route).

(About 610 lines, one piece: snapshot, fork, restore, save and pause each go through the
same pod lookup, daemon client and lost-pod errors; the records and the image push
already live apart.)

A pod's writable layer is the node's, out of the pool's reach, so the daemon sends
what the sandbox changed: ``GET /v1/changes`` is a tar stream of every entry whose
ctime is at or after the daemon's start (nothing else runs in a pod before its daemon,
and nothing can move a ctime back), each changed directory followed by the list of
every name it holds, so that removals travel too. No listing is taken at start: a pod
that is never snapshotted pays nothing.

The pool keeps the stream, checked and rewritten by `sandman.daemon.changes` (it comes
from inside a sandbox: hostile), as a file on its own host:
``<snapshot_dir>/<namespace>@<server>/<id>/`` holds ``meta.json`` (the record, written
first under a staging name and renamed into place, so a half-made snapshot is found
and deleted) and ``files.tar``. A sandbox made from it, a fork, is a pod of the same
image whose daemon applies the file (``PUT /v1/changes``) before the pod counts as
created: the pool's pacing and readiness cover it. A restore deletes the pod and
makes it again under the same name, token and labels (same id and lease) from the
snapshot: the image's files are only in the node's image layers, which the daemon
cannot reach, so a pod cannot be put back in place.

The snapshot's directory is flocked shared while a sandbox is made from it and
exclusively while it is deleted: a delete waits for the creates in flight.

`PodSnapshots.save_image` makes a snapshot an image in a registry (``sandman snapshot
save ID --as-image REF --kubernetes``): its image's layers, fetched with skopeo, and
the changes as one more layer (`sandman.providers.kubernetes.commit`), pushed with
skopeo, which uploads only the blobs the registry lacks. It works in a scratch
directory beside the snapshots (``.image-*``), flocked while its maker lives, so
``sandman gc`` removes one whose maker was killed.

A pause is the pod's daemon's (`sandman.daemon.pausing`): no freezer cgroup is writable
in a pod, so the daemon stops every other process of it with SIGSTOP until none runs,
stops again whatever a hostile sandbox gets running meanwhile, and refuses to start a
process until the resume. The pod, its id, lease and memory stay, and so does the
pause across a pool's restart: it is the daemon's state, not the pool's.

The records, their lock and their listing are `sandman.providers.snapshot_records`'s,
shared with the local provider's store; the image push is apart in
`sandman.providers.kubernetes.commit`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from sandman import errors
from sandman.daemon.changes import apply_changes, download_changes
from sandman.daemon.client import DaemonClient
from sandman.daemon.pausing import pause_processes, resume_processes
from sandman.images.registry import (
    PROBE_TIMEOUT,
    PUSH_DIR,
    PUSH_TAG,
    Credentials,
    parse_reference,
    probe_registry,
    push_with_skopeo,
    run_skopeo,
)
from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo, SnapshotInfo
from sandman.providers.kubernetes import commit, pods
from sandman.providers.snapshot_records import SnapshotRecords, new_snapshot_id, snapshot_id_of

if TYPE_CHECKING:
    from sandman.providers.kubernetes.provider import KubernetesProvider

__all__ = ["PodSnapshots", "SnapshotStore", "new_snapshot_id", "spec_of"]

logger = logging.getLogger(__name__)

_FILES = "files.tar"
_PARTIAL = ".files.tar.part"
_SCRATCH = ".image-"
# A scratch directory is flocked a moment after it is made; one older than this and
# not locked is a dead maker's.
_SCRATCH_GRACE = 10.0
_MAX_ENTRIES = 2_000_000
_GONE_TIMEOUT = 60.0

MEMORY_UNSUPPORTED = (
    "snapshots with memory are not supported by the kubernetes provider: they need the "
    "pods to run on gVisor (a RuntimeClass of containerd's runsc shim) and an agent on "
    "each node to run `runsc checkpoint` and to restore into a new pod (the kubelet's "
    "checkpoint API only writes CRIU archives, and restores nothing); "
    "snapshot(memory=False) keeps the files, and fork and restore work from it"
)
PAUSE_MEMORY_UNSUPPORTED = (
    "pause(memory=True) is not supported by the kubernetes provider: it would checkpoint "
    "the processes, which needs gVisor pods and an agent on each node; pause() stops "
    "every process (no CPU) and keeps the memory, and snapshot(), release and "
    "acquire(snapshot=...) free the memory too"
)


def spec_of(pod: Mapping[str, Any]) -> SandboxSpec:
    """The spec a pod was made from (its ``sandman.io/spec`` annotation); ConfigError for a
    pod made by an older Sandman, which has none."""
    metadata = pod.get("metadata") or {}
    given = (metadata.get("annotations") or {}).get(pods.SPEC)
    if not given:
        raise errors.ConfigError(
            f"pod {metadata.get('name')} records no spec (made by an older Sandman): "
            "it cannot be snapshotted or restored"
        )
    try:
        return SandboxSpec.model_validate_json(given)
    except ValidationError as exc:
        raise errors.ConfigError(f"pod {metadata.get('name')}: its recorded spec: {exc}") from None


def _token_of(pod: Mapping[str, Any]) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == pods.CONTAINER:
            for env in container.get("env") or []:
                if env.get("name") == pods.TOKEN_ENV:
                    return str(env.get("value"))
    return None


def _image_id(pod: Mapping[str, Any]) -> str:
    """The image the pod's task container runs, as the node resolved it (a digest)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == pods.CONTAINER:
            return str(status.get("imageID") or "")
    return ""


class SnapshotStore(SnapshotRecords):
    """The snapshots of one namespace of one cluster, on this host. Methods block: call
    them in a thread."""

    def __init__(self, root: Path, provider: str = "kubernetes") -> None:
        super().__init__(root, provider, "the snapshot directory")

    def files(self, snapshot_id: str) -> Path:
        """The snapshot's checked stream of changes."""
        return self._dir(snapshot_id) / _FILES

    def partial(self, snapshot_id: str) -> Path:
        """Where the stream is written while it arrives."""
        return self._dir(snapshot_id) / _PARTIAL

    def complete(self, snapshot_id: str) -> None:
        """The stream is whole: put it in place and mark the snapshot usable."""
        directory = self._dir(snapshot_id)
        os.replace(directory / _PARTIAL, directory / _FILES)
        self._update(snapshot_id, {"size": (directory / _FILES).stat().st_size, "complete": True})

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A private directory beside the snapshots to make an image in, removed after the
        block; flocked meanwhile, so that `remove_strays` takes only a dead maker's."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=_SCRATCH, dir=self.root))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)

    def _remove_stray(self, entry: os.DirEntry[str], deadline: float) -> bool:
        # Also the scratch directories of image makers that died.
        if entry.name.startswith(_SCRATCH):
            return _remove_dead_scratch(entry.path, time.time() - _SCRATCH_GRACE)
        return super()._remove_stray(entry, deadline)

    def _read(self, directory: Path) -> tuple[SnapshotInfo, bool] | None:
        try:
            return super()._read(directory)
        except ValueError:  # a record this Sandman cannot read: found, as a half-made one
            return None


def _remove_dead_scratch(path: str, deadline: float) -> bool:
    """Remove scratch directory ``path`` if it is older than ``deadline`` and no live
    process holds its lock; whether it did."""
    try:
        if os.stat(path, follow_symlinks=False).st_mtime >= deadline:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its maker lives
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


class PodSnapshots:
    """The kubernetes provider's snapshots: taken from, and applied by, pods' daemons."""

    def __init__(self, provider: KubernetesProvider, server: str) -> None:
        self._provider = provider
        cluster = hashlib.sha256(server.encode()).hexdigest()[:12]
        self.store = SnapshotStore(
            provider.config.snapshot_dir / f"{provider.namespace}@{cluster}", provider.name
        )

    def _check_daemon(self) -> None:
        if self._provider.config.readiness != "daemon":
            raise errors.ConfigError(
                "snapshots need the pods' daemons (readiness='daemon'), not readiness='pod'"
            )

    @contextlib.asynccontextmanager
    async def _held(self, snapshot_id: str) -> AsyncIterator[SnapshotInfo]:
        hold = self.store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        try:
            yield snapshot
        finally:
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    # -- taking -------------------------------------------------------------------

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        snapshot_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: bool = False,
    ) -> SnapshotInfo:
        """Keep the files the sandbox changed since it started (see the module docstring);
        it goes on running meanwhile, so a file written during the snapshot may be kept
        half-written: take it when the sandbox is idle. ``memory``: ConfigError."""
        if memory:
            raise errors.ConfigError(MEMORY_UNSUPPORTED)
        self._check_daemon()
        provider = self._provider
        pod = await provider.api.get_pod(sandbox_id)
        info = provider._info(pod)
        if info.state != "running" or info.endpoint is None:
            raise self._lost(sandbox_id, info)
        spec = spec_of(pod).model_copy(update={"snapshot": None})
        sid = snapshot_id_of(snapshot_id)
        record = {
            "id": sid, "labels": dict(labels or {}), "image": spec.image,
            "image_id": _image_id(pod), "created_at": time.time(), "source": sandbox_id,
            "spec": spec.model_dump(mode="json"), "memory": False,
        }  # fmt: skip
        store = self.store
        await store.add(sid, record)
        config = provider.config
        try:
            async with info.endpoint.client(request_timeout=config.request_timeout) as daemon:
                await download_changes(
                    daemon,
                    store.partial(sid),
                    max_bytes=config.snapshot_max_bytes,
                    max_entries=_MAX_ENTRIES,
                    timeout=config.snapshot_timeout,
                    source=f"the changes of sandbox {sandbox_id}",
                )
            await anyio.to_thread.run_sync(store.complete, sid)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(store.delete, sid)
                if isinstance(exc, errors.DaemonUnavailable):
                    # Its daemon died (the pod with it): nothing to keep, and why.
                    try:
                        now = provider._info(await provider.api.get_pod(sandbox_id))
                    except errors.SandboxError:
                        now = None
                    if now is None or now.state != "running":
                        raise self._lost(sandbox_id, now) from exc
            if isinstance(exc, OSError) and not isinstance(exc, errors.SandboxError):
                raise errors.ProviderError(
                    f"cannot keep snapshot {sid}: the snapshot directory failed at "
                    f"{exc.filename or store.root}: {exc.strerror or exc}"
                ) from exc
            raise
        return await anyio.to_thread.run_sync(store.get, sid)

    @staticmethod
    def _lost(
        sandbox_id: str, info: SandboxInfo | None, what: str = "nothing to keep"
    ) -> errors.SandboxLost:
        if info is None:
            return errors.SandboxLost.of(sandbox_id, "deleted", f"its pod is gone: {what}")
        if info.lost is not None:
            return errors.SandboxLost.of(
                sandbox_id, info.lost.reason, f"{info.lost.detail}: {what}"
            )
        return errors.SandboxLost.of(
            sandbox_id, "unknown", f"its pod is {info.state}, its daemon unreachable: {what}"
        )

    async def snapshots(
        self, *, labels: Mapping[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Every snapshot of this namespace kept on this host (half-made ones too)."""
        return await self.store.find(labels)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot's files and record; waits for creates from it in flight."""
        await self.store.drop(snapshot_id)

    # -- using ----------------------------------------------------------------------

    async def create_from(
        self, spec: SandboxSpec, *, sandbox_id: str | None, labels: Mapping[str, str] | None
    ) -> SandboxInfo:
        """A pod of the snapshot's image, given its files by its daemon before it counts
        as created; the snapshot is held (a delete waits) until then."""
        assert spec.snapshot is not None
        self._check_daemon()
        async with self._held(spec.snapshot) as snapshot:
            if spec.image != snapshot.image:
                raise errors.ConfigError(
                    f"snapshot {snapshot.id} is of image {snapshot.image!r}, not {spec.image!r}"
                )
            info = await self._provider._create_pod(spec, sandbox_id=sandbox_id, labels=labels)
            try:
                await self._apply(info, snapshot)
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await self._provider.api.delete_pod(info.id)
                raise
        return info

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Make the sandbox's pod again, same name, token and labels (so same id and lease),
        from the snapshot: every process ends, the files are the snapshot's."""
        self._check_daemon()
        provider = self._provider
        async with self._held(snapshot_id) as snapshot:
            pod = await provider.api.get_pod(sandbox_id)
            spec = spec_of(pod)
            token = _token_of(pod)
            if spec.image != snapshot.image:
                raise errors.ConfigError(
                    f"snapshot {snapshot_id} is of image {snapshot.image!r}; sandbox "
                    f"{sandbox_id} runs {spec.image!r}: restore needs the same image"
                )
            kept = pods.pool_labels((pod.get("metadata") or {}).get("labels") or {})
            # From here on a failure leaves the sandbox without its pod: the pool finds
            # it lost, as it would a pod that died.
            await self._delete(sandbox_id, str((pod.get("metadata") or {}).get("uid", "")))
            info = await provider._create_pod(spec, sandbox_id=sandbox_id, labels=kept, token=token)
            try:
                await self._apply(info, snapshot)
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await provider.api.delete_pod(sandbox_id)
                raise
        return info

    async def _delete(self, sandbox_id: str, uid: str) -> None:
        """Delete the pod and wait until the pool's watch has seen it go: only then may a
        pod of the same name be made, else the old pod's last events could be taken for
        the new one's (its start, its loss)."""
        provider = self._provider
        await provider.watch.ensure_started()
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[None] = loop.create_future()

        def on_event(kind: str, pod: dict[str, Any]) -> None:
            gone = kind == "DELETED" and (pod.get("metadata") or {}).get("uid") == uid
            if gone and not seen.done():
                seen.set_result(None)

        provider.watch.add(sandbox_id, on_event)
        try:
            await provider.delete(sandbox_id)
            async with asyncio.timeout(_GONE_TIMEOUT):
                absent = 0
                while not seen.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(seen), 1.0)
                    if seen.done():
                        break
                    # No word from the watch (it listed again, or told before this
                    # waited): the API server's, twice a second apart, does then.
                    try:
                        await provider.api.get_pod(sandbox_id)
                        absent = 0
                    except errors.SandboxNotFound:
                        absent += 1
                        if absent >= 2:
                            break
        except TimeoutError:
            raise errors.ProviderError(
                f"the pod of sandbox {sandbox_id} was not gone {_GONE_TIMEOUT} s after its "
                "delete: cannot make it again"
            ) from None
        finally:
            provider.watch.remove(sandbox_id)

    async def _apply(self, info: SandboxInfo, snapshot: SnapshotInfo) -> None:
        """The snapshot's files, applied by the new pod's daemon."""
        assert info.endpoint is not None
        provider = self._provider
        config = provider.config
        async with info.endpoint.client(request_timeout=config.request_timeout) as daemon:
            await daemon.wait_ready(config.start_timeout)
            if snapshot.image_id:
                resolved = _image_id(await provider.api.get_pod(info.id))
                if resolved and resolved != snapshot.image_id:
                    raise errors.ConfigError(
                        f"image {snapshot.image!r} is now {resolved}, and snapshot "
                        f"{snapshot.id} holds changes to {snapshot.image_id}: name the image "
                        "by its digest to make sandboxes from snapshots of it"
                    )
            path = self.store.files(snapshot.id)
            await apply_changes(daemon, path, timeout=config.snapshot_timeout)

    # -- images -----------------------------------------------------------------------

    async def save_image(
        self,
        snapshot_id: str,
        reference: str,
        *,
        auth: Credentials | None = None,
        tls_verify: bool = True,
        timeout: float = 3600.0,
    ) -> str:
        """Push the snapshot's files over its image's as the image ``reference``
        (``registry.example/team/task:1``), one layer more than its image; the pushed
        manifest's digest (``registry.example/team/task@<digest>`` names it).

        Needs skopeo, and the snapshot's image in a registry this host can pull from (its
        layers are read for the names the snapshot removed, and referenced as they are).
        The registry is asked for each blob first: the image's layers, or the whole
        image, pushed before are not uploaded again. ``auth`` is the pushed registry's
        (and the image's, when it is the same registry; give an auth file to cover
        two); ``tls_verify`` for both; ``timeout`` bounds it all. Raises
        `SnapshotNotFound`, `ImageError` (a bad reference, a registry unreachable, at
        once, or refusing, an image not in a registry) and `ConfigError` (the image's
        tag now names another image). The snapshot is held (a delete waits); nothing
        is left on this host."""
        target = parse_reference(reference)
        if target.tag is None:
            raise errors.ImageError(
                f"cannot push to {reference}: name a tag (REPOSITORY:TAG); the registry "
                "gives the digest"
            )
        if timeout <= 0:
            raise errors.ConfigError(f"timeout must be positive, not {timeout}")
        started = time.monotonic()

        def left() -> float:
            return max(timeout - (time.monotonic() - started), 0.001)

        digest = ""
        async with self._held(snapshot_id) as snapshot:
            base_name, base_id = commit.base_reference(snapshot.image, snapshot.image_id)
            base = parse_reference(base_name)
            same = isinstance(auth, Path) or base.registry == target.registry
            with anyio.move_on_after(timeout) as deadline:
                await probe_registry(
                    target, tls_verify=tls_verify, timeout=min(PROBE_TIMEOUT, timeout),
                    action="push",
                )  # fmt: skip
                async with self._scratch() as scratch:
                    try:
                        layout = await run_skopeo(
                            base, scratch, auth=auth if same else None,
                            tls_verify=tls_verify, timeout=left(),
                        )  # fmt: skip
                    except errors.ImageError as exc:
                        raise type(exc)(
                            f"cannot make an image of snapshot {snapshot_id}: its image "
                            f"{snapshot.image} cannot be fetched by this host ({exc}); "
                            "make the sandbox of an image in a registry that both this host "
                            "and the nodes reach"
                        ) from exc
                    try:
                        digest = await anyio.to_thread.run_sync(
                            self._layout, scratch, layout, snapshot, base_id
                        )
                    except OSError as exc:
                        if isinstance(exc, errors.SandboxError):
                            raise
                        raise errors.ProviderError(
                            f"cannot make an image of snapshot {snapshot_id}: "
                            f"{exc.filename or scratch}: {exc.strerror or exc}"
                        ) from exc
                    await push_with_skopeo(
                        target, scratch, auth=auth, tls_verify=tls_verify, timeout=left()
                    )
        if deadline.cancelled_caught:
            raise errors.ImageError(
                f"making an image of snapshot {snapshot_id} and pushing it to {target.name} "
                f"took more than {timeout:g} s"
            )
        logger.info(
            "snapshot %s pushed to %s as %s in %.1f s",
            snapshot_id, target.name, digest, time.monotonic() - started,
        )  # fmt: skip
        return digest

    def _layout(
        self, scratch: Path, fetched: Path, snapshot: SnapshotInfo, base_id: str | None
    ) -> str:
        """The layout to push, in ``scratch``: the image skopeo ``fetched`` plus the
        snapshot's layer; its manifest's digest. Blocking."""
        layout = scratch / PUSH_DIR
        fetched.rename(layout)
        what = f"image {snapshot.image}"
        base = commit.read_base(layout, what)
        if base_id is not None and base.config_digest != base_id:
            raise errors.ConfigError(
                f"image {snapshot.image!r} is now {base.config_digest}, and snapshot "
                f"{snapshot.id} holds changes to {base_id}: name the image by its digest "
                "to make images from snapshots of it"
            )
        tree = commit.base_tree(layout, base, what)
        layer = commit.changes_layer(
            self.store.files(snapshot.id),
            tree,
            layout / "blobs" / "sha256",
            what=f"the files of snapshot {snapshot.id}",
        )
        return commit.finish_layout(
            layout,
            base,
            layer,
            tag=PUSH_TAG,
            source=snapshot.id,
            created_by=f"sandman snapshot save {snapshot.source or snapshot.id} --as-image",
        )

    @contextlib.asynccontextmanager
    async def _scratch(self) -> AsyncIterator[Path]:
        try:
            hold = self.store.scratch()
            path = await anyio.to_thread.run_sync(hold.__enter__)
        except OSError as exc:
            raise errors.ProviderError(
                f"cannot make an image: the snapshot directory failed at "
                f"{exc.filename or self.store.root}: {exc.strerror or exc}"
            ) from exc
        try:
            yield path
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    # -- pause ------------------------------------------------------------------------

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Stop every process of the pod but its daemon, which does it (no freezer cgroup is
        writable in a pod: `sandman.daemon.pausing`); the pod, its id, lease and memory
        stay. ``memory``: ConfigError."""
        if memory:
            raise errors.ConfigError(PAUSE_MEMORY_UNSUPPORTED)
        async with self._daemon(sandbox_id, "pause") as (_, daemon):
            await pause_processes(daemon)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Continue what `pause` stopped (nothing, if it is not paused)."""
        async with self._daemon(sandbox_id, "resume") as (info, daemon):
            await resume_processes(daemon)
        return info

    @contextlib.asynccontextmanager
    async def _daemon(
        self, sandbox_id: str, action: str
    ) -> AsyncIterator[tuple[SandboxInfo, DaemonClient]]:
        """The running pod's info and a client of its daemon; `SandboxLost` when there is
        none to ask."""
        if self._provider.config.readiness != "daemon":
            raise errors.ConfigError(
                f"{action} needs the pods' daemons (readiness='daemon'), not readiness='pod'"
            )
        provider = self._provider
        info = provider._info(await provider.api.get_pod(sandbox_id))
        if info.state != "running" or info.endpoint is None:
            raise self._lost(sandbox_id, info, f"nothing to {action}")
        async with info.endpoint.client(request_timeout=provider.config.request_timeout) as daemon:
            try:
                yield info, daemon
            except errors.DaemonUnavailable as exc:
                try:
                    now = provider._info(await provider.api.get_pod(sandbox_id))
                except errors.SandboxError:
                    now = None
                if now is None or now.state != "running":
                    raise self._lost(sandbox_id, now, f"nothing to {action}") from exc
                raise
