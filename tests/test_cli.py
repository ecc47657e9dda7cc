from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from click.testing import CliRunner

import sandman
from sandman.cli import build as _build
from tests.providers.local.conftest import needs_root_and_crun


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
