"""The log parsers read only the framework's own report, whatever else the log holds."""

from __future__ import annotations

from sandman.eval import parse_log

PYTEST_LOG = """\
============================= test session starts ==============================
platform linux -- Python 3.11.2, pytest-7.2.1, pluggy-1.0.0+repack
collected 5 items

tests/test_stats.py ...Fs                                                [100%]

=================================== FAILURES ===================================
_______________________________ test_median_even _______________________________
E       assert 3 == 2.5
==================================== PASSES ====================================
____________________________ test_mean ____________________________
----------------------------- Captured stdout call -----------------------------
PASSED tests/test_stats.py::test_median_even
=========================== short test summary info ============================
PASSED tests/test_stats.py::test_mean
PASSED tests/test_stats.py::test_param[a b - c]
XFAIL tests/test_stats.py::test_known - reason: not yet
SKIPPED [1] tests/test_stats.py:30: no network
FAILED tests/test_stats.py::test_median_even - assert 3 == 2.5
ERROR tests/test_stats.py::test_fixture - RuntimeError: boom
========= 1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error in 0.07s ===========
==================== short test summary info ====================
PASSED tests/test_stats.py::test_median_even
==================== 4 passed in 0.01s ====================
"""


def test_pytest_reads_the_first_summary_only() -> None:
    # A test's captured output before the summary and a fake summary printed
    # after the run (atexit) both claim test_median_even passed: neither counts.
    # SWE-bench's parse_log_pytest ends a name at its first space; pytest_v2 does not.
    assert parse_log("pytest", PYTEST_LOG) == {
        "tests/test_stats.py::test_mean": "PASSED",
        "tests/test_stats.py::test_param[a": "PASSED",
        "tests/test_stats.py::test_known": "XFAIL",
        "tests/test_stats.py::test_median_even": "FAILED",
        "tests/test_stats.py::test_fixture": "ERROR",
    }


def test_pytest_v2_keeps_whole_names() -> None:
    results = parse_log("pytest_v2", PYTEST_LOG)
    assert results["tests/test_stats.py::test_param[a b - c]"] == "PASSED"
    assert results["tests/test_stats.py::test_median_even"] == "FAILED"
    # Read as SWE-bench reads a log, every line counts: the fake summary after the run wins.
    assert parse_log("pytest", PYTEST_LOG, strict=False)[
        "tests/test_stats.py::test_median_even"
    ] == ("PASSED")


def test_pytest_without_rA_falls_back_to_verbose_lines() -> None:
    log = (
        # -vv -o console_output_style=classic (old astropy): no percentages.
        "tests/test_a.py::test_one PASSED\n"
        "tests/test_a.py::test_two FAILED\n"
        "=================== 1 failed, 1 passed in 0.02s ===================\n"
        "tests/test_a.py::test_two PASSED\n"
    )
    # As parse_log_pytest_v2 reads them (parse_log_pytest reads none).
    assert parse_log("pytest_v2", log) == {
        "tests/test_a.py::test_one": "PASSED",
        "tests/test_a.py::test_two": "FAILED",
    }
    assert parse_log("pytest", log) == {}


