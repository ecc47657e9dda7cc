"""The system-call filter, played from inside real sandboxes as an attacker would.

The probe (``seccomp_probe.c``, built static with the host's gcc) makes each
system call in a child of its own and prints its errno; ``int80_*`` probes
make 32-bit calls from a 64-bit process, the classic way past a filter that
only knows x86_64 numbers.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import sandman
from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider, seccomp
from sandman.settings import LocalConfig
from tests.images.debian import debian_python_tar
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.leaks import assert_nothing_left

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

PROBE_SOURCE = Path(__file__).with_name("seccomp_probe.c")
PROBE_IN_SANDBOX = "/usr/local/bin/probe"

DENIED = {
    "unshare_user": "EPERM",
    "unshare_mount": "EPERM",
    "clone_newuser": "EPERM",
    "clone3": "ENOSYS",  # so that libc and Go fall back to clone
    "setns": "EPERM",
    "mount": "EPERM",
    "fsopen": "EPERM",
    "add_key": "EPERM",
    "keyctl": "EPERM",
    "io_uring_setup": "EPERM",
    "bpf": "EPERM",
    "perf_event_open": "EPERM",
    "ptrace": "EPERM",
    "userfaultfd": "EPERM",
    "open_by_handle_at": "EPERM",
    "socket_vsock": "EPERM",
    "personality_no_aslr": "EPERM",
}
ALLOWED = ["fork", "threads", "socket_unix", "personality_linux32", "int80_getpid"]
INT80_DENIED = {
    "int80_unshare_user": "EPERM",
    "int80_mount": "EPERM",
    "int80_keyctl": "EPERM",
    "int80_io_uring_setup": "EPERM",
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the static probe")
    binary = tmp_path_factory.mktemp("probe") / "probe"
    built = subprocess.run(
        ["gcc", "-static", "-no-pie", "-O2", "-pthread", "-o", str(binary), str(PROBE_SOURCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        pytest.skip(f"cannot build a static probe here: {built.stderr[-500:]}")
    return binary.read_bytes()


@contextlib.asynccontextmanager
async def _sandbox(
    provider: LocalProvider, probe: bytes, **spec: object
) -> AsyncIterator[sandman.DaemonClient]:
    info = await provider.create(SandboxSpec.model_validate({"image": "busybox", **spec}))
    assert info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=10)
        await sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        yield sb
    await provider.delete(info.id)


async def _probe(sb: sandman.DaemonClient, *names: str) -> dict[str, str]:
    result = await sb.exec([PROBE_IN_SANDBOX, *names], check=True)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert sorted(lines) == sorted(names), result
    return lines


@pytest.fixture
async def confined(provider: LocalProvider, probe: bytes) -> AsyncIterator[sandman.DaemonClient]:
    async with _sandbox(provider, probe) as sb:
        yield sb


async def test_default_profile_refuses_namespaces_mounts_keyring_io_uring_and_more(
    confined: sandman.DaemonClient,
) -> None:
    assert await _probe(confined, *DENIED) == DENIED
    unshare = await confined.exec("unshare -Ur id")
    assert unshare.exit_code != 0 and "Operation not permitted" in unshare.stderr
    assert (await confined.exec("unshare -U true")).exit_code != 0
    mount = await confined.exec("mount -t tmpfs t /tmp")
    assert mount.exit_code != 0
    assert "Seccomp:\t2" in (await confined.read_file("/proc/1/status")).decode()


async def test_32_bit_system_calls_cannot_bypass_the_filter(
    confined: sandman.DaemonClient,
) -> None:
    assert await _probe(confined, *INT80_DENIED) == INT80_DENIED
    # The x32 ABI (bit 30 of the number) is no way around it either.
    assert (await _probe(confined, "x32_unshare_user"))["x32_unshare_user"] != "ok"


async def test_ordinary_work_runs_under_the_filter(confined: sandman.DaemonClient) -> None:
    assert await _probe(confined, *ALLOWED) == dict.fromkeys(ALLOWED, "ok")
    shell = await confined.exec(
        "cd /tmp && mkdir d && echo x > d/f && chmod 600 d/f && ln -s f d/l && cat d/l"
        " && (sleep 0.1 & wait) && ls -l d | wc -l && id -u",
        check=True,
    )
    assert shell.stdout == "x\n3\n0\n"
    # What the daemon itself does for the host: background processes, a
    # terminal, a shell session, files and archives.
    sleeper = await confined.spawn(["sh", "-c", "echo up; sleep 100"])
    tty = await confined.spawn(["sh", "-c", "tty; stty size"], tty=True, rows=7, cols=9)
    assert (await confined.wait(tty.id, timeout=10)).exit_code == 0
    assert "/dev/pts/" in (await confined.read_output(tty.id)).stdout
    assert "up" in (await confined.read_output(sleeper.id, wait=10)).stdout
    await confined.signal(sleeper.id, "KILL")
    assert not (await confined.wait(sleeper.id, timeout=10)).running
    session = await confined.create_session()
    await confined.run_in_session(session.id, "cd /tmp && export V=7", check=True)
    assert (await confined.run_in_session(session.id, "echo $PWD $V")).stdout == "/tmp 7\n"
    tar = await confined.download_archive("/tmp/d")
    await confined.upload_archive("/root/copy", tar)
    assert await confined.read_file("/root/copy/f") == b"x\n"


async def test_unconfined_allows_what_the_default_refuses(
    provider: LocalProvider, probe: bytes
) -> None:
    """Without the filter the same attacks work: the tests above can fail."""
    async with _sandbox(provider, probe, seccomp="unconfined") as sb:
        result = await sb.exec("unshare -Urm sh -c 'mount -t tmpfs t /tmp && echo mounted'")
        assert result.stdout == "mounted\n", result
        lines = await _probe(sb, "unshare_user", "int80_unshare_user", "keyctl")
        assert lines == dict.fromkeys(lines, "ok")
        assert "Seccomp:\t0" in (await sb.read_file("/proc/1/status")).decode()


async def test_a_profile_from_a_path_is_used(
    provider: LocalProvider, probe: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["symlink", "symlinkat"], "action": "SCMP_ACT_ERRNO"}],
            }
        )
    )
    async with _sandbox(provider, probe, seccomp=str(path)) as sb:
        made = await sb.exec("ln -s a /tmp/l")
        assert made.exit_code != 0 and "Operation not permitted" in made.stderr, made
        assert (await _probe(sb, "unshare_user")) == {"unshare_user": "ok"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        ("{not json", "not valid JSON"),
        ('["SCMP_ACT_ALLOW"]', "not a JSON object"),
        ('{"syscalls": []}', "defaultAction"),
        ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"action": "x"}]}', "syscalls\\[0\\]"),
    ],
)
async def test_a_bad_profile_path_is_a_config_error_naming_it(
    provider: LocalProvider, tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(errors.ConfigError, match=f"seccomp profile {path}: .*{message}"):
        await provider.create(SandboxSpec(image="busybox", seccomp=str(path)))
    assert await provider.list() == []


async def test_a_fifo_or_directory_as_profile_is_refused_without_blocking(
    provider: LocalProvider, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(errors.ConfigError, match=f"seccomp profile {path}: not a regular file"):
            await provider.create(SandboxSpec(image="busybox", seccomp=str(path)))


@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)  # the first run on a machine builds the image
async def test_python_threads_and_git_in_a_debian_sandbox_under_the_filter(
    provider: LocalProvider,
) -> None:
    await provider.images.import_archive(debian_python_tar(), name="debian-python")
    info = await provider.create(SandboxSpec(image="debian-python", memory="512Mi"))
    assert info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=30)
        script = (
            "import concurrent.futures as f, multiprocessing as m, subprocess, os\n"
            "with f.ThreadPoolExecutor(8) as pool: print(sum(pool.map(abs, range(-100, 0))))\n"
            "with m.Pool(2) as pool: print(sum(pool.map(abs, range(10))))\n"
            "print(subprocess.run(['true']).returncode, os.cpu_count() > 0)\n"
        )
        await sb.write_file("/repo/t.py", script)
        result = await sb.exec(
            "git init -q . && git add . && git -c user.name=t -c user.email=t@t commit -qm init"
            " && git log --oneline | wc -l && python3 t.py",
            cwd="/repo",
            check=True,
        )
        assert result.stdout == "1\n5050\n45\n0 True\n"
        status = await sb.read_file("/proc/self/status")
        assert b"Seccomp:\t2" in status


@pytest.mark.skipif(shutil.which("runc") is None, reason="needs runc")
async def test_runc_applies_the_same_profile(
    busybox_tar: Path, state_dir: Path, probe: bytes
) -> None:
    """runc ignores crun's compiled-filter annotation: it compiles the JSON."""
    config = LocalConfig(
        state_dir=state_dir,
        runtime="runc",
        cgroup_parent=f"/sandman-test/runc-seccomp-{uuid.uuid4().hex[:8]}",
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    try:
        async with _sandbox(provider, probe) as sb:
            assert await _probe(sb, *DENIED, *INT80_DENIED) == DENIED | INT80_DENIED
            assert await _probe(sb, *ALLOWED) == dict.fromkeys(ALLOWED, "ok")
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        await provider.aclose()  # unmounts the disk filesystem
    await assert_nothing_left(provider)


async def test_the_precompiled_filter_is_the_one_crun_compiles(
    provider: LocalProvider, tmp_path: Path
) -> None:
    """crun loads our compiled default (the annotation) instead of compiling
    the JSON: it must be the very program crun makes from the same JSON."""
    path = tmp_path / "default.json"
    path.write_text(json.dumps(seccomp.default_profile()))
    from_json = await provider.create(SandboxSpec(image="busybox", seccomp=str(path)))
    precompiled = await provider.create(SandboxSpec(image="busybox"))
    runtime = provider.config.state_dir / "runtime" / provider.config.runtime
    compiled = seccomp.compiled_default()
    assert compiled is not None
    for info in (from_json, precompiled):
        assert (runtime / info.id / "seccomp.bpf").read_bytes() == base64.b64decode(compiled)


def test_default_profile_shape() -> None:
    profile = seccomp.default_profile("x86_64")
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == 1
    assert profile["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    allowed = {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW"
        for name in rule["names"]
    }
    denied = {name for group in seccomp.DENIED.values() for name in group}
    assert not allowed & denied
    assert {"clone", "socket", "personality", "execve", "read"} <= allowed
    clone = next(rule for rule in profile["syscalls"] if rule["names"] == ["clone"])
    assert clone["args"][0]["op"] == "SCMP_CMP_MASKED_EQ"
    assert clone["args"][0]["value"] == 0x7E020000  # every CLONE_NEW* flag
