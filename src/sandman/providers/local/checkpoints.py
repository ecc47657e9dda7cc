"""Snapshots, restores and pauses of local sandboxes (`sandman.providers.base.Snapshots`).

A snapshot keeps a sandbox's files (`SnapshotStore`: a btrfs snapshot of its layer, or
a copy), taken with its processes frozen so that they are as of one instant. With
``memory`` (gVisor with its own network stack only: ``runtime="runsc"``,
``runsc_network="sandbox"``) it keeps every process too: the daemon is told to stop
serving (`prepare_checkpoint`; refused while the workload holds TCP sockets), ``runsc
checkpoint`` saves the sandbox, which stops it, and the sandbox is then restored in
place (SIGUSR2 wakes its daemon). A restore makes the sandbox's container again over
a new layer from the snapshot: same id, token and network. A pause freezes the
sandbox's processes, or with ``memory`` checkpoints them to ``paused-memory/`` in its
directory and removes its container until `Checkpoints.resume`.

`LocalProvider` holds one `Checkpoints` and gives it what of its own it needs: how to
stop a sandbox's container (keeping its files and network), and its create path's
layer and launch steps, which a restore runs again.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio

from sandman import errors
from sandman.daemon.checkpoint import prepare_checkpoint, replace_token
from sandman.images import Image, ImageStore
from sandman.models import SandboxSpec
from sandman.providers.base import DaemonEndpoint, SnapshotInfo
from sandman.providers.local import records
from sandman.providers.local.commit import oci_layout_of
from sandman.providers.local.disk import DiskPool
from sandman.providers.local.network import NETNS_DIR, NetworkManager, names
from sandman.providers.local.runtime import OCIRuntime
from sandman.providers.local.snapshots import SnapshotStore, tree_size
from sandman.providers.local.trees import remove_tree
from sandman.providers.snapshot_records import snapshot_id_of
from sandman.settings import LocalConfig

__all__ = ["Checkpoints", "check_memory"]

Stop = Callable[[str], Awaitable[None]]
"""Remove a sandbox's container and cgroups; its files, network and ids stay."""
MakeLayer = Callable[[str, Path, SandboxSpec, str | None], Awaitable[Path]]
"""A sandbox's new overlay layer: empty, or a snapshot's files (`LocalProvider._layer`)."""
Launch = Callable[[str, Path, Image, Path, str, str | None], Awaitable[DaemonEndpoint]]
"""Create and start the container of a sandbox's bundle (`LocalProvider._launch`)."""


def check_memory(config: LocalConfig) -> None:
    """ConfigError unless a provider of ``config`` can keep and restore processes."""
    if config.runtime != "runsc":
        raise errors.ConfigError(
            "a snapshot with memory needs a runtime that can checkpoint processes: "
            f"this provider runs {config.runtime!r}, and the CRIU that crun would use "
            "fails `criu check` on this kernel; use LocalConfig(runtime='runsc', "
            "runsc_network='sandbox'), or snapshot(memory=False) to keep the files"
        )
    if config.runsc_network != "sandbox":
        raise errors.ConfigError(
            "a snapshot with memory needs gVisor's own network stack: "
            f"runsc_network={config.runsc_network!r} (host networking) cannot be "
            "checkpointed; use LocalConfig(runsc_network='sandbox')"
        )