UNITTEST_LOG = """\
test_accents (tests.test_slug.SlugifyTest.test_accents) ... ok
test_chatty (tests.test_slug.SlugifyTest.test_chatty) ... some output
more output
FAIL
test_documented (tests.test_slug.SlugifyTest.test_documented)
Slugs are lower case. ... ok
test_old_style (tests.test_slug.SlugifyTest) ... ERROR
test_skipped (tests.test_slug.SlugifyTest.test_skipped) ... skipped 'no locale'
test_known (tests.test_slug.SlugifyTest.test_known) ... expected failure
test_lucky (tests.test_slug.SlugifyTest.test_lucky) ... unexpected success

======================================================================
FAIL: test_chatty (tests.test_slug.SlugifyTest.test_chatty)
----------------------------------------------------------------------
test_accents (tests.test_slug.SlugifyTest.test_accents) ... FAIL
----------------------------------------------------------------------
Ran 7 tests in 0.001s

FAILED (failures=1, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""


def test_unittest_names_are_stable_across_python_versions() -> None:
    # 3.11+ prints (module.Class.method), older versions (module.Class): both
    # become "method (module.Class)". The failure report's lines do not count.
    assert parse_log("unittest", UNITTEST_LOG) == {
        "test_accents (tests.test_slug.SlugifyTest)": "PASSED",
        "test_chatty (tests.test_slug.SlugifyTest)": "FAILED",
        "test_documented (tests.test_slug.SlugifyTest)": "PASSED",
        "test_old_style (tests.test_slug.SlugifyTest)": "ERROR",
        "test_skipped (tests.test_slug.SlugifyTest)": "SKIPPED",
        "test_known (tests.test_slug.SlugifyTest)": "XFAIL",
        "test_lucky (tests.test_slug.SlugifyTest)": "FAILED",
    }


def test_the_unittest_runners_failure_report_overrules_an_ok_printed_by_the_code() -> None:
    # slugify() printed "ok" (and a newline) right after the runner wrote the test's
    # name; the runner's own FAIL line then stands alone, and its report names it.
    log = (
        "test_fine (tests.test_slug.SlugifyTest) ... ok\n"
        "test_punct (tests.test_slug.SlugifyTest) ... ok\n"
        "FAIL\n"
        "test_spaces (tests.test_slug.SlugifyTest) ... ok\n"
        "\n" + "=" * 70 + "\n"
        "FAIL: test_punct (tests.test_slug.SlugifyTest.test_punct)\n" + "-" * 70 + "\n"
        "Traceback (most recent call last):\n"
        "AssertionError: 'a--b' != 'a-b'\n" + "-" * 70 + "\n"
        "Ran 3 tests in 0.001s\n\nFAILED (failures=1)\n"
    )
    assert parse_log("unittest", log) == {
        "test_fine (tests.test_slug.SlugifyTest)": "PASSED",
        "test_punct (tests.test_slug.SlugifyTest)": "FAILED",
        "test_spaces (tests.test_slug.SlugifyTest)": "PASSED",
    }


DJANGO_LOG = """\
Testing against Django installed in '/testbed/django' with up to 2 processes
Importing application queries
Found 3 test(s).
Creating test database for alias 'default'...
Operations to perform:
  Apply all migrations: admin, sites
Running migrations:
  Applying admin.0001_initial... OK
System check identified no issues (1 silenced).
test_exists (queries.tests.ExistsTests) ... ok
test_ticket_24605 (queries.tests.Ticket23605Tests)
Subquery table names should be quoted. ... FAIL
test_slow (queries.tests.SlowTests) ... skipped 'slow'

======================================================================
FAIL: test_ticket_24605 (queries.tests.Ticket23605Tests)
----------------------------------------------------------------------
Ran 3 tests in 0.105s

FAILED (failures=1, skipped=1)
Destroying test database for alias 'default'...
"""


def test_django_runner() -> None:
    # A test with a docstring is named by its first line, as SWE-bench's lists name it;
    # the report's "FAIL: test_x (...)" header adds the method's name alone.
    assert parse_log("django", DJANGO_LOG) == {
        "test_exists (queries.tests.ExistsTests)": "PASSED",
        "Subquery table names should be quoted.": "FAILED",
        "test_ticket_24605 (queries.tests.Ticket23605Tests)": "FAILED",
        "test_ticket_24605": "FAILED",
        "test_slow (queries.tests.SlowTests)": "SKIPPED",
    }


def test_djangos_failure_report_overrules_an_ok_printed_by_the_code() -> None:
    log = (
        "test_fine (app.tests.T) ... ok\n"
        "test_punct (app.tests.T) ... ok\n"  # the code printed " ok\n"
        "FAIL\n"
        "\n" + "=" * 70 + "\n"
        "FAIL: test_punct (app.tests.T)\n" + "-" * 70 + "\n"
        "Ran 2 tests in 0.001s\n\nFAILED (failures=1)\n"
        "test_punct (app.tests.T) ... ok\n"
    )
    assert parse_log("django", log) == {
        "test_fine (app.tests.T)": "PASSED",
        "test_punct (app.tests.T)": "FAILED",
        "test_punct": "FAILED",
    }
    # SWE-bench's rules alone take the printed "ok".
    assert parse_log("django", log, strict=False)["test_punct (app.tests.T)"] == "PASSED"


def test_an_empty_log_has_no_results() -> None:
    assert parse_log("pytest", "") == {}
    assert parse_log("unittest", "") == {}
