"""A watchdog process bound to the life of an embedded pool's process.

A process killed by SIGKILL runs no code of ours, so the pool starts this
small process, which watches the pool's process itself (a pidfd: readable
once it has exited) and a pipe from it. When that process dies, for
whatever reason, the watchdog deletes every sandbox labelled with the
pool's name *and* that process as its owner (``sandman.io/owner``, see
`sandman.pool.owner`), then exits: a successor started at once under the
same pool name keeps its own sandboxes, and so does one that adopted the
dead pool's (adoption relabels the owner). A delete that fails does not stop
the sweep: the rest go on, and what is left is tried again with backoff. The pipe alone would not do: a child the pool's
process forks (multiprocessing's default on Linux) inherits its write end
and keeps it open after the parent is gone. A pool that closes normally has
released everything already, and says ``bye`` so the watchdog exits
without a sweep; ``detach`` leaves sandboxes for a later pool to adopt.

It reads the provider's settings (a `LocalConfig` as JSON) from the first
line of stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import subprocess
import sys
from collections.abc import Mapping

from sandman import errors
from sandman.pool import owner as owners
from sandman.pool.records import LABEL_POOL
from sandman.pool.snapshots import sweep_snapshots
from sandman.providers.base import Provider, SandboxInfo
from sandman.settings import LocalConfig

__all__ = ["Watchdog", "sweep"]

logger = logging.getLogger(__name__)

_ENTRY = "import sys; from sandman.client.watchdog import main; sys.exit(main())"
_STRAY_GRACE = 60.0
"""Seconds a directory of a create killed half-way is spared (``sandman gc``'s default)."""


class Watchdog:
    """The pool-side handle: holds the pipe's write end."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, config: LocalConfig, pool_name: str, owner: str | None = None) -> Watchdog:
        """Bind a watchdog to this process, the owner (by default) of the pool's sandboxes."""
        owner = owner or owners.current()
        process = subprocess.Popen(
            # Not `-m`: the package imports this module before runpy would run it.
            [sys.executable, "-c", _ENTRY, pool_name, str(os.getpid()), owner],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            # Its own session: a signal to our process group must not reach it.
            start_new_session=True,
            close_fds=True,
        )
        assert process.stdin is not None
        process.stdin.write(config.model_dump_json().encode() + b"\n")
        process.stdin.flush()
        os.set_inheritable(process.stdin.fileno(), False)
        return cls(process)

    def stop(self, *, detach: bool = False) -> None:
        """The pool closed: tell the watchdog to exit without a sweep (or to leave them all)."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(b"detach\n" if detach else b"bye\n")
                stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def sweep(
    provider: Provider,
    labels: Mapping[str, str],
    *,
    attempts: int = 6,
    backoff: float = 0.5,
    concurrency: int = 16,
) -> int:
    """Delete every sandbox whose labels include ``labels``; returns how many went.

    Each is looked at again just before its delete (a successor may have adopted
    it meanwhile). A failed delete is logged and does not stop the others; the
    sandboxes left are listed and tried again, up to ``attempts`` rounds, the
    wait between them doubling from ``backoff``. A round that finds nothing ends
    it; so the last round is a look for creates that finished while we deleted.
    """
    gate = asyncio.Semaphore(concurrency)
    deleted: set[str] = set()

    async def one(sandbox_id: str) -> None:
        async with gate:
            try:
                info = await provider.inspect(sandbox_id)
            except errors.SandboxNotFound:
                return
            if labels.items() <= info.labels.items():
                await provider.delete(sandbox_id)
                deleted.add(sandbox_id)

    wait = backoff
    for attempt in range(1, attempts + 1):
        try:
            infos = await provider.list(labels=labels)
        except errors.SandboxError as exc:
            logger.warning("sweep round %d: cannot list sandboxes: %s", attempt, exc)
            infos = None
        if infos == []:
            break
        if infos:
            results = await asyncio.gather(
                *(one(info.id) for info in infos), return_exceptions=True
            )
            failed = [(i.id, r) for i, r in zip(infos, results, strict=True) if r is not None]
            for sandbox_id, failure in failed:
                logger.warning("sweep round %d: delete %s failed: %r", attempt, sandbox_id, failure)
            if not failed:
                continue  # at once: only a look for late arrivals is left
        if attempt < attempts:
            await asyncio.sleep(wait)
            wait *= 2
    else:
        left = [info.id for info in await _listed(provider, labels)]
        if left:
            logger.error("sweep gave up after %d rounds; left: %s", attempts, " ".join(left))
    return len(deleted)


async def _listed(provider: Provider, labels: Mapping[str, str]) -> list[SandboxInfo]:
    try:
        return await provider.list(labels=labels)
    except errors.SandboxError:
        return []


async def _sweep_local(config: LocalConfig, labels: Mapping[str, str]) -> int:
    from sandman.providers.local import LocalProvider

    provider = LocalProvider(config)
    try:
        swept = await sweep(provider, labels)
        swept += await sweep_snapshots(provider, labels)
        # What a delete of the dead pool's, killed with it, left under a trash name
        # (another pool's creates in flight are younger than the grace).
        with contextlib.suppress(errors.SandboxError, OSError):
            await provider.remove_strays(older_than=_STRAY_GRACE)
        # Likewise a snapshot's delete killed with it (its record already gone, so no
        # sweep by label finds it); a live pool's delete removes the same trash alike.
        with contextlib.suppress(errors.SandboxError, OSError):
            await asyncio.to_thread(provider.snapshot_store.remove_strays)
        return swept
    finally:
        await provider.aclose()  # unmounts the disk filesystem if no sandbox is left


def _first_line() -> tuple[bytes, bytes]:
    """The first line from the pipe, and whatever came after it already."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def _last_word(owner: int, received: bytes) -> bytes:
    """Wait until the pool's process says its last word, closes the pipe, or exits;
    returns the last line it wrote (empty: it died without one)."""
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        return _last(received + _drain())
    if os.getppid() != owner:
        # It died before we looked (we were re-parented): its pid may be another's now.
        return _last(received + _drain())
    with selectors.DefaultSelector() as selector:
        selector.register(0, selectors.EVENT_READ, "pipe")
        selector.register(pidfd, selectors.EVENT_READ, "owner")
        while True:
            for key, _ in selector.select():
                if key.data == "owner":
                    # Gone; whatever it wrote before is in the pipe already.
                    return _last(received + _drain())
                chunk = os.read(0, 1 << 16)
                received = received[-4096:] + chunk
                # The last word ends it even while a forked child keeps the pipe open.
                if not chunk or _last(received) in _LAST_WORDS:
                    return _last(received)


def _drain() -> bytes:
    os.set_blocking(0, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(0, 1 << 16):
            data += chunk
    return data


def _last(received: bytes) -> bytes:
    lines = received.strip().splitlines()
    return lines[-1].strip() if lines else b""


_LAST_WORDS = (b"bye", b"detach")


def main() -> int:
    pool_name = sys.argv[1]
    pid = int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid()
    labels = {LABEL_POOL: pool_name}
    if len(sys.argv) > 3:
        labels[owners.LABEL_OWNER] = sys.argv[3]
    # The raw descriptor, never sys.stdin: a "bye" must not wait in a buffer.
    line, rest = _first_line()
    config = LocalConfig.model_validate_json(line)
    if _last_word(pid, rest) in _LAST_WORDS:
        return 0
    # Our own process: its warnings go to the stderr the pool's process had.
    logging.basicConfig(level=logging.INFO, format="sandman watchdog: %(levelname)s %(message)s")
    asyncio.run(_sweep_local(config, labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
