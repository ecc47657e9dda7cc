"""Instances, predictions, conditions and verdicts: loading, hashing and grading, no sandbox needed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import sandman
from sandman.client import AsyncClient, InProcessBackend
from sandman.eval import (
    INFRA_ERRORS,
    Conditions,
    Instance,
    Prediction,
    Report,
    Verdict,
    evaluate,
    inputs_hash,
    load_instances,
    load_predictions,
    report_path,
    run_batch,
)
from sandman.eval.harness import git_paths, is_protected
from sandman.eval.parsers import TestStatus
from sandman.eval.verdict import grade_tests
from sandman.pool import Pool, PoolConfig
from sandman.testing import FakeProvider, Faults

TEST_PATCH = """\
diff --git a/tests/test_a.py b/tests/test_a.py
--- a/tests/test_a.py
+++ b/tests/test_a.py
@@ -1 +1,2 @@
 x = 1
+y = 2
diff --git a/tests/data/new.txt b/tests/data/new.txt
new file mode 100644
"""

RECORD = {
    "instance_id": "repo__repo-1",
    "image": "task:1",
    "base_commit": "abc1234",
    "test_patch": TEST_PATCH,
    # SWE-bench keeps these as JSON text.
    "FAIL_TO_PASS": '["tests/test_a.py::test_new"]',
    "PASS_TO_PASS": '["tests/test_a.py::test_old", "tests/test_a.py::test_other"]',
    "test_cmd": "pytest -rA",
    "version": "1.0",
}


def instance(**changes: object) -> Instance:
    return Instance.model_validate({**RECORD, **changes})


def test_swe_bench_records_load_from_jsonl_and_json(tmp_path: Path) -> None:
    jsonl = tmp_path / "instances.jsonl"
    jsonl.write_text(json.dumps(RECORD) + "\n\n")
    (loaded,) = load_instances(jsonl)
    assert loaded.FAIL_TO_PASS == ["tests/test_a.py::test_new"]
    assert loaded.repo_path == "/testbed"
    assert loaded.test_files == ["tests/test_a.py", "tests/data/new.txt"]
    assert loaded.directives == loaded.test_files
    as_list = tmp_path / "instances.json"
    as_list.write_text(json.dumps([RECORD]))
    assert load_instances(as_list) == [loaded]

    predictions = tmp_path / "preds.jsonl"
    predictions.write_text(json.dumps({"instance_id": "repo__repo-1", "model_patch": None}) + "\n")
    (prediction,) = load_predictions(predictions)
    assert prediction.patch == ""
    assert prediction.model_name_or_path == "model"


def test_bad_records_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "instances.jsonl"
    broken = {k: v for k, v in RECORD.items() if k != "base_commit"}
    path.write_text(json.dumps(RECORD) + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(
        sandman.ConfigError, match=r"instances.jsonl:2: base_commit: Field required"
    ):
        load_instances(path)
    path.write_text(json.dumps(RECORD) + "\n{not json\n")
    with pytest.raises(sandman.ConfigError, match=r"instances.jsonl:2: not valid JSON"):
        load_instances(path)
    path.write_text(json.dumps(RECORD) + "\n" + json.dumps(RECORD) + "\n")
    with pytest.raises(sandman.ConfigError, match="appears twice"):
        load_instances(path)
    path.write_text(json.dumps({**RECORD, "FAIL_TO_PASS": "[oops"}) + "\n")
    with pytest.raises(sandman.ConfigError, match="FAIL_TO_PASS: Value error, not a JSON list"):
        load_instances(path)
    with pytest.raises(sandman.ConfigError, match="cannot read"):
        load_instances(tmp_path / "missing.jsonl")


def test_the_inputs_hash_covers_every_input() -> None:
    base = inputs_hash(instance(), "patch", Conditions(), "sha256:1")
    assert base == inputs_hash(instance(), "patch", Conditions(), "sha256:1")
    changed = {
        inputs_hash(instance(test_cmd="pytest"), "patch", Conditions(), "sha256:1"),
        inputs_hash(instance(), "patch2", Conditions(), "sha256:1"),
        inputs_hash(instance(), "patch", Conditions(memory="1Gi"), "sha256:1"),
        inputs_hash(instance(), "patch", Conditions(env={"A": "1"}), "sha256:1"),
        inputs_hash(instance(), "patch", Conditions(), "sha256:2"),
    }
    assert base not in changed
    assert len(changed) == 5


def test_conditions_parse_quantities_and_refuse_nonsense() -> None:
    assert Conditions(memory="512Mi").memory == 512 * 2**20
    assert Conditions().network == "none"
    with pytest.raises(ValueError, match="timeout"):
        Conditions(timeout=0)
    with pytest.raises(ValueError, match="unknown"):
        Conditions.model_validate({"unknown": 1})


def test_resolved_needs_every_listed_test_to_pass() -> None:
    graded = instance(PASS_TO_PASS=["old", "known", "slow"], FAIL_TO_PASS=["new"])
    status, reason, f2p, p2p = grade_tests(
        graded,
        {"new": "PASSED", "old": "PASSED", "known": "XFAIL", "slow": "SKIPPED", "extra": "FAILED"},
    )
    # A skipped PASS_TO_PASS test is no regression (as in the official grading).
    assert (status, f2p, p2p) == (
        "resolved",
        {"new": "PASSED"},
        {"old": "PASSED", "known": "XFAIL", "slow": "SKIPPED"},
    )
    status, reason, f2p, _ = grade_tests(graded, {"old": "PASSED", "known": "ERROR"})
    assert status == "unresolved"
    assert f2p == {"new": "MISSING"}
    assert reason == (
        "FAIL_TO_PASS 1 of 1 not passing (new: MISSING). "
        "PASS_TO_PASS 2 of 3 not passing (known: ERROR; slow: MISSING)"
    )
    # A skipped FAIL_TO_PASS test is not a fix.
    assert grade_tests(graded, {"new": "SKIPPED", "old": "PASSED"})[0] == "unresolved"


def test_grading_needs_results_and_an_exit_code_that_agrees() -> None:
    graded = instance(PASS_TO_PASS=[], FAIL_TO_PASS=["new"])
    assert grade_tests(graded, {})[:2] == ("unresolved", "no test results in the log")
    assert grade_tests(graded, {"new": "PASSED"}, exit_code=0)[0] == "resolved"
    assert grade_tests(graded, {"new": "PASSED"}, exit_code=1)[:2] == (
        "unresolved",
        "the test command exited 1 but its log reports no failure",
    )
    assert grade_tests(graded, {"new": "PASSED", "other": "FAILED"}, exit_code=1)[0] == "resolved"


def test_unittest_names_hold_under_python_3_11() -> None:
    graded = instance(FAIL_TO_PASS=["test_x (app.tests.T)"], PASS_TO_PASS=["test_y (app.tests.T)"])
    results: dict[str, TestStatus] = {
        "test_x (app.tests.T.test_x)": "PASSED",
        "test_y (app.tests.T.test_y)": "FAILED",
    }
    assert grade_tests(graded, results)[2:] == (
        {"test_x (app.tests.T)": "PASSED"},
        {"test_y (app.tests.T)": "FAILED"},
    )


def test_truncated_parametrized_ids_match_by_prefix() -> None:
    graded = instance(FAIL_TO_PASS=["t.py::test_x[log(photon"], PASS_TO_PASS=["t.py::test_y[a"])
    results: dict[str, TestStatus] = {
        "t.py::test_x[log(photon cm)]": "PASSED",
        "t.py::test_x[log(photon s)]": "PASSED",
        "t.py::test_y[a]": "PASSED",
        "t.py::test_y[ab]": "FAILED",
    }
    status, _, f2p, p2p = grade_tests(graded, results)
    # test_y[a is ambiguous (one match passes, one fails): not found.
    assert (status, f2p, p2p) == (
        "unresolved",
        {"t.py::test_x[log(photon": "PASSED"},
        {"t.py::test_y[a": "MISSING"},
    )


SWEBENCH_ROW = {
    "repo": "django/django",
    "instance_id": "django__django-11099",
    "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
    "patch": "diff --git a/django/contrib/auth/validators.py ...",
    "test_patch": "diff --git a/tests/auth_tests/test_validators.py "
    "b/tests/auth_tests/test_validators.py\n--- a/tests/auth_tests/test_validators.py\n"
    "diff --git a/tests/auth_tests/fixtures/x.json b/tests/auth_tests/fixtures/x.json\n",
    "problem_statement": "UsernameValidator allows trailing newline in usernames",
    "hints_text": "",
    "created_at": "2019-03-20T03:46:18Z",
    "version": "3.0",
    "FAIL_TO_PASS": '["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"]',
    "PASS_TO_PASS": '["test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest)"]',
    "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
}


def test_swe_bench_rows_load_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "verified.json"
    path.write_text(json.dumps([SWEBENCH_ROW]))
    (row,) = load_instances(path)
    assert row.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert row.repo_path == "/testbed"
    assert row.test_cmd == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert row.directives == ["auth_tests.test_validators"]  # dotted, data files left out
    assert row.log_parser == "django"
    assert row.pre_test[:2] == [". /opt/miniconda3/bin/activate", "conda activate testbed"]
    assert row.pre_test[-1] == "python -m pip install -e ."
    assert "export LANG=en_US.UTF-8" in row.pre_test
    assert row.FAIL_TO_PASS == [
        "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"
    ]

    sympy = Instance.model_validate(
        {**SWEBENCH_ROW, "repo": "sympy/sympy", "version": "1.1", "instance_id": "sympy__sympy-1",
         "test_patch": "diff --git a/sympy/core/tests/test_x.py b/sympy/core/tests/test_x.py\n"}
    )  # fmt: skip
    assert sympy.test_cmd.endswith("bin/test -C --verbose")
    assert sympy.directives == ["sympy/core/tests/test_x.py"]
    assert sympy.log_parser == "sympy"
    # SWE-bench 5's rows name their parser; an explicit field wins.
    assert Instance.model_validate(
        {**SWEBENCH_ROW, "log_parser": "parse_log_astropy", "image": "mine:1", "test_cmd": "x"}
    ).model_dump(include={"log_parser", "image", "test_cmd"}) == {
        "log_parser": "pytest_v2", "image": "mine:1", "test_cmd": "x",
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"django/django at version '0.1' has no SWE-bench spec"):
        Instance.model_validate({**SWEBENCH_ROW, "version": "0.1"})
    with pytest.raises(ValueError, match="not in SWE-bench's: give image, test_cmd, log_parser"):
        Instance.model_validate({**SWEBENCH_ROW, "repo": "me/mine"})


def test_parquet_needs_pyarrow_or_says_so(tmp_path: Path) -> None:
    path = tmp_path / "test-00000-of-00001.parquet"
    path.write_bytes(b"PAR1")
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(sandman.ConfigError, match="reading parquet needs pyarrow"):
            load_instances(path)
    else:
        with pytest.raises(sandman.ConfigError, match="not a readable parquet file"):
            load_instances(path)


def fake_client(faults: Faults | None = None) -> AsyncClient:
    provider = FakeProvider(faults=faults or Faults(), daemon=False)
    return AsyncClient(InProcessBackend(Pool(provider, PoolConfig(name="eval-unit"))))


@pytest.mark.anyio
async def test_no_sandbox_is_an_error_not_a_verdict_on_the_patch() -> None:
    async with fake_client(Faults(fail_create=1.0)) as client:
        verdict = await evaluate(instance(), "diff", client=client, acquire_timeout=1.0)
    assert verdict.status == "error"
    assert verdict.category == "error"
    assert verdict.reason.startswith("no sandbox for the evaluation")
    assert not verdict.resolved


@pytest.mark.anyio
async def test_an_empty_patch_fails_without_a_sandbox() -> None:
    async with fake_client(Faults(fail_create=1.0)) as client:
        verdict = await evaluate(instance(), " \n", client=client)
    assert (verdict.status, verdict.reason) == ("patch_failed", "the patch is empty")
    assert verdict.category == "unresolved"
    assert verdict.image_digest is None  # a bare name, and no image store to pin it


@pytest.mark.anyio
async def test_a_batch_refuses_predictions_it_cannot_grade(tmp_path: Path) -> None:
    async with fake_client() as client:
        with pytest.raises(sandman.ConfigError, match="unknown instances: nope-1"):
            await run_batch(
                [instance()], [Prediction(instance_id="nope-1", model_patch="x")],
                client=client, out=tmp_path,
            )  # fmt: skip
        twice = [Prediction(instance_id="repo__repo-1", model_patch="x")] * 2
        with pytest.raises(sandman.ConfigError, match="two predictions of model 'model'"):
            await run_batch([instance()], twice, client=client, out=tmp_path)
        with pytest.raises(sandman.ConfigError, match="concurrency"):
            await run_batch([instance()], [], client=client, out=tmp_path, concurrency=0)
    assert list(tmp_path.iterdir()) == []


def test_what_a_model_patch_may_not_change() -> None:
    django_like = instance(
        test_patch="diff --git a/tests/queries/tests.py b/tests/queries/tests.py\n"
        "diff --git a/src/pkg/thing_test.py b/src/pkg/thing_test.py\n",
        protected=["docs/*.rst"],
    )
    for path in ("tests/queries/tests.py", "tests/queries/models.py", "src/pkg/thing_test.py",
                 "conftest.py", "src/pkg/conftest.py", "pytest.ini", ".pytest.ini",
                 "setup.cfg", "sub/pyproject.toml", "docs/index.rst",
                 "evil-1.dist-info/entry_points.txt", "src/pkg.egg-info/entry_points.txt",
                 "src/x.egg-info/deep/file", "hook.pth"):  # fmt: skip
        assert is_protected(django_like, path), path
    # A test file next to the code does not protect the code beside it.
    for path in ("src/pkg/thing.py", "tests.py", "docs/conf.py", "testsuite/x.py",
                 "dist-info.py", "src/egg-info/x.py"):  # fmt: skip
        assert not is_protected(django_like, path), path


@pytest.mark.anyio
async def test_a_patch_that_touches_git_itself_is_refused() -> None:
    sneaky = (
        "--- a/.git/refs/replace/abc1234\n+++ b/.git/refs/replace/abc1234\n@@ -0,0 +1 @@\n+f00\n"
        "diff --git a/src/.git/config b/src/.git/config\n"
        "diff --git a/src/mod.py b/src/mod.py\n--- a/src/mod.py\n+++ b/src/mod.py\n"
    )
    assert git_paths(sneaky) == [".git/refs/replace/abc1234", "src/.git/config"]
    assert git_paths("diff --git a/.github/x.yml b/.github/x.yml\n") == []
    async with fake_client(Faults(fail_create=1.0)) as client:
        verdict = await evaluate(instance(), sneaky, client=client)
    assert verdict.status == "patch_failed"
    assert verdict.reason == ("the patch touches .git: .git/refs/replace/abc1234, src/.git/config")


@pytest.mark.anyio
async def test_retry_errors_grades_again_only_infrastructure_errors(tmp_path: Path) -> None:
    statuses = ["resolved", "unresolved", "patch_failed", "timeout", "oom", "sandbox_died", "error"]
    assert {"error", "sandbox_died"} == INFRA_ERRORS
    # One model per status, all for the same instance and patch.
    predictions = [
        Prediction(instance_id="repo__repo-1", model_name_or_path=status, model_patch="diff\n")
        for status in statuses
    ]
    seen: list[tuple[str, bool]] = []

    def progress(verdict: Verdict, reused: bool) -> None:
        seen.append((verdict.model, reused))

    async with fake_client(Faults(fail_create=1.0)) as client:

        async def batch(retry_errors: bool) -> dict[str, str]:
            seen.clear()
            result = await run_batch(
                [instance()], predictions, client=client, out=tmp_path, acquire_timeout=0.3,
                progress=progress, retry_errors=retry_errors, concurrency=7,
            )  # fmt: skip
            return {v.model: v.status for v in result.verdicts}

        assert set((await batch(False)).values()) == {"error"}  # the backend is down
        # What past runs left on disk: each model's report carries its own name as the status.
        for status in statuses:
            path = report_path(tmp_path, status, "repo__repo-1")
            report = Report.model_validate_json(path.read_text())
            verdict = report.verdict.model_copy(update={"status": status})
            path.write_text(report.model_copy(update={"verdict": verdict}).model_dump_json())

        assert await batch(False) == {status: status for status in statuses}
        assert all(reused for _, reused in seen)

        stored = await batch(True)
        assert sorted(model for model, reused in seen if not reused) == ["error", "sandbox_died"]
        # Graded again (the backend is still down, so an error again), the rest kept.
        assert stored == {**{status: status for status in statuses}, "sandbox_died": "error"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["by_status"]["error"] == 2 and "sandbox_died" not in summary["by_status"]
