"""The OCI runtime (crun, runc or runsc) driven as a command: create, start, delete, list;
and gVisor's checkpoint and restore."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio

from sandman import errors
from sandman.providers.local import spawn

__all__ = ["OCIRuntime", "UserNamespace"]

logger = logging.getLogger(__name__)

# Runtime processes at once. A pool closing with 4000 sandboxes started 4000
# `crun delete`s together (~1 MiB each, on 2 cores): 20 deletes a second, where
# 1000 went at 67 a second; and the memory of thousands of processes at once on a
# host that is full of sandboxes.
MAX_PROCESSES = 32
# Checkpoint and restore move the sandbox's memory: bounded by this many stop timeouts.
_SLOW = 6


@dataclass(frozen=True)
class UserNamespace:
    """The user namespace overlay-exec makes for a container (``--userns``): ids
    0..``size``-1 inside are host ids ``base``..., owned by ``base``, bound at ``path``."""

    base: int
    size: int
    path: Path

    def flags(self) -> list[str]:
        return [f"--userns={self.base}:{self.size}:{self.path}"]


class OCIRuntime:
    """One runtime binary with its own state directory (``--root``).

    Every call is bounded by ``timeout``; a runtime that hangs is killed and
    the call fails with ProviderError.
    """

    def __init__(
        self,
        binary: str,
        root: Path,
        *,
        kind: Literal["crun", "runc", "runsc"],
        timeout: float,
        global_args: Sequence[str] = (),
        hide_sys_net: Path | None = None,
    ) -> None:
        self.binary = binary
        self.root = root.resolve()  # crun misbehaves with a relative --root
        self.kind = kind
        self.timeout = timeout
        # Flags every call takes before the command (runsc: --platform).
        self._global = ["--root", str(self.root), *global_args]
        # Debian's runsc with --network=sandbox: the commands that set up its network
        # run where /proc/sys/net is hidden (`sandmand hide-sys-net`, this helper).
        self._hide = hide_sys_net
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _gate(self) -> asyncio.Semaphore:
        """At most `MAX_PROCESSES` runtime processes at once, per event loop."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(MAX_PROCESSES)
        return gate

    async def _spawn(
        self,
        argv: list[str],
        what: str,
        log: Path | None = None,
        pass_fds: Sequence[int] = (),
        timeout: float | None = None,
    ) -> spawn.Completed:
        limit = timeout or self.timeout
        try:
            # Queued here, not in the kernel: the timeout counts from the start.
            async with self._gate():
                return await spawn.run(argv, log=log, timeout=limit, pass_fds=pass_fds)
        except TimeoutError:
            raise errors.ProviderError(
                f"{self.kind} {what} did not finish within {limit} s"
            ) from None
        except BlockingIOError as exc:
            # EAGAIN from fork: the host is out of processes (pid_max, threads-max).
            raise errors.CapacityError(
                f"cannot start {self.kind} {what}: the host is out of processes ({exc.strerror})"
            ) from exc
        except OSError as exc:
            raise errors.ProviderError(f"cannot start {self.kind} {what}: {exc}") from exc

    def _hidden(self) -> list[str]:
        return [] if self._hide is None else [str(self._hide), "hide-sys-net", "--"]

    async def _run(
        self, *args: str, hide: bool = False, timeout: float | None = None
    ) -> tuple[int, str]:
        """Run the runtime; returns (exit code, stdout, or stderr on failure)."""
        argv = [*(self._hidden() if hide else []), self.binary, *self._global, *args]
        done = await self._spawn(argv, args[0], timeout=timeout)
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace")
            logger.debug("%s %s failed: %s", self.kind, " ".join(args), message)
            return done.returncode, message
        return 0, done.stdout.decode(errors="replace")

    async def create(
        self,
        sandbox_id: str,
        bundle: Path,
        *,
        log: Path,
        overlay: tuple[Path, Path, Path, Path],
        helper: Path,
        pass_fds: Sequence[int] = (),
        userns: UserNamespace | None = None,
        sysfs: str | None = None,
    ) -> int:
        """``create`` run through ``helper overlay-exec``, which mounts the overlay
        (lower, upper, work, target) in a private mount namespace first; with
        ``userns``, it makes the sandbox's user namespace and idmaps the layers into it;
        with ``sysfs`` (a network namespace's path), it mounts that one's sysfs at /sys.

        ``pass_fds`` are the container process's descriptors 3, 4, ...
        Returns the pid of the container's init (on this host).
        """
        preserve = ["--preserve-fds", str(len(pass_fds))] if pass_fds else []
        command = [
            "create", *preserve, "--bundle", str(bundle), "--pid-file", str(bundle / "pid"),
            sandbox_id,
        ]  # fmt: skip
        return await self._overlaid(
            sandbox_id, command, log=log, overlay=overlay, helper=helper, pass_fds=pass_fds,
            userns=userns, sysfs=sysfs,
        )  # fmt: skip

    async def restore(
        self,
        sandbox_id: str,
        bundle: Path,
        image_path: Path,
        *,
        log: Path,
        overlay: tuple[Path, Path, Path, Path],
        helper: Path,
    ) -> int:
        """gVisor: a new container ``sandbox_id`` of ``bundle``, running the processes of
        the checkpoint at ``image_path`` (`checkpoint`), over the overlay as `create` has
        it. Returns the pid of its sandbox process (on this host)."""
        command = [
            "restore", "--image-path", str(image_path), "--bundle", str(bundle),
            "--pid-file", str(bundle / "pid"), "--detach", sandbox_id,
        ]  # fmt: skip
        return await self._overlaid(
            sandbox_id, command, log=log, overlay=overlay, helper=helper, slow=True
        )

    async def _overlaid(
        self,
        sandbox_id: str,
        command: list[str],
        *,
        log: Path,
        overlay: tuple[Path, Path, Path, Path],
        helper: Path,
        pass_fds: Sequence[int] = (),
        slow: bool = False,
        userns: UserNamespace | None = None,
        sysfs: str | None = None,
    ) -> int:
        what = command[0]
        bundle = Path(command[command.index("--bundle") + 1])
        pid_file = bundle / "pid"
        hide = ["--hide-sys-net"] if self._hide is not None else []
        ids = userns.flags() if userns is not None else []
        ids += [f"--sysfs={sysfs}"] if sysfs is not None else []
        argv = [
            str(helper), "overlay-exec", *hide, *ids, *(str(p) for p in overlay), "--",
            self.binary, *self._global, *command,
        ]  # fmt: skip
        # Both streams go to the log: the container's PID 1 inherits them as its stdio.
        # Not interrupted by cancellation: a create killed half-way leaves a
        # container the runtime does not know. It is short (and bounded by the
        # timeout); on cancellation we let it finish, then the caller deletes.
        timeout = self.timeout * _SLOW if slow else None
        running = asyncio.ensure_future(self._spawn(argv, what, log, pass_fds, timeout))
        try:
            done = await asyncio.shield(running)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running
            raise
        if done.returncode != 0:
            tail = (await anyio.Path(log).read_text(errors="replace"))[-2000:].strip()
            raise errors.ProviderError(
                f"{self.kind} {what} {sandbox_id} failed ({done.returncode}): {tail}"
            )
        pid = read_pid(pid_file)
        if pid is None:
            raise errors.ProviderError(
                f"{self.kind} {what} {sandbox_id} wrote no pid to {pid_file}"
            )
        return pid

    async def checkpoint(self, sandbox_id: str, image_path: Path) -> None:
        """gVisor: save every process of the container to ``image_path``; the container
        stops. Refused by gVisor with host networking, and fatal to the sandbox if a TCP
        endpoint is in use (the daemon's prepare rules that out)."""
        code, message = await self._run(
            "checkpoint", "--image-path", str(image_path), sandbox_id,
            hide=True, timeout=self.timeout * _SLOW,
        )  # fmt: skip
        if code != 0:
            raise errors.ProviderError(
                f"{self.kind} checkpoint {sandbox_id} failed: {message.strip()}"
            )

    async def kill(self, sandbox_id: str, signal: str) -> None:
        """Send ``signal`` (``"USR2"``) to the container's init."""
        code, message = await self._run("kill", sandbox_id, signal)
        if code != 0:
            raise errors.ProviderError(
                f"{self.kind} kill {sandbox_id} {signal} failed: {message.strip()}"
            )

    async def start(self, sandbox_id: str) -> None:
        code, message = await self._run("start", sandbox_id, hide=True)
        if code != 0:
            raise errors.ProviderError(f"{self.kind} start {sandbox_id} failed: {message.strip()}")

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the container (the freezer cgroup): no CPU until `resume`."""
        code, message = await self._run("pause", sandbox_id)
        if code != 0 and "paused" not in message.lower():
            raise errors.ProviderError(f"{self.kind} pause {sandbox_id} failed: {message.strip()}")

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a paused container."""
        code, message = await self._run("resume", sandbox_id)
        if code != 0 and "not paused" not in message.lower():
            raise errors.ProviderError(f"{self.kind} resume {sandbox_id} failed: {message.strip()}")

    async def delete(self, sandbox_id: str) -> None:
        """Kill and remove the container, its cgroups and its state; fine if it is gone."""
        for attempt in range(3):
            if attempt:
                # Another delete of it (a dead pool's watchdog, gc, a reconcile) may be
                # half-way through its state ("error loading config.json"): again, later.
                await asyncio.sleep(0.05 * attempt)
            code, message = await self._run("delete", "--force", sandbox_id)
            if code == 0 or _is_missing(message):
                return
        raise errors.ProviderError(f"{self.kind} delete {sandbox_id} failed: {message.strip()}")

    async def states(self) -> dict[str, str]:
        """Every container under our ``--root``: id to status (created, running, paused,
        stopped)."""
        if not self.root.exists():
            return {}
        for attempt in range(3):
            code, out = await self._run("list", "--format", "json")
            # A container deleted while crun read its state ("error opening file
            # .../status"): a moment later it is gone from the list.
            if code == 0 or not _is_missing(out):
                break
            await asyncio.sleep(0.02 * (attempt + 1))
        if code != 0:
            raise errors.ProviderError(f"{self.kind} list failed: {out.strip()}")
        entries = json.loads(out or "[]") or []
        return {entry["id"]: entry["status"] for entry in entries}


def read_pid(pid_file: Path) -> int | None:
    """The container init's pid the runtime wrote, or None when there is none (yet)."""
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _is_missing(message: str) -> bool:
    lowered = message.lower()
    return "does not exist" in lowered or "not found" in lowered or "no such file" in lowered
