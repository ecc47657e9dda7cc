"""The adapters' test images, offline: the busybox rootfs (`tests.images.builders`), and
the same with what inspect's conformance suite and its tools call beyond it.

``busybox`` has ``sh`` but no ``bash``, so the Harbor tests run the adapter's
fallback to ``sh``. ``busybox-inspect`` adds more applets (``rmdir``,
``chown``...), a ``bash`` that is busybox's ``sh`` (inspect's ``bash()`` tool
runs ``bash --login -c``), and stand-ins for busybox's ``adduser -D`` and
shadow's ``userdel -r``, which the host's busybox lacks, so that
``test_exec_as_user`` can add the user it then runs commands as, and an
``/etc/os-release`` (inspect reads it before injecting its tools).
"""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

BUSYBOX = "busybox"
INSPECT_IMAGE = "busybox-inspect"

EXTRA_APPLETS = ("rmdir", "chown", "tar", "gzip", "base64", "awk", "mktemp", "od", "timeout")

BASH = """#!/bin/sh
exec /bin/busybox sh "$@"
"""

ADDUSER = """#!/bin/sh
# A stand-in for busybox's `adduser -D NAME`, which the host's busybox lacks.
case "$1" in
--help) echo "BusyBox adduser stand-in (tests): adduser -D NAME"; exit 0 ;;
-D) name=$2 ;;
*) echo "usage: adduser -D NAME" >&2; exit 1 ;;
esac
if grep -q "^$name:" /etc/passwd; then echo "adduser: user '$name' in use" >&2; exit 1; fi
uid=1000
while grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd; do uid=$((uid + 1)); done
echo "$name:x:$uid:$uid:$name:/home/$name:/bin/sh" >>/etc/passwd
echo "$name:x:$uid:" >>/etc/group
mkdir -p "/home/$name" && chown "$uid:$uid" "/home/$name"
"""

OS_RELEASE = """ID=busybox
NAME="BusyBox (Sandman's tests)"
VERSION="1"
"""
"""inspect identifies the distribution before it injects its tools (`bash_session()`...)."""

USERDEL = """#!/bin/sh
# A stand-in for shadow's `userdel [-r] NAME`.
if [ "$1" = "-r" ]; then remove=1; shift; fi
name=$1
home=$(grep "^$name:" /etc/passwd | cut -d: -f6)
grep -q "^$name:" /etc/passwd || { echo "userdel: user '$name' does not exist" >&2; exit 6; }
sed -i "/^$name:/d" /etc/passwd /etc/group
if [ -n "$remove" ] && [ -n "$home" ]; then rm -rf "$home"; fi
"""


def inspect_rootfs_tar(busybox_tar: Path, path: Path) -> Path:
    """``busybox_tar`` plus the applets and scripts above, written to ``path``."""
    shutil.copyfile(busybox_tar, path)
    with tarfile.open(path, mode="a") as tar:

        def add(name: str, *, data: bytes | None = None, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, link
                tar.addfile(info)
            else:
                info.type, info.mode, info.size = tarfile.REGTYPE, 0o755, len(data)
                tar.addfile(info, io.BytesIO(data))

        info = tarfile.TarInfo("usr/sbin")
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        tar.addfile(info)
        for applet in EXTRA_APPLETS:
            add(f"bin/{applet}", link="busybox")
        add("bin/bash", data=BASH.encode())
        add("usr/sbin/adduser", data=ADDUSER.encode())
        add("usr/sbin/userdel", data=USERDEL.encode())
        add("etc/os-release", data=OS_RELEASE.encode())
    return path
