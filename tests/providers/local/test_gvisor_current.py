"""gVisor as ``hack/gvisor/build`` makes it (runsc from gVisor's current ``go``
branch, through the Go module proxy), on the systrap platform with gVisor's own
network stack (``runsc_network="sandbox"``), through the public API.

Debian 12's runsc (2022, ``test_gvisor.py``) has neither systrap nor a netstack
that starts on this kernel. The session fixture runs ``hack/gvisor/build``
(a no-op when ``hack/gvisor/.bin`` is current; the CI script runs it beforehand,
and a cold build takes a few minutes).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider, runsc
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for
from tests.providers.local.leaks import leftovers

REPO = Path(__file__).resolve().parents[3]
GVISOR = REPO / "hack" / "gvisor"
RUNSC = GVISOR / ".bin" / "runsc"
# Debian 12's runsc (2022), if installed.
DEBIAN_RUNSC = shutil.which("runsc")
# A cold build of runsc and its shim: about 3-6 minutes on two cores.
BUILD_TIMEOUT = 1200

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.timeout(BUILD_TIMEOUT + 60),
]


@pytest.fixture(scope="session")
def built_runsc() -> Path:
    """``hack/gvisor/.bin/runsc``, built or brought up to date first when Go is here."""
    if shutil.which("go") is not None:
        proc = subprocess.run(
            [GVISOR / "build"], capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"hack/gvisor/build failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
    elif not RUNSC.exists():
        pytest.skip("no hack/gvisor/.bin/runsc and no Go to build it (hack/gvisor/build)")
    return RUNSC


@pytest.fixture
async def systrap(
    built_runsc: Path, state_dir: Path, busybox_tar: Path
) -> AsyncIterator[LocalConfig]:
    """Settings for the built runsc on systrap with netstack, the busybox image in their
    store; at the end, nothing of any sandbox may be left."""
    config = config_for(
        state_dir,
        runtime="runsc",
        runtime_path=str(built_runsc),
        runsc_platform="systrap",
        runsc_network="sandbox",
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    try:
        yield config
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        await provider.network.reset()
        await provider.aclose()
        left = _left(provider)
        with anyio.move_on_after(10):  # processes and mounts go a moment after the delete
            while left := _left(provider):
                await anyio.sleep(0.02)
        remove_cgroup_parent(config.cgroup_parent)
        assert not left, left


def _left(provider: LocalProvider) -> list[str]:
    return leftovers(provider, closed=True)


async def test_a_sandbox_runs_on_systrap_with_gvisors_own_network_stack(
    systrap: LocalConfig,
) -> None:
    async with (
        sandman.local(systrap) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        result = await sb.exec("echo hi from $(hostname); dmesg | head -1")
        assert result.stdout.startswith(f"hi from {sb.id}\n"), result
        assert "gVisor" in result.stdout, result  # gVisor's kernel answers, not the host's
        await sb.write_file("/work/a.txt", "kept\n")
        assert (await sb.exec("cat /work/a.txt")).stdout == "kept\n"
        # The platform and network stack asked for, as the sandbox process was started.
        pid = (systrap.state_dir / "sandboxes" / sb.id / "pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--platform=systrap" in argv and b"--network=sandbox" in argv, argv
        # netstack holds the sandbox's address; the sandbox reaches no host service.
        addresses = (await sb.exec("ip -4 addr show eth0")).stdout
        (inet,) = [line.split()[1] for line in addresses.splitlines() if "inet " in line]
        host_ip = str(ipaddress.ip_interface(inet).ip - 1)
        with socket.create_server(("0.0.0.0", 0)) as server:
            port = server.getsockname()[1]
            out = await sb.exec(["busybox", "nc", "-w", "2", host_ip, str(port)], stdin="x")
            assert out.exit_code not in (0, 127), out  # refused, not "no nc"


async def test_nothing_is_left_in_the_runtimes_state_directory(systrap: LocalConfig) -> None:
    async with (
        sandman.local(systrap) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        assert (await sb.exec("true")).exit_code == 0
    root = systrap.state_dir / "runtime" / "runsc"
    assert sorted(p.name for p in root.iterdir()) == []


async def _create_warnings(config: LocalConfig, logs: Path, count: int) -> list[str]:
    """The warnings runsc logged in the creates of ``count`` sandboxes made one after
    the other (each used, then deleted). runsc logs nothing unless given a debug log:
    one file per command in ``logs``, its warnings the lines that start with ``W``."""
    config = config.model_copy(
        update={
            "runsc_args": [*config.runsc_args, f"--debug-log={logs}/", "--debug-command=create"]
        }
    )
    async with sandman.local(config) as client:
        for _ in range(count):
            async with client.sandbox("busybox", memory="256Mi", pids=128) as sb:
                assert (await sb.exec("true")).exit_code == 0
    files = sorted(logs.iterdir())
    assert len(files) == count, files  # one per create: so the logs were written
    return [line for f in files for line in f.read_text().splitlines() if line.startswith("W")]


async def test_a_current_runsc_gets_a_gofer_network_namespace_of_its_own_by_default(
    systrap: LocalConfig, tmp_path: Path
) -> None:
    """Default settings: the provider finds that this runsc takes
    ``--gofer-network-namespace=new`` and gives it; nothing is pinned, nothing warned."""
    root = systrap.state_dir / "runtime" / "runsc"
    # (Other warnings stay, the host's: cgroup v1, its sysctls, RLIMIT_NOFILE.)
    warnings = await _create_warnings(systrap, tmp_path / "new", 2)
    assert not [w for w in warnings if "network namespace" in w], warnings
    assert not (root / "null-netns").exists()
    # runsc's own default, asked for in runsc_args (which come last, so they win): the
    # gofers' namespace is pinned in overlay-exec's mount namespace, which ends with the
    # create; an empty null-netns is left, and the next create warns. So the checks
    # above can fail, and the flag is what makes the difference.
    pinned = systrap.model_copy(update={"runsc_args": ["--gofer-network-namespace=null"]})
    try:
        warnings = await _create_warnings(pinned, tmp_path / "null", 2)
        assert (root / "null-netns").exists()
        assert any("No usable null network namespace" in w for w in warnings), warnings
    finally:
        (root / "null-netns").unlink(missing_ok=True)


async def test_each_runsc_binary_is_asked_for_its_flags_once(built_runsc: Path) -> None:
    """``runsc flags``, run once per binary file: the built runsc has the flag, Debian's
    (when on PATH) has not; asked again, the answer is the one kept."""
    flags = runsc.known_flags(str(built_runsc))
    assert {"platform", "network", "overlay2", runsc.GOFER_NETNS} <= flags, flags
    assert runsc.known_flags(str(built_runsc)) is flags
    if DEBIAN_RUNSC is not None:
        debian = runsc.known_flags(DEBIAN_RUNSC)
        assert "platform" in debian and runsc.GOFER_NETNS not in debian, debian


@pytest.mark.parametrize(
    ("platform", "network"),
    [("systrap", "sandbox"), ("systrap", "host"), ("ptrace", "sandbox"), ("ptrace", "host")],
)
async def test_the_sentry_loads_its_precompiled_seccomp_program(
    systrap: LocalConfig, tmp_path: Path, platform: str, network: str
) -> None:
    """hack/gvisor/build precompiles the sentry's seccomp programs for the settings
    Sandman runs: the sentry loads one instead of compiling 2,000-4,000 rules at start."""
    logs = tmp_path / "boot"
    config = systrap.model_copy(
        update={
            "runsc_platform": platform,
            "runsc_network": network,
            "runsc_args": ["--debug", f"--debug-log={logs}/", "--debug-command=boot"],
        }
    )
    async with (
        sandman.local(config) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        assert (await sb.exec("true")).exit_code == 0
    (boot,) = logs.iterdir()  # the sentry's (`runsc boot`)
    loaded = [line for line in boot.read_text().splitlines() if "precompiled seccomp" in line]
    assert loaded and "Loaded precompiled seccomp instructions" in loaded[0], loaded
    assert f'Platform="{platform}" HostNetwork={network == "host"}'.lower() in loaded[0].lower()


SIDECARS = GVISOR / ".bin" / "gvisor-bin"
# Run by a Python of its own whose only fds are 0-2 (a forked child's fd table is sized
# by its parent's highest open fd; pytest's may be high): `grep` and `ls` report their own
# fd table's size and fds, run directly, then through the prewarmer.
_FDSIZE = """
import subprocess, sys
for prefix in ([], [sys.argv[1], "/bin/grep"]):
    size = ["grep", "FDSize", "/proc/self/status"]
    fds = ["ls", "/proc/self/fd"] if not prefix else [sys.argv[1], "/bin/ls", "ls", "/proc/self/fd"]
    for argv in ([*prefix, *size], fds):
        print(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split())
