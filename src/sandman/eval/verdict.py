"""What an evaluation decides (`Verdict`) and everything it saw on the way (`Report`).

A verdict holds only what the inputs determine: the same instance, patch,
conditions and image give byte-identical verdicts (`Verdict.canonical`).
Timings, the sandbox's id and the logs go in the report around it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from sandman.eval.conditions import Conditions
from sandman.eval.instances import Instance
from sandman.eval.parsers import TestStatus

__all__ = [
    "HARNESS_VERSION",
    "INFRA_ERRORS",
    "ApplyAttempt",
    "Category",
    "Report",
    "Status",
    "Verdict",
    "category",
    "grade_tests",
    "inputs_hash",
    "lookup",
]

# 2: pytest summary found by the harness plugin; 3: snapshot of the whole tree, OOM from
# the cgroup counter, no summary but pytest's, unittest's FAIL/ERROR headers overrule;
# 4: no markers, a pass needs the witness's signed word, the audit (``suspicious``);
# SWE-bench's test names and grading (skipped PASS_TO_PASS kept, truncated ids);
# 5: tests renamed, canaries, XFAIL/SKIPPED only where declared, git apply alone,
# the grader's files only after pre_test, ``official`` beside ``status``;
# 6: ``official`` read by the swebench package's own parser where it is importable,
# ``official_parser`` naming the parser.
# 7: input variants (`sandman.eval.variants`) where the instance carries its fix.
HARNESS_VERSION = "7"
"""Part of every inputs hash: a harness change that could change verdicts bumps it."""

Status = Literal[
    "resolved", "unresolved", "patch_failed", "timeout", "oom", "sandbox_died", "error"
]
"""``resolved``: every FAIL_TO_PASS and PASS_TO_PASS test passed. ``unresolved``:
the tests ran and some did not pass. ``patch_failed``: no way of applying the
patch worked (or it was empty). ``timeout``: the test run passed its wall-clock
limit and was killed. ``oom``: the test run was killed by the OOM killer.
``sandbox_died``: the sandbox went away mid-evaluation. ``error``: the harness
could not grade (no sandbox, the test patch does not apply, no test output)."""

Category = Literal["resolved", "unresolved", "error"]

INFRA_ERRORS: frozenset[Status] = frozenset({"error", "sandbox_died"})
"""The statuses that say nothing about the patch: the harness or the backend failed.

A batch run with ``retry_errors`` grades these again. ``timeout`` and ``oom``
are not among them: under fixed conditions they are what the patch did."""

_CATEGORY: dict[Status, Category] = {
    "resolved": "resolved", "unresolved": "unresolved", "patch_failed": "unresolved",
    "timeout": "error", "oom": "error", "sandbox_died": "error", "error": "error",
}  # fmt: skip
_PASSING: frozenset[TestStatus] = frozenset({"PASSED", "XFAIL"})
_OLD_UNITTEST_NAME = re.compile(r"^(\w+) \(([\w.]+)\)$")
# A PASS_TO_PASS test skipped is no regression (the official grading's test_maintained).
_KEPT: frozenset[TestStatus] = frozenset({"PASSED", "XFAIL", "SKIPPED"})


def category(status: Status) -> Category:
    """How a summary counts a status: the patch's fault is ``unresolved``, a run cut short ``error``."""
    return _CATEGORY[status]


