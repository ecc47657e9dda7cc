from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections.abc import Awaitable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import sandman
from sandman.cli import build as _build
from sandman.client import AsyncClient, InProcessBackend
from sandman.pool import Pool, PoolConfig
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider
from tests.server.conftest import KEY_A, KEY_B, serve
from tests.support import eventually


def test_doctor_reports_each_check() -> None:
    result = CliRunner().invoke(_build(), ["doctor", "--runtime", "runc"])
    assert "OCI runtime runc installed" in result.output
    assert "overlayfs available" in result.output
    assert result.exit_code in (0, 1)
    assert ("ready for the local provider" in result.output) == (result.exit_code == 0)


def test_doctor_names_the_fix_for_a_missing_runtime() -> None:
    from sandman.providers.local.host import check_host

    findings = check_host("crun", runtime_path="/nonexistent/crun")
    missing = next(f for f in findings if "runtime" in f.what)
    assert not missing.ok and "apt-get install -y crun" in missing.fix


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
        assert "bb:latest" in listed.output

        ran = runner.invoke(_build(), [*base, "run", "bb", "--", "sh", "-c", "echo hi; exit 3"])
        assert ran.exit_code == 3 and "hi" in ran.output

        missing = runner.invoke(_build(), [*base, "run", "nope", "--", "true"])
        assert missing.exit_code == 1
        assert "error:" in missing.output and "hint: import it first" in missing.output

        assert runner.invoke(_build(), [*base, "ls"]).output == ""  # run released its sandbox
        reaped = runner.invoke(_build(), [*base, "gc", "--all"])
        assert reaped.exit_code == 0 and "reaped 0" in reaped.output
        removed = runner.invoke(_build(), [*base, "images", "rm", "bb"])
        assert removed.exit_code == 0
        assert "bb:latest" not in runner.invoke(_build(), [*base, "images", "ls"]).output
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

            env = {"SANDMAN_URL": served.url, "SANDMAN_API_KEY": KEY_A}
            listed = await _cli("ls", env=env)
            assert listed.exit_code == 0 and sandbox.id in listed.output
            assert "leased" in listed.output
            other = await _cli("ls", "--url", served.url, "--api-key", KEY_B)
            assert other.exit_code == 0 and other.output == ""  # another tenant's: not shown
            foreign = await _cli("exec", "--url", served.url, "--api-key", KEY_B, sandbox.id,
                                 "--", "true")  # fmt: skip
            assert foreign.exit_code == 1 and "hint: `sandman ls`" in foreign.output

            removed = await _cli("rm", *key, sandbox.id)
            assert removed.exit_code == 0 and f"released {sandbox.id}" in removed.output
            await eventually(lambda: served.provider.live == 0)
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
