"""LocalProvider: sandboxes as crun (or runc) containers on this machine.

(About 730 lines: the create and delete sequences, whose order is the
leak-freedom argument; host, disk, network and trees already live apart.)

On disk, under ``<state_dir>/sandboxes/<id>/``: ``meta.json`` (written
first: the record that makes even a half-created sandbox findable; the
directory is made under a staging name, ``.new-<id>.<random>``, and renamed
into place once the record is in it; a delete removes the record last),
``config.json`` (the OCI bundle), ``upper/`` and ``work/`` (the sandbox's
overlay layer over the shared, read-only image; with a disk limit they are
in ``<state_dir>/disk/<id>/`` instead, see `disk`), ``rootfs/`` (the mount
point, mounted only inside the container's mount namespace),
``sandmand.sock`` (the daemon's socket: bound here by the host, handed to
the daemon as a descriptor; the sandbox sees no path to it), ``token``,
``pid`` and ``log``. The directory is root's alone (0700). ``<state_dir>/empty``
is what the masked directories (``/proc/acpi``...) show under crun: nothing.

The provider tells at once of a sandbox whose daemon dies by itself (`watch_lost`,
`lost`; see `exits`): not under gVisor, whose daemon has no pid on this host; the
pool's reconcile pass finds those stopped.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from sandman import errors
from sandman.daemon import daemon_path
from sandman.daemon.checkpoint import prepare_checkpoint, replace_token
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
from sandman.providers.local import oci, seccomp, userns
from sandman.providers.local.commit import oci_layout_of
from sandman.providers.local.disk import DiskPool
from sandman.providers.local.exits import ExitWatch, classify, in_cgroup, log_tail, oom_kills
from sandman.providers.local.host import (
    beyond_host,
    host_size,
    limit_cgroup_parent,
    parent_pids,
    prepare_cgroups,
    raise_open_files,
)
from sandman.providers.local.network import (
    DEFAULT_EGRESS_DENY,
    NETNS_DIR,
    EgressPolicy,
    NetworkManager,
    names,
)
from sandman.providers.local.runtime import OCIRuntime, UserNamespace, read_pid
from sandman.providers.local.snapshots import (
    SnapshotStore,
    check_id,
    image_users,
    new_snapshot_id,
    tree_size,
)
from sandman.providers.local.trees import remove_tree
from sandman.providers.local.usage import MemoryMeter, read_usage
from sandman.settings import LocalConfig

__all__ = ["LocalProvider"]

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
_SOCKET_NAME = "sandmand.sock"
_META = "meta.json"
_STAGING = ".new-"  # a sandbox's directory before its record is whole: never a valid id
_TRASH = ".old-"  # a sandbox's directory on its way out, record and all: never a valid id
_TCP_ENDPOINT = "endpoint.json"
_PAUSED = "paused-memory"  # a sandbox paused with its memory: the checkpoint, until resumed  # runsc: the daemon's address on the sandbox's network
GVISOR_DAEMON_PORT = 8731
GVISOR_PIDS_HEADROOM = 256
GVISOR_MEMORY_HEADROOM = 128 * 2**20
_IMAGE_TTL = 2.0
_EMPTY = "empty"  # what masked directories show (oci.MASKED_DIRS): nothing, read-only
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
            global_args = [
                f"--platform={self.config.runsc_platform}",
                f"--network={self.config.runsc_network}",
                # The workload's files in the sandbox's layer, as under crun: runsc
                # >= 2023 defaults to root:self, one opaque .gvisor.filestore.<id> file
                # (nothing for a snapshot to keep; a restore refuses it). Debian's
                # runsc's default, which it accepts too.
                "--overlay2=none",
                *self.config.runsc_args,
            ]
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
        self._empty = state / _EMPTY
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
            await self._limit_parent()
            raise_open_files()  # a descriptor per sandbox held (`ExitWatch`)
            self._sandboxes.mkdir(parents=True, exist_ok=True)
            if self._userns:
                await self._check_userns()
            try:
                await anyio.to_thread.run_sync(_make_empty, self._empty)
            except OSError as exc:
                if isinstance(exc, errors.SandboxError):
                    raise
                raise errors.ProviderError(
                    f"the state directory failed at {exc.filename or self._empty}: "
                    f"{exc.strerror or exc}"
                ) from exc
            self._prepared = True

    async def _check_userns(self) -> None:
        """ConfigError unless sandboxes can run in user namespaces here (`userns.probe`,
        on the state directory's filesystem: the image layers are idmapped there)."""
        state = self.config.state_dir.resolve()
        try:
            works, why = await anyio.to_thread.run_sync(userns.probe, self._daemon, state)
        except OSError as exc:
            raise errors.ProviderError(
                f"the state directory failed at {exc.filename or state}: {exc.strerror or exc}"
            ) from exc
        if not works:
            raise errors.ConfigError(
                f"sandboxes cannot run in user namespaces here: {why} (`sandman doctor`); "
                "LocalConfig(userns=False) runs them without one (root inside is then "
                "root on the host)"
            )
        try:
            await anyio.to_thread.run_sync(lambda: userns.ROOTFS.mkdir(mode=0o755, exist_ok=True))
        except OSError as exc:
            raise errors.ProviderError(f"cannot make {userns.ROOTFS}: {exc.strerror}") from exc

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
        if not _ID.match(sandbox_id):
            raise errors.ConfigError(
                f"invalid sandbox id {sandbox_id!r}: lowercase letters, digits and '-', at most 63"
            )
        return self._sandboxes / sandbox_id

    def _socket(self, directory: Path) -> Path:
        return directory / _SOCKET_NAME

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
                self._check_memory()
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
        _make_record(directory, json.dumps(meta))
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
                raise _state_error(sid, directory, exc) from exc
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
        _write(directory / "token", token, mode=0o400)
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
        )
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
            _write(directory / _TCP_ENDPOINT, json.dumps({"host": tcp.host, "port": tcp.port}))
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
            _write(directory / "resolv.conf", f"nameserver {attachment.host_ip}\n", mode=0o644)
            config["mounts"].append({
                "destination": "/etc/resolv.conf", "type": "bind",
                "source": str(directory / "resolv.conf"),
                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"],
            })  # fmt: skip
        _write(directory / "config.json", json.dumps(config))
        if memory:
            assert source is not None
            return await self._restore_memory(sid, directory, image, layer, source, token)
        return await self._launch(sid, directory, image, layer, token, layout.netns, base)

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
        overlay = (_lowerdir(image), layer / "upper", layer / "work", directory / "rootfs")
        ids = None
        if base is not None or (directory / userns.MOUNT_POINT).exists():
            if base is None:
                # Adopted, or restored: the range it holds (again, after a reboot).
                base = await anyio.to_thread.run_sync(userns.allocate, directory)
            ids = UserNamespace(base, userns.RANGE, directory / userns.MOUNT_POINT, netns)
            overlay = (*overlay[:3], userns.ROOTFS)
        if self.config.runtime == "runsc":
            await self._runtime.create(
                sid, directory, log=directory / "log", overlay=overlay, helper=self._daemon
            )
            await self._runtime.start(sid)
            return _endpoint(directory, self._socket(directory), token)
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
            await anyio.to_thread.run_sync(_remove_record_last, directory)
        except OSError as exc:
            raise errors.ProviderError(
                f"cannot remove sandbox {sandbox_id}'s files: {exc}"
            ) from exc

    async def _remove_cgroups(self, sandbox_id: str) -> None:
        """Remove cgroup dirs the runtime left: it gives up on one still busy
        with exiting tasks (seen with hugetlb under load)."""
        left = await anyio.to_thread.run_sync(
            _remove_cgroup_dirs, self.config.cgroup_parent.strip("/"), sandbox_id
        )
        if left:
            raise errors.ProviderError(f"cgroups of {sandbox_id} still busy: {left}")

    # -- snapshots, restore, pause (sandman.providers.base.Snapshots) ------------------

    def _meta(self, sandbox_id: str) -> dict[str, Any]:
        try:
            meta: dict[str, Any] = json.loads((self._dir(sandbox_id) / _META).read_text())
        except FileNotFoundError:
            raise errors.SandboxNotFound(f"no sandbox {sandbox_id} in {self._sandboxes}") from None
        except (OSError, ValueError) as exc:
            raise errors.ProviderError(f"cannot read sandbox {sandbox_id}'s record: {exc}") from exc
        return meta

    async def _running(self, sandbox_id: str) -> str:
        """The container's status, which must be running or paused; else why not, typed."""
        status = (await self._runtime.states()).get(sandbox_id)
        if status in ("running", "paused"):
            return status
        if status is None and (self._dir(sandbox_id) / _PAUSED).is_dir():
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused with its memory: resume it")
        raise errors.SandboxLost.of(
            sandbox_id, "daemon_exit", f"its container is {status or 'gone'}: nothing to keep"
        )

    def _layer_of(self, sandbox_id: str) -> Path:
        if self.disk.has(sandbox_id):
            return self.disk.root / sandbox_id
        return self._dir(sandbox_id)

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
        if memory:
            self._check_memory()
        meta = self._meta(sandbox_id)
        status = await self._running(sandbox_id)
        if memory and status != "running":
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused: resume it first")
        sid = check_id(snapshot_id) if snapshot_id else new_snapshot_id()
        record = {
            "id": sid, "labels": dict(labels or {}), "image": meta.get("image", ""),
            "image_id": meta.get("image_id", ""), "created_at": time.time(),
            "source": sandbox_id, "spec": _own_spec(meta.get("spec")), "memory": memory,
        }  # fmt: skip
        store = self.snapshot_store
        try:
            await anyio.to_thread.run_sync(store.record, sid, record)
        except FileExistsError:
            raise errors.ConfigError(f"snapshot {sid} already exists") from None
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            # The state directory read-only or full: typed, as a create's is.
            raise errors.ProviderError(
                f"cannot record snapshot {sid}: the state directory failed at "
                f"{exc.filename or store.root}: {exc.strerror or exc}"
            ) from exc
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

    def _check_memory(self) -> None:
        """ConfigError unless this provider can keep and restore processes."""
        if self.config.runtime != "runsc":
            raise errors.ConfigError(
                "a snapshot with memory needs a runtime that can checkpoint processes: "
                f"this provider runs {self.config.runtime!r}, and the CRIU that crun would use "
                "fails `criu check` on this kernel; use LocalConfig(runtime='runsc', "
                "runsc_network='sandbox'), or snapshot(memory=False) to keep the files"
            )
        if self.config.runsc_network != "sandbox":
            raise errors.ConfigError(
                "a snapshot with memory needs gVisor's own network stack: "
                f"runsc_network={self.config.runsc_network!r} (host networking) cannot be "
                "checkpointed; use LocalConfig(runsc_network='sandbox')"
            )

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
        store = self.snapshot_store
        token = (directory / "token").read_text()
        endpoint = _endpoint(directory, self._socket(directory), token)
        try:
            await prepare_checkpoint(token=token, host=endpoint.host, port=endpoint.port)
        except BaseException as exc:
            # Refused (typed) while the workload holds TCP sockets: nothing happened
            # then. Any other failure may have left the daemon prepared, and deaf.
            if not (isinstance(exc, errors.DaemonError) and exc.code == "not_checkpointable"):
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise
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

    async def _resume_from(self, sandbox_id: str, image_path: Path, token: str) -> None:
        """Restore the checkpointed (stopped) sandbox in place: same container id, bundle,
        layer, network and token; its daemon serves again."""
        directory = self._dir(sandbox_id)
        meta = self._meta(sandbox_id)
        image = await self.images.get(meta["image_id"])
        await self._runtime.delete(sandbox_id)
        await self._remove_cgroups(sandbox_id)
        await self.network.readdress(sandbox_id)
        (directory / "pid").unlink(missing_ok=True)
        layer = self._layer_of(sandbox_id)
        await self._restored(sandbox_id, directory, image, layer, image_path, token, token)

    async def _restore_memory(
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
        store = self.snapshot_store
        held = await anyio.to_thread.run_sync(store.token, snapshot_id)
        return await self._restored(
            sid, directory, image, layer, store.memory(snapshot_id), held, token
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
        overlay = (_lowerdir(image), layer / "upper", layer / "work", directory / "rootfs")
        await self._runtime.restore(
            sid, directory, image_path, log=directory / "log", overlay=overlay,
            helper=self._daemon,
        )  # fmt: skip
        await self._runtime.kill(sid, "USR2")
        endpoint = _endpoint(directory, self._socket(directory), token)
        assert endpoint.host is not None and endpoint.port is not None
        deadline = time.monotonic() + self.config.stop_timeout
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
                        f"{self.config.stop_timeout} s"
                    ) from None
                await anyio.sleep(0.002)
        return endpoint

    async def snapshots(
        self, *, labels: Mapping[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        """Every snapshot of this state directory (half-made ones too) with ``labels``."""
        return await anyio.to_thread.run_sync(self.snapshot_store.list, labels)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot's files and record; waits for creates from it in flight."""
        try:
            await anyio.to_thread.run_sync(self.snapshot_store.delete, snapshot_id)
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            raise errors.ProviderError(f"cannot delete snapshot {snapshot_id}: {exc}") from exc

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Reset the sandbox to the snapshot's files: its container is made again over a
        new layer from the snapshot (same id, token and network; new processes, or with a
        memory snapshot the snapshot's processes, restored)."""
        meta = self._meta(sandbox_id)
        directory = self._dir(sandbox_id)
        hold = self.snapshot_store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        try:
            if snapshot.image_id != meta.get("image_id"):
                raise errors.ConfigError(
                    f"snapshot {snapshot_id} is of image {snapshot.image!r}; sandbox "
                    f"{sandbox_id} runs {meta.get('image')!r}: restore needs the same image"
                )
            if snapshot.memory:
                self._check_memory()
            image = await self.images.get(snapshot.image_id)
            spec = SandboxSpec.model_validate(_own_spec(meta["spec"]))
            token = (directory / "token").read_text()
            self._exits.forget(sandbox_id)
            await self._runtime.delete(sandbox_id)
            await self._remove_cgroups(sandbox_id)
            # The old layer goes; a crash from here on leaves a sandbox without a
            # container, which the pool finds lost and deletes, record and all.
            await anyio.to_thread.run_sync(self._drop_layer, sandbox_id, directory)
            layer = await self._layer(sandbox_id, directory, spec, snapshot_id)
            if snapshot.memory:
                # Its processes from the image, in its own namespace, with its own token.
                await self.network.readdress(sandbox_id)
                endpoint = await self._restore_memory(
                    sandbox_id, directory, image, layer, snapshot_id, token
                )
            else:
                netns = None if spec.network == "none" else str(NETNS_DIR / names(sandbox_id)[0])
                endpoint = await self._launch(sandbox_id, directory, image, layer, token, netns)
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
        self._seen.pop(sandbox_id, None)  # a new daemon pid
        info = await self.inspect(sandbox_id)
        return info.model_copy(update={"endpoint": endpoint})

    async def save_image(self, snapshot_id: str, name: str) -> Image:
        """The snapshot's files over its image's, as a new image ``name`` in the store
        (one more layer; the image's config kept): later creates name it."""
        hold = self.snapshot_store.using(snapshot_id)
        snapshot = await anyio.to_thread.run_sync(hold.__enter__)
        try:
            layout = Path(tempfile.mkdtemp(prefix=".commit-", dir=self.config.state_dir))
        except OSError as exc:
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)
            raise errors.ProviderError(
                f"cannot make an image of {snapshot_id}: the state directory failed at "
                f"{exc.filename or self.config.state_dir}: {exc.strerror or exc}"
            ) from exc
        try:
            image = await self.images.get(snapshot.image_id)
            upper = self.snapshot_store.upper(snapshot_id)
            await anyio.to_thread.run_sync(
                lambda: oci_layout_of(image, upper, layout / "oci", source=snapshot_id)
            )
            return await self.images.import_oci_layout(layout / "oci", name=name)
        finally:
            await anyio.to_thread.run_sync(_remove_tree, layout)
            await anyio.to_thread.run_sync(hold.__exit__, None, None, None)

    def _drop_layer(self, sandbox_id: str, directory: Path) -> None:
        if self.disk.has(sandbox_id):
            self.disk.remove(sandbox_id)
        for name in ("upper", "work"):
            _remove_tree(directory / name)
        for name in (_SOCKET_NAME, "pid"):
            (directory / name).unlink(missing_ok=True)

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Freeze the sandbox's processes (its freezer cgroup): it uses no CPU; its memory
        stays. With ``memory`` (gVisor with its own network stack, as for a memory
        snapshot) its processes are checkpointed to disk and the container is removed:
        no CPU and no memory, until `resume` restores them (same id, address, token)."""
        self._meta(sandbox_id)
        if not memory:
            await self._running(sandbox_id)
            await self._runtime.pause(sandbox_id)
            return
        self._check_memory()
        if (await self._running(sandbox_id)) != "running":
            raise errors.SandboxPaused(f"sandbox {sandbox_id} is paused already")
        directory = self._dir(sandbox_id)
        token = (directory / "token").read_text()
        endpoint = _endpoint(directory, self._socket(directory), token)
        image_path = directory / _PAUSED
        try:
            await prepare_checkpoint(token=token, host=endpoint.host, port=endpoint.port)
        except BaseException as exc:
            if not (isinstance(exc, errors.DaemonError) and exc.code == "not_checkpointable"):
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise
        try:
            await anyio.to_thread.run_sync(lambda: image_path.mkdir(mode=0o700))
            await self._runtime.checkpoint(sandbox_id, image_path)
            # Gone from the runtime: memory and cgroups freed; the record, layer,
            # network and the image stay, and `list` tells it paused (`_read`).
            await self._runtime.delete(sandbox_id)
            await self._remove_cgroups(sandbox_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_remove_tree, image_path)
                with contextlib.suppress(errors.SandboxError):
                    await self._runtime.kill(sandbox_id, "USR2")
            raise
        self._seen.pop(sandbox_id, None)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox, or restore one paused with its memory."""
        self._meta(sandbox_id)
        directory = self._dir(sandbox_id)
        image_path = directory / _PAUSED
        if await anyio.to_thread.run_sync(image_path.is_dir):
            token = (directory / "token").read_text()
            await self._resume_from(sandbox_id, image_path, token)
            await anyio.to_thread.run_sync(_remove_tree, image_path)
            self._seen.pop(sandbox_id, None)
            return await self.inspect(sandbox_id)
        await self._running(sandbox_id)
        await self._runtime.resume(sandbox_id)
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
            await anyio.to_thread.run_sync(_relabel, directory / _META, dict(labels))
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
                if _ID.match(entry.name):
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
            stat = os.stat(directory / _META)
            identity: tuple[int, int] | None = (stat.st_ino, stat.st_mtime_ns)
        except OSError:
            identity = None
        seen = self._seen.get(sid)
        if identity is not None and seen is not None and seen[0] == identity:
            _, meta, token, known = seen
        else:
            meta, token, known = {}, None, None
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((directory / _META).read_text())
            with contextlib.suppress(OSError):
                token = (directory / "token").read_text()
        state = _STATES.get(states.get(sid, ""), "creating" if meta else "unknown")
        if sid not in states and meta and (directory / _PAUSED).is_dir():
            state = "running"  # paused with its memory on disk (`pause`): held, not gone
        endpoint = None
        if token is not None and state == "running":
            endpoint = known or _endpoint(directory, self._socket(directory), token)
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
        return await anyio.to_thread.run_sync(self._remove_strays, older_than)

    def _remove_strays(self, older_than: float) -> builtins.list[str]:
        removed = []
        deadline = time.time() - older_than
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._sandboxes):
                if not entry.name.startswith((_STAGING, _TRASH)):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if (
                        entry.name.startswith(_TRASH)
                        or entry.stat(follow_symlinks=False).st_mtime < deadline
                        or _abandoned(Path(entry.path))
                    ):
                        _remove_tree(Path(entry.path))
                        removed.append(entry.name)
        return removed

    async def aclose(self) -> None:
        """Sandboxes live on until deleted; the disk filesystem is unmounted if none holds a layer."""
        self._exits.close()
        await anyio.to_thread.run_sync(self.disk.release)


def _lowerdir(image: Image) -> Path:
    """The image's layers as one overlay lowerdir, topmost first (``a:b:c``): stacked as
    the layer store keeps them (`Image.lowers`), not copied."""
    return Path(":".join(str(p) for p in image.lowers))


def _own_spec(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A sandbox's recorded spec as a caller could have written it: without Sandman's own
    labels (a tenant's, set by the service), which a spec may not name."""
    if spec is None:
        return None
    labels = {k: v for k, v in spec.get("labels", {}).items() if not k.startswith("sandman.io/")}
    return {**spec, "labels": labels}


def _state_error(sid: str, directory: Path, exc: OSError) -> errors.ProviderError:
    """A failure of this host's state directory (read-only, full...), named as such."""
    where = exc.filename or directory
    return errors.ProviderError(
        f"cannot create sandbox {sid}: the state directory failed at {where}: {exc.strerror or exc}"
    )


def _endpoint(directory: Path, socket_path: Path, token: str) -> DaemonEndpoint:
    """Where a running sandbox's daemon listens, from what its directory records."""
    with contextlib.suppress(OSError, ValueError):
        where = json.loads((directory / _TCP_ENDPOINT).read_text())
        return DaemonEndpoint(host=str(where["host"]), port=int(where["port"]), token=token)
    return DaemonEndpoint(uds=str(socket_path), token=token, pid=read_pid(directory / "pid"))


def _relabel(meta_path: Path, labels: dict[str, str | None]) -> None:
    meta = json.loads(meta_path.read_text())
    merged = {**meta.get("labels", {}), **labels}
    meta["labels"] = {k: v for k, v in merged.items() if v is not None}
    staged = meta_path.with_name(f".{meta_path.name}.{secrets.token_hex(4)}")
    _write(staged, json.dumps(meta))
    os.replace(staged, meta_path)


def _make_record(directory: Path, meta: str) -> None:
    """The sandbox's directory with its ``meta.json``, whole or not at all: made under a
    staging name `list` does not see (`remove_strays` finds it if we die first), then renamed.

    The staging directory is flocked while it is made: one with its record written
    and no lock held is a create that died, which `remove_strays` takes at once,
    not after its grace (a dead pool's watchdog sweeps right after the death)."""
    staging = directory.with_name(f"{_STAGING}{directory.name}.{secrets.token_hex(4)}")
    try:
        staging.mkdir(mode=0o700)
        try:
            fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # at once: only a sweeper's look may hold it
                _write(staging / _META, meta)
                # Onto nothing, or onto an empty directory a crashed delete left.
                staging.rename(directory)
            finally:
                os.close(fd)
        except BaseException:
            _remove_tree(staging)
            raise
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise errors.ConfigError(f"sandbox {directory.name} already exists") from None
        raise _state_error(directory.name, directory, exc) from exc


def _abandoned(staging: Path) -> bool:
    """Whether a staging directory's create died: its record written, its lock free
    (`_make_record` holds it until the rename; a dead process holds nothing)."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a create in flight
        # Gone (renamed into place) since we opened it: no record under this name.
        return (staging / _META).exists()
    finally:
        os.close(fd)


def _make_empty(path: Path) -> None:
    """The empty directory masked paths are bound to: root's, read-only, kept empty."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o555)
    if any(path.iterdir()) or path.stat().st_mode & 0o777 != 0o555:
        raise errors.ProviderError(f"{path} must be an empty directory of mode 0555")


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _remove_cgroup_dirs(parent: str, sandbox_id: str, patience: float = 5.0) -> list[Path]:
    """Kill whatever still runs in the sandbox's cgroups, then rmdir them; returns what is left.

    Normally the runtime's delete did all this. Not when its ``create`` died
    half-way (killed, timed out): then the runtime does not know the
    container, but its init may already sit in the cgroups.
    """
    left = [p for p in _CGROUP_ROOT.glob(f"*/{parent}/{sandbox_id}") if p.is_dir()]
    deadline = time.monotonic() + patience
    while left and time.monotonic() < deadline:
        for path in list(left):
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                path.rmdir()
                left.remove(path)
            except FileNotFoundError:
                left.remove(path)
            except OSError:
                pass  # EBUSY: its last tasks are still exiting
        if left:
            time.sleep(0.01)
    return left


def _remove_record_last(directory: Path) -> None:
    """The sandbox's files, then its record (``meta.json``) and directory at once.

    Killed half-way, this leaves a sandbox `list` still finds by its labels (and
    the next delete finishes), or a directory under a trash name that it never
    lists and the next delete of it, or `remove_strays`, removes at once. It never leaves a directory under
    the sandbox's name without its record: `list` would show it unlabelled, so no
    sweep by label would remove it (a client SIGKILLed mid-delete did). Another
    delete of the same sandbox at the same time is no error: what it removed
    first is skipped, never a reason to stop and leave the rest.
    """
    try:
        names = [entry.name for entry in os.scandir(directory)]
    except FileNotFoundError:
        # Gone already, or a delete before this one failed once it had the trash
        # name (the state directory read-only for a moment): this retry removes
        # that, or nothing would (only a dead pool's sweep and gc look for trash).
        _remove_trash_of(directory)
        return
    for name in names:
        if name != _META:
            _remove_entry(directory / name)
    trash = directory.with_name(f"{_TRASH}{directory.name}.{secrets.token_hex(4)}")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return  # another delete got there first
    _remove_tree(trash)


def _remove_trash_of(directory: Path) -> None:
    """What earlier deletes of this sandbox left under a trash name."""
    prefix = f"{_TRASH}{directory.name}."
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory.parent):
            if entry.name.startswith(prefix):
                _remove_tree(Path(entry.path))


def _remove_entry(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        _remove_tree(path)


def _remove_tree(directory: Path) -> None:
    """The tree, however deep or odd the workload made it (`trees.remove_tree`: no
    recursion, no symlink followed); goes on past entries another remover took first."""
    remove_tree(directory)