class Verdict(BaseModel):
    """The grade of one patch on one instance, and the conditions it was graded under.

    ``applied_with`` says which way of applying worked (``git apply``, ``git
    apply --3way``, ``patch --fuzz``); ``reverted`` lists the protected paths
    (test files, ``conftest.py``...) the patch changed and the harness set back
    before the run. ``fail_to_pass`` and ``pass_to_pass`` map each graded
    test to its status (empty when the tests did not run to the end).
    ``suspicious`` lists what the patch or its run did that a patch forging
    its own grade does (ending the test process early, reaching into the
    test framework, other processes' descriptors, the grader's files...);
    with ``Conditions(audit="strict")`` such a run is never ``resolved``.
    ``official`` is what the official SWE-bench grading makes of the same
    run's log (None when the tests did not run to the end). Where it differs
    from ``status``, the reason says why (a canary that lied, an XFAIL the
    test's source does not declare), or the log holds results outside the
    framework's own report, which SWE-bench reads and we do not (a summary
    printed after the run's last line). ``official_parser`` names the parser
    that read the log for it: the ``swebench`` package's own
    (``swebench==5.0.2:parse_log_pytest``) where it is importable, else ours
    reading every line as it does (``sandman:pytest``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_id: str
    model: str
    status: Status
    reason: str
    applied_with: str | None = None
    reverted: list[str] = []
    fail_to_pass: dict[str, TestStatus] = {}
    pass_to_pass: dict[str, TestStatus] = {}
    suspicious: list[str] = []
    official: Status | None = None
    official_parser: str | None = None
    image: str
    image_digest: str | None
    conditions: Conditions
    inputs_hash: str

    @property
    def resolved(self) -> bool:
        """True only when every FAIL_TO_PASS and PASS_TO_PASS test passed."""
        return self.status == "resolved"

    @property
    def category(self) -> Category:
        return category(self.status)

    def canonical(self) -> bytes:
        """The verdict as sorted, compact JSON: equal verdicts are equal bytes."""
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
        ).encode()


class ApplyAttempt(BaseModel):
    """One try at applying the patch: the command, its exit code and its output."""

    model_config = ConfigDict(frozen=True)

    method: str
    exit_code: int
    output: str


class Report(BaseModel):
    """A verdict with what led to it: written as ``report.json`` per evaluation."""

    model_config = ConfigDict(frozen=True)

    verdict: Verdict
    sandbox_id: str | None = None
    started_at: float
    durations: dict[str, float] = {}
    """Seconds per step: ``acquire``, ``apply``, ``tests``, ``total``."""
    apply_attempts: list[ApplyAttempt] = []
    test_exit_code: int | None = None
    test_output: str = ""
    """The test run's output (stdout and stderr as one stream)."""
    patch: str = ""
    renamed: dict[str, str] = {}
    """The names this run gave the listed tests (token -> the function's listed
    name): ``test_output`` holds the tokens; replace them to read it by the
    listed names (the verdict's results already are)."""
    canaries: dict[str, str] = {}
    """The canaries planted for this run: token -> what it was planted to do."""


def inputs_hash(instance: Instance, patch: str, conditions: Conditions, digest: str | None) -> str:
    """sha256 over everything a verdict depends on; a batch skips work whose hash it has graded."""
    payload = {
        "harness": HARNESS_VERSION,
        "instance": instance.model_dump(mode="json"),
        "patch": patch,
        "conditions": conditions.model_dump(mode="json"),
        "image_digest": digest,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def lookup(name: str, results: Mapping[str, TestStatus]) -> TestStatus:
    """``name``'s status; a name cut short inside its brackets takes the status of those it starts.

    SWE-bench Verified lists some parametrized ids truncated mid-parameter
    (``test_x[log(photon``); the official grading (``_resolve_case``) matches
    those by prefix when every match agrees on passing or not. So does this.
    """
    if name in results:
        return results[name]
    # "test_x (app.tests.Case)", as unittest named tests before Python 3.11, is
    # "test_x (app.tests.Case.test_x)" in a 3.11 log. SWE-bench's lists and logs
    # always agree, so this never changes one of its verdicts; our own instances'
    # lists then hold under either Python.
    if (old := _OLD_UNITTEST_NAME.match(name)) and (
        found := results.get(f"{old[1]} ({old[2]}.{old[1]})")
    ):
        return found
    if name.count("[") > name.count("]"):
        matches = [key for key in results if key.startswith(name)]
        if matches and len({results[key] in _PASSING for key in matches}) == 1:
            return results[matches[0]]
    return "MISSING"


def grade_tests(
    instance: Instance, results: dict[str, TestStatus], exit_code: int | None = None
) -> tuple[Status, str, dict[str, TestStatus], dict[str, TestStatus]]:
    """Resolved as the official SWE-bench grading (``swebench.harness.grading``, 5.x) decides.

    A FAIL_TO_PASS test must pass (PASSED or XFAIL); a PASS_TO_PASS test must
    pass or be skipped. A test not in the log fails. A log without results is
    unresolved, and so is one that reports no failure while the test command
    exited non-zero (``exit_code``, when known): the log is not the run's.
    """
    f2p = {t: lookup(t, results) for t in instance.FAIL_TO_PASS}
    p2p = {t: lookup(t, results) for t in instance.PASS_TO_PASS}
    if not results:
        return "unresolved", "no test results in the log", f2p, p2p
    if exit_code not in (None, 0) and not any(s in ("FAILED", "ERROR") for s in results.values()):
        return (
            "unresolved",
            f"the test command exited {exit_code} but its log reports no failure",
            f2p,
            p2p,
        )
    problems = []
    for label, tests, good in (("FAIL_TO_PASS", f2p, _PASSING), ("PASS_TO_PASS", p2p, _KEPT)):
        bad = [f"{name}: {status}" for name, status in tests.items() if status not in good]
        if bad:
            shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
            problems.append(f"{label} {len(bad)} of {len(tests)} not passing ({shown})")
    if problems:
        return "unresolved", ". ".join(problems), f2p, p2p
    return (
        "resolved",
        f"all {len(f2p)} FAIL_TO_PASS and {len(p2p)} PASS_TO_PASS tests pass",
        f2p,
        p2p,
    )
