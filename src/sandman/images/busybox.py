"""A tiny rootfs tarball made from the host's static busybox, for tests, examples and benchmarks."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import struct
import subprocess
import tarfile
from pathlib import Path

from sandman.errors import ImageError

__all__ = ["APPLETS", "busybox_rootfs_tar", "find_static_busybox"]

APPLETS = (
    "sh", "ls", "cat", "echo", "sleep", "ps", "true", "false", "seq", "mkdir", "rm", "env",
    "id", "head", "tr", "wc", "kill", "pwd", "touch", "grep", "stat", "chmod", "cp", "mv",
    "ln", "readlink", "test", "[", "printf", "uname", "whoami", "hostname", "tail", "sort",
    "dd", "sed", "xargs", "find", "date", "basename", "dirname", "yes", "cut", "tee", "top",
)  # fmt: skip
"""The applets linked into /bin (the image runs any other as ``busybox NAME``)."""

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "daemon:x:1:1:daemon:/usr/sbin:/bin/false\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\ndaemon:x:1:\nnogroup:x:65534:\n"
MTIME = 1_700_000_000


def find_static_busybox() -> Path:
    """The host's statically linked busybox (``$SANDMAN_BUSYBOX``, /bin/busybox or on PATH).

    Raises `ImageError` when there is none (Debian/Ubuntu: ``apt-get install busybox-static``).
    """
    candidates = (os.environ.get("SANDMAN_BUSYBOX"), "/bin/busybox", shutil.which("busybox"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and _is_static(Path(candidate).resolve()):
            return Path(candidate).resolve()
    raise ImageError(
        "no statically linked busybox found (Debian/Ubuntu: apt-get install busybox-static)"
    )


def busybox_rootfs_tar(path: Path, *, busybox: Path | None = None, compress: bool = False) -> Path:
    """Write a plain rootfs tarball to `path` and return `path`.

    It holds busybox with applet symlinks in /bin (see `APPLETS`), /etc/passwd
    (root, daemon, nobody = 65534), /etc/group, /etc/hostname and empty /tmp
    (1777), /proc, /sys, /dev, /run, /root (0700), /home and /var.
    """
    binary = (busybox or find_static_busybox()).read_bytes()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, MTIME, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("./", tarfile.DIRTYPE, 0o755)
        for name in ("bin", "etc", "proc", "sys", "dev", "run", "home", "var", "usr", "usr/bin"):
            add(name, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        add("root", tarfile.DIRTYPE, 0o700)
        add("bin/busybox", tarfile.REGTYPE, 0o755, binary)
        add("etc/passwd", tarfile.REGTYPE, 0o644, PASSWD.encode())
        add("etc/group", tarfile.REGTYPE, 0o644, GROUP.encode())
        add("etc/hostname", tarfile.REGTYPE, 0o644, b"sandbox\n")
        for applet in APPLETS:
            add(f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox")
        add("usr/bin/env", tarfile.SYMTYPE, 0o777, link="/bin/busybox")
    data = buffer.getvalue()
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return path


def _is_static(binary: Path) -> bool:
    """Whether `binary` is a static ELF: ``file -L`` says so, or it has no PT_INTERP header."""
    if shutil.which("file"):
        argv = ["file", "-L", str(binary)]
        out = subprocess.run(argv, check=False, capture_output=True, text=True).stdout
        return "statically linked" in out or "static-pie linked" in out
    with open(binary, "rb") as file:
        data = file.read(1 << 16)
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phoff + phnum * phentsize > len(data):
        return False
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return 3 not in types  # PT_INTERP: a dynamic loader is needed
