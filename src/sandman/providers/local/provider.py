"""LocalProvider: sandboxes as crun (or runc) containers on this machine.

(About 850 lines: the create, delete and list sequences, whose order is the
leak-freedom argument; records, checkpoints, host, disk, network and userns live
apart, and the `Snapshots` methods here only hand over to `checkpoints`.)

Each sandbox is a directory under ``<state_dir>/sandboxes/`` (`records`: its record
is written first and removed last), a container, and what host, disk, network and
userns hold for it. ``<state_dir>/empty`` is what the masked directories
(``/proc/acpi``...) show under crun: nothing. Snapshots, restores and pauses are
`checkpoints`'.

The provider tells at once of a sandbox whose daemon dies by itself (`watch_lost`,
`lost`; see `exits`): not under gVisor, whose daemon has no pid on this host; the
pool's reconcile pass finds those stopped.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from sandman import errors
from sandman.daemon import daemon_path
from sandman.egress import Egress
from sandman.images import Image, ImageStore, resolve_user
from sandman.models import SandboxSpec, Usage
from sandman.providers.base import (
    DaemonEndpoint,
    Lost,
    LostReports,
    SandboxInfo,
    SandboxState,
    SnapshotInfo,
)
from sandman.providers.local import oci, records, runsc, seccomp, userns, views
from sandman.providers.local.checkpoints import Checkpoints, check_memory
from sandman.providers.local.disk import DiskPool
from sandman.providers.local.exits import ExitWatch, classify, in_cgroup, log_tail, oom_kills
from sandman.providers.local.host import (
    beyond_host,
    host_size,
    limit_cgroup_parent,
    parent_pids,
    prepare_cgroups,
    raise_open_files,
    remove_sandbox_cgroups,
)
from sandman.providers.local.network import DEFAULT_EGRESS_DENY, EgressPolicy, NetworkManager
from sandman.providers.local.runtime import OCIRuntime, UserNamespace
from sandman.providers.local.snapshots import SnapshotStore, image_users
from sandman.providers.local.usage import MemoryMeter, read_usage
from sandman.settings import LocalConfig

__all__ = ["LocalProvider"]

logger = logging.getLogger(__name__)

_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
GVISOR_DAEMON_PORT = 8731  # runsc: the daemon's address on the sandbox's network
GVISOR_PIDS_HEADROOM = 256
GVISOR_MEMORY_HEADROOM = 128 * 2**20
_IMAGE_TTL = 2.0
_EMPTY = "empty"  # what masked directories show (oci.MASKED_DIRS): nothing, read-only
_CGROUP_VIEW = "cgroup"  # the skeleton of a sandbox's /sys/fs/cgroup (views.cgroup_skeleton)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 charges a cgroup's TCP buffers to it only once this is set (v2: always).
_KERNEL_TCP = _CGROUP_ROOT / "memory" / "memory.kmem.tcp.limit_in_bytes"
_STATES: dict[str, SandboxState] = {
    "created": "creating",
    "running": "running",
    "paused": "running",  # its processes stopped, not gone (`pause`)
    "stopped": "stopped",
}


def new_sandbox_id() -> str:
    """A fresh id: short, so socket paths stay within the unix limit."""
    return f"sb-{secrets.token_hex(6)}"


class LocalProvider:
    """Creates sandboxes from images in a local store, one OCI container each."""

    name = "local"

    def __init__(
        self, config: LocalConfig | None = None, *, images: ImageStore | None = None
    ) -> None:
        self.config = config or LocalConfig()
        state = self.config.state_dir.resolve()
        self._sandboxes = state / "sandboxes"
        self.images = images or ImageStore(state / "images", in_use=image_users(state))
        binary = self.config.runtime_path or shutil.which(self.config.runtime)
        if binary is None or not os.access(binary, os.X_OK):
            raise errors.ConfigError(
                f"OCI runtime {self.config.runtime!r} not found: apt-get install -y {self.config.runtime}"
            )
        global_args = []
        self._daemon = (self.config.daemon_path or daemon_path()).resolve()
        netstack = self.config.runtime == "runsc" and self.config.runsc_network == "sandbox"
        if self.config.runtime == "runsc":
            # Probed once per binary (`runsc flags`): Debian's runsc or a current one.
            global_args = runsc.global_args(
                binary,
                self.config.runsc_platform,
                self.config.runsc_network,
                self.config.runsc_args,
            )
        self._runtime = OCIRuntime(
            binary,
            state / "runtime" / self.config.runtime,
            kind=self.config.runtime,
            timeout=self.config.stop_timeout,
            global_args=global_args,
            # Debian's runsc refuses its own network stack on kernels >= 6.x unless
            # /proc/sys/net is hidden from it (`sandmand hide-sys-net`).
            hide_sys_net=self._daemon if netstack else None,
        )
        self._warned_beyond: set[str] = set()
        self.network = NetworkManager(
            state_dir=state,
            subnet=self.config.subnet,
            uplink=self.config.uplink,
            egress=EgressPolicy.of(
                DEFAULT_EGRESS_DENY if self.config.egress_deny is None else self.config.egress_deny,
                self.config.egress_allow,
            ),
            dns_upstream=self.config.dns_upstream,
            conntrack_max=self.config.conntrack_max,
        )
        self.disk = DiskPool(state)
        self.snapshot_store = SnapshotStore(state, self.disk, self.name)
        self._checkpoints = Checkpoints(
            self.config, sandboxes=self._sandboxes, runtime=self._runtime,
            store=self.snapshot_store, images=self.images, network=self.network,
            disk=self.disk, daemon=self._daemon, stop=self._stop, layer=self._layer,
            launch=self._launch,
        )  # fmt: skip
        self._empty = state / _EMPTY
        # crun: what a sandbox sees of /dev, /sys and its cgroups costs no superblock of
        # its own unless asked (`views`); runc and gVisor as they were.
        self._views = self.config.runtime == "crun"
        self._sysfs = views.SharedNetns()
        self._cgroup_view = state / _CGROUP_VIEW
        self._hierarchies: tuple[str, ...] = ()
        # Each sandbox in a user namespace of its own (crun only: `userns`).
        self._userns = self.config.userns and self.config.runtime == "crun"
        # The same kernel as the sandboxes': what exists here exists in their /proc, /sys.
        self._masked = tuple(p for p in oci.MASKED_DIRS if os.path.isdir(p))
        self._prepared = False
        self._prepare_lock = asyncio.Lock()
        self._images: dict[str, tuple[float, Image]] = {}
        self._users: dict[tuple[str, str], tuple[int, int]] = {}
        self._exits = ExitWatch(self._loss)
        self._meter = MemoryMeter(self.config.cgroup_parent)
        # What `list` read of each sandbox's files, by its record's identity: a record is
        # replaced whole (`relabel`), never changed in place, and the token and the
        # daemon's address never change once it runs. A reconcile of 10k sandboxes
        # otherwise opens 40k files each time (0.6 ms per sandbox, measured).
        self._seen: dict[
            str, tuple[tuple[int, int], dict[str, Any], str | None, DaemonEndpoint | None]
        ] = {}

    def __repr__(self) -> str:
        return f"LocalProvider(state_dir={str(self.config.state_dir)!r}, runtime={self.config.runtime!r})"

    async def _prepare(self) -> None:
        if self._prepared:
            return
        async with self._prepare_lock:
            if self._prepared:
                return
            if os.geteuid() != 0:
                raise errors.ConfigError("the local provider needs root (run `sandman doctor`)")
            if self.config.runtime == "crun":
                await anyio.to_thread.run_sync(prepare_cgroups)
                # After prepare_cgroups: it may mount a hierarchy.
                self._hierarchies = await anyio.to_thread.run_sync(views.hierarchies)
            await self._limit_parent()
            raise_open_files()  # a descriptor per sandbox held (`ExitWatch`)
            self._sandboxes.mkdir(parents=True, exist_ok=True)
            if self._userns:
                state = self.config.state_dir.resolve()
                await anyio.to_thread.run_sync(userns.prepare, self._daemon, state)
            try:
                await anyio.to_thread.run_sync(_make_empty, self._empty)
                if self._views and self._hierarchies:
                    await anyio.to_thread.run_sync(
                        views.cgroup_skeleton, self._cgroup_view, self._hierarchies
                    )
            except OSError as exc:
                if isinstance(exc, errors.SandboxError):
                    raise
                raise errors.ProviderError(
                    f"the state directory failed at {exc.filename or self._empty}: "
                    f"{exc.strerror or exc}"
                ) from exc
            self._prepared = True

    async def _limit_parent(self) -> None:
        """Cap the tasks of all sandboxes together (`LocalConfig.cgroup_parent_pids`), so
        that together they cannot take the host's last pids."""
        pids = parent_pids(self.config.cgroup_parent_pids)
        try:
            written = await anyio.to_thread.run_sync(
                limit_cgroup_parent, self.config.cgroup_parent, pids
            )
        except OSError as exc:
            raise errors.ProviderError(
                f"cannot set pids.max={pids} on the cgroup parent {self.config.cgroup_parent}: "
                f"{exc.strerror or exc}"
            ) from exc
        if written is None:
            logger.warning("no pids cgroup controller: sandboxes together are not limited in pids")

    async def _image(self, ref: str) -> Image:
        # A burst resolves the same name thousands of times; a name may be
        # re-pointed by another process, so the answer is kept only briefly.
        now = time.monotonic()
        cached = self._images.get(ref)
        if cached is not None and now - cached[0] < _IMAGE_TTL:
            return cached[1]
        image = await self.images.get(ref)
        self._images[ref] = (now, image)
        return image

    def _user(self, image: Image, user: str) -> tuple[int, int]:
        # An image's content never changes under its id: resolve once.
        key = (image.id, user)
        if key not in self._users:
            self._users[key] = resolve_user(image.rootfs, user)
        return self._users[key]

    def _dir(self, sandbox_id: str) -> Path:
        return records.directory(self._sandboxes, sandbox_id)

    def _socket(self, directory: Path) -> Path:
        return directory / records.SOCKET

    # -- create -------------------------------------------------------------

    def _check_fits(self, spec: SandboxSpec) -> None:
        """Refuse, or warn of, limits beyond the host's (`LocalConfig.beyond_host`)."""
        memory, cpus = host_size()
        beyond = beyond_host(spec.memory, spec.cpu, memory, cpus)
        if beyond is None:
            return
        if self.config.beyond_host == "refuse":
            raise errors.ConfigError(
                f"the spec asks for more than this host has: {beyond} "
                "(LocalConfig.beyond_host is 'refuse')"
            )
        if beyond not in self._warned_beyond:
            self._warned_beyond.add(beyond)
            logger.warning(
                "a spec asks for more than this host has: %s; creating it anyway, its limit "
                "limits nothing (LocalConfig.beyond_host='refuse' refuses such specs)",
                beyond,
            )

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        """Start a sandbox from ``spec``; its daemon is starting when this returns."""
        self._check_fits(spec)
        await self._prepare()
        if spec.snapshot is not None:
            return await self._create_from(spec, spec.snapshot, sandbox_id, labels)
        return await self._create(spec, await self._image(spec.image), sandbox_id, labels)

    async def _create_from(
        self,
        spec: SandboxSpec,
        snapshot_id: str,
        sandbox_id: str | None,
        labels: Mapping[str, str] | None,
    ) -> SandboxInfo:
        """`create` from a snapshot's files, holding it (a delete waits) until it runs."""
        hold = self.snapshot_store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        try:
            if spec.image not in (snapshot.image, snapshot.image_id):
                raise errors.ConfigError(
                    f"snapshot {snapshot_id} is of image {snapshot.image!r}, not {spec.image!r}"
                )
            try:
                image = await self.images.get(snapshot.image_id)
            except errors.ImageNotFound:
                raise errors.ImageNotFound(
                    f"the image of snapshot {snapshot_id} ({snapshot.image}, "
                    f"{snapshot.image_id}) is no longer in the store"
                ) from None
            if snapshot.memory:
                check_memory(self.config)
            return await self._create(
                spec, image, sandbox_id, labels, source=snapshot_id, memory=snapshot.memory
            )
        finally:
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    async def _create(
        self,
        spec: SandboxSpec,
        image: Image,
        sandbox_id: str | None,
        labels: Mapping[str, str] | None,
        *,
        source: str | None = None,
        memory: bool = False,
    ) -> SandboxInfo:
        sid = sandbox_id or new_sandbox_id()
        directory = self._dir(sid)
        socket = self._socket(directory)
        if len(os.fsencode(socket)) > _MAX_SOCKET_PATH:
            raise errors.ConfigError(
                f"socket path {socket} is longer than {_MAX_SOCKET_PATH} bytes: use a shorter state_dir"
            )
        all_labels = {**spec.labels, **(labels or {})}
        uid, gid = self._user(image, spec.user or image.config.user)
        created_at = time.time()
        # The record comes before anything else, so that a crash from here on
        # leaves a sandbox that list() finds and delete() removes.
        meta = {
            "id": sid, "labels": all_labels, "image": spec.image, "image_id": image.id,
            "created_at": created_at, "spec": spec.model_dump(mode="json"),
        }  # fmt: skip
        records.make(directory, json.dumps(meta))
        try:
            token = secrets.token_urlsafe(32)
            endpoint = await self._start(
                sid, directory, spec, image, uid, gid, token, all_labels, source, memory
            )
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                try:
                    await self.delete(sid)
                except errors.SandboxError:
                    # The record stays: a later delete (the pool retries) or the
                    # reconciler removes it. The caller hears the first failure.
                    logger.warning("cleanup of half-created %s failed", sid, exc_info=True)
            if isinstance(exc, OSError) and not isinstance(exc, errors.SandboxError):
                raise records.state_error(sid, directory, exc) from exc
            raise
        return SandboxInfo(
            id=sid,
            provider=self.name,
            state="running",
            labels=all_labels,
            created_at=created_at,
            image=spec.image,
            endpoint=endpoint,
        )

    async def _start(
        self,
        sid: str,
        directory: Path,
        spec: SandboxSpec,
        image: Image,
        uid: int,
        gid: int,
        token: str,
        labels: Mapping[str, str],
        source: str | None = None,
        memory: bool = False,
    ) -> DaemonEndpoint:
        """Create and start the container (or, with ``memory``, restore the processes of
        the snapshot ``source``); returns where its daemon listens."""
        (directory / "rootfs").mkdir()
        layer = await self._layer(sid, directory, spec, source)
        # Kept for the host alone: a restarted pool reads it to adopt the sandbox.
        records.write(directory / "token", token, mode=0o400)
        gvisor = self.config.runtime == "runsc"
        mode = spec.network_mode if spec.network_mode != "none" or not gvisor else "isolated"
        attachment = None
        if mode != "none":
            # The namespace must exist before the runtime creates the container in it.
            attachment = await self.network.setup(sid, mode, spec.egress)
        layout = oci.BundleLayout(
            daemon=str(self._daemon),
            netns=attachment.netns_path if attachment else None,
            # crun only: runc refuses a mount inside /proc, and gVisor masks in its own
            # kernel (no host superblock to save).
            empty=str(self._empty) if self.config.runtime == "crun" else None,
            masked=self._masked,
            dev_tmpfs=not self._views or self.config.dev_tmpfs,
            cgroup_view=str(self._cgroup_view) if self._views and self._hierarchies else None,
            hierarchies=self._hierarchies if self._views else (),
        )
        layout = replace(layout, sysfs_premounted=self._premounts_sysfs(layout.netns))
        base = None
        if self._userns:
            base = await anyio.to_thread.run_sync(userns.allocate, directory)
            layout = replace(
                layout, userns=str(directory / userns.MOUNT_POINT), rootfs=str(userns.ROOTFS)
            )
        if gvisor:
            # gVisor takes no descriptors from the host: its daemon serves TCP
            # on the sandbox's own address, which only the host can reach.
            assert attachment is not None
            layout = replace(layout, listen=f"tcp:0.0.0.0:{GVISOR_DAEMON_PORT}", token_env=token)
            # The cgroup holds gVisor's own kernel too (~66 tasks, ~50 MiB idle
            # on ptrace): the spec's limits are the workload's, on top.
            spec = spec.model_copy(
                update={
                    "pids": spec.pids + GVISOR_PIDS_HEADROOM,
                    "memory": spec.memory + GVISOR_MEMORY_HEADROOM,
                }
            )
            tcp = DaemonEndpoint(host=attachment.sandbox_ip, port=GVISOR_DAEMON_PORT, token=token)
            records.write(
                directory / records.TCP_ENDPOINT, json.dumps({"host": tcp.host, "port": tcp.port})
            )
        config = oci.config(
            sandbox_id=sid,
            spec=spec,
            image_env=image.config.env,
            workdir=spec.workdir or image.config.working_dir or "/",
            uid=uid,
            gid=gid,
            cgroup_parent=self.config.cgroup_parent,
            layout=layout,
            annotations={f"sandman.io/label.{k}": v for k, v in labels.items()},
            seccomp=await seccomp.resolve(spec.seccomp),
            # gVisor's TCP buffers are its own kernel's memory, in the cgroup already.
            kernel_tcp=_KERNEL_TCP.exists() and not gvisor,
            ptys=self.config.ptys,
        )
        if mode == "egress" and attachment is not None:
            # The egress resolver on its gateway (providers/local/egress.py); read-only,
            # but a workload that names another resolver only loses its DNS.
            records.write(
                directory / "resolv.conf", f"nameserver {attachment.host_ip}\n", mode=0o644
            )
            config["mounts"].append({
                "destination": "/etc/resolv.conf", "type": "bind",
                "source": str(directory / "resolv.conf"),
                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"],
            })  # fmt: skip
        records.write(directory / "config.json", json.dumps(config))
        if memory:
            assert source is not None
            return await self._checkpoints.restore_memory(
                sid, directory, image, layer, source, token
            )
        return await self._launch(sid, directory, image, layer, token, layout.netns, base)

    def _premounts_sysfs(self, netns: str | None) -> bool:
        """Whether overlay-exec mounts /sys of a sandbox in ``netns`` (None: a new one the
        runtime makes, with only a loopback): without a network, the shared view of an
        empty namespace (crun, unless ``own_sysfs``), which shows what its own would; with
        one, in a user namespace, its own (the runtime cannot mount the sysfs of a
        network namespace the host made)."""
        if netns is None:
            return self._views and not self.config.own_sysfs
        return self._userns

    def _sysfs_netns(self, netns: str | None) -> str:
        """The network namespace whose sysfs overlay-exec mounts (`_premounts_sysfs`)."""
        return netns if netns is not None else self._sysfs.path()

    async def _layer(
        self, sid: str, directory: Path, spec: SandboxSpec, source: str | None
    ) -> Path:
        """The sandbox's overlay layer (``upper``, ``work``): empty, or the snapshot
        ``source``'s files; in the disk filesystem when it has a limit."""
        limit = spec.disk if spec.disk is not None else self.config.disk
        if source is not None:
            return await anyio.to_thread.run_sync(
                self.snapshot_store.layer, source, sid, directory, limit
            )
        if limit is None:
            (directory / "upper").mkdir()
            (directory / "work").mkdir()
            return directory
        return await anyio.to_thread.run_sync(self.disk.create, sid, limit)

    async def _launch(
        self,
        sid: str,
        directory: Path,
        image: Image,
        layer: Path,
        token: str,
        netns: str | None,
        base: int | None = None,
    ) -> DaemonEndpoint:
        """Create and start the container of a bundle written whole (``config.json``):
        in its user namespace if its bundle has one (`userns.MOUNT_POINT`; ``base`` its
        range if known), ``netns`` the network namespace the host made for it."""
        overlay = (records.lowerdir(image), layer / "upper", layer / "work", directory / "rootfs")
        ids = None
        if base is not None or (directory / userns.MOUNT_POINT).exists():
            if base is None:
                # Adopted, or restored: the range it holds (again, after a reboot).
                base = await anyio.to_thread.run_sync(userns.allocate, directory)
            ids = UserNamespace(base, userns.RANGE, directory / userns.MOUNT_POINT)
            overlay = (*overlay[:3], userns.ROOTFS)
        # What the bundle's config leaves to the host: a bundle outlives the provider
        # that wrote it (a restore after a restart), so its config decides.
        mounts = await anyio.to_thread.run_sync(_mounts_of, directory, layer)
        # The shared namespace is made on first use (a thread of its own, joined).
        sysfs = (
            None if "/sys" in mounts else await anyio.to_thread.run_sync(self._sysfs_netns, netns)
        )
        if self.config.runtime == "runsc":
            await self._runtime.create(
                sid, directory, log=directory / "log", overlay=overlay, helper=self._daemon
            )
            await self._runtime.start(sid)
            return records.endpoint(directory, token)
        # The host binds the socket where no sandbox can write, so it never
        # connects through a path the workload could swap for a symlink or a
        # server of its own; the daemon calls listen(2) on it, which makes
        # it the peer SO_PEERCRED reports.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        token_read, token_write = os.pipe()
        try:
            listener.bind(str(self._socket(directory)))
            os.write(token_write, token.encode())  # far below the pipe's buffer
            os.close(token_write)
            token_write = -1
            pid = await self._runtime.create(
                sid,
                directory,
                log=directory / "log",
                overlay=overlay,
                helper=self._daemon,
                pass_fds=(listener.fileno(), token_read),
                userns=ids,
                sysfs=sysfs,
            )
        finally:
            listener.close()
            os.close(token_read)
            if token_write >= 0:
                os.close(token_write)
        await self._runtime.start(sid)
        return DaemonEndpoint(uds=str(self._socket(directory)), token=token, pid=pid)

    # -- delete -------------------------------------------------------------

    def progress(self, sandbox_id: str) -> str | None:
        """Nothing to say: a local create is one runtime call, no waiting on others."""
        return None

    async def delete(self, sandbox_id: str) -> None:
        """Kill the sandbox and remove all it holds: container, cgroups, files. Idempotent."""
        directory = self._dir(sandbox_id)
        self._exits.forget(sandbox_id)  # killed here: no loss to tell of
        self._meter.forget(sandbox_id)
        await self._runtime.delete(sandbox_id)
        # After the container: its processes are gone, so the netns goes at once.
        await self.network.teardown(sandbox_id)
        await self._remove_cgroups(sandbox_id)
        # Its processes are gone: its uid range may be another sandbox's.
        await anyio.to_thread.run_sync(userns.release, directory)
        # Before the record: a crash in between leaves a sandbox list() still finds.
        await anyio.to_thread.run_sync(self.disk.remove, sandbox_id)
        try:
            await anyio.to_thread.run_sync(records.remove, directory)
        except OSError as exc:
            raise errors.ProviderError(
                f"cannot remove sandbox {sandbox_id}'s files: {exc}"
            ) from exc
        # The shared /sys's namespace is held for the sandboxes that see it: with none
        # left (a create in progress has its directory already), nothing of theirs
        # stays open here; the next create makes another.
        if not await anyio.to_thread.run_sync(_any_entry, self._sandboxes):
            self._sysfs.close()

    async def _remove_cgroups(self, sandbox_id: str) -> None:
        """Remove cgroup dirs the runtime left: it gives up on one still busy
        with exiting tasks (seen with hugetlb under load)."""
        left = await anyio.to_thread.run_sync(
            remove_sandbox_cgroups, self.config.cgroup_parent.strip("/"), sandbox_id
        )
        if left:
            raise errors.ProviderError(f"cgroups of {sandbox_id} still busy: {left}")

    # -- snapshots, restore, pause (sandman.providers.base.Snapshots: `checkpoints`) ----

    async def _stop(self, sandbox_id: str) -> None:
        """Remove the sandbox's container and cgroups, keeping its record, layer, network
        and ids: a restore or a resume makes its container again."""
        self._exits.forget(sandbox_id)  # stopped here: no loss to tell of
        await self._runtime.delete(sandbox_id)
        await self._remove_cgroups(sandbox_id)

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        snapshot_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: bool = False,
    ) -> SnapshotInfo:
        """Keep the sandbox's files: a btrfs snapshot of its layer (constant time), or a
        copy without a disk filesystem. Its processes are frozen meanwhile, so the files
        are as of one instant.

        ``memory`` (gVisor with its own network stack only: ``runtime="runsc"``,
        ``runsc_network="sandbox"``) keeps every process too: the daemon stops serving
        (refused, `DaemonError` ``not_checkpointable``, while the sandbox's processes hold
        TCP sockets), ``runsc checkpoint`` saves the sandbox (which stops it) and its files
        are kept as of then; the sandbox is then restored in place and goes on running,
        same id, address and token."""
        return await self._checkpoints.snapshot(
            sandbox_id, snapshot_id=snapshot_id, labels=labels, memory=memory
        )

    async def snapshots(
        self, *, labels: Mapping[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Every snapshot of this state directory (half-made ones too) with ``labels``."""
        return await self._checkpoints.snapshots(labels=labels)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot's files and record; waits for creates from it in flight."""
        await self._checkpoints.delete_snapshot(snapshot_id)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Reset the sandbox to the snapshot's files: its container is made again over a
        new layer from the snapshot (same id, token and network; new processes, or with a
        memory snapshot the snapshot's processes, restored)."""
        endpoint = await self._checkpoints.restore(sandbox_id, snapshot_id)
        self._seen.pop(sandbox_id, None)  # a new daemon pid
        info = await self.inspect(sandbox_id)
        return info.model_copy(update={"endpoint": endpoint})

    async def save_image(self, snapshot_id: str, name: str) -> Image:
        """The snapshot's files over its image's, as a new image ``name`` in the store
        (one more layer; the image's config kept): later creates name it."""
        return await self._checkpoints.save_image(snapshot_id, name)

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Freeze the sandbox's processes (its freezer cgroup): it uses no CPU; its memory
        stays. With ``memory`` (gVisor with its own network stack, as for a memory
        snapshot) its processes are checkpointed to disk and the container is removed:
        no CPU and no memory, until `resume` restores them (same id, address, token)."""
        await self._checkpoints.pause(sandbox_id, memory=memory)
        self._seen.pop(sandbox_id, None)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox, or restore one paused with its memory."""
        await self._checkpoints.resume(sandbox_id)
        self._seen.pop(sandbox_id, None)
        return await self.inspect(sandbox_id)

    # -- usage (sandman.providers.base.ReportsUsage) ----------------------------------

    async def usage(self, sandbox_id: str) -> Usage:
        """What the sandbox has used so far, from its cgroups, disk layer and veth."""
        self._dir(sandbox_id)
        parent = self.config.cgroup_parent
        return await anyio.to_thread.run_sync(
            read_usage, parent, sandbox_id, self.disk, self._meter
        )

    # -- egress rules (sandman.providers.base.ChangesEgress) --------------------------

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace a running egress sandbox's rules (`providers.local.egress`): what it
        has open is judged again by them."""
        await self.inspect(sandbox_id)  # SandboxNotFound
        await self.network.set_egress(sandbox_id, egress)

    # -- lost sandboxes (sandman.providers.base.WatchesLost) ---------------------

    def watch_lost(self, sandbox: SandboxInfo) -> None:
        """Tell through `lost` when this sandbox's daemon dies (a pidfd of it); a
        gVisor sandbox (no daemon pid here) is not watched."""
        endpoint = sandbox.endpoint
        if endpoint is None or endpoint.pid is None:
            return
        parent = self.config.cgroup_parent.strip("/")
        self._exits.watch(
            sandbox.id, endpoint.pid, lambda pid: in_cgroup(pid, f"{parent}/{sandbox.id}")
        )

    def lost(self) -> LostReports:
        """Each watched sandbox whose daemon died, as it happens, with the reason."""
        return self._exits.reports()

    def _loss(self, sandbox_id: str, status: int | None) -> Lost:
        """Why the sandbox's daemon died: its wait status, the OOM kills of its memory
        cgroup (read before a delete removes it) and the end of its log."""
        parent = self.config.cgroup_parent.strip("/")
        oom = oom_kills(parent, sandbox_id)
        reason, detail = classify(status, oom, log_tail(self._sandboxes / sandbox_id / "log"))
        return Lost(sandbox_id=sandbox_id, reason=reason, detail=detail)

    # -- list / inspect -------------------------------------------------------

    async def list(self, *, labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox of this state directory, including half-created ones and
        containers the runtime holds without a record (reported with no labels)."""
        states = await self._runtime.states()
        networks = await self.network.list()
        layers = await anyio.to_thread.run_sync(self.disk.names)
        infos = await anyio.to_thread.run_sync(self._read_all, states, [*networks, *layers])
        if self._meter.due():
            # The pool lists every few seconds: its listings are the meter's clock.
            await anyio.to_thread.run_sync(self._meter.sample, [info.id for info in infos])
        wanted = dict(labels or {})
        return [info for info in infos if wanted.items() <= info.labels.items()]

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        """Rewrite the record's labels (atomically: a reader sees the old or the new)."""
        directory = self._dir(sandbox_id)
        try:
            await anyio.to_thread.run_sync(records.relabel, directory, dict(labels))
        except FileNotFoundError:
            raise errors.SandboxNotFound(f"no sandbox {sandbox_id} in {self._sandboxes}") from None
        except (OSError, ValueError) as exc:
            raise errors.ProviderError(f"cannot relabel sandbox {sandbox_id}: {exc}") from exc

    async def inspect(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox; SandboxNotFound when neither a record nor a container exists."""
        directory = self._dir(sandbox_id)
        states = await self._runtime.states()
        if not directory.exists() and sandbox_id not in states:
            raise errors.SandboxNotFound(f"no sandbox {sandbox_id} in {self._sandboxes}")
        return self._read(directory, states)

    def _read_all(
        self, states: dict[str, str], held: builtins.list[str]
    ) -> builtins.list[SandboxInfo]:
        found = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self._sandboxes) as entries:
            for entry in entries:
                if records.ID.match(entry.name):
                    found[entry.name] = self._read(Path(entry.path), states)
        # A container, or a network or disk layer (``held``), without a record is
        # an orphan: listed, so it gets deleted.
        for orphan in (states.keys() | set(held)) - found.keys():
            found[orphan] = self._read(self._sandboxes / orphan, states)
        for gone in self._seen.keys() - found.keys():
            del self._seen[gone]
        return sorted(found.values(), key=lambda info: info.created_at)

    def _read(self, directory: Path, states: dict[str, str]) -> SandboxInfo:
        sid = directory.name
        try:
            stat = os.stat(directory / records.META)
            identity: tuple[int, int] | None = (stat.st_ino, stat.st_mtime_ns)
        except OSError:
            identity = None
        seen = self._seen.get(sid)
        if identity is not None and seen is not None and seen[0] == identity:
            _, meta, token, known = seen
        else:
            meta, token, known = {}, None, None
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((directory / records.META).read_text())
            with contextlib.suppress(OSError):
                token = (directory / "token").read_text()
        state = _STATES.get(states.get(sid, ""), "creating" if meta else "unknown")
        if sid not in states and meta and (directory / records.PAUSED).is_dir():
            state = "running"  # paused with its memory on disk (`pause`): held, not gone
        endpoint = None
        if token is not None and state == "running":
            endpoint = known or records.endpoint(directory, token)
        if identity is not None and meta and token is not None:
            # Kept only once whole: a half-created sandbox's files are read again.
            ready = endpoint if endpoint is not None and (endpoint.pid or endpoint.port) else None
            self._seen[sid] = (identity, meta, token, ready)
        created_at = meta.get("created_at")
        if created_at is None:
            # No record (a crash's leftover): as old as its directory's last change.
            with contextlib.suppress(OSError):
                created_at = directory.stat().st_mtime
        return SandboxInfo(
            id=sid,
            provider=self.name,
            state=state,
            labels=meta.get("labels", {}),
            created_at=created_at or 0.0,
            image=meta.get("image", ""),
            endpoint=endpoint,
            lost=self._loss(sid, None) if state == "stopped" else None,
        )

    async def remove_strays(self, *, older_than: float) -> builtins.list[str]:
        """Remove the directories `list` does not see: what a create killed before its
        record was whole left (at once if its record was written, else once older than
        ``older_than`` seconds: a create in flight has one for a moment), and what a
        delete killed after its record had gone left (at once: nothing comes back for
        it). Returns their names."""
        return await anyio.to_thread.run_sync(records.remove_strays, self._sandboxes, older_than)

    async def aclose(self) -> None:
        """Sandboxes live on until deleted; the disk filesystem is unmounted if none holds a layer."""
        self._exits.close()
        self._sysfs.close()  # held on by the sysfs of each sandbox that sees it
        await anyio.to_thread.run_sync(self.disk.release)


def _any_entry(directory: Path) -> bool:
    """Whether ``directory`` holds anything (a sandbox's directory, or one's trash)."""
    try:
        with os.scandir(directory) as entries:
            return any(True for _ in entries)
    except FileNotFoundError:
        return False


def _mounts_of(directory: Path, layer: Path) -> set[str]:
    """Where the bundle's config mounts something; without /dev, the sandbox's /dev is
    its layer's (`views.make_dev`), made here."""
    config = json.loads((directory / "config.json").read_bytes())
    mounts = {str(m["destination"]) for m in config["mounts"]}
    if "/dev" not in mounts:
        views.make_dev(layer / "upper")
    return mounts


def _make_empty(path: Path) -> None:
    """The empty directory masked paths are bound to: root's, read-only, kept empty."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o555)
    if any(path.iterdir()) or path.stat().st_mode & 0o777 != 0o555:
        raise errors.ProviderError(f"{path} must be an empty directory of mode 0555")
