"""A watchdog process bound to the life of an embedded pool's process.

A process killed by SIGKILL runs no code of ours, so the pool starts this
small process, which watches the pool's process itself (a pidfd: readable
once it has exited) and a pipe from it. When that process dies, for
whatever reason, the watchdog deletes every sandbox labelled with the
pool's name, then exits. The pipe alone would not do: a child the pool's
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
import os
import selectors
import subprocess
import sys

from sandman.pool.records import LABEL_POOL
from sandman.settings import LocalConfig

__all__ = ["Watchdog"]

_ENTRY = "import sys; from sandman.pool.watchdog import main; sys.exit(main())"


class Watchdog:
    """The pool-side handle: holds the pipe's write end."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, config: LocalConfig, pool_name: str) -> Watchdog:
        process = subprocess.Popen(
            # Not `-m`: the package imports this module before runpy would run it.
            [sys.executable, "-c", _ENTRY, pool_name, str(os.getpid())],
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


async def sweep(config: LocalConfig, pool_name: str) -> int:
    """Delete every sandbox of the pool; returns how many there were."""
    from sandman.providers.local import LocalProvider

    provider = LocalProvider(config)
    infos = await provider.list(labels={LABEL_POOL: pool_name})
    await asyncio.gather(*(provider.delete(info.id) for info in infos), return_exceptions=True)
    # Once more for any that failed or appeared while we deleted.
    for info in await provider.list(labels={LABEL_POOL: pool_name}):
        await provider.delete(info.id)
    await provider.aclose()  # unmounts the disk filesystem if no sandbox is left
    return len(infos)


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
    owner = int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid()
    # The raw descriptor, never sys.stdin: a "bye" must not wait in a buffer.
    line, rest = _first_line()
    config = LocalConfig.model_validate_json(line)
    if _last_word(owner, rest) in _LAST_WORDS:
        return 0
    asyncio.run(sweep(config, pool_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
