"""``sandman eval`` on the shipped instances, as the README shows it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandman.cli import build
from tests.eval.conftest import EXAMPLES, Demo
from tests.providers.local.conftest import needs_root_and_crun

README = Path(__file__).resolve().parents[2] / "README.md"


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    instances = tmp_path / "instances.jsonl"
    instances.write_text("{broken\n")
    runner = CliRunner()
    args = ["eval", str(instances), str(EXAMPLES / "predictions.jsonl"), "--out", str(tmp_path)]
    done = runner.invoke(build(), args)
    assert done.exit_code == 1
    assert "error: " in done.output and "instances.jsonl:1: not valid JSON" in done.output
    done = runner.invoke(build(), [*args, "--env", "NOEQUALS"])
    assert done.exit_code == 2 and "'NOEQUALS' is not KEY=VALUE" in done.output
    done = runner.invoke(build(), [*args, "--memory", "lots"])
    assert done.exit_code == 2 and "not a byte quantity" in done.output


@needs_root_and_crun
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)
def test_eval_command_grades_and_resumes(demo: Demo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        "--state-dir", str(demo.state_dir), "eval", str(demo.instances), str(demo.predictions),
        "--out", str(out), "--model", "gold", "--model", "noapply", "--timeout", "120", "-j", "2",
    ]  # fmt: skip
    done = CliRunner().invoke(build(), args)
    assert done.exit_code == 0, done.output
    assert "resolved      gold/calc-1" in done.output
    assert "resolved      gold/shop-1" in done.output
    assert "patch_failed  noapply/calc-1" in done.output
    assert "5 evaluated (0 reused" in done.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["resolved"], summary["unresolved"], summary["error"]) == (4, 1, 0)
    assert summary["conditions"]["timeout"] == 120
    assert (out / "summary.html").exists()
    again = CliRunner().invoke(build(), args)
    assert "5 evaluated (5 reused" in again.output

    # Infrastructure errors a past run left, as it stores them: kept on a plain
    # re-run, graded again (to the patches' real verdicts) with --retry-errors.
    for model, instance_id, status in (("gold", "shop-1", "sandbox_died"),
                                       ("noapply", "calc-1", "error")):  # fmt: skip
        path = out / model / instance_id / "report.json"
        report = json.loads(path.read_text())
        report["verdict"]["status"] = status
        path.write_text(json.dumps(report))
    again = CliRunner().invoke(build(), args)
    assert "sandbox_died  gold/shop-1" in again.output
    assert "5 evaluated (5 reused" in again.output
    retried = CliRunner().invoke(build(), [*args, "--retry-errors"])
    assert retried.exit_code == 0, retried.output
    assert "5 evaluated (3 reused" in retried.output
    assert "resolved      gold/shop-1" in retried.output
    assert "patch_failed  noapply/calc-1" in retried.output


def test_the_readme_shows_this_command() -> None:
    section = README.read_text().split("## Evaluation", 1)
    assert len(section) == 2, "the README has no Evaluation section"
    assert re.search(r"sandman eval examples/eval/instances\.jsonl", section[1])
    assert "python examples/eval/build.py" in section[1]
