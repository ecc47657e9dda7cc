"""What the local provider needs from the machine, checked and, where safe, arranged."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sandman import errors
from sandman.daemon.binary import daemon_path
from sandman.providers.local import disk, userns

__all__ = [
    "Finding",
    "beyond_host",
    "check_capacity",
    "check_host",
    "host_size",
    "limit_cgroup_parent",
    "memory_for",
    "parent_pids",
    "prepare_cgroups",
    "raise_open_files",
    "remove_cgroup_parent",
    "remove_sandbox_cgroups",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SYS = Path("/proc/sys")

# What one idle sandbox takes of the host's per-count limits, measured with
# benchmarks/density.py (busybox, network "none"): its daemon (Go, GOMAXPROCS=1)
# runs 5-6 threads, each a pid; room is left for a command or two.
PIDS_PER_SANDBOX = 8
# The pool holds a pidfd per sandbox (told of its death at once); connections to
# daemons come and go (in the headroom).
FDS_PER_SANDBOX = 1
# Host-wide open files: the daemon's, its runtime's, the namespaces' own.
FILES_PER_SANDBOX = 16
# Host memory per idle sandbox: what its memory cgroup is charged (~1.3 MiB of the
# daemon's, its kernel objects; 1.47 MiB measured), page tables, kernel stacks.
MEMORY_PER_SANDBOX = 3 * 2**19
# And what grows with the square of the count: every memory cgroup holds a shrinker
# slot per superblock on the host (1 KiB per 64, kmalloc-1k), and each sandbox has a
# memory cgroup and makes 4 superblocks (overlay, proc, devpts, its IPC namespace's
# mqueue; providers/local/views.py). The kernel sizes a new memory cgroup's slots for
# the most superblocks the host has had at once since boot, never fewer.
SUPERBLOCKS_PER_SANDBOX = 4
SHRINKER_SLOTS_PER_KIB = 64
NAMESPACES = ("mnt", "pid", "ipc", "uts", "cgroup", "net")  # each sandbox makes one of each
MEMCG_IDS = 65535  # cgroup v1: memory cgroups (live and dying) have 16-bit ids
HEADROOM = 4096  # what the rest of the host uses of each


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


def parent_pids(configured: int | None) -> int:
    """What the cgroup parent's ``pids.max`` is: ``configured``, else 3/4 of the host's
    ``kernel.pid_max`` (all sandboxes together never take the host's last pids)."""
    if configured is not None:
        return configured
    pid_max = _sysctl("kernel.pid_max") or 32768
    return max(1, pid_max * 3 // 4)


def limit_cgroup_parent(parent: str, pids: int) -> Path | None:
    """Make the cgroup parent ``parent`` (``/a/b``) and set its ``pids.max`` to ``pids``:
    in the v1 ``pids`` hierarchy, else in cgroup v2 where it holds the pids controller
    (enabled down to the parent). Returns the file written; None when no pids
    controller is mounted. Idempotent."""
    parts = parent.strip("/").split("/")
    v1 = CGROUP_ROOT / "pids"
    if (v1 / "cgroup.procs").exists():
        target = v1.joinpath(*parts)
        target.mkdir(parents=True, exist_ok=True)
    elif "pids" in _controllers(CGROUP_ROOT):
        target = CGROUP_ROOT
        for part in parts:
            control = target / "cgroup.subtree_control"
            if "pids" not in control.read_text().split():
                control.write_text("+pids")
            target = target / part
            target.mkdir(exist_ok=True)
    else:
        return None
    limit = target / "pids.max"
    if limit.read_text().strip() != str(pids):
        limit.write_text(str(pids))
    return limit


def _controllers(directory: Path) -> list[str]:
    try:
        return (directory / "cgroup.controllers").read_text().split()
    except OSError:
        return []


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


def remove_sandbox_cgroups(parent: str, sandbox_id: str, patience: float = 5.0) -> list[Path]:
    """Kill whatever still runs in the sandbox's cgroups, then rmdir them; returns what is left.

    Normally the runtime's delete did all this. Not when its ``create`` died
    half-way (killed, timed out): then the runtime does not know the
    container, but its init may already sit in the cgroups.
    """
    left = [p for p in CGROUP_ROOT.glob(f"*/{parent}/{sandbox_id}") if p.is_dir()]
    deadline = time.monotonic() + patience
    while left and time.monotonic() < deadline:
        for path in list(left):
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                path.rmdir()
                left.remove(path)
            except FileNotFoundError:
                left.remove(path)
            except OSError:
                pass  # EBUSY: its last tasks are still exiting
        if left:
            time.sleep(0.01)
    return left


def _sysctl(name: str) -> int | None:
    try:
        return int((PROC_SYS / name.replace(".", "/")).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def raise_open_files() -> int:
    """Raise this process's soft limit on open files to its hard limit (the pool holds
    descriptors per sandbox; a soft limit of 1024 would stop it at ~500); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


def memory_for(sandboxes: int) -> int:
    """Host memory, in bytes, that ``sandboxes`` idle sandboxes take (busybox, network
    "none"); see `benchmarks/density.py`."""
    slots = -(-sandboxes * SUPERBLOCKS_PER_SANDBOX // SHRINKER_SLOTS_PER_KIB)
    return sandboxes * MEMORY_PER_SANDBOX + sandboxes * slots * 1024


def check_capacity(sandboxes: int) -> list[Finding]:
    """Whether this host's limits let one pool hold ``sandboxes`` idle sandboxes at once:
    each kernel parameter that grows with the count, and the value it needs."""
    findings: list[Finding] = []
    pids = sandboxes * PIDS_PER_SANDBOX + HEADROOM
    for name in ("kernel.pid_max", "kernel.threads-max"):
        value = _sysctl(name)
        if value is not None:
            findings.append(
                Finding(
                    value >= pids,
                    f"{name} = {value} >= {pids} for {sandboxes} sandboxes "
                    f"({PIDS_PER_SANDBOX} pids each: an idle daemon runs 5-6 threads)",
                    f"sysctl -w {name}={max(pids, 4194304 if name == 'kernel.pid_max' else pids)}",
                )
            )
    for ns in NAMESPACES:
        name = f"user.max_{ns}_namespaces"
        value = _sysctl(name)
        if value is not None:
            need = sandboxes + HEADROOM
            findings.append(
                Finding(value >= need, f"{name} = {value} >= {need}", f"sysctl -w {name}={need}")
            )
    files = sandboxes * FILES_PER_SANDBOX + 65536
    value = _sysctl("fs.file-max")
    if value is not None:
        findings.append(
            Finding(
                value >= files,
                f"fs.file-max = {value} >= {files}",
                f"sysctl -w fs.file-max={files}",
            )
        )
    keys = sandboxes + HEADROOM
    value = _sysctl("kernel.keys.root_maxkeys")
    if value is not None:
        findings.append(
            Finding(
                value >= keys,
                f"kernel.keys.root_maxkeys = {value} >= {keys} (the runtime makes a session "
                "keyring per sandbox)",
                f"sysctl -w kernel.keys.root_maxkeys={keys}",
            )
        )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = sandboxes * FDS_PER_SANDBOX + HEADROOM
    findings.append(
        Finding(
            hard == resource.RLIM_INFINITY or hard >= fds,
            f"open files (hard limit {hard}) >= {fds} in the pool's process "
            "(it raises its soft limit to the hard one)",
            f"ulimit -n {fds} before starting it (systemd: LimitNOFILE={fds})",
        )
    )
    if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
        findings.append(
            Finding(
                sandboxes < MEMCG_IDS - HEADROOM,
                f"{sandboxes} memory cgroups < {MEMCG_IDS - HEADROOM} (cgroup v1 ids are 16 bits)",
                "hold fewer sandboxes on this host, or boot with cgroup v2",
            )
        )
    available = _mem_available()
    if available is not None:
        need = memory_for(sandboxes)
        findings.append(
            Finding(
                available >= need,
                f"memory available {available // 2**20} MiB >= {need // 2**20} MiB for "
                f"{sandboxes} idle sandboxes ({MEMORY_PER_SANDBOX / 2**20:.1f} MiB each, plus "
                f"{(need - sandboxes * MEMORY_PER_SANDBOX) // 2**20} MiB of the kernel's "
                "shrinker slots: superblocks x memory cgroups)",
                "free memory, or hold fewer sandboxes on this host",
            )
        )
    return findings


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
            all(shutil.which(tool) is not None for tool in ("nft", "ip", "conntrack")),
            "nft, ip and conntrack installed (network modes isolated and egress)",
            "apt-get install -y nftables iproute2 conntrack",
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
    if runtime == "crun":
        findings.append(_check_userns())
    else:
        findings.append(
            Finding(True, f"a user namespace per sandbox: off under {runtime} (crun only)")
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
    for tool, use in (("skopeo", "pulls images (sandman images pull)"),
                      ("buildah", "builds images (sandman images build)")):  # fmt: skip
        findings.append(
            Finding(shutil.which(tool) is not None, f"{tool} {use}", f"apt-get install -y {tool}")
        )
    return findings


def _check_userns() -> Finding:
    """Whether crun sandboxes can each run in a user namespace of their own
    (`LocalConfig.userns`, on by default): tried as a create does (`userns.probe`)."""
    what = (
        "a user namespace per sandbox (LocalConfig.userns, on by default under crun): "
        "root inside is an unprivileged host uid range of its own"
    )
    try:
        works, why = userns.probe(daemon_path())
    except (OSError, errors.SandboxError) as exc:
        works, why = False, str(exc)
    fix = (
        f"{why}: needs a kernel >= 5.19 with idmapped mounts on the state directory's "
        "filesystem (ext4, xfs, btrfs, tmpfs), or LocalConfig(userns=False): root in a "
        "sandbox is then root on the host, and sandboxes share root's per-user limits"
    )
    return Finding(works, what, fix)


def host_size() -> tuple[int, int]:
    """This host's memory in bytes and its CPU count."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return memory, os.cpu_count() or 1


def beyond_host(memory: int, cpu: float, host_memory: int, host_cpus: int) -> str | None:
    """What of a spec's ``memory`` (bytes) and ``cpu`` (cores) this host cannot give, in
    words, or None when both fit."""
    beyond = []
    if memory > host_memory:
        beyond.append(f"memory {memory / 2**30:.1f} GiB > the host's {host_memory / 2**30:.1f} GiB")
    if cpu > host_cpus:
        beyond.append(f"cpu {cpu:g} > the host's {host_cpus} CPUs")
    return "; ".join(beyond) or None


def check_gvisor(built: Path | None = None) -> list[str]:
    """What `sandman doctor` says of gVisor (the optional second wall): which runsc is in
    use and on which platforms it can run here. Lines of information, never a failure."""
    lines = []
    candidates: list[tuple[str, Path | None]] = [("built (hack/gvisor/build)", built)]
    on_path = shutil.which("runsc")
    candidates.append(("on PATH", Path(on_path) if on_path else None))
    found = False
    for where, binary in candidates:
        if binary is None or not binary.exists():
            continue
        found = True
        version = _first_line([str(binary), "--version"])
        lines.append(f"runsc {where}: {binary} ({version or 'version unknown'})")
        if binary == built:
            lines.append(_sidecars(binary))
    if not found:
        lines.append("runsc: none (optional; apt-get install -y runsc, or hack/gvisor/build)")
        return lines
    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not Path("/dev/kvm").exists():
        lines.append("gVisor platform kvm: no /dev/kvm; use systrap (runsc >= 2023) or ptrace")
    elif not flags & {"vmx", "svm"}:
        lines.append(
            "gVisor platform kvm: /dev/kvm is not hardware virtualization here (no vmx/svm: a "
            "paravirtual KVM such as PVM, where gVisor's sentry cannot run); use systrap or "
            "ptrace (hack/gvisor/README.md)"
        )
    else:
        lines.append("gVisor platform kvm: /dev/kvm with hardware virtualization: may work")
    return lines


# runsc (>= 2026) starts each sentry through these, found in gvisor-bin/ beside itself
# (hack/gvisor/README.md); without them it boots with its whole self and waits an RCU
# grace period as the sentry's fd table grows.
_SIDECARS = ("gvisor_sentry", "gvisor-sentry-prewarmer")


def _sidecars(runsc: Path) -> str:
    """Whether the sidecars runsc looks for beside itself are there, in words."""
    missing = [
        name for name in _SIDECARS if not os.access(runsc.parent / "gvisor-bin" / name, os.X_OK)
    ]
    if not missing:
        return f"runsc sidecars: {', '.join(_SIDECARS)} (no wait as each sentry starts)"
    return (
        f"runsc sidecars: {', '.join(missing)} missing in {runsc.parent / 'gvisor-bin'} "
        "(each create waits 1-15 ms more; hack/gvisor/build makes them, the prewarmer "
        "with a C compiler)"
    )


def _first_line(argv: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else ""
    return ""
