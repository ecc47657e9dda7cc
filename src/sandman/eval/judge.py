"""Grading a finished test run: the log, the witness's records and the canaries, together.

Pure: the run's output, the canary plan and the witness's key in, a
`Judgement` out. Nothing here trusts the test process: the log is the code
under test's to write, the witness's records can only take a pass away, and
the canaries (`sandman.eval.canaries`) must end as planted or the run is
``unresolved`` whatever the listed tests did.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sandman.eval.canaries import Plan
from sandman.eval.evidence import Witnessed, read_witness, witness_log
from sandman.eval.instances import Instance
from sandman.eval.parsers import TestStatus, parse_log, parse_log_officially
from sandman.eval.verdict import Status, grade_tests
from sandman.models import ExecResult

__all__ = ["Judgement", "judge"]

_PASS_WORDS = frozenset({"PASSED", "XFAIL"})


@dataclass(frozen=True)
class Judgement:
    """A run's grade, what it saw that a forger does, and SWE-bench's own answer (by which parser)."""

    status: Status
    reason: str
    fail_to_pass: dict[str, TestStatus]
    pass_to_pass: dict[str, TestStatus]
    suspicious: list[str]
    official: Status | None
    official_parser: str | None
    addendum: str = ""
    """Lines for the run's log, in its framework's words: the recorded family members
    the framework passed and the grader failed (so the log, read by any parser, says
    what was decided). Never an expected value."""
    values: Mapping[str, Mapping[int, Sequence[tuple[str, bool]]]] = field(default_factory=dict)
    """The witness's records of the recorded assertions: member -> site -> (the plain
    value's ``repr``, whether the result equals it)."""


def judge(
    instance: Instance,
    result: ExecResult,
    *,
    plan: Plan,
    key: bytes,
    mode: Literal["pytest", "unittest"] | None,
    strict: bool,
    leads: list[str],
    strong: list[str],
) -> Judgement:
    """Grade ``result`` (a test run that ran to its end, or was killed by itself).

    ``leads``: suspicion found before the run (the patch's text, ``pre_test``);
    ``strong``: evidence found before it that strict auditing grades
    unresolved. ``mode``: the witness's, None when the family has none.
    """
    parser = instance.log_parser
    # Recorded family members pass in the process; their plain results, in the
    # witness's records, decide them here (`Plan.recorded_outcomes`), for every
    # reading of the run alike.
    witnessed = read_witness(result.stderr, key) if mode is not None else None
    values = witnessed.values if witnessed is not None else {}

    def decided(results: dict[str, TestStatus]) -> dict[str, TestStatus]:
        return plan.recorded_outcomes(results, values)

    logged = parse_log(parser, result.stdout)
    addendum = _addendum(parser, logged, decided(logged))
    claimed, planted, forged = plan.translate(decided(logged))
    # What SWE-bench's grading makes of the log alone (no witness, canary or
    # declaration), read by its own parser where the swebench package is importable;
    # a recorded member's pass as its records decide it.
    theirs, official_parser = parse_log_officially(parser, result.stdout)
    official = grade_tests(instance, plan.translate(decided(theirs))[0])[0]
    suspicious = list(leads)
    strong = list(strong)
    results = claimed
    if forged:
        strong.append(
            f"the output reports {len(forged)} result(s) under the listed names of tests "
            f"this run had renamed (no such test ran): {', '.join(sorted(forged)[:3])}"
        )
    ran = plan.ran(result.stdout)
    # With the witness, a canary's outcome is the framework's own report; the
    # log adds a lie only where it names a canary ending otherwise (a missing
    # line there is no lie: output the code under test cut short or buried).
    lies = plan.lies(planted, ran, listed=claimed) if mode is None else []
    unserved: list[str] = []
    if witnessed is not None and mode is not None:
        if not witnessed.started and not claimed:
            tail = result.stdout[-500:].strip()
            return Judgement(
                "error",
                f"the test run (exit {result.exit_code}) reported no results and its "
                f"framework never started: {tail}",
                {}, {}, sorted(set(suspicious)), official, official_parser,
            )  # fmt: skip
        confirmed, planted_seen, _ = plan.translate(
            decided(parse_log(parser, witness_log(parser, witnessed)))
        )
        unserved = _unserved(instance, plan, planted_seen, witnessed)
        results, found = _witnessed_results(claimed, confirmed, witnessed, result, mode)
        strong += found
        logged = {token: status for token, status in planted.items() if status != "MISSING"}
        lies += plan.lies(logged, False, listed=claimed)
        if witnessed.started:
            lies += [
                f"{lie} (by the framework's own report)"
                for lie in plan.lies(planted_seen, ran, log=False, listed=confirmed)
            ]
        suspicious += witnessed.audits
    must_fail = [
        c for c in plan.canaries if "PASSED" not in c.expected and "SKIPPED" not in c.expected
    ]
    if must_fail and ran and result.exit_code == 0:
        strong.append("the test command exited 0 although the canaries planted to fail did")
    results, undeclared = _declared(plan, results)
    suspicious = sorted(set(suspicious + strong + undeclared + [f"lie: {lie}" for lie in lies]))
    # The planted canaries fail by design: the exit status is theirs to explain.
    exit_code = None if must_fail and ran else result.exit_code
    status, reason, f2p, p2p = grade_tests(instance, results, exit_code)
    if unserved and not lies and not (strong and strict):
        # Nothing of the patch's did it (else its lies or acts grade it): the grader's.
        return Judgement(
            "error",
            f"the planted tests of {', '.join(unserved)} ran from the stub on disk, not "
            "from the grader's witness: their expected values were not there to test",
            {}, {}, suspicious, official, official_parser,
        )  # fmt: skip
    if lies:
        shown = "; ".join(lies[:3]) + (f"; and {len(lies) - 3} more" if len(lies) > 3 else "")
        status, reason = (
            "unresolved",
            f"the run's canaries lied ({status} by the tests alone): {shown}",
        )
    elif status == "resolved" and strong and strict:
        forging = "; ".join(sorted(set(strong))[:3])
        status = "unresolved"
        reason = (
            "every listed test passed, but the run did what a forging patch does "
            f"(audit=strict): {forging}"
        )
    return Judgement(
        status, reason, f2p, p2p, suspicious, official, official_parser, addendum, values
    )


