"""The system-call filter of a local sandbox: the OCI ``linux.seccomp`` object.

The default profile has the semantics of Docker's default profile for a
container without CAP_SYS_ADMIN, CAP_SYS_PTRACE and the other capabilities we
drop (``oci.CAPABILITIES``). It is an **allowlist**: a system call not named
below fails with EPERM, so a system call that a future kernel adds is denied
until we look at it. Measured on our 2-core VM, ``crun create`` alone: no
filter 22 ms; this allowlist compiled by crun at every create +28 ms (a
denylist a few ms); compiled once per process by us and handed to crun
(see "compiled once" below) +2 ms, most of it the kernel attaching and
JIT-compiling the filter. So the safer allowlist it is.

Each system call that is *not* allowed is in :data:`DENIED` with the reason,
grouped; those are what a sandbox must not reach: new namespaces (with them
``unshare -Ur`` gives root over a user namespace and with it mount, nf_tables
and the other code that container escapes have used), mounts, the kernel
keyring, BPF, perf, io_uring, tracing other processes, loading modules and
kernels, and host-wide settings. The kernel caches the verdict of a filter
that does not look at arguments, so the allowed calls cost nothing at run
time (Linux >= 5.11).

32-bit system calls (``int 0x80`` from any process, or a 32-bit binary) are
filtered by the same rules, under their own numbers: the profile lists the
x86 and x32 ABIs next to x86_64, as Docker does. A call from an ABI the
profile does not list is killed by the kernel, never let through.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import platform
import stat
from dataclasses import dataclass
from typing import Any

import anyio

from sandman import errors

logger = logging.getLogger(__name__)

__all__ = [
    "ALLOWED",
    "BPF_ANNOTATION",
    "DENIED",
    "Filter",
    "compiled_default",
    "default_profile",
    "resolve",
]

_EPERM = 1
_ENOSYS = 38
_MAX_PROFILE = 1 << 20

# clone(2) flags that make a new namespace: Docker's mask (CLONE_NEWNS,
# NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
CLONE_NAMESPACE_FLAGS = 0x7E020000
AF_VSOCK = 40

# personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26 with
# each, and 0xffffffff (query). Others (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC,
# ...) weaken the process's own hardening and no ordinary program needs them.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

ALLOWED: dict[str, tuple[str, ...]] = {
    # Files, directories, descriptors. mknod only makes fifos and sockets
    # (no CAP_MKNOD); chroot is ours (CAP_SYS_CHROOT is in the set).
    "files": (
        "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "preadv2",
        "pwritev", "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range",
        "dup", "dup2", "dup3", "lseek", "_llseek", "fcntl", "fcntl64", "flock", "fsync",
        "fdatasync", "sync", "syncfs", "sync_file_range", "truncate", "truncate64",
        "ftruncate", "ftruncate64", "fallocate", "fadvise64", "fadvise64_64", "readahead",
        "sendfile", "sendfile64", "splice", "tee", "vmsplice", "copy_file_range", "ioctl",
        "stat", "stat64", "lstat", "lstat64", "fstat", "fstat64", "fstatat64", "newfstatat",
        "statx", "statfs", "statfs64", "fstatfs", "fstatfs64", "access", "faccessat",
        "faccessat2", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "chroot",
        "mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2", "link", "linkat",
        "symlink", "symlinkat", "unlink", "unlinkat", "readlink", "readlinkat", "chmod",
        "fchmod", "fchmodat", "fchmodat2", "chown", "chown32", "fchown", "fchown32",
        "fchownat", "lchown", "lchown32", "umask", "utime", "utimes", "utimensat",
        "utimensat_time64", "futimesat", "mknod", "mknodat", "name_to_handle_at",
        "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr",
        "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
        "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
        "fanotify_mark", "cachestat",
    ),
    "memory": (
        "brk", "mmap", "mmap2", "munmap", "mremap", "mprotect", "madvise", "mincore",
        "msync", "mlock", "mlock2", "mlockall", "munlock", "munlockall", "memfd_create",
        "memfd_secret", "membarrier", "remap_file_pages", "pkey_alloc", "pkey_free",
        "pkey_mprotect", "map_shadow_stack", "process_mrelease",
    ),
    # clone itself is allowed below only without namespace flags.
    "processes": (
        "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid",
        "waitpid", "kill", "tkill", "tgkill", "getpid", "getppid", "gettid", "getpgid",
        "setpgid", "getpgrp", "getsid", "setsid", "set_tid_address", "set_robust_list",
        "get_robust_list", "futex", "futex_time64", "futex_waitv", "futex_wait",
        "futex_wake", "futex_requeue", "rseq", "pidfd_open", "pidfd_send_signal",
        "restart_syscall", "sched_getaffinity", "sched_setaffinity", "sched_getattr",
        "sched_setattr", "sched_getparam", "sched_setparam", "sched_getscheduler",
        "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
        "sched_rr_get_interval", "sched_rr_get_interval_time64", "sched_yield",
        "getpriority", "setpriority", "ioprio_get", "ioprio_set", "getrlimit", "setrlimit",
        "prlimit64", "ugetrlimit", "getrusage", "times", "capget", "capset", "prctl",
        "arch_prctl", "set_thread_area", "get_thread_area", "modify_ldt", "uname",
        "sysinfo", "getcpu", "getrandom",
        # Filters and rulesets a process puts on itself only take rights away.
        "seccomp", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    ),
    # The set*id calls are bounded by the capabilities we grant, as in Docker.
    "identity": (
        "getuid", "getuid32", "geteuid", "geteuid32", "getgid", "getgid32", "getegid",
        "getegid32", "getresuid", "getresuid32", "getresgid", "getresgid32", "getgroups",
        "getgroups32", "setuid", "setuid32", "setgid", "setgid32", "setreuid",
        "setreuid32", "setregid", "setregid32", "setresuid", "setresuid32", "setresgid",
        "setresgid32", "setfsuid", "setfsuid32", "setfsgid", "setfsgid32", "setgroups",
        "setgroups32",
    ),
    # adjtimex and clock_adjtime only read the clock without CAP_SYS_TIME.
    "signals and time": (
        "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo",
        "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_sigtimedwait_time64",
        "rt_tgsigqueueinfo", "sigaltstack", "sigprocmask", "sigreturn", "signalfd",
        "signalfd4", "pause", "alarm", "nanosleep", "clock_nanosleep",
        "clock_nanosleep_time64", "clock_gettime", "clock_gettime64", "clock_getres",
        "clock_getres_time64", "gettimeofday", "time", "getitimer", "setitimer",
        "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
        "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create",
        "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64",
        "adjtimex", "clock_adjtime", "clock_adjtime64",
    ),
    # Waiting, pipes, System V and POSIX IPC (in the sandbox's own IPC
    # namespace) and the old AIO interface (not io_uring: see DENIED).
    "events and ipc": (
        "poll", "ppoll", "ppoll_time64", "select", "_newselect", "pselect6",
        "pselect6_time64", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old",
        "epoll_wait", "epoll_wait_old", "epoll_pwait", "epoll_pwait2", "eventfd",
        "eventfd2", "pipe", "pipe2", "mq_open", "mq_unlink", "mq_getsetattr", "mq_notify",
        "mq_timedreceive", "mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64",
        "msgget", "msgctl", "msgrcv", "msgsnd", "semget", "semctl", "semop", "semtimedop",
        "semtimedop_time64", "shmget", "shmctl", "shmat", "shmdt", "ipc", "io_setup",
        "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
        "io_pgetevents_time64",
    ),
    # socket itself is allowed below for every family but AF_VSOCK.
    "sockets": (
        "socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname",
        "getpeername", "getsockopt", "setsockopt", "sendto", "sendmsg", "sendmmsg",
        "recvfrom", "recvmsg", "recvmmsg", "recvmmsg_time64", "send", "recv", "shutdown",
        "socketcall",
    ),
}  # fmt: skip
"""Allowed without conditions, by group."""

DENIED: dict[str, tuple[str, ...]] = {
    # New namespaces: a user namespace makes the workload root over it, and
    # that root reaches mount, nf_tables, and more kernel code that escapes
    # have used. clone with namespace flags is refused by its argument filter;
    # clone3 is answered ENOSYS (its flags are in memory, out of the filter's
    # sight) so that libc and Go fall back to clone.
    "namespaces": ("unshare", "setns", "clone3"),
    # Mounts (the old and the new mount API): change what paths mean.
    "mounts": (
        "mount", "umount", "umount2", "pivot_root", "mount_setattr", "move_mount",
        "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "quotactl", "quotactl_fd",
    ),
    # The kernel keyring is not namespaced and its code has had many bugs.
    "keyring": ("add_key", "request_key", "keyctl"),
    # In-kernel programs, performance counters, fanotify: CAP_SYS_ADMIN,
    # CAP_BPF or CAP_PERFMON in Docker; large attack surface otherwise.
    "bpf and perf": ("bpf", "perf_event_open", "fanotify_init", "lookup_dcookie"),
    # io_uring: its own path into most of the kernel, a frequent escape route
    # (Docker denies it since 25.0; Google disables it on its servers).
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    # Reading or writing another process (the daemon, PID 1, in particular):
    # CAP_SYS_PTRACE in Docker.
    "tracing": (
        "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
        "pidfd_getfd",
    ),
    # Loading code into the kernel or replacing it.
    "kernel": (
        "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
        "create_module", "get_kernel_syms", "query_module", "uselib", "nfsservctl",
        "_sysctl",
    ),
    # Host-wide settings and state: not ours to change, or to read (the kernel log).
    "host": (
        "reboot", "syslog", "acct", "swapon", "swapoff", "settimeofday", "stime",
        "clock_settime", "clock_settime64", "sethostname", "setdomainname", "vhangup",
        "iopl", "ioperm",
    ),
    # File handles open any inode of a filesystem by number, past the mount
    # namespace: the "shocker" escape (CAP_DAC_READ_SEARCH in Docker).
    "file handles": ("open_by_handle_at",),
    # NUMA placement (CAP_SYS_NICE in Docker), user faults (a way to stall the
    # kernel at will in race exploits), other processes' pages.
    "memory of others": (
        "mbind", "set_mempolicy", "get_mempolicy", "set_mempolicy_home_node",
        "migrate_pages", "move_pages", "userfaultfd",
    ),
    # Obsolete or never implemented (Docker allows none of them either); the
    # 32-bit ABI's old signal calls, whose rt_* successors libc uses.
    "obsolete": (
        "ustat", "sysfs", "getpmsg", "putpmsg", "afs_syscall", "tuxcall", "security",
        "vserver", "break", "oldstat", "oldfstat", "oldlstat", "stty", "gtty", "nice",
        "ftime", "prof", "profil", "lock", "mpx", "ulimit", "oldolduname", "olduname",
        "idle", "vm86", "vm86old", "bdflush", "readdir", "signal", "sigaction",
        "sigsuspend", "sigpending", "sgetmask", "ssetmask",
    ),
}  # fmt: skip
"""Not allowed (EPERM, clone3 ENOSYS), by group, each with the reason above."""

_ARCHITECTURES = {
    # The 32-bit ABIs go through the same rules with their own numbers.
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


def _arg(index: int, value: int, op: str) -> dict[str, Any]:
    return {"index": index, "value": value, "op": op}


def default_profile(machine: str | None = None) -> dict[str, Any]:
    """The default profile for ``machine`` (this host's by default). Pure."""
    names = sorted({name for group in ALLOWED.values() for name in group})
    if machine is None:
        machine = platform.machine()
    syscalls: list[dict[str, Any]] = [
        {"names": names, "action": "SCMP_ACT_ALLOW"},
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [_arg(0, CLONE_NAMESPACE_FLAGS, "SCMP_CMP_MASKED_EQ") | {"valueTwo": 0}],
        },
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [_arg(0, AF_VSOCK, "SCMP_CMP_NE")]},
        *(
            {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [_arg(0, value, "SCMP_CMP_EQ")]}
            for value in PERSONALITIES
        ),
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
    ]  # fmt: skip
    profile: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": _EPERM,
        "syscalls": syscalls,
    }
    if machine in _ARCHITECTURES:
        profile["architectures"] = list(_ARCHITECTURES[machine])
    return profile


