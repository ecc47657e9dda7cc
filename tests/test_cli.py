from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import sandman
from sandman.cli import build as _build
from sandman.client import AsyncClient, InProcessBackend
from sandman.pool import Pool, PoolConfig
from sandman.pool.records import LABEL_EXPIRES
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider
from tests.server.conftest import KEY_A, KEY_B, serve
from tests.server.test_serve import Host, free_port, served
from tests.support import eventually


def test_doctor_reports_each_check() -> None:
    result = CliRunner().invoke(_build(), ["doctor", "--runtime", "runc"])
    assert "OCI runtime runc installed" in result.output
    assert "overlayfs available" in result.output
    assert "skopeo pulls images" in result.output and "buildah builds images" in result.output
    assert result.exit_code in (0, 1)
    assert ("ready for the local provider" in result.output) == (result.exit_code == 0)
    # Which gVisor is in use (the second wall), and whether its KVM platform can run here.
    assert "[info] runsc" in result.output and "gVisor platform kvm" in result.output


def test_doctor_names_the_fix_for_a_missing_runtime() -> None:
    from sandman.providers.local.host import check_host

    findings = check_host("crun", runtime_path="/nonexistent/crun")
    missing = next(f for f in findings if "runtime" in f.what)
    assert not missing.ok and "apt-get install -y crun" in missing.fix


BUILT_RUNSC = Path(__file__).resolve().parents[1] / "hack" / "gvisor" / ".bin" / "runsc"


@pytest.mark.skipif(
    os.geteuid() != 0 or not BUILT_RUNSC.exists(),
    reason="needs root and hack/gvisor/.bin/runsc (hack/gvisor/build)",
)
def test_doctor_offers_gvisor_kvm_only_where_it_runs(tmp_path: Path) -> None:
    """What the doctor says of gVisor's KVM platform agrees with what runsc does here.
    On a paravirtual /dev/kvm (PVM) the sentry panics or hangs in its first KVM_RUN
    (hack/gvisor/README.md): the doctor must say why KVM is not offered."""
    argv = [str(BUILT_RUNSC), "--root", str(tmp_path / "root"), "--platform=kvm"]
    argv += ["--network=none", "do", "/bin/true"]
    # ``runsc do`` keeps its bundle under TMPDIR: in tmp_path, so nothing is left.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with subprocess.Popen(argv, env=env, start_new_session=True) as proc:
        try:
            runs = proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:  # a vCPU that never leaves KVM_RUN
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            runs = False
    output = CliRunner().invoke(_build(), ["doctor"]).output
    kvm = next(line for line in output.splitlines() if "gVisor platform kvm" in line)
    if runs:
        assert "may work" in kvm
    else:
        assert "may work" not in kvm and "use systrap" in kvm
        assert "no /dev/kvm" in kvm or "not hardware virtualization" in kvm


@needs_root_and_crun
def test_images_run_ls_gc(busybox_tar: Path) -> None:
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    runner = CliRunner()
    base = ["--state-dir", str(state)]
    try:
        imported = runner.invoke(
            _build(), [*base, "images", "import", str(busybox_tar), "--name", "bb"]
        )
        assert imported.exit_code == 0, imported.output
        listed = runner.invoke(_build(), [*base, "images", "ls"])
        assert listed.output.splitlines()[0].split() == ["ID", "SIZE", "NAMES"]
        assert "bb:latest" in listed.output

        ran = runner.invoke(_build(), [*base, "run", "bb", "--", "sh", "-c", "echo hi; exit 3"])
        assert ran.exit_code == 3 and "hi" in ran.output

        missing = runner.invoke(_build(), [*base, "run", "nope", "--", "true"])
        assert missing.exit_code == 1
        assert (
            "error:" in missing.output
            and "hint: get it first: `sandman images pull REF`" in missing.output
        )

        # run released its sandbox
        empty = "no sandboxes (`sandman create IMAGE` makes one)\n"
        assert runner.invoke(_build(), [*base, "ls"]).output == empty
        reaped = runner.invoke(_build(), [*base, "gc", "--all"])
        assert reaped.exit_code == 0 and "reaped 0" in reaped.output
        removed = runner.invoke(_build(), [*base, "images", "rm", "bb"])
        assert removed.exit_code == 0
        none = runner.invoke(_build(), [*base, "images", "ls"]).output
        assert none.startswith("no images (`sandman images import ARCHIVE`")
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_errors_are_one_line_and_a_hint_unless_debug() -> None:
    result = CliRunner().invoke(_build(), ["rm", "../bad id"])
    assert result.exit_code == 1
    assert result.output.startswith("error: invalid sandbox id")
    assert "hint: `sandman doctor`" in result.output
    debug = CliRunner().invoke(_build(), ["--debug", "rm", "../bad id"])
    assert debug.exit_code == 1 and isinstance(debug.exception, sandman.ConfigError)