"""


def test_the_prewarmer_grows_the_fd_table_and_execs_what_it_is_given(built_runsc: Path) -> None:
    """gvisor-sentry-prewarmer execs its first argument with the rest as argv, its fd
    table grown to 256 entries (so the sentry, multi-threaded, never grows it: an RCU
    grace period) and no fd of its own left open."""
    prewarmer = SIDECARS / "gvisor-sentry-prewarmer"
    if not prewarmer.exists():
        pytest.skip("no C compiler when hack/gvisor/build ran: no prewarmer")
    done = subprocess.run(
        [sys.executable, "-c", _FDSIZE, str(prewarmer)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    # The table is the default 64 alone, 256 through the prewarmer; the fds are the same
    # (0-2 and ls's own): the prewarmer leaves none open.
    assert done.stdout.splitlines() == [
        "['FDSize:', '64']",
        "['0', '1', '2', '3']",
        "['FDSize:', '256']",
        "['0', '1', '2', '3']",
    ], done.stdout
    usage = subprocess.run([prewarmer], capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and "runsc runs this" in usage.stderr, usage


async def test_the_sandbox_boots_through_the_prewarmer_into_the_sentry_sidecar(
    systrap: LocalConfig, tmp_path: Path
) -> None:
    """hack/gvisor/build puts runsc's sidecars in gvisor-bin/: runsc starts the sandbox
    process through the prewarmer, which becomes gvisor_sentry (not runsc itself), and
    the create warns of no missing sidecar."""
    logs = tmp_path / "create"
    config = systrap.model_copy(
        update={"runsc_args": ["--debug", f"--debug-log={logs}/", "--debug-command=create"]}
    )
    async with (
        sandman.local(config) as client,
        client.sandbox("busybox", memory="256Mi", pids=128) as sb,
    ):
        assert (await sb.exec("true")).exit_code == 0
        pid = (systrap.state_dir / "sandboxes" / sb.id / "pid").read_text().strip()
        assert Path(f"/proc/{pid}/exe").resolve() == SIDECARS / "gvisor_sentry"
    (create,) = logs.iterdir()
    text = create.read_text()
    assert 'Sidecar "gvisor-sentry-prewarmer" found' in text, text[-4000:]
    assert 'Sidecar "gvisor_sentry" found' in text, text[-4000:]
    missing = [line for line in text.splitlines() if line.startswith("W") and "idecar" in line]
    assert not missing, missing


async def test_a_memory_snapshot_is_restored_through_the_sidecars(systrap: LocalConfig) -> None:
    """`runsc restore` boots its sandbox as `runsc create` does, through the prewarmer
    into gvisor_sentry: a memory snapshot of a sandbox on the built runsc comes back
    with its files, on the sidecar."""
    provider = LocalProvider(systrap)
    spec = SandboxSpec(image="busybox", memory="256Mi", pids=128)
    parent = await provider.create(spec)
    try:
        assert parent.endpoint is not None
        async with parent.endpoint.client() as sb:
            await sb.wait_ready(timeout=30)
            await sb.write_file("/root/kept", "kept\n")
        snapshot = await provider.snapshot(parent.id, memory=True)
        try:
            fork = await provider.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
            try:
                assert fork.endpoint is not None
                async with fork.endpoint.client() as sb:
                    await sb.wait_ready(timeout=30)
                    assert (await sb.exec("cat /root/kept")).stdout == "kept\n"
                pid = (systrap.state_dir / "sandboxes" / fork.id / "pid").read_text().strip()
                assert Path(f"/proc/{pid}/exe").resolve() == SIDECARS / "gvisor_sentry"
            finally:
                await provider.delete(fork.id)
        finally:
            await provider.delete_snapshot(snapshot.id)
    finally:
        await provider.delete(parent.id)
        await provider.aclose()


@pytest.mark.skipif(
    DEBIAN_RUNSC is None, reason="no runsc on PATH (Debian's: apt-get install runsc)"
)
async def test_debians_runsc_is_not_given_the_flag_it_refuses(
    state_dir: Path, busybox_tar: Path
) -> None:
    """The runsc on PATH (Debian 12's, 2022) refuses ``--gofer-network-namespace``: the
    provider leaves it out, and creates work as they did."""
    assert DEBIAN_RUNSC is not None
    version = (await anyio.run_process([DEBIAN_RUNSC, "--version"])).stdout.decode()
    if "0.0~2022" not in version:
        pytest.skip(f"the runsc on PATH is not Debian 12's: {version!r}")
    config = config_for(state_dir, runtime="runsc")
    async with provider_for(config, busybox_tar) as provider:
        info = await provider.create(SandboxSpec(image="busybox", memory="256Mi", pids=128))
        assert info.endpoint is not None
        async with info.endpoint.client() as sb:
            await sb.wait_ready(timeout=30)
            assert (await sb.exec("echo hi")).stdout == "hi\n"
        pid = (state_dir / "sandboxes" / info.id / "pid").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        # runsc hands its sandbox process the flags that differ from its defaults:
        assert b"--network=host" in argv, argv  # the provider's flags reach it...
        assert not any(b"gofer-network-namespace" in arg for arg in argv), argv  # ...not this
        await provider.delete(info.id)
