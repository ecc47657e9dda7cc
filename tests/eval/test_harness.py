"""The shipped instances graded for real: fresh sandboxes on the local provider.

Every kind of patch gets the verdict it was built to get; a second run reuses
every report; a sandbox that dies mid-run is reported as such.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import pytest

from sandman.client import AsyncClient
from sandman.eval import (
    Verdict,
    evaluate,
    evaluate_report,
    load_instances,
    load_predictions,
    run_batch,
)
from sandman.eval.decoys import CHOICES
from sandman.eval.variants import COUNT
from sandman.images import ImageStore
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.eval.conftest import CONDITIONS, Demo
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the image
]

# The hanging patch is graded on its own under a short limit: it never finishes anyway.
SHORT = CONDITIONS.model_copy(update={"timeout": 4.0})


async def test_every_kind_of_patch_gets_its_verdict(
    demo: Demo, client: AsyncClient, tmp_path: Path
) -> None:
    images = ImageStore(demo.state_dir / "images")
    instances = load_instances(demo.instances)
    predictions = [p for p in load_predictions(demo.predictions) if p.model_name_or_path != "hang"]
    seen: list[tuple[str, str, bool]] = []

    def progress(verdict: Verdict, reused: bool) -> None:
        seen.append((verdict.model, verdict.instance_id, reused))

    result = await run_batch(
        instances, predictions, client=client, out=tmp_path, conditions=CONDITIONS,
        concurrency=4, images=images, progress=progress,
    )  # fmt: skip
    got = {(v.model, v.instance_id): v for v in result.verdicts}
    assert {key: v.status for key, v in got.items()} == {
        key: status for key, status in demo.expected().items() if key[0] != "hang"
    }
    assert len(seen) == len(predictions) and not any(reused for *_, reused in seen)

    # No honest patch (right or wrong) is flagged by the audit.
    honest = {"gold", "3way", "fuzzy", "wrong", "noapply"}
    assert {key: v.suspicious for key, v in got.items() if key[0] in honest} == {
        key: [] for key in got if key[0] in honest
    }

    # How each patch went in: the fallbacks were needed and used in order.
    assert got["gold", "calc-1"].applied_with == "git apply"
    assert got["3way", "intervals-1"].applied_with == "git apply --3way"
    assert got["fuzzy", "textkit-1"].applied_with == "patch --fuzz"
    assert got["noapply", "calc-1"].applied_with is None

    # The tampering patch's test edits and conftest.py were set back: it is
    # graded exactly like the plain wrong patch.
    tamper, wrong = got["tamper", "calc-1"], got["wrong", "calc-1"]
    assert tamper.reverted == ["conftest.py", "tests/test_stats.py"]
    assert (
        tamper.fail_to_pass
        == wrong.fail_to_pass
        == {"tests/test_stats.py::test_median_even": "FAILED"}
    )
    assert tamper.pass_to_pass == wrong.pass_to_pass
    assert all(s == "PASSED" for s in wrong.pass_to_pass.values())

    # The Django instance ran under Django's own runner, database and all: the
    # django parser read every test, and only the gold patch fixes the bug.
    shop = "test_single_digit_cents (shop_tests.tests.FormatCentsTests)"
    assert got["gold", "shop-1"].fail_to_pass == {shop: "PASSED"}
    assert got["wrong", "shop-1"].fail_to_pass == {shop: "FAILED"}
    for model in ("gold", "wrong"):
        assert got[model, "shop-1"].pass_to_pass == {
            "test_two_digit_cents (shop_tests.tests.FormatCentsTests)": "PASSED",
            "test_under_a_unit (shop_tests.tests.FormatCentsTests)": "PASSED",
            "test_cheapest_first (shop_tests.tests.ProductTests)": "PASSED",
            "test_price_display (shop_tests.tests.ProductTests)": "PASSED",
        }
    shop_log = json.loads((tmp_path / "wrong" / "shop-1" / "report.json").read_text())
    assert "Creating test database for alias 'default'" in shop_log["test_output"]
    # The family's expected values never entered the test process: its assertions
    # recorded their plain results ('12.50') and passed there; the grader, which
    # alone held '12.05', failed the test (rounds 8 to 10 of heldout/ read them, or
    # tried values on the members, in the process).
    assert "12.05" not in shop_log["test_output"]
    assert "FAIL_TO_PASS 1 of 1 not passing" in shop_log["verdict"]["reason"]
    # The log says so in the runner's words, after the run's own pass (any parser then
    # reads what the grader decided).
    token = next(t for t, name in shop_log["renamed"].items() if name == "test_single_digit_cents")
    lines = shop_log["test_output"].splitlines()
    assert any(ln.startswith(f"{token} (") and ln.endswith(" ... FAIL") for ln in lines)

    # A run cut short has no test results, only the reason.
    assert got["oom", "calc-1"].fail_to_pass == got["oom", "calc-1"].pass_to_pass == {}
    # Known from the sandbox's cgroup counter, not guessed from the SIGKILL.
    assert "killed by the OOM killer" in got["oom", "calc-1"].reason

    # The conditions are recorded, the image pinned to the id that ran.
    gold = got["gold", "calc-1"]
    assert gold.conditions == CONDITIONS
    assert gold.conditions.network == "none"
    assert gold.image_digest == demo.image_id

    # Files: a report per prediction, the summaries.
    report = json.loads((tmp_path / "gold" / "calc-1" / "report.json").read_text())
    assert report["verdict"] == gold.model_dump(mode="json")
    # The listed tests ran under names drawn for this run, canaries beside them;
    # the verdict names them as listed, and agrees with the official grading.
    token = next(t for t, name in report["renamed"].items() if name == "test_median_even")
    assert f"PASSED tests/test_stats.py::{token}" in report["test_output"]
    assert "test_median_even" not in report["test_output"]
    # Input variants too: the instance carries its fix (how many reach the bug depends
    # on the process's draw; every even list of four or six does).
    kinds = sorted(d.split()[1] for d in report["canaries"].values())
    assert 1 <= kinds.count("input") <= COUNT
    assert [k for k in kinds if k != "input"] == [
        "must-error", "must-fail", "must-pass", "must-skip", "must-xfail",
        *["mutant"] * 2 * (CHOICES - 1), "re-importing",
    ]  # fmt: skip
    assert all(v.official in (v.status, None) for key, v in got.items() if key[0] in honest)
    assert got["noapply", "calc-1"].official is None
    assert report["sandbox_id"].startswith("sb-")
    summary = json.loads((tmp_path / "summary.json").read_text())
    expected = [s for (model, _), s in demo.expected().items() if model != "hang"]
    assert summary["total"] == len(predictions)
    assert summary["resolved"] == expected.count("resolved")
    assert summary["error"] == expected.count("oom")
    assert summary["by_status"]["patch_failed"] == expected.count("patch_failed")
    html = (tmp_path / "summary.html").read_text()
    assert "intervals-1" in html and 'href="gold/calc-1/report.json"' in html

    # Again into the same directory: nothing is re-run, the verdicts are the same bytes.
    seen.clear()
    again = await run_batch(
        instances, predictions, client=client, out=tmp_path, conditions=CONDITIONS,
        images=images, progress=progress,
    )  # fmt: skip
    assert again.reused == len(predictions) and all(reused for *_, reused in seen)
    assert [v.canonical() for v in again.verdicts] == [v.canonical() for v in result.verdicts]
    assert (tmp_path / "summary.json").read_text() == json.dumps(summary, indent=2)


async def test_a_hanging_test_run_is_a_timeout(demo: Demo, client: AsyncClient) -> None:
    instance, patch = demo.shipped("calc-1", "hang")
    report = await evaluate_report(instance, patch, client=client, conditions=SHORT)
    assert report.verdict.status == "timeout"
    assert report.verdict.category == "error"
    assert report.verdict.reason == (
        "the test run passed its wall-clock limit of 4 s and was killed"
    )
    assert report.verdict.fail_to_pass == report.verdict.pass_to_pass == {}
    assert report.test_exit_code is None  # killed: no exit code of its own
    assert 4.0 <= report.durations["tests"] < 60


async def test_changed_inputs_are_graded_again(
    demo: Demo, client: AsyncClient, tmp_path: Path
) -> None:
    instances = load_instances(demo.instances)
    gold = [p for p in load_predictions(demo.predictions) if p.model_name_or_path == "gold"]
    first = await run_batch(instances, gold, client=client, out=tmp_path, conditions=CONDITIONS)
    assert first.reused == 0 and first.summary.resolved == len(gold)
    assert first.verdicts[0].image_digest is None  # no image store: a bare name pins nothing
    other = CONDITIONS.model_copy(update={"env": {**CONDITIONS.env, "EXTRA": "1"}})
    second = await run_batch(instances, gold, client=client, out=tmp_path, conditions=other)
    assert second.reused == 0 and second.summary.resolved == len(gold)
    third = await run_batch(instances, gold, client=client, out=tmp_path, conditions=other)
    assert third.reused == len(gold)


async def test_the_sdk_call_a_reward_function_makes(demo: Demo, client: AsyncClient) -> None:
    instance, patch = demo.shipped("textkit-1", "gold")
    verdict = await evaluate(instance, patch, client=client, conditions=CONDITIONS)
    assert verdict.resolved
    assert verdict.pass_to_pass == {
        "test_accents (tests.test_slug.SlugifyTest)": "PASSED",
        "test_single_word (tests.test_slug.SlugifyTest)": "PASSED",
    }


async def test_pre_test_runs_first_and_its_environment_reaches_the_tests(
    demo: Demo, client: AsyncClient
) -> None:
    """As SWE-bench's eval script: activation-style exports before the test command
    (one spanning lines), run in an exec of their own; nothing they start lives on."""
    instance, patch = demo.shipped("calc-1", "gold")
    staged = instance.model_copy(
        update={
            "pre_test": ["export SANDMAN_T_MULTI='one\ntwo'", "export SANDMAN_T_READY=1",
                         "sleep 300 &"],
            "test_cmd": 'test "$SANDMAN_T_READY" = 1 && test "$(echo "$SANDMAN_T_MULTI" | wc -l)" = 2'
            " && ! (cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -q 'sleep 30[0]') && "
            + instance.test_cmd,
        }
    )  # fmt: skip
    report = await evaluate_report(staged, patch, client=client, conditions=CONDITIONS)
    assert report.verdict.status == "resolved", (report.verdict.reason, report.test_output)


async def test_a_test_patch_that_does_not_apply_is_a_harness_error(
    demo: Demo, client: AsyncClient
) -> None:
    instance, patch = demo.shipped("calc-1", "gold")
    _, stale = demo.shipped("calc-1", "noapply")
    broken = instance.model_copy(update={"test_patch": stale})
    report = await evaluate_report(broken, patch, client=client, conditions=CONDITIONS)
    assert report.verdict.status == "error"
    assert report.verdict.reason.startswith("the test patch does not apply")
    missing = instance.model_copy(update={"image": "no-such-image:1"})
    images = ImageStore(demo.state_dir / "images")
    verdict = await evaluate(missing, patch, client=client, images=images)
    assert verdict.status == "error" and "no-such-image" in verdict.reason


def _running_tests(sandbox_id: str) -> bool:
    """Whether the sandbox's pytest run has started (seen from the host's /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and b"pytest" in (proc / "cmdline").read_bytes()
                and sandbox_id in (proc / "cgroup").read_text()
            ):
                return True
        except OSError:
            continue
    return False


async def test_a_sandbox_that_dies_is_reported_as_such(demo: Demo, client: AsyncClient) -> None:
    instance, patch = demo.shipped("calc-1", "hang")
    # One sandbox only, the grade's: no input variants to learn first.
    instance = instance.model_copy(update={"patch": None})
    provider = LocalProvider(LocalConfig(state_dir=demo.state_dir))
    slow = CONDITIONS.model_copy(update={"timeout": 300.0})
    verdicts: list[Verdict] = []

    async def grade() -> None:
        verdicts.append(await evaluate(instance, patch, client=client, conditions=slow))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(grade)
        with anyio.fail_after(120):
            while not (infos := await provider.list()) or not _running_tests(infos[0].id):
                await anyio.sleep(0.1)
        await provider.delete(infos[0].id)  # the backend loses it mid-run
    (verdict,) = verdicts
    assert verdict.status == "sandbox_died"
    assert verdict.reason == "the sandbox went away during tests"
    assert verdict.category == "error"