class Checkpoints:
    """Keeps local sandboxes as of a moment and brings them back (the module docstring)."""

    def __init__(
        self,
        config: LocalConfig,
        *,
        sandboxes: Path,
        runtime: OCIRuntime,
        store: SnapshotStore,
        images: ImageStore,
        network: NetworkManager,
        disk: DiskPool,
        daemon: Path,
        stop: Stop,
        layer: MakeLayer,
        launch: Launch,
    ) -> None:
        self._config = config
        self._sandboxes = sandboxes
        self._runtime = runtime
        self._store = store
        self._images = images
        self._network = network
        self._disk = disk
        self._daemon = daemon
        self._stop = stop
        self._layer = layer
        self._launch = launch

    def _dir(self, sandbox_id: str) -> Path:
        return records.directory(self._sandboxes, sandbox_id)

    def _meta(self, sandbox_id: str) -> dict[str, Any]:
        return records.read(self._dir(sandbox_id))

    async def _running(self, sandbox_id: str) -> str:
        """The container's status, which must be running or paused; else why not, typed."""
        status = (await self._runtime.states()).get(sandbox_id)
        if status in ("running", "paused"):
            return status
        if status is None and (self._dir(sandbox_id) / records.PAUSED).is_dir():
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused with its memory: resume it")
        raise errors.SandboxLost.of(
            sandbox_id, "daemon_exit", f"its container is {status or 'gone'}: nothing to keep"
        )

    def _layer_of(self, sandbox_id: str) -> Path:
        if self._disk.has(sandbox_id):
            return self._disk.root / sandbox_id
        return self._dir(sandbox_id)

    # -- snapshots --------------------------------------------------------------------

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        snapshot_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: bool = False,
    ) -> SnapshotInfo:
        """`LocalProvider.snapshot`."""
        if memory:
            check_memory(self._config)
        meta = self._meta(sandbox_id)
        status = await self._running(sandbox_id)
        if memory and status != "running":
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused: resume it first")
        sid = snapshot_id_of(snapshot_id)
        record = {
            "id": sid, "labels": dict(labels or {}), "image": meta.get("image", ""),
            "image_id": meta.get("image_id", ""), "created_at": time.time(),
            "source": sandbox_id, "spec": _own_spec(meta.get("spec")), "memory": memory,
        }  # fmt: skip
        store = self._store
        await store.add(sid, record)  # typed, as a create's failures are
        if memory:
            try:
                await self._checkpoint(sandbox_id, sid)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(store.delete, sid)
                raise
            return await anyio.to_thread.run_sync(store.get, sid)
        try:
            if status == "running":
                await self._runtime.pause(sandbox_id)
            try:
                await anyio.to_thread.run_sync(
                    store.keep, sid, sandbox_id, self._layer_of(sandbox_id)
                )
            finally:
                if status == "running":
                    with anyio.CancelScope(shield=True):
                        await self._runtime.resume(sandbox_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(store.delete, sid)
            raise
        return await anyio.to_thread.run_sync(store.get, sid)

    async def snapshots(
        self, *, labels: Mapping[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        """`LocalProvider.snapshots`."""
        return await self._store.find(labels)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """`LocalProvider.delete_snapshot`."""
        await self._store.drop(snapshot_id)

    async def save_image(self, snapshot_id: str, name: str) -> Image:
        """`LocalProvider.save_image`."""
        hold = self._store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        state_dir = self._config.state_dir
        try:
            layout = Path(tempfile.mkdtemp(prefix=".commit-", dir=state_dir))
        except OSError as exc:
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)
            raise errors.ProviderError(
                f"cannot make an image of {snapshot_id}: the state directory failed at "
                f"{exc.filename or state_dir}: {exc.strerror or exc}"
            ) from exc
        try:
            image = await self._images.get(snapshot.image_id)
            upper = self._store.upper(snapshot_id)
            await anyio.to_thread.run_sync(
                lambda: oci_layout_of(image, upper, layout / "oci", source=snapshot_id)
            )
            return await self._images.import_oci_layout(layout / "oci", name=name)
        finally:
            await anyio.to_thread.run_sync(remove_tree, layout)
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    # -- memory: checkpoint and restore (gVisor) -------------------------------------

    async def _checkpoint(self, sandbox_id: str, snapshot_id: str) -> None:
        """Save the running sandbox's processes and files into the snapshot (recorded),
        then bring the sandbox back as it was, in place."""
        directory = self._dir(sandbox_id)
        # One checkpoint of a sandbox at a time (across processes too): a second one's
        # prepare would find the daemon deaf, and its SIGUSR2 would wake it mid-save.
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise errors.ProviderError(
                    f"a memory snapshot of {sandbox_id} is being taken already"
                ) from None
            await self._checkpoint_locked(sandbox_id, snapshot_id, directory)
        finally:
            os.close(fd)

    async def _checkpoint_locked(self, sandbox_id: str, snapshot_id: str, directory: Path) -> None:
        store = self._store
        token = (directory / "token").read_text()
        await self._prepare(sandbox_id, directory, token)
        image_path = await anyio.to_thread.run_sync(store.make_memory, snapshot_id, token)
        try:
            await self._runtime.checkpoint(sandbox_id, image_path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                # A failed checkpoint may have left the sandbox running, its daemon deaf.
                with contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise
        try:
            # The files as of the checkpoint: the sandbox is stopped.
            await anyio.to_thread.run_sync(
                store.keep, snapshot_id, sandbox_id, self._layer_of(sandbox_id)
            )
            size = await anyio.to_thread.run_sync(tree_size, image_path)
            await anyio.to_thread.run_sync(store.add_size, snapshot_id, size)
        finally:
            with anyio.CancelScope(shield=True):
                await self._resume_from(sandbox_id, image_path, token)

    async def _prepare(self, sandbox_id: str, directory: Path, token: str) -> None:
        """Tell the sandbox's daemon to stop serving, for a checkpoint."""
        endpoint = records.endpoint(directory, token)
        try:
            await prepare_checkpoint(token=token, host=endpoint.host, port=endpoint.port)
        except BaseException as exc:
            # Refused (typed) while the workload holds TCP sockets: nothing happened
            # then. Any other failure may have left the daemon prepared, and deaf.
            if not (isinstance(exc, errors.DaemonError) and exc.code == "not_checkpointable"):
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise

    async def _resume_from(self, sandbox_id: str, image_path: Path, token: str) -> None:
        """Restore the checkpointed (stopped) sandbox in place: same container id, bundle,
        layer, network and token; its daemon serves again."""
        directory = self._dir(sandbox_id)
        meta = self._meta(sandbox_id)
        image = await self._images.get(meta["image_id"])
        await self._stop(sandbox_id)
        await self._network.readdress(sandbox_id)
        (directory / "pid").unlink(missing_ok=True)
        layer = self._layer_of(sandbox_id)
        await self._restored(sandbox_id, directory, image, layer, image_path, token, token)

    async def restore_memory(
        self,
        sid: str,
        directory: Path,
        image: Image,
        layer: Path,
        snapshot_id: str,
        token: str,
    ) -> DaemonEndpoint:
        """The new sandbox ``sid`` (its bundle and layer made) running the processes of
        the memory snapshot: in its own network namespace, with its own token."""
        held = await anyio.to_thread.run_sync(self._store.token, snapshot_id)
        return await self._restored(
            sid, directory, image, layer, self._store.memory(snapshot_id), held, token
        )

    async def _restored(
        self,
        sid: str,
        directory: Path,
        image: Image,
        layer: Path,
        image_path: Path,
        held: str,
        token: str,
    ) -> DaemonEndpoint:
        """``runsc restore`` of the bundle in ``directory``; then the daemon (which holds
        the token ``held``) serves again (SIGUSR2) and is given ``token``."""
        lower = records.lowerdir(image)
        overlay = (lower, layer / "upper", layer / "work", directory / "rootfs")
        await self._runtime.restore(
            sid, directory, image_path, log=directory / "log", overlay=overlay,
            helper=self._daemon,
        )  # fmt: skip
        await self._runtime.kill(sid, "USR2")
        endpoint = records.endpoint(directory, token)
        assert endpoint.host is not None and endpoint.port is not None
        deadline = time.monotonic() + self._config.stop_timeout
        while True:
            try:
                if held != token:
                    await replace_token(token, token=held, host=endpoint.host, port=endpoint.port)
                else:
                    async with endpoint.client() as daemon:
                        await daemon.health()
                break
            except errors.DaemonUnavailable:
                # USR2 is asynchronous: its listener comes up a few ms later.
                if time.monotonic() > deadline:
                    raise errors.ProviderError(
                        f"the daemon of {sid}, restored, did not serve again within "
                        f"{self._config.stop_timeout} s"
                    ) from None
                await anyio.sleep(0.002)
        return endpoint

    # -- restore ----------------------------------------------------------------------

    async def restore(self, sandbox_id: str, snapshot_id: str) -> DaemonEndpoint:
        """`LocalProvider.restore`; returns where the sandbox's new daemon listens."""
        meta = self._meta(sandbox_id)
        directory = self._dir(sandbox_id)
        hold = self._store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        try:
            if snapshot.image_id != meta.get("image_id"):
                raise errors.ConfigError(
                    f"snapshot {snapshot_id} is of image {snapshot.image!r}; sandbox "
                    f"{sandbox_id} runs {meta.get('image')!r}: restore needs the same image"
                )
            if snapshot.memory:
                check_memory(self._config)
            image = await self._images.get(snapshot.image_id)
            spec = SandboxSpec.model_validate(_own_spec(meta["spec"]))
            token = (directory / "token").read_text()
            await self._stop(sandbox_id)
            # The old layer goes; a crash from here on leaves a sandbox without a
            # container, which the pool finds lost and deletes, record and all.
            await anyio.to_thread.run_sync(self._drop_layer, sandbox_id, directory)
            layer = await self._layer(sandbox_id, directory, spec, snapshot_id)
            if snapshot.memory:
                # Its processes from the image, in its own namespace, with its own token.
                await self._network.readdress(sandbox_id)
                return await self.restore_memory(
                    sandbox_id, directory, image, layer, snapshot_id, token
                )
            netns = None if spec.network == "none" else str(NETNS_DIR / names(sandbox_id)[0])
            return await self._launch(sandbox_id, directory, image, layer, token, netns)
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            # The state directory read-only or full (its socket, its layer): typed, as a
            # create's is; the sandbox has no container now, so the pool finds it lost.
            raise errors.ProviderError(
                f"cannot restore sandbox {sandbox_id}: the state directory failed at "
                f"{exc.filename or directory}: {exc.strerror or exc}"
            ) from exc
        finally:
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    def _drop_layer(self, sandbox_id: str, directory: Path) -> None:
        if self._disk.has(sandbox_id):
            self._disk.remove(sandbox_id)
        for name in ("upper", "work"):
            remove_tree(directory / name)
        for name in (records.SOCKET, "pid"):
            (directory / name).unlink(missing_ok=True)

    # -- pause ------------------------------------------------------------------------

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """`LocalProvider.pause`."""
        self._meta(sandbox_id)
        if not memory:
            await self._running(sandbox_id)
            await self._runtime.pause(sandbox_id)
            return
        check_memory(self._config)
        if (await self._running(sandbox_id)) != "running":
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused already")
        directory = self._dir(sandbox_id)
        token = (directory / "token").read_text()
        image_path = directory / records.PAUSED
        await self._prepare(sandbox_id, directory, token)
        try:
            await anyio.to_thread.run_sync(lambda: image_path.mkdir(mode=0o700))
            await self._runtime.checkpoint(sandbox_id, image_path)
            # Gone from the runtime: memory and cgroups freed; the record, layer,
            # network and the image stay, and `list` tells it paused (`_read`).
            await self._stop(sandbox_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(remove_tree, image_path)
                with contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise

    async def resume(self, sandbox_id: str) -> None:
        """`LocalProvider.resume` (the caller inspects the sandbox after)."""
        self._meta(sandbox_id)
        directory = self._dir(sandbox_id)
        image_path = directory / records.PAUSED
        if await anyio.to_thread.run_sync(image_path.is_dir):
            token = (directory / "token").read_text()
            await self._resume_from(sandbox_id, image_path, token)
            await anyio.to_thread.run_sync(remove_tree, image_path)
            return
        await self._running(sandbox_id)
        await self._runtime.resume(sandbox_id)


def _own_spec(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A sandbox's recorded spec as a caller could have written it: without Sandman's own
    labels (a tenant's, set by the service), which a spec may not name."""
    if spec is None:
        return None
    labels = {k: v for k, v in spec.get("labels", {}).items() if not k.startswith("sandman.io/")}
    return {**spec, "labels": labels}