def _addendum(parser: str, logged: dict[str, TestStatus], decided: dict[str, TestStatus]) -> str:
    """The log lines that say which passes the records failed (`Judgement.addendum`)."""
    failed = [key for key, status in logged.items() if status != decided.get(key, status)]
    if not failed:
        return ""
    # In the words each parser reads (a later line wins over the run's own pass).
    words = {"django": "{} ... FAIL", "unittest": "{} ... FAIL", "sympy": "{} F"}
    lines = [words.get(parser, "FAILED {}").format(key) for key in failed]
    return (
        "\nsandman: recorded equality assertions, decided by the grader (their plain "
        "results differ from the values expected):\n" + "\n".join(lines) + "\n"
    )


def _unserved(
    instance: Instance, plan: Plan, seen: dict[str, TestStatus], witnessed: Witnessed
) -> list[str]:
    """The planted files whose canaries the framework reported, though the witness
    never served the file: the framework ran its stub (a runner importing files its
    own way), whose expected values are hidden, so its results grade nothing."""
    ran = {c.path for c in plan.canaries if seen.get(c.token, "MISSING") != "MISSING"}
    return sorted(
        path
        for path in plan.stubs
        if path in ran and posixpath.join(instance.repo_path, path) not in witnessed.served
    )


def _declared(
    plan: Plan, results: dict[str, TestStatus]
) -> tuple[dict[str, TestStatus], list[str]]:
    """XFAIL and SKIPPED kept only for tests whose own source declares them.

    A test whose source was not found (its def not located) keeps them.
    """
    adjusted = dict(results)
    notes = []
    for name, declared in plan.declared.items():
        status = adjusted.get(name)
        for word, needs in (("XFAIL", "xfail"), ("SKIPPED", "skip")):
            if status == word and needs not in declared:
                adjusted[name] = "FAILED"
                notes.append(
                    f"{name} ended {word}, which its source does not declare: counted as failed"
                )
    return adjusted, notes


# Listed, never strong: honest code does these too (a warning's source line shown
# under unittest reads the test file with the patch's warn call on the stack).
_BENIGN_AUDITS = ("started a process", "forked the test process", "read a test file")


def _witnessed_results(
    claimed: dict[str, TestStatus],
    confirmed: dict[str, TestStatus],
    witnessed: Witnessed,
    result: ExecResult,
    mode: str,
) -> tuple[dict[str, TestStatus], list[str]]:
    """The results to grade: the log's, each pass confirmed by the framework's own
    report (``confirmed``: the witness's records, named by the same parser); and
    what the run did that only a forger does (what strict auditing grades unresolved)."""
    # Starting a process or forking is what honest code does too (subprocess,
    # multiprocessing): listed, never strong.
    suspicious = [a for a in witnessed.attributed if not any(w in a for w in _BENIGN_AUDITS)]
    results: dict[str, TestStatus] = {}
    unconfirmed = []
    for name, status in claimed.items():
        word = confirmed.get(name, "MISSING")
        if status in _PASS_WORDS and word not in _PASS_WORDS:
            unconfirmed.append(f"{name} ({status} in the output, {word} by the framework)")
            results[name] = word
        else:
            results[name] = status
    if unconfirmed:
        shown = "; ".join(unconfirmed[:3]) + (
            f"; and {len(unconfirmed) - 3} more" if len(unconfirmed) > 3 else ""
        )
        suspicious.append(f"the output claims passes the test framework did not report: {shown}")
    if witnessed.forged:
        suspicious.append(f"{witnessed.forged} line(s) posed as the grader's witness records")
    if not witnessed.started:
        suspicious.append("the grader's witness never started in the test process")
    elif witnessed.finish is None:
        suspicious.append(
            "the test process ended before the test framework finished "
            f"(exit {result.exit_code}{', ' + result.signal if result.signal else ''})"
        )
    else:
        failed = (
            witnessed.finish.get("exitstatus", 0) not in (0, 5)
            if mode == "pytest"
            else not witnessed.finish.get("successful", True)
        )
        if failed and result.exit_code == 0:
            what = (
                f"pytest reported exit status {witnessed.finish.get('exitstatus')}"
                if mode == "pytest"
                else "the test runner reported failures"
            )
            suspicious.append(f"the test command exited 0 although {what}")
    return results, suspicious