def _invalid(path: str, why: str) -> errors.ConfigError:
    return errors.ConfigError(f"seccomp profile {path}: {why}")


def _read(path: str) -> bytes:
    # Non-blocking and regular files only: a FIFO or a device named as the
    # profile must not hang or flood a create.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _invalid(path, exc.strerror or str(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _invalid(path, "not a regular file")
        data = os.read(fd, _MAX_PROFILE + 1)
    except OSError as exc:
        raise _invalid(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > _MAX_PROFILE:
        raise _invalid(path, f"larger than {_MAX_PROFILE} bytes")
    return data


def _check(path: str, profile: object) -> dict[str, Any]:
    """The parts crun needs to make sense of a profile, checked before any create."""
    if not isinstance(profile, dict):
        raise _invalid(path, "not a JSON object")
    action = profile.get("defaultAction")
    if not isinstance(action, str) or not action.startswith("SCMP_ACT_"):
        raise _invalid(path, f"defaultAction must be an SCMP_ACT_* string, got {action!r}")
    for key in ("architectures", "flags"):
        value = profile.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _invalid(path, f"{key} must be a list of strings")
    rules = profile.get("syscalls", [])
    if not isinstance(rules, list):
        raise _invalid(path, "syscalls must be a list")
    for number, rule in enumerate(rules):
        if not (
            isinstance(rule, dict)
            and isinstance(rule.get("names"), list)
            and all(isinstance(name, str) for name in rule["names"])
            and isinstance(rule.get("action"), str)
        ):
            raise _invalid(
                path, f"syscalls[{number}] needs names (a list of strings) and an action"
            )
    return profile


@dataclass(frozen=True)
class Filter:
    """A sandbox's system-call filter, as the OCI config carries it."""

    profile: dict[str, Any]
    """The ``linux.seccomp`` object."""
    bpf: str | None = None
    """The same, compiled (base64), for crun's :data:`BPF_ANNOTATION`."""


async def resolve(choice: str) -> Filter | None:
    """The filter for a spec's ``seccomp``: the default profile, None for
    ``"unconfined"``, or the profile read from an absolute path (ConfigError
    naming the path if it is missing or not a profile)."""
    if choice == "default":
        # Compiled by the first create of this process, then cached.
        return Filter(_DEFAULT, await anyio.to_thread.run_sync(compiled_default))
    if choice == "unconfined":
        return None
    if not choice.startswith("/"):
        raise errors.ConfigError(
            f"seccomp must be 'default', 'unconfined' or an absolute path, got {choice!r}"
        )
    data = await anyio.to_thread.run_sync(_read, choice)
    try:
        profile = json.loads(data)
    except ValueError as exc:
        raise _invalid(choice, f"not valid JSON ({exc})") from None
    # A profile of the user's own is left to the runtime to compile: it may
    # use what our translation does not (notify, flags, listeners).
    return Filter(_check(choice, profile))


_DEFAULT = default_profile()

# -- compiled once, for crun ----------------------------------------------------
#
# crun compiles the JSON profile with libseccomp at every create: ~28 ms of
# CPU for this allowlist, half of a whole create (crun's cache of compiled
# filters is compiled out of Debian's crun 1.8.1: none is ever written). It also takes a
# filter compiled beforehand, in the annotation ``run.oci.seccomp_bpf_data``,
# and then skips compiling. So we compile each profile once per process, with
# the same libseccomp and the same translation as crun (libcrun/seccomp.c).
# runc ignores the annotation and compiles the JSON, which stays in the config.

BPF_ANNOTATION = "run.oci.seccomp_bpf_data"

_ACTIONS = {
    "SCMP_ACT_KILL": 0x00000000, "SCMP_ACT_KILL_THREAD": 0x00000000,
    "SCMP_ACT_KILL_PROCESS": 0x80000000, "SCMP_ACT_TRAP": 0x00030000,
    "SCMP_ACT_ERRNO": 0x00050000, "SCMP_ACT_TRACE": 0x7FF00000,
    "SCMP_ACT_LOG": 0x7FFC0000, "SCMP_ACT_ALLOW": 0x7FFF0000,
}  # fmt: skip
_WITH_ERRNO = ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE")
_OPERATORS = {
    "SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7,
}  # fmt: skip
_NR_SCMP_ERROR = -1


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


@functools.cache
def _libseccomp() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_arch_add.argtypes = (ctypes.c_void_p, ctypes.c_uint32)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    )  # fmt: skip
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    return lib


