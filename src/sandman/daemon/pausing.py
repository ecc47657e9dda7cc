"""The host's pause of a sandbox where no freezer cgroup is writable (a Kubernetes pod):
its daemon stops every other process of the sandbox (SIGSTOP, until none runs) and
keeps them stopped until it is told to continue them (``daemon/PROTOCOL.md``, "Host
calls"). Meanwhile it refuses what would start, signal or feed a process
(`protocol.DaemonPaused`, a `SandboxPaused`).

Not a sandbox's vocabulary (`DaemonClient`): only the provider that made the sandbox
makes these calls.
"""

from __future__ import annotations

from sandman.daemon import protocol
from sandman.daemon.client import DaemonClient

__all__ = ["pause_processes", "resume_processes"]

# The daemon gives itself 10 s to stop every process; then it answers.
_PAUSE_DEADLINE = 30.0


async def pause_processes(daemon: DaemonClient) -> int:
    """Stop every process of the sandbox but its daemon; how many it holds stopped.
    Pausing a paused sandbox changes nothing. A sandbox whose processes could not all be
    stopped within the daemon's 10 s is `DaemonError` ``not_pausable``, and goes on."""
    answer = await daemon._json("POST", protocol.PAUSE, deadline=_PAUSE_DEADLINE)
    return int(answer["processes"])


async def resume_processes(daemon: DaemonClient) -> int:
    """Continue what the pause stopped; how many processes. Resuming a sandbox that is
    not paused changes nothing."""
    answer = await daemon._json("POST", protocol.RESUME, deadline=_PAUSE_DEADLINE)
    return int(answer["processes"])