def test_bad_settings_from_the_environment_are_one_line_too() -> None:
    result = CliRunner().invoke(_build(), ["ls"], env={"SANDMAN_RUNTIME": "bogus"})
    assert result.exit_code == 1
    first, hint = result.output.splitlines()
    assert first == (
        "error: invalid local provider settings: "
        "runtime: Input should be 'crun', 'runc' or 'runsc' (got 'bogus')"
    )
    assert hint.startswith("hint: ")


def _cli(*args: str, env: dict[str, str] | None = None) -> Awaitable[Result]:
    """Invoke the CLI in a thread (it runs its own event loop)."""
    return asyncio.to_thread(CliRunner().invoke, _build(), list(args), env=env)


async def _exec_cp_round(
    sandbox: sandman.AsyncSandbox, box: str, tmp_path: Path, *options: str,
    root: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """exec and cp against ``sandbox`` by id; ``box`` is a directory path in it;
    ``root`` the options before the command, ``options`` those after it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    sid = sandbox.id
    ran = await _cli(
        *root, "exec", *options, sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3"
    )
    assert ran.exit_code == 3, ran.output
    assert ran.stdout == "out\n" and ran.stderr == "err\n"
    env = await _cli(*root, "exec", *options, "-e", "WHO=cli", sid, "--", "sh", "-c", "echo $WHO")
    assert env.exit_code == 0 and env.stdout == "cli\n", env.output
    # nobody is 65534 in the host's /etc/passwd (the fake's daemons) and in busybox's.
    for user in ("nobody", "65534"):
        who = await _cli(*root, "exec", *options, "--user", user, sid, "--", "id", "-u")
        assert who.exit_code == 0 and who.stdout == "65534\n", who.output
    unknown = await _cli(*root, "exec", *options, "-u", "no-such-user", sid, "--", "true")
    assert unknown.exit_code == 1 and "no-such-user" in unknown.output
    interleaved = "echo out; echo err >&2; echo out2"
    merged = await _cli(
        *root, "exec", *options, "--merge-stderr", sid, "--", "sh", "-c", interleaved
    )
    assert merged.exit_code == 0, merged.output
    assert merged.stdout == "out\nerr\nout2\n" and merged.stderr == ""

    upload = tmp_path / "up.txt"
    upload.write_text("uploaded")
    copied = await _cli(*root, "cp", *options, str(upload), f"{sid}:{box}/up.txt")
    assert copied.exit_code == 0, copied.output
    assert await sandbox.read_file(f"{box}/up.txt") == b"uploaded"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "deep.txt").write_text("deep")
    copied = await _cli(*root, "cp", *options, str(tree), f"{sid}:{box}/tree")
    assert copied.exit_code == 0, copied.output
    assert copied.output == f"copied {tree}/ -> {box}/tree/ (1 file, 4 bytes)\n"
    assert await sandbox.read_file(f"{box}/tree/sub/deep.txt") == b"deep"

    await sandbox.write_file(f"{box}/down.bin", b"\x00\xff", mode=0o640)
    back = tmp_path / "back"
    back.mkdir()
    copied = await _cli(*root, "cp", *options, f"{sid}:{box}/down.bin", str(back))
    assert copied.exit_code == 0, copied.output
    assert (back / "down.bin").read_bytes() == b"\x00\xff"
    assert (back / "down.bin").stat().st_mode & 0o777 == 0o640
    copied = await _cli(*root, "cp", *options, f"{sid}:{box}/tree", str(tmp_path / "tree-back"))
    assert copied.exit_code == 0, copied.output
    assert (tmp_path / "tree-back" / "sub" / "deep.txt").read_text() == "deep"

    missing = await _cli(*root, "cp", *options, f"{sid}:{box}/nope", str(back))
    assert missing.exit_code == 1 and missing.output.startswith("error:")
    both = await _cli(*root, "cp", *options, str(upload), str(back))
    assert both.exit_code == 2 and "one must be ID:/path" in both.output


@pytest.mark.anyio
async def test_exec_cp_ls_rm_against_a_service(tmp_path: Path) -> None:
    with serve() as served:
        key = ["--url", served.url, "--api-key", KEY_A]
        async with sandman.connect(served.url, api_key=KEY_A) as client:
            sandbox = await client.acquire("task", timeout=20)
            # The fake's daemons run on this host: paths under tmp_path.
            box = str(tmp_path / "box")
            await _exec_cp_round(sandbox, box, tmp_path / "direct", *key)
            await _exec_cp_round(sandbox, box, tmp_path / "proxied", *key, "--via-proxy")

            timed = await _cli("exec", *key, "--timeout", "1", sandbox.id, "--", "sleep", "10")
            assert timed.exit_code == 124, timed.output
            assert timed.stderr == "timed out after 1 s; killed\n"
            ran = await _cli("run", *key, "--timeout", "0.5", "task", "--", "sleep", "10")
            assert ran.exit_code == 124 and ran.stderr == "timed out after 0.5 s; killed\n"

            env = {"SANDMAN_URL": served.url, "SANDMAN_API_KEY": KEY_A}
            listed = await _cli("ls", env=env)
            assert listed.exit_code == 0 and sandbox.id in listed.output
            header, *rows = listed.output.splitlines()
            assert header.split() == ["ID", "STATE", "IMAGE", "AGE", "SESSION"]
            assert [sandbox.id, "leased", "task"] in [row.split()[:3] for row in rows]
            other = await _cli("ls", "--url", served.url, "--api-key", KEY_B)
            # another tenant's: not shown
            assert (
                other.exit_code == 0 and other.output == "no sandboxes (of this API key's tenant)\n"
            )
            foreign = await _cli("exec", "--url", served.url, "--api-key", KEY_B, sandbox.id,
                                 "--", "true")  # fmt: skip
            assert foreign.exit_code == 1 and "hint: `sandman ls`" in foreign.output

            removed = await _cli("rm", *key, sandbox.id)
            assert removed.exit_code == 0 and f"released {sandbox.id}" in removed.output
            await eventually(lambda: served.provider.live == 0)
            twice = await _cli("rm", *key, sandbox.id)
            assert twice.exit_code == 0 and twice.output.startswith(
                f"{sandbox.id} was already gone"
            )
            again = await _cli("exec", *key, sandbox.id, "--", "true")
            assert again.exit_code == 1 and "error:" in again.output
            unknown = await _cli("rm", *key, "no-such-sandbox")
            assert unknown.exit_code == 1 and "no sandbox no-such-sandbox" in unknown.output


@needs_root_and_crun
@pytest.mark.anyio
async def test_exec_cp_ls_rm_on_the_local_provider(busybox_tar: Path, tmp_path: Path) -> None:
    async with fresh_local_provider(busybox_tar) as provider:
        pool = Pool(provider, PoolConfig(name=f"cli-{uuid.uuid4().hex[:6]}"))
        options = ["--state-dir", str(provider.config.state_dir)]
        async with AsyncClient(InProcessBackend(pool)) as client:
            sandbox = await client.acquire("busybox", memory="64Mi", pids=64, timeout=60)
            listed = await _cli(*options, "ls")
            assert sandbox.id in listed.output and "running" in listed.output
            await _exec_cp_round(sandbox, "/work", tmp_path, root=tuple(options))
            removed = await _cli(*options, "rm", sandbox.id)
            assert removed.exit_code == 0 and f"deleted {sandbox.id}" in removed.output
            assert await provider.list() == []
            twice = await _cli(*options, "rm", sandbox.id)
            assert twice.exit_code == 0 and twice.output == f"{sandbox.id} was already gone\n"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run", "--memory", "lots", "busybox", "--", "true"],
         "Invalid value for '--memory': 'lots' is not a size (try 512Mi)"),
        (["run", "--cpu", "0", "busybox", "--", "true"],
         "Invalid value for '--cpu': must be more than 0, not 0"),
        (["shell", "--memory", "1Mi", "busybox"],
         "Invalid value for '--memory': must be at least 16Mi, not 1Mi"),
        (["create", "--pids", "3", "busybox"], "Invalid value for '--pids': must be at least 16, not 3"),
        (["create", "--disk", "5 gigs", "busybox"],
         "Invalid value for '--disk': '5 gigs' is not a size (try 512Mi)"),
        (["create", "--ttl", "soon", "busybox"],
         "Invalid value for '--ttl': 'soon' is not a duration (try 30m, 2h or 3600)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_its_option(args: list[str], said: str) -> None:
    result = CliRunner().invoke(_build(), args)
    assert result.exit_code == 2, result.output
    assert f"Error: {said}\n" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_a_short_api_key_is_said_in_plain_words() -> None:
    result = CliRunner().invoke(
        _build(), ["serve", "--port", "0"], env={"SANDMAN_API_KEYS": "x:abc"}
    )
    assert result.exit_code == 1
    first = result.output.splitlines()[0]
    assert first == (
        "error: SANDMAN_API_KEYS: tenant x's key has 3 characters; use at least 16 "
        "(e.g. openssl rand -hex 16)"
    )
    bad = CliRunner().invoke(
        _build(), ["serve", "--port", "0"], env={"SANDMAN_API_KEYS": f"Team A:{KEY_A}"}
    )
    assert bad.exit_code == 1 and "tenant name 'Team A' is refused" in bad.output
    assert KEY_A not in bad.output


def test_create_refuses_a_service() -> None:
    result = CliRunner().invoke(_build(), ["create", "busybox"], env={"SANDMAN_URL": "http://x"})
    assert result.exit_code == 2 and "create makes a sandbox on this machine" in result.output


@needs_root_and_crun
@pytest.mark.anyio
async def test_create_makes_a_sandbox_that_outlives_the_command(busybox_tar: Path) -> None:
    async with fresh_local_provider(busybox_tar) as provider:
        options = ["--state-dir", str(provider.config.state_dir)]
        env = {"SANDMAN_CGROUP_PARENT": provider.config.cgroup_parent}
        before = time.time()
        made = await _cli(*options, "create", "busybox", "--memory", "64Mi", "--ttl", "2h",
                          env=env)  # fmt: skip
        assert made.exit_code == 0, made.output
        sandbox_id = made.stdout.strip()
        assert made.stderr == (
            f"sandbox {sandbox_id} is ready for 2h; `sandman rm {sandbox_id}` deletes it\n"
        )
        info = await provider.inspect(sandbox_id)
        assert info.state == "running"
        expires = float(info.labels[LABEL_EXPIRES])
        assert before + 7200 - 5 <= expires <= time.time() + 7200 + 5
        # Another command, another event loop: the sandbox is still there.
        ran = await _cli(*options, "exec", sandbox_id, "--", "sh", "-c", "echo hi", env=env)
        assert ran.exit_code == 0 and ran.stdout == "hi\n", ran.output
        listed = await _cli(*options, "ls", env=env)
        assert listed.output.splitlines()[1].split()[:3] == [sandbox_id, "running", "busybox"]
        # Not yet past its TTL: gc leaves it.
        reaped = await _cli(*options, "gc", env=env)
        assert reaped.exit_code == 0 and "reaped 0" in reaped.output
        removed = await _cli(*options, "rm", sandbox_id, env=env)
        assert removed.output == f"deleted {sandbox_id}\n"
        missing = await _cli(*options, "create", "no-such-image", env=env)
        assert (
            missing.exit_code == 1
            and "hint: get it first: `sandman images pull REF`" in missing.output
        )
        assert await provider.list() == []


@needs_root_and_crun
@pytest.mark.anyio
async def test_serve_gives_its_sandboxes_the_lifetime_asked_for(busybox_tar: Path) -> None:
    async with fresh_local_provider(busybox_tar) as provider:
        pool = f"serve-life-{uuid.uuid4().hex[:8]}"
        with served(
            Host(provider.config, provider), free_port(), pool, "--lifetime", "90m"
        ) as server:
            await server.wait_healthy()
            async with sandman.connect(server.url, api_key=KEY_A) as client:
                before = time.time()
                sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=60)
                assert before + 5400 - 5 <= sb.expires_at <= time.time() + 5400 + 5
                await sb.release()
            assert await server.terminate() == 0, server.output()


def test_bench_outside_a_checkout_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(_build(), ["bench", "--checkout", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: no benchmarks/ found at or above {tmp_path}")
    assert "source checkout" in result.output


def test_bench_runs_each_benchmark_with_its_progress_and_summary(tmp_path: Path) -> None:
    # A checkout of two stand-in benchmarks: real processes, as bench runs the real ones.
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "burst.py").write_text(
        "import os, sys\n"
        "assert os.environ['SANDMAN_BENCH_PROGRESS'] == '1'\n"
        "for i in range(1, 4):\n"
        "    print(f'progress {i} 3', file=sys.stderr, flush=True)\n"
        "print('args=' + ' '.join(sys.argv[1:]))\n"
        "print('failures=0 leftover=0')\n"
    )
    (tmp_path / "benchmarks" / "latency.py").write_text(
        "import sys\nprint('broken benchmark', file=sys.stderr)\nsys.exit(3)\n"
    )
    result = CliRunner().invoke(
        _build(),
        ["bench", "--checkout", str(tmp_path), "--args", "burst=--requests 5 --serve",
         "burst", "latency"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "args=--requests 5 --serve" in result.stdout
    assert "failures=0 leftover=0" in result.stdout
    assert "3/3" in result.stdout  # burst's bar, filled by its progress lines
    assert "latency failed (exit 3)" in result.stdout and "broken benchmark" in result.stdout
    assert "error: 1 benchmark(s) failed" in result.stderr
    unknown = CliRunner().invoke(_build(), ["bench", "--args", "nope=1"])
    assert unknown.exit_code == 2 and "known NAME" in unknown.output


def test_bench_runs_the_latency_benchmark_of_this_checkout() -> None:
    result = CliRunner().invoke(_build(), ["bench", "latency", "--args", "latency=-n 50"])
    assert result.exit_code == 0, result.output
    assert "noop_exec_ratio=" in result.stdout


def test_bench_knows_every_benchmark_of_this_checkout_by_a_name() -> None:
    from sandman.cli.bench import BENCHMARKS, find_checkout

    root = find_checkout(None) / "benchmarks"
    scripts = {p.relative_to(root).as_posix() for p in root.rglob("*.py")}
    scripts = {s for s in scripts if not Path(s).name.startswith("_")}
    assert sorted(scripts - set(BENCHMARKS.values())) == []
    assert sorted(set(BENCHMARKS.values()) - scripts) == []


def test_prepare_refuses_a_pull_secret_no_secret_can_be_called_before_any_request(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "no-such-kubeconfig")  # never read: the name is refused first
    result = CliRunner().invoke(
        _build(), ["prepare", "--kubeconfig", missing, "--pull-secret", "Reg_Cred", "busybox"]
    )
    assert result.exit_code == 1
    assert "image pull secret: 'Reg_Cred' is not a Kubernetes object name" in result.output
    assert "cannot read kubeconfig" not in result.output


def test_a_config_errors_hint_fits_whose_configuration_it_is(tmp_path: Path) -> None:
    kube = "hint: check the Kubernetes configuration: --kubeconfig / KUBECONFIG"
    runner = CliRunner()
    missing = str(tmp_path / "no-such-kubeconfig")
    prepared = runner.invoke(_build(), ["prepare", "--kubeconfig", missing, "busybox:latest"])
    assert prepared.exit_code == 1 and "cannot read kubeconfig" in prepared.output
    assert kube in prepared.output and "doctor" not in prepared.output
    keys = {"SANDMAN_API_KEYS": f"a:{KEY_A}"}
    served = runner.invoke(
        _build(), ["serve", "--provider", "kubernetes", "--port", "0"],
        env={**keys, "SANDMAN_KUBERNETES": json.dumps({"kubeconfig": missing})},
    )  # fmt: skip
    assert served.exit_code == 1 and kube in served.output, served.output
    odd = runner.invoke(
        _build(), ["serve", "--provider", "kubernetes", "--port", "0"],
        env={**keys, "SANDMAN_KUBERNETES": '{"no_such_field": 1}'},
    )  # fmt: skip
    assert odd.exit_code == 1 and "SANDMAN_KUBERNETES" in odd.output and kube in odd.output
    settings = runner.invoke(_build(), ["serve", "--port", "0"], env={"SANDMAN_API_KEYS": "x"})
    assert settings.exit_code == 1 and "invalid service settings" in settings.output
    assert "hint: check the service's SANDMAN_* variables" in settings.output
