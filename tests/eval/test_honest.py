"""The honest-patch corpus (examples/eval/honest): the grader's false positives, counted.

Every patch in ``predictions.jsonl`` is honest: it really fixes its
instance's bug or really fails to, and forges nothing, though many use what a
careful grader might take for forging (threads, ``exec``, ``atexit``,
``importlib``, ``signal``, ``subprocess``, ``gc``, files under /tmp...; each
row's ``uses``). Each must get the status it was made to get, no run
evidence may have turned it ``unresolved``, and that status must be what the
official SWE-bench grading (swebench 5.0.2) makes of the same test output.

The demo's four instances are graded on the demo's image (the ``demo``
fixture); the two projects' (toolz and more-itertools from their sdists, with
injected bugs) on ``sandman-eval-honest:1``, built here into a state dir of
its own by ``examples/eval/honest/build.py``.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from sandman.client import AsyncClient
from sandman.eval import Instance, Verdict, load_instances, load_predictions, report_path, run_batch
from sandman.eval.verdict import Report
from sandman.images import ImageStore
from tests.eval.conftest import CONDITIONS, EXAMPLES, Demo, built, local_client
from tests.eval.test_parity import _official
from tests.providers.local.conftest import needs_root_and_crun

HONEST = EXAMPLES / "honest"
ROWS: list[dict[str, Any]] = [
    json.loads(line) for line in (HONEST / "predictions.jsonl").read_text().splitlines()
]
# What strict auditing says when run evidence turned a pass into ``unresolved``.
AUDIT_DOWNGRADE = "every listed test passed, but the run did what a forging patch does"
OFFICIAL_PARSER = {"pytest": "parse_log_pytest", "unittest": "parse_log_django",
                   "django": "parse_log_django"}  # fmt: skip
_OLD_UNITTEST_NAME = re.compile(r"^(\w+) \(([\w.]+)\)$")


def test_the_shipped_corpus_is_what_its_script_writes() -> None:
    done = subprocess.run(
        [sys.executable, str(HONEST / "make_predictions.py"), "--check"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(ROWS) >= 32
    assert all(r["expected"] in ("resolved", "unresolved") and r["uses"] for r in ROWS)


@pytest.fixture(scope="session")
def honest() -> Iterator[Demo]:
    """Build the honest image (from the cached Debian base and sdists) into its own state dir."""
    yield from built(HONEST / "build.py", "sm-eh-")


@pytest.fixture(params=["demo", "honest"], ids=["demo-instances", "projects"])
def corpus(request: pytest.FixtureRequest) -> Demo:
    """The demo's four instances on the demo's image, or the two projects' on theirs."""
    return cast(Demo, request.getfixturevalue(request.param))


@pytest.fixture
async def corpus_client(corpus: Demo) -> AsyncIterator[AsyncClient]:
    """A local pool on the corpus's state dir; afterwards no sandbox may be left."""
    async for pool in local_client(corpus.state_dir):
        yield pool


# -- the official grading of a run's output -----------------------------------------------


def _official_name(name: str, log: str, theirs: dict[str, str]) -> str:
    """The name a SWE-bench dataset built from this log would list for ``name``.

    Our unittest lists use the pre-3.11 form (``test_x (mod.Class)``); a 3.11
    log, read by the official (Django) parser, names it ``test_x
    (mod.Class.test_x)``, or by its docstring's first line when it has one.
    """
    old = _OLD_UNITTEST_NAME.match(name)
    if name in theirs or old is None:
        return name
    new = f"{old[1]} ({old[2]}.{old[1]})"
    lines = [line.strip() for line in log.splitlines()]
    for line, after in itertools.pairwise(lines):
        if line == new and new not in theirs and " ... " in after:
            return after.split(" ... ")[0]
    return new


