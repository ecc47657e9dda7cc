"""The OCI runtime configuration (``config.json``) of one sandbox. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandman.models import SandboxSpec
from sandman.providers.local.seccomp import BPF_ANNOTATION, Filter

__all__ = [
    "DAEMON_IN_SANDBOX",
    "LISTEN_FD",
    "MASKED_DIRS",
    "TOKEN_FD",
    "BundleLayout",
    "config",
]

DAEMON_IN_SANDBOX = "/.sandman/sandmand"
# The host binds the daemon's socket in a directory no sandbox sees and hands
# it over with the token (on a pipe) as these descriptors (``--preserve-fds``):
# no path inside the sandbox leads to either.
LISTEN_FD = 3
TOKEN_FD = 4
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD_US = 100_000
CGROUP_ROOT = "/sys/fs/cgroup"
NOFILE = 20_000  # no CAP_SYS_RESOURCE here: cannot exceed our own hard limit
PTYS = 256
"""Pseudo-terminals a sandbox may hold at once, by default (`LocalConfig.ptys`)."""

# Docker's default set minus NET_RAW and MKNOD: root inside, contained.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
]  # fmt: skip

MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi",
    # Every btrfs filesystem of the host, its quota groups among them: the disk usage of
    # every other sandbox (qgroups/*/referenced), by subvolume.
    "/sys/fs/btrfs",
]  # fmt: skip
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
# The directories among them. The runtime masks each with a tmpfs of its own: a
# superblock each, and every superblock adds to what each memory cgroup on the host
# allocates (a shrinker slot per superblock, in every memcg): memory that grows with
# the square of the sandbox count. Bound to one empty read-only host directory
# instead (`BundleLayout.empty`), they cost no superblock.
MASKED_DIRS = ["/proc/acpi", "/proc/asound", "/proc/scsi", "/sys/firmware", "/sys/fs/btrfs"]


@dataclass(frozen=True)
class BundleLayout:
    """Host paths the container config refers to."""

    daemon: str
    netns: str | None = None
    listen: str = f"fd:{LISTEN_FD}"
    """Where the daemon serves: the host's socket handed over (crun, runc), or
    ``tcp:0.0.0.0:PORT`` in the sandbox's network namespace (runsc)."""
    token_env: str | None = None
    """The token in the daemon's environment (runsc cannot take descriptors);
    None: on descriptor TOKEN_FD. The daemon re-executes itself without it."""
    """A named network namespace to join; None makes a new, loopback-only one."""
    empty: str | None = None
    """An empty, read-only host directory that ``masked`` are bound to; None: the
    runtime masks them (a tmpfs each)."""
    masked: tuple[str, ...] = ()
    """The `MASKED_DIRS` that exist on this host (a bind needs its mount point)."""
    rootfs: str = "rootfs"
    """The root's mount point, relative to the bundle or absolute (`userns.ROOTFS`)."""
    userns: str | None = None
    """The sandbox's user namespace to join (bound there by ``sandmand overlay-exec
    --userns``, see `userns`); None: none (root inside is root on the host)."""
    sysfs_premounted: bool = False
    """overlay-exec mounts /sys (``--sysfs``): the sysfs of the one empty network
    namespace sandboxes without a network share (`views`), or, in a user namespace with
    ``netns``, the sandbox's own (the runtime cannot mount the sysfs of a network
    namespace the sandbox's user namespace does not own). False: the runtime mounts it."""
    dev_tmpfs: bool = True
    """/dev and /dev/shm are tmpfs of their own (a superblock each). False: the root's
    own /dev, which the runtime fills, with /dev/shm a directory in it (`views.make_dev`)."""
    cgroup_view: str | None = None
    """A read-only host directory with an empty directory per cgroup v1 hierarchy
    (`views.cgroup_skeleton`), bound at /sys/fs/cgroup with the sandbox's own cgroup
    in each of ``hierarchies`` bound read-only on it; None: the runtime's cgroup mount
    (on cgroup v1, a tmpfs holding a mount per hierarchy)."""
    hierarchies: tuple[str, ...] = ()
    """The cgroup v1 hierarchies of ``cgroup_view`` (`views.hierarchies`)."""


def _cgroup_mounts(layout: BundleLayout, cgroup: str) -> list[dict[str, Any]]:
    """/sys/fs/cgroup: the runtime's view, or the same made of binds (`BundleLayout.cgroup_view`)."""
    if layout.cgroup_view is None:
        return [
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
            }
        ]
    ro = ["bind", "ro", "nosuid", "nodev", "noexec"]
    return [
        {
            "destination": "/sys/fs/cgroup",
            "type": "bind",
            "source": layout.cgroup_view,
            "options": ro,
        },
        *(
            {
                "destination": f"/sys/fs/cgroup/{name}",
                "type": "bind",
                # Made by the runtime before it mounts anything; seen from the sandbox's
                # cgroup namespace, whose root it is, as "/" (as the runtime's mount).
                "source": f"{CGROUP_ROOT}/{name}/{cgroup}",
                "options": ro,
            }
            for name in layout.hierarchies
        ),
    ]


