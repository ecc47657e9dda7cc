"""The fake provider, for our tests and yours.

(About 700 lines, one public module: users import `sandman.testing` alone.)

`FakeProvider` satisfies `sandman.providers.base.Provider` without
containers, images or root, and fails on request. Each of its sandboxes is a
real ``sandmand`` process started on this machine, so everything the SDK
does (exec, files, processes, sessions) works against it; with
``daemon=False`` there is no process at all, for fast tests of pool logic
with thousands of sandboxes. `Faults` says what goes wrong and how often; its
fields can be changed while a test runs.

```python
import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.testing import FakeProvider, Faults


async def test_a_flaky_backend() -> None:
    faults = Faults(create_latency=0.05, throttle=0.1, lose_after=60.0)
    async with FakeProvider(faults=faults, seed=1) as provider:
        info = await provider.create(SandboxSpec(image="task"), labels={"team": "a"})
        assert info.endpoint is not None
        async with info.endpoint.client() as sandbox:
            await sandbox.wait_ready(timeout=10)
            assert (await sandbox.exec(["echo", "hi"])).stdout == "hi\\n"
        faults.fail_create = 1.0  # from now on every create fails
        with pytest.raises(sandman.ProviderError):
            await provider.create(SandboxSpec(image="task"))
        await provider.delete(info.id)
    assert provider.live == 0  # nothing leaked
```

It tells of its sandboxes' deaths at once (``watch_lost`` and ``lost``, the
optional `sandman.providers.base.WatchesLost` capability the pool uses): one lost
through `FakeProvider.lose` (reason ``killed`` unless given), through
``Faults.lose_after`` (``node_lost``), or whose daemon process ended by itself
(``killed`` by a signal, else ``daemon_exit``).

What it is not: a sandbox. The daemon runs on the host as the user running
the test, in a working directory of its own (``<state_dir>/<id>/``); the
spec's image, resources, network, workdir and user are recorded but not
enforced (``spec.env`` is passed to the daemon, so commands see it).

Faults are decided with ``random.Random(seed)``: three draws per create
(``throttle``, ``fail_create``, ``leak_on_fail``) and one per delete
(``fail_delete``), always taken, and taken when the call starts, so a run
that makes the same calls in the same order meets the same faults whatever
the timing. Generated sandbox ids count up (``fake-000001``, ...).

It runs on asyncio (daemons are asyncio subprocesses) and on Linux (it finds
what a daemon started through ``/proc``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import random
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sandman import errors
from sandman.daemon import daemon_path
from sandman.egress import Egress
from sandman.models import SandboxSpec
from sandman.providers.base import DaemonEndpoint, Lost, LostReports, SandboxInfo, SandboxState
from sandman.providers.losses import LossFeed

__all__ = ["FakeProvider", "Faults"]

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
_PROBABILITIES = ("fail_create", "throttle", "fail_delete", "leak_on_fail")


@dataclass
class Faults:
    """What goes wrong in a `FakeProvider`, and how often.

    Probabilities are in ``[0, 1]``; latencies in seconds. Every field may be
    changed (or the whole object replaced, ``provider.faults = Faults(...)``)
    while a test runs: each call reads the fields it needs when it needs
    them.

    A create checks, in this order: ``image_errors`` (at once), ``throttle``
    (at once), ``capacity`` (at once), then waits ``create_latency``, then
    ``fail_create`` (with ``leak_on_fail``).
    """

    create_latency: float = 0.0
    """Seconds a create takes before it returns (or fails with ``fail_create``)."""
    ready_latency: float = 0.0
    """Extra seconds, after create returns, before the daemon starts (``daemon=True``).

    The sandbox is already ``running`` with an endpoint; readiness is
    observed the way the pool does it, with ``DaemonClient.wait_ready``.
    """
    delete_latency: float = 0.0
    """Seconds a delete takes before it acts (or fails with ``fail_delete``)."""
    fail_create: float = 0.0
    """Probability that a create raises `ProviderError` (a server error) after
    ``create_latency``. Nothing is recorded or left behind, unless ``leak_on_fail``."""
    throttle: float = 0.0
    """Probability that a create raises `ThrottledError` at once."""
    throttle_retry_after: float | None = 0.1
    """The ``retry_after`` of those `ThrottledError` s."""
    capacity: int | None = None
    """Most sandboxes at once: those held (lost ones too, until deleted) plus
    creates in flight. A create beyond it raises `CapacityError` at once."""
    fail_delete: float = 0.0
    """Probability that a delete of an existing sandbox raises `ProviderError`
    after ``delete_latency``. The sandbox stays; a retry may succeed."""
    lose_after: float | None = None
    """Seconds after a sandbox became running (its create returned) when it
    vanishes: its daemon is killed and its state becomes ``stopped``, as if
    the node died (reason ``node_lost``). Read when each sandbox is created."""
    image_errors: frozenset[str] = frozenset()
    """Images whose create raises `ImageError` at once."""
    leak_on_fail: float = 0.0
    """Probability that a failed create (``fail_create``, or cancelled during
    ``create_latency``) still leaves a running sandbox behind, like a backend
    that made the pod but timed out answering. It is listed with the labels
    given, so a reconciler can find it; only `delete` removes it."""

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise errors.ConfigError(f"Faults.{name} must be in [0, 1], got {value}")
        if self.capacity is not None and self.capacity < 0:
            raise errors.ConfigError(f"Faults.capacity must be >= 0, got {self.capacity}")


@dataclass(eq=False)
class _Sandbox:
    """One sandbox the fake backend holds."""

    id: str
    labels: dict[str, str]
    image: str
    env: dict[str, str]
    created_at: float = field(default_factory=time.time)
    state: SandboxState = "running"
    socket: Path | None = None  # the daemon's socket; None without a daemon
    token: str | None = None
    process: asyncio.subprocess.Process | None = None
    starter: asyncio.Task[None] | None = None  # starts the daemon after ready_latency
    loser: asyncio.Task[None] | None = None  # loses the sandbox after lose_after
    monitor: asyncio.Task[None] | None = None  # notices the daemon ending by itself
    lost: Lost | None = None  # why it stopped, when it died by itself
    egress: Egress | None = None  # its rules, for a sandbox made with egress
    stopping: asyncio.Task[None] | None = None  # kills the daemon; set once
    deleting: asyncio.Task[None] | None = None  # stops, removes files, forgets; set once


class FakeProvider:
    """A `Provider` that fails on request; its sandboxes are ``sandmand`` processes on the host.

    Arguments:
        faults: what goes wrong; the default is nothing. Kept as ``self.faults``.
        daemon: start a real daemon per sandbox (``endpoint`` set), or none
            (``endpoint`` None) for pure pool-logic tests at high counts.
        seed: seeds the `random.Random` that decides faults; None for a
            different run each time.
        state_dir: where daemons keep their sockets, logs and working
            directories. Keep it short: socket paths must stay under 108
            bytes. By default a fresh directory under ``/tmp``, removed by
            `aclose`.

    Introspection for tests: `live`, `creating`, ``created_total``,
    ``deleted_total`` (always ``live == created_total - deleted_total``),
    ``calls`` (every ``(op, sandbox_id)`` in call order; ``op`` is
    ``create``, ``delete``, ``inspect``, ``list``, ``relabel`` or ``aclose``, the id is
    ``""`` where there is none) and ``max_concurrent_creates``.
    """

    name = "fake"

    def __init__(
        self,
        *,
        faults: Faults | None = None,
        daemon: bool = True,
        seed: int | None = 0,
        state_dir: Path | None = None,
    ) -> None:
        self.faults = faults if faults is not None else Faults()
        self.daemon = daemon
        self.created_total = 0
        """Sandboxes that came into existence (leftovers of failed creates too)."""
        self.deleted_total = 0
        """Sandboxes removed by `delete`."""
        self.calls: builtins.list[tuple[str, str]] = []
        """``(op, sandbox_id)`` of every call, in the order they were made."""
        self.max_concurrent_creates = 0
        """The most creates that were in flight at once (past the immediate checks)."""
        self._rng = random.Random(seed)
        self._binary = daemon_path() if daemon else None
        self._state_dir = state_dir.resolve() if state_dir is not None else None
        self._own_dir: Path | None = None
        self._sandboxes: dict[str, _Sandbox] = {}
        self._pending: set[str] = set()  # ids of creates in flight
        self._next_id = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._watched: set[str] = set()  # ids whose loss `lost` reports
        self._losses = LossFeed()

    def __repr__(self) -> str:
        return f"FakeProvider(live={self.live}, daemon={self.daemon}, faults={self.faults!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- introspection -------------------------------------------------------

    @property
    def live(self) -> int:
        """Sandboxes the backend holds now: created and not yet deleted (lost ones too)."""
        return len(self._sandboxes)

    @property
    def creating(self) -> int:
        """Creates in flight now (past the immediate checks)."""
        return len(self._pending)

    def daemon_pid(self, sandbox_id: str) -> int | None:
        """The process id of the sandbox's daemon while it runs, else None."""
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.process is None or sandbox.process.returncode is not None:
            return None
        return sandbox.process.pid

    # -- the Provider protocol -------------------------------------------------

    def progress(self, sandbox_id: str) -> str | None:
        """``"fake: waiting out create_latency"`` while that create is in flight."""
        return "fake: waiting out create_latency" if sandbox_id in self._pending else None

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        """Make a sandbox, with the faults of ``self.faults``; it is running when this returns.

        Raises `ImageError`, `ThrottledError`, `CapacityError` or
        `ProviderError` as the faults decide, and `ConfigError` for an
        invalid or taken ``sandbox_id``. Cancelled while it waits out
        ``create_latency``, it leaves nothing (but see ``leak_on_fail``).
        """
        sid = self._new_id() if sandbox_id is None else sandbox_id
        if not _ID.match(sid):
            raise errors.ConfigError(
                f"invalid sandbox id {sid!r}: lowercase letters, digits and '-', at most 63"
            )
        if sid in self._sandboxes or sid in self._pending:
            raise errors.ConfigError(f"sandbox {sid} already exists")
        socket = self._socket(sid) if self.daemon else None
        self.calls.append(("create", sid))
        faults = self.faults
        throttled = self._rng.random() < faults.throttle
        failed = self._rng.random() < faults.fail_create
        leaks = self._rng.random() < faults.leak_on_fail
        all_labels = {**spec.labels, **(labels or {})}
        if spec.image in faults.image_errors:
            raise errors.ImageError(f"fake: cannot pull image {spec.image!r}")
        if throttled:
            logger.debug("fake: throttling the create of %s", sid)
            raise errors.ThrottledError(
                f"fake: too many requests creating {sid}", retry_after=faults.throttle_retry_after
            )
        if faults.capacity is not None and self.live + self.creating >= faults.capacity:
            raise errors.CapacityError(
                f"fake: no room for {sid}: {self.live} held, {self.creating} being created, "
                f"capacity {faults.capacity}"
            )
        env = {**os.environ, **spec.env}
        self._pending.add(sid)
        self.max_concurrent_creates = max(self.max_concurrent_creates, self.creating)
        try:
            try:
                await asyncio.sleep(self.faults.create_latency)
            except asyncio.CancelledError:
                if leaks:
                    self._leave_behind(sid, spec, all_labels, env, socket)
                raise
            if failed:
                if leaks:
                    self._leave_behind(sid, spec, all_labels, env, socket)
                raise errors.ProviderError(f"fake: internal server error creating {sid}")
            token = secrets.token_urlsafe(24) if self.daemon else None
            process = None
            delay = self.faults.ready_latency
            if socket is not None and delay <= 0:
                process = await self._spawn(sid, socket, env, token)
            if self._closing:
                if process is not None and socket is not None:
                    await _kill(process)
                    await asyncio.to_thread(_remove_files, socket)
                raise errors.ProviderError(f"fake: provider closing while creating {sid}")
        finally:
            self._pending.discard(sid)
        sandbox = _Sandbox(
            sid, all_labels, spec.image, env, socket=socket, token=token, process=process,
            egress=spec.egress,
        )  # fmt: skip
        self._admit(sandbox, start_after=delay if socket is not None and process is None else None)
        return self._info(sandbox)

    async def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox: kill its daemon and everything it started, and wait for them.

        A missing sandbox is not an error. With ``fail_delete`` it may raise
        `ProviderError` instead, leaving the sandbox as it was. Cancelling a
        delete that has begun removing does not stop the removal.
        """
        self.calls.append(("delete", sandbox_id))
        self._watched.discard(sandbox_id)  # a delete is no loss
        fails = self._rng.random() < self.faults.fail_delete
        await asyncio.sleep(self.faults.delete_latency)
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            return
        if fails and sandbox.deleting is None:
            logger.debug("fake: failing the delete of %s", sandbox_id)
            raise errors.ProviderError(f"fake: internal server error deleting {sandbox_id}")
        await asyncio.shield(self._delete_task(sandbox))

    async def list(self, *, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """Every sandbox held whose labels include ``labels``, oldest first
        (leftovers of failed creates and lost sandboxes included)."""
        self.calls.append(("list", ""))
        wanted = dict(labels or {}).items()
        return [self._info(s) for s in self._sandboxes.values() if wanted <= s.labels.items()]

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        """Merge ``labels`` into the sandbox's; `SandboxNotFound` when it is not held."""
        self.calls.append(("relabel", sandbox_id))
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise errors.SandboxNotFound(f"fake: no sandbox {sandbox_id}")
        merged = {**sandbox.labels, **labels}
        sandbox.labels = {k: v for k, v in merged.items() if v is not None}

    async def inspect(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox; `SandboxNotFound` when it is not held."""
        self.calls.append(("inspect", sandbox_id))
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise errors.SandboxNotFound(f"fake: no sandbox {sandbox_id}")
        return self._info(sandbox)

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Keep ``egress`` as the sandbox's rules (`egress_of`), refusing as the local
        provider does: `SandboxNotFound`, or `ConfigError` for a sandbox made without egress."""
        self.calls.append(("set_egress", sandbox_id))
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise errors.SandboxNotFound(f"fake: no sandbox {sandbox_id}")
        if sandbox.egress is None:
            raise errors.ConfigError(
                f"sandbox {sandbox_id} has no egress: egress rules need a sandbox made "
                "with network='egress' or Egress(...)"
            )
        sandbox.egress = egress

    def egress_of(self, sandbox_id: str) -> Egress | None:
        """The sandbox's egress rules as last set; None for a sandbox without egress."""
        return self._sandboxes[sandbox_id].egress

    async def aclose(self, *, forget: bool = False) -> None:
        """Kill every daemon this provider started and wait for them: no process is left.

        Sandboxes stay recorded (``stopped``), so a test still sees what was
        not deleted (``live``) and can `delete` it. ``forget=True`` drops
        them too, without counting them as deleted. A create in flight
        meanwhile fails with `ProviderError`. The provider can be used again
        afterwards.
        """
        self.calls.append(("aclose", ""))
        self._closing = True
        try:
            for sandbox in builtins.list(self._sandboxes.values()):
                self._stop_task(sandbox)
            while self._tasks:
                await asyncio.shield(asyncio.wait(builtins.list(self._tasks)))
        finally:
            self._closing = False
        if forget:
            self._sandboxes.clear()
            self._watched.clear()
        if self._own_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._own_dir, ignore_errors=True)
            self._own_dir = None

    # -- faults on demand ------------------------------------------------------

    def lose(self, sandbox_id: str, *, reason: str = "killed", detail: str = "") -> None:
        """Make one sandbox vanish now: its daemon is killed, its state becomes ``stopped``.

        It stays held (listed, counted in `live`) until deleted, like a pod
        whose node died; if watched, `lost` reports it with ``reason`` (one of
        `sandman.SandboxLost.REASONS`) and ``detail``. Raises `SandboxNotFound`
        for a sandbox not held. Call it on the event loop the provider runs on
        (it stops the daemon there).
        """
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise errors.SandboxNotFound(f"fake: no sandbox {sandbox_id}")
        logger.debug("fake: losing %s (%s)", sandbox_id, reason)
        self._stop_task(sandbox)
        self._report(sandbox, reason, detail or f"fake: lost ({reason})")

    # -- telling of losses (sandman.providers.base.WatchesLost) ------------------

    def watch_lost(self, sandbox: SandboxInfo) -> None:
        """Report ``sandbox`` through `lost` when it dies by itself (at once if it has)."""
        held = self._sandboxes.get(sandbox.id)
        if held is None:
            return
        self._watched.add(sandbox.id)
        if held.lost is not None:
            self._report(held, held.lost.reason, held.lost.detail)

    def lost(self) -> LostReports:
        """Every watched sandbox that dies by itself, as it happens (`WatchesLost`)."""
        return self._losses.reader()

    def _report(self, sandbox: _Sandbox, reason: str, detail: str) -> None:
        sandbox.lost = Lost(sandbox_id=sandbox.id, reason=reason, detail=detail)
        if sandbox.id in self._watched:
            self._watched.discard(sandbox.id)
            self._losses.report(sandbox.lost)

    # -- internals -------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            self._next_id += 1
            sid = f"fake-{self._next_id:06d}"
            if sid not in self._sandboxes and sid not in self._pending:
                return sid

    def _dir(self) -> Path:
        if self._state_dir is not None:
            self._state_dir.mkdir(parents=True, exist_ok=True)
            return self._state_dir
        if self._own_dir is None:
            base = "/tmp" if os.path.isdir("/tmp") else None
            self._own_dir = Path(tempfile.mkdtemp(prefix="sandman-fake-", dir=base))
        return self._own_dir

    def _socket(self, sid: str) -> Path:
        socket = self._dir() / f"{sid}.sock"
        if len(os.fsencode(socket)) > _MAX_SOCKET_PATH:
            raise errors.ConfigError(
                f"socket path {socket} is longer than {_MAX_SOCKET_PATH} bytes: "
                "use a shorter state_dir or sandbox id"
            )
        return socket

    def _info(self, sandbox: _Sandbox) -> SandboxInfo:
        state = sandbox.state
        lost = sandbox.lost
        if state == "running" and sandbox.process and sandbox.process.returncode is not None:
            state = "stopped"  # the daemon died on its own
            lost = lost or _exit_loss(sandbox.id, sandbox.process.returncode)
        endpoint = None
        if state == "running" and sandbox.socket is not None and sandbox.token is not None:
            # The daemon calls listen(2) itself: connections check it is the peer.
            pid = sandbox.process.pid if sandbox.process is not None else None
            endpoint = DaemonEndpoint(uds=str(sandbox.socket), token=sandbox.token, pid=pid)
        return SandboxInfo(
            id=sandbox.id,
            provider=self.name,
            state=state,
            labels=dict(sandbox.labels),
            created_at=sandbox.created_at,
            image=sandbox.image,
            endpoint=endpoint,
            lost=lost if state == "stopped" else None,
        )

    def _task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _admit(self, sandbox: _Sandbox, *, start_after: float | None) -> _Sandbox:
        """Hold ``sandbox``: it exists from now on. Synchronous, so it cannot be cut short."""
        self._sandboxes[sandbox.id] = sandbox
        self.created_total += 1
        if self._closing:
            sandbox.state = "stopped"
            return sandbox
        if start_after is not None:
            sandbox.starter = self._task(self._start_later(sandbox, start_after))
        elif sandbox.process is not None:
            sandbox.monitor = self._task(self._monitor(sandbox))
        lose_after = self.faults.lose_after
        if lose_after is not None:
            sandbox.loser = self._task(self._lose_later(sandbox, lose_after))
        return sandbox

    def _leave_behind(
        self,
        sid: str,
        spec: SandboxSpec,
        labels: dict[str, str],
        env: dict[str, str],
        socket: Path | None,
    ) -> None:
        """A failed create's leftover: held and listed; its daemon starts in the background."""
        logger.debug("fake: the failed create of %s leaves it behind", sid)
        self._pending.discard(sid)
        token = secrets.token_urlsafe(24) if socket is not None else None
        sandbox = _Sandbox(sid, labels, spec.image, env, socket=socket, token=token)
        self._admit(sandbox, start_after=self.faults.ready_latency if socket is not None else None)

    async def _spawn(
        self, sid: str, socket: Path, env: dict[str, str], token: str | None
    ) -> asyncio.subprocess.Process:
        """Start a daemon. Cancelled or failing half-way, it leaves no process and no file."""
        assert self._binary is not None and token is not None
        home, log = _prepare(socket, sid)
        try:
            return await asyncio.create_subprocess_exec(
                str(self._binary),
                "--listen",
                f"unix:{socket}",
                env={**env, "SANDMAND_TOKEN": token},
                cwd=home,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # its own session and process group: killed as one
            )
        except BaseException as exc:
            # asyncio has killed and reaped a half-started process.
            _remove_files(socket)
            if isinstance(exc, OSError):
                raise errors.ProviderError(f"fake: cannot start sandmand for {sid}: {exc}") from exc
            raise
        finally:
            os.close(log)

    async def _start_later(self, sandbox: _Sandbox, delay: float) -> None:
        assert sandbox.socket is not None
        await asyncio.sleep(delay)
        try:
            sandbox.process = await self._spawn(
                sandbox.id, sandbox.socket, sandbox.env, sandbox.token
            )
        except errors.ProviderError:
            logger.warning("fake: the daemon of %s did not start", sandbox.id, exc_info=True)
            sandbox.state = "stopped"
            self._report(sandbox, "daemon_exit", "fake: the daemon did not start")
            return
        sandbox.monitor = self._task(self._monitor(sandbox))

    async def _monitor(self, sandbox: _Sandbox) -> None:
        """Wait for the daemon to end; if nothing here stopped it, the sandbox is lost."""
        assert sandbox.process is not None
        code = await sandbox.process.wait()
        if sandbox.stopping is None and self._sandboxes.get(sandbox.id) is sandbox:
            logger.debug("fake: the daemon of %s ended by itself (%s)", sandbox.id, code)
            self._stop_task(sandbox)  # what it started dies with it, as in a sandbox
            lost = _exit_loss(sandbox.id, code)
            self._report(sandbox, lost.reason, lost.detail)

    async def _lose_later(self, sandbox: _Sandbox, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._sandboxes.get(sandbox.id) is sandbox and sandbox.stopping is None:
            logger.debug("fake: %s is lost after %s s", sandbox.id, delay)
            self._stop_task(sandbox)
            self._report(sandbox, "node_lost", f"fake: lost after {delay} s (lose_after)")

    def _stop_task(self, sandbox: _Sandbox) -> asyncio.Task[None]:
        """Start stopping ``sandbox`` (state ``stopped`` at once), or return the stop under way."""
        sandbox.state = "stopped"
        if sandbox.stopping is None:
            if sandbox.process is not None:
                _kill_group(sandbox.process)  # now, so the daemon stops answering at once
            sandbox.stopping = self._task(self._stop(sandbox))
        return sandbox.stopping

    async def _stop(self, sandbox: _Sandbox) -> None:
        current = asyncio.current_task()
        if sandbox.loser is not None and sandbox.loser is not current:
            sandbox.loser.cancel()
        if sandbox.starter is not None:
            sandbox.starter.cancel()  # a half-started daemon is killed by asyncio
            await asyncio.wait([sandbox.starter])
        if sandbox.process is not None:
            await _kill(sandbox.process)

    def _delete_task(self, sandbox: _Sandbox) -> asyncio.Task[None]:
        if sandbox.deleting is None:
            sandbox.deleting = self._task(self._delete(sandbox))
        return sandbox.deleting

    async def _delete(self, sandbox: _Sandbox) -> None:
        await self._stop_task(sandbox)
        if sandbox.socket is not None:
            await asyncio.to_thread(_remove_files, sandbox.socket)
        if self._sandboxes.get(sandbox.id) is sandbox:
            del self._sandboxes[sandbox.id]
            self.deleted_total += 1
            logger.debug("fake: deleted %s", sandbox.id)


def _exit_loss(sandbox_id: str, returncode: int) -> Lost:
    """Why a sandbox whose daemon ended with ``returncode`` (negative: a signal) is lost."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return Lost(sandbox_id=sandbox_id, reason="killed", detail=f"the daemon got {name}")
    return Lost(
        sandbox_id=sandbox_id, reason="daemon_exit", detail=f"the daemon exited {returncode}"
    )


def _prepare(socket: Path, sid: str) -> tuple[Path, int]:
    """The daemon's working directory (``<dir>/<id>/``) and an open log file (an fd) for it."""
    home = socket.with_suffix("")
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = os.open(socket.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return home, log


def _remove_files(socket: Path) -> None:
    """Remove what a daemon had on the host: its working directory, socket and log."""
    shutil.rmtree(socket.with_suffix(""), ignore_errors=True)
    for path in (socket, socket.with_suffix(".log")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the daemon's process group, unless the daemon was already reaped."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def _kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the daemon, its process group and every process of its session; reap it."""
    _kill_group(process)
    # Commands run in process groups of their own, but all stay in the
    # daemon's session (unless one calls setsid itself).
    await asyncio.to_thread(_kill_session, process.pid)
    await process.wait()


def _kill_session(session: int) -> None:
    """SIGKILL every live process of ``session`` until none is left (about a second at most)."""
    if not os.path.isdir("/proc"):
        return
    for _ in range(500):
        members = _session_members(session)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    logger.warning("fake: processes of session %s survived SIGKILL", session)


def _session_members(session: int) -> builtins.list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # Fields after the command name: state, ppid, pgrp, session, ...
        if fields[0] not in (b"Z", b"X") and int(fields[3]) == session:
            found.append(int(entry))
    return found