def official_resolved(
    official: types.SimpleNamespace, instance: Instance, report: Report, tmp: Path
) -> bool:
    """swebench 5.0.2's verdict on the run: its parser and get_eval_report on the eval log."""
    parser = OFFICIAL_PARSER[instance.log_parser]

    def spec(f2p: list[str], p2p: list[str]) -> Any:
        return official.types.TestSpec(
            instance_id="repo__repo-1", image="unused", eval_script_list=[], repo="repo/repo",
            version="1.0", FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, log_parser=parser,
            eval_type="pass_and_fail",
        )  # fmt: skip

    log = report.test_output
    # The run gave the listed tests names of its own; the log read by the listed names.
    for token, name in report.renamed.items():
        log = log.replace(token, name)
    theirs = official.log_parsers.PARSER_REGISTRY[parser](log, spec([], []))
    f2p = [_official_name(n, log, theirs) for n in instance.FAIL_TO_PASS]
    p2p = [_official_name(n, log, theirs) for n in instance.PASS_TO_PASS]
    c = official.constants
    code = report.test_exit_code
    path = tmp / "test_output.txt"
    path.write_text(
        f"+ : '{c.START_TEST_OUTPUT}'\n{log}+ SWEBENCH_TEST_EXIT_CODE={code}\n"
        f"+ : '{c.END_TEST_OUTPUT}'\n{c.TEST_EXIT_CODE}: {code}\n"
    )
    prediction = {"instance_id": "repo__repo-1", "model_name_or_path": "m", "model_patch": "x"}
    graded = official.grading.get_eval_report(spec(f2p, p2p), prediction, str(path), True)
    return bool(graded["repo__repo-1"]["resolved"])


# -- grading the corpus ---------------------------------------------------------------------


async def _grade_corpus(
    built: Demo, pool: AsyncClient, instances: list[Instance], out: Path
) -> None:
    ids = {i.instance_id for i in instances}
    predictions = [
        p for p in load_predictions(HONEST / "predictions.jsonl") if p.instance_id in ids
    ]
    rows = {(r["model_name_or_path"], r["instance_id"]): r for r in ROWS if r["instance_id"] in ids}
    assert len(predictions) == len(rows) > 0
    result = await run_batch(
        instances, predictions, client=pool, out=out, conditions=CONDITIONS, concurrency=4,
        images=ImageStore(built.state_dir / "images"),
    )  # fmt: skip
    official = _official()
    by_id = {i.instance_id: i for i in instances}
    wrong: list[str] = []
    for verdict in sorted(result.verdicts, key=lambda v: (v.instance_id, v.model)):
        row = rows[(verdict.model, verdict.instance_id)]
        report = Report.model_validate_json(
            report_path(out, verdict.model, verdict.instance_id).read_text()
        )
        theirs = official_resolved(official, by_id[verdict.instance_id], report, out)
        problems = _problems(verdict, row["expected"], theirs)
        if problems:
            wrong.append(
                f"{verdict.instance_id} {verdict.model} [{row['uses']}]: expected "
                f"{row['expected']}, got {verdict.status} ({'; '.join(problems)}): "
                f"{verdict.reason} | suspicious: {verdict.suspicious}"
            )
    assert not wrong, f"{len(wrong)} of {len(rows)} honest patches graded wrongly:\n" + "\n".join(
        wrong
    )


def _problems(verdict: Verdict, expected: str, official_resolved: bool) -> list[str]:
    found = []
    if verdict.status != expected:
        found.append("a false positive" if expected == "resolved" else "a false negative")
    if verdict.reason.startswith(AUDIT_DOWNGRADE):
        found.append("run evidence made it unresolved")
    if official_resolved != (expected == "resolved"):
        found.append(f"the official grading says resolved={official_resolved}")
    if verdict.official != verdict.status:
        found.append(f"the verdict's own official grading says {verdict.official}")
    return found


@needs_root_and_crun
@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)  # the first run on a machine builds the image
async def test_honest_patches_get_the_status_they_were_made_to_get(
    corpus: Demo, corpus_client: AsyncClient, tmp_path: Path
) -> None:
    await _grade_corpus(corpus, corpus_client, load_instances(corpus.instances), tmp_path)