def _env(image_env: list[str], spec_env: Mapping[str, str]) -> list[str]:
    merged: dict[str, str] = {}
    for item in image_env:
        key, _, value = item.partition("=")
        merged[key] = value
    merged.update(spec_env)
    merged.setdefault("PATH", DEFAULT_PATH.removeprefix("PATH="))
    merged.setdefault("HOME", "/root")
    return [f"{key}={value}" for key, value in merged.items()]


def config(
    *,
    sandbox_id: str,
    spec: SandboxSpec,
    image_env: list[str],
    workdir: str,
    uid: int,
    gid: int,
    cgroup_parent: str,
    layout: BundleLayout,
    annotations: Mapping[str, str],
    seccomp: Filter | None,
    kernel_tcp: bool = False,
    ptys: int = PTYS,
) -> dict[str, Any]:
    """The ``config.json`` that runs sandmand as PID 1 of the sandbox.

    ``seccomp`` is its system-call filter (``seccomp.resolve``); None runs
    the sandbox without one. ``kernel_tcp``: limit its TCP buffers to its memory
    limit (cgroup v1, where they are charged to the cgroup only once limited; v2
    charges them always). ``ptys``: the most pseudo-terminals it may hold at once."""
    memory: dict[str, int] = {"limit": spec.memory, "swap": spec.memory}
    if kernel_tcp:
        memory["kernelTCP"] = spec.memory
    caps = list(CAPABILITIES)
    bound = [p for p in layout.masked if p in MASKED_DIRS] if layout.empty is not None else []
    namespace_net: dict[str, str] = {"type": "network"}
    if layout.netns is not None:
        namespace_net["path"] = layout.netns
    namespace_user = [{"type": "user", "path": layout.userns}] if layout.userns else []
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": [
                DAEMON_IN_SANDBOX,
                "--listen",
                layout.listen,
                *(["--token-fd", str(TOKEN_FD)] if layout.token_env is None else []),
            ],
            "env": _env(image_env, spec.env)
            + ([] if layout.token_env is None else [f"SANDMAND_TOKEN={layout.token_env}"]),
            "cwd": workdir,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": NOFILE, "soft": NOFILE}],
            "noNewPrivileges": True,
            # PID 1 stays at 0 so the OOM killer prefers the commands it runs.
            "oomScoreAdj": 0,
        },
        "root": {"path": layout.rootfs, "readonly": False},
        "hostname": sandbox_id,
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            *(
                [
                    {
                        "destination": "/dev",
                        "type": "tmpfs",
                        "source": "tmpfs",
                        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
                    }
                ]
                if layout.dev_tmpfs
                else []
            ),
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": [
                    "nosuid",
                    "noexec",
                    "newinstance",
                    "ptmxmode=0666",
                    "mode=0620",
                    "gid=5",
                    # All containers' devpts share one host budget (kernel.pty.max less
                    # kernel.pty.reserve): without a max, one sandbox could take it all.
                    f"max={ptys}",
                ],
            },
            *(
                [
                    {
                        "destination": "/dev/shm",
                        "type": "tmpfs",
                        "source": "shm",
                        "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
                    }
                ]
                if layout.dev_tmpfs
                else []
            ),
            {
                # No superblock of its own: the IPC namespace has its mqueue already.
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            *(
                []
                if layout.sysfs_premounted
                else [
                    {
                        "destination": "/sys",
                        "type": "sysfs",
                        "source": "sysfs",
                        "options": ["nosuid", "noexec", "nodev", "ro"],
                    }
                ]
            ),
            # The sandbox's own cgroup, read-only (as in a Kubernetes pod): its OOM
            # kill count tells an OOM kill from any other SIGKILL.
            *_cgroup_mounts(layout, f"{cgroup_parent.strip('/')}/{sandbox_id}"),
            {
                "destination": DAEMON_IN_SANDBOX,
                "type": "bind",
                "source": layout.daemon,
                "options": ["rbind", "ro", "nosuid", "nodev"],
            },
            *(
                {
                    "destination": path,
                    "type": "bind",
                    "source": layout.empty,
                    "options": ["rbind", "ro", "nosuid", "nodev", "noexec"],
                }
                for path in bound
            ),
        ],
        "annotations": {
            **annotations,
            **({BPF_ANNOTATION: seccomp.bpf} if seccomp is not None and seccomp.bpf else {}),
        },
        "linux": {
            "cgroupsPath": f"{cgroup_parent.rstrip('/')}/{sandbox_id}",
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": memory,
                "cpu": {"quota": max(1000, int(spec.cpu * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
                "pids": {"limit": spec.pids},
            },
            "namespaces": [
                *namespace_user,
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "cgroup"},
                namespace_net,
            ],
            "maskedPaths": [p for p in MASKED_PATHS if p not in bound],
            "readonlyPaths": READONLY_PATHS,
            # The daemon, PID 1, runs under the filter too: it is applied
            # before the runtime execs it, and inherited by all it starts.
            **({"seccomp": seccomp.profile} if seccomp is not None else {}),
        },
    }