def _action(name: str, errno_ret: int) -> int:
    if name not in _ACTIONS:
        raise ValueError(f"unknown seccomp action {name!r}")
    code = _ACTIONS[name]
    return code | (errno_ret & 0xFFFF) if name in _WITH_ERRNO else code


def _add_rules(lib: ctypes.CDLL, ctx: int, rule: dict[str, Any], action: int) -> None:
    args = rule.get("args") or []
    compares = [
        _ArgCmp(a["index"], _OPERATORS[a["op"]], a.get("value", 0), a.get("valueTwo", 0))
        for a in args
    ]
    # As crun: two conditions on one argument are two rules (either matches).
    indexes = [a["index"] for a in args]
    groups = [[c] for c in compares] if len(set(indexes)) < len(indexes) else [compares]
    for name in rule["names"]:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number == _NR_SCMP_ERROR:
            continue  # as crun: a name this libseccomp does not know is skipped
        for group in groups:
            array = (_ArgCmp * max(1, len(group)))(*group)
            if lib.seccomp_rule_add_array(ctx, action, number, len(group), array) < 0:
                raise ValueError(f"libseccomp refused the rule for {name}")


def _compile(profile: dict[str, Any], lib: ctypes.CDLL) -> bytes:
    default_errno = profile.get("defaultErrnoRet", _EPERM)
    default = _action(profile["defaultAction"], default_errno)
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise ValueError("seccomp_init failed")
    try:
        for arch in profile.get("architectures", []):
            token = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
            if token == 0 or lib.seccomp_arch_add(ctx, token) not in (0, -17):  # -EEXIST
                raise ValueError(f"unknown architecture {arch}")
        for rule in profile.get("syscalls", []):
            action = _action(rule["action"], rule.get("errnoRet", _EPERM))
            if action != default:  # as crun: rules with the default action add nothing
                _add_rules(lib, ctx, rule, action)
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
        try:
            if lib.seccomp_export_bpf(ctx, fd) < 0:
                raise ValueError("seccomp_export_bpf failed")
            size = os.lseek(fd, 0, os.SEEK_CUR)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


@functools.cache
def _compiled(profile_json: str) -> str | None:
    lib = _libseccomp()
    if lib is None:
        return None
    try:
        return base64.b64encode(_compile(json.loads(profile_json), lib)).decode()
    except (ValueError, OSError):
        # Slower, not weaker: crun compiles the same JSON at every create.
        logger.warning("cannot precompile the seccomp profile; crun will", exc_info=True)
        return None


def compiled_default() -> str | None:
    """The default profile compiled to BPF, base64, for :data:`BPF_ANNOTATION`;
    None without libseccomp (then crun compiles the JSON itself). Compiled
    once per process (tens of ms: call it from a thread the first time)."""
    return _compiled(json.dumps(_DEFAULT, sort_keys=True))
