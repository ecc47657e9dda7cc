"""gVisor's runsc: the global flags the provider gives it, by what the binary in use
accepts (Debian 12's runsc of 2022 or a current one, ``hack/gvisor/build``)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Sequence

__all__ = ["global_args", "known_flags"]

logger = logging.getLogger(__name__)

# `runsc flags` prints each top-level flag as "  -name [type]" (Go's flag package).
_FLAG = re.compile(r"^\s+-([A-Za-z0-9][A-Za-z0-9_.-]*)", re.MULTILINE)
# Probed binaries, by file identity: a rebuilt runsc (hack/gvisor/build) is probed anew.
_KNOWN: dict[tuple[str, int, int, int, int], frozenset[str]] = {}
_PROBE_TIMEOUT = 10.0
GOFER_NETNS = "gofer-network-namespace"


def known_flags(binary: str) -> frozenset[str]:
    """The top-level flags ``binary`` accepts (``runsc flags``), without dashes; empty
    if it cannot tell. Run once per binary file and kept: a few ms, in no create."""
    try:
        st = os.stat(binary)
    except OSError:
        return frozenset()
    key = (os.path.realpath(binary), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    flags = _KNOWN.get(key)
    if flags is None:
        try:
            # Go's flag package prints the list to stderr (Debian's runsc) or stdout.
            done = subprocess.run(
                [binary, "flags"], capture_output=True, timeout=_PROBE_TIMEOUT, check=False
            )
            out = (done.stdout + done.stderr).decode(errors="replace")
            flags = frozenset(_FLAG.findall(out)) if done.returncode == 0 else frozenset()
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("cannot list the flags of %s: %s", binary, exc)
            flags = frozenset()
        _KNOWN[key] = flags
    return flags


def global_args(binary: str, platform: str, network: str, extra: Sequence[str]) -> list[str]:
    """Every runsc command's flags: the platform and network stack, the provider's own
    as far as ``binary`` accepts them, then ``extra`` (`LocalConfig.runsc_args`), which
    may override them (the last of a flag wins)."""
    args = [
        f"--platform={platform}",
        f"--network={network}",
        # The workload's files in the sandbox's layer, as under crun: runsc >= 2023
        # defaults to root:self, one opaque .gvisor.filestore.<id> file (nothing for a
        # snapshot to keep; a restore refuses it). Debian's runsc's default, which it
        # accepts too.
        "--overlay2=none",
    ]
    if GOFER_NETNS in known_flags(binary):
        # runsc >= 2025 pins one empty network namespace for all gofers at
        # <--root>/null-netns; create runs in overlay-exec's private mount namespace,
        # where that mount vanishes: a warning per create and an empty file left behind.
        # A new namespace per gofer pins nothing. Debian's runsc refuses the flag.
        args.append(f"--{GOFER_NETNS}=new")
    return [*args, *extra]
