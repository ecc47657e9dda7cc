"""What the local provider needs from the machine, checked and, where safe, arranged."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandman.providers.local import disk

__all__ = ["Finding", "check_host", "prepare_cgroups", "remove_cgroup_parent"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Finding:
    """One thing `sandman doctor` reports: what is wrong and how to fix it."""

    ok: bool
    what: str
    fix: str = ""


def _hybrid_v2_controllers() -> list[str]:
    controllers = CGROUP_ROOT / "unified" / "cgroup.controllers"
    try:
        return controllers.read_text().split()
    except OSError:
        return []


def prepare_cgroups() -> None:
    """Make a hybrid cgroup host acceptable to crun.

    crun refuses to run when, in hybrid mode, the cgroup v2 hierarchy holds
    any controller ("cgroups in hybrid mode not supported"). On hosts where
    only ``hugetlb`` is left there (it has no v1 mount), mounting it as v1
    moves it off v2; nothing else uses it. Idempotent.
    """
    if _hybrid_v2_controllers() != ["hugetlb"]:
        return
    target = CGROUP_ROOT / "hugetlb"
    target.mkdir(exist_ok=True)
    subprocess.run(
        ["mount", "-t", "cgroup", "-o", "hugetlb", "cgroup", str(target)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def remove_cgroup_parent(parent: str) -> list[Path]:
    """Remove the cgroup parent ``parent`` (``/a/b``) and each ancestor left empty,
    in every hierarchy; returns the directories that are still busy (they hold
    sandboxes or other runs' parents), which are left alone."""
    parts = parent.strip("/").split("/")
    busy: list[Path] = []
    for hierarchy in CGROUP_ROOT.iterdir():
        for depth in range(len(parts), 0, -1):
            target = hierarchy.joinpath(*parts[:depth])
            try:
                target.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # EBUSY, ENOTEMPTY: in use; so are its ancestors
                busy.append(target)
                break
    return busy


def check_host(runtime: str, runtime_path: str | None = None) -> list[Finding]:
    """Everything the local provider needs, each as a Finding (``ok`` or how to fix it)."""
    findings = [
        Finding(os.geteuid() == 0, "running as root", "run as root (sudo): containers need it"),
    ]
    binary = runtime_path or shutil.which(runtime)
    findings.append(
        Finding(
            binary is not None and Path(binary).exists(),
            f"OCI runtime {runtime} installed",
            f"apt-get install -y {runtime}",
        )
    )
    findings.append(
        Finding(
            shutil.which("nft") is not None and shutil.which("ip") is not None,
            "nft and ip installed (network modes isolated and egress)",
            "apt-get install -y nftables iproute2",
        )
    )
    filesystems = Path("/proc/filesystems").read_text()
    findings.append(Finding("overlay" in filesystems, "overlayfs available", "modprobe overlay"))
    v1 = (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists()
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
    findings.append(Finding(v1 or v2, "cgroups mounted (v1 or v2)", "mount the cgroup hierarchies"))
    if runtime == "crun" and v1:
        leftover = [c for c in _hybrid_v2_controllers() if c != "hugetlb"]
        findings.append(
            Finding(
                not leftover,
                "crun accepts this hybrid cgroup layout",
                f"controllers {leftover} sit on cgroup v2 in hybrid mode; use runtime=runc",
            )
        )
    works, why = disk.probe()
    findings.append(
        Finding(
            works,
            "btrfs quotas on a loop image (per-sandbox disk limits)",
            f"{why}: apt-get install -y btrfs-progs, a kernel with btrfs "
            "(or set LocalConfig.disk=None: no default limit)",
        )
    )
    return findings
