"""A watchdog process bound to the life of an embedded pool's process.

A process killed by SIGKILL runs no code of ours, so the pool starts this
small process with a pipe that only the pool's process holds open. When that
process dies, for whatever reason, the pipe reaches end-of-file and the
watchdog deletes every sandbox labelled with the pool's name, then exits. A
pool that closes normally has released everything already, and says ``bye``
so the watchdog exits without a sweep; ``detach`` leaves sandboxes for a
later pool to adopt.

It reads the provider's settings (a `LocalConfig` as JSON) from the first
line of stdin.
"""

from __future__ import annotations

import asyncio
import os
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
            [sys.executable, "-c", _ENTRY, pool_name],
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


def main() -> int:
    pool_name = sys.argv[1]
    config = LocalConfig.model_validate_json(sys.stdin.buffer.readline())
    last = b""
    # Blocks until the pool's process writes its last word or dies.
    for line in sys.stdin.buffer:
        last = line.strip()
    if last in (b"bye", b"detach"):
        return 0
    asyncio.run(sweep(config, pool_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
