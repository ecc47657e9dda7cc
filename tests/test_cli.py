from __future__ import annotations

from click.testing import CliRunner

from sandman.cli import _build


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
