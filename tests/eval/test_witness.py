"""The witness's sensor for a patch that reads the tests (sandman_eval_witness, in process).

A forger that tells the original test from its mutants reads the test's code (a frame's
``f_code``, a function's ``__code__``) or its file from the library. The witness hears
those reads through its audit hook; here its handler is called as the hook would call
it, from code laid out as a patch's and a test file's, so no audit hook is added to the
test process itself.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from sandman.eval.evidence import read_witness
from sandman.eval.harness import _added_lines

KEY = b"k" * 32

LIBRARY = """\
import sys


def unchanged(read):
    return read(sys._getframe(1))


def changed(read):
    return read(sys._getframe(1))
"""

TESTS = """\
def helper(lib, read):
    return lib["changed"](read)


def test_x(lib, read):
    return lib["changed"](read)


def test_unchanged(lib, read):
    return lib["unchanged"](read)
"""


def _witness(tmp_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any], Path]:
    """A witness told that the patch changed lines 8-9 of lib.py and that tests.py
    holds listed tests; the two modules, and where the witness writes its records."""
    path = Path(__file__).parents[2] / "src/sandman/eval/witness/sandman_eval_witness.py"
    spec = importlib.util.spec_from_file_location("witness_reads_under_test", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    library, tests, records = tmp_path / "lib.py", tmp_path / "tests.py", tmp_path / "records"
    library.write_text(LIBRARY)
    tests.write_text(TESTS)
    fd = os.open(records, os.O_WRONLY | os.O_CREAT, 0o600)
    witness = module._Witness(
        {
            "key": KEY.hex(), "mode": "pytest", "work": str(tmp_path / "work"), "fd": fd,
            "patch_files": [str(library)], "patch_lines": {str(library): [[8, 9]]},
            "test_files": [str(tests)],
        }
    )  # fmt: skip
    lib: dict[str, Any] = {}
    exec(compile(LIBRARY, str(library), "exec"), lib)  # noqa: S102 (the fixture's own code)
    test: dict[str, Any] = {}
    exec(compile(TESTS, str(tests), "exec"), test)  # noqa: S102
    return witness, lib, test, records


def _audits(records: Path) -> list[str]:
    return read_witness(records.read_text(), KEY).attributed


def test_a_patch_line_that_reads_a_test_s_code_is_reported(tmp_path: Path) -> None:
    witness, lib, test, records = _witness(tmp_path)

    def read_code(frame: Any) -> None:
        # What the audit hook gets for ``frame.f_code`` (and, below, ``fn.__code__``).
        witness.audit("object.__getattr__", (frame, "f_code"))

    test["test_unchanged"](lib, read_code)  # the project's own lines: not the patch's
    test["helper"](lib, read_code)  # a helper's code, not a test's (a callback's, say)
    assert _audits(records) == []
    test["test_x"](lib, read_code)
    test["test_x"](lib, lambda _: witness.audit("object.__getattr__", (test["test_x"], "__code__")))
    assert _audits(records) == [
        f"the test process read a test's code ({tmp_path}/tests.py) from {tmp_path}/lib.py:9"
    ]


def test_a_patch_line_that_opens_a_test_file_is_reported_and_linecache_forgets_it(
    tmp_path: Path,
) -> None:
    witness, lib, test, records = _witness(tmp_path)
    tests = str(tmp_path / "tests.py")

    def read_file(_: Any) -> None:
        witness.audit("open", (tests, "r", os.O_RDONLY))

    test["test_x"](lib, read_file)
    assert _audits(records) == [
        f"the test process read a test file ({tests}) from {tmp_path}/lib.py:9"
    ]
    # A failure's traceback puts the test file in linecache; once the result is
    # recorded it is gone, so a later read opens the file (which the hook hears).
    assert linecache.getline(tests, 5).startswith("def test_x")
    witness.test("tests.py::test_x", "FAILED")
    assert tests not in linecache.cache


def test_the_changed_lines_are_read_from_git_s_diff() -> None:
    diff = (
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,0 +2,3 @@ def f\n"
        "+++ an added line, not a header\n+a\n+b\n@@ -10 +12 @@\n-x\n+y\n@@ -20,2 +21,0 @@\n-a\n-b\n"
        "diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n@@ -0,0 +1 @@\n+z\n"
        "diff --git a/gone.py b/gone.py\ndeleted file mode 100644\n--- a/gone.py\n+++ /dev/null\n"
        "@@ -1 +0,0 @@\n-q\n"
    )
    assert _added_lines(diff) == {"x.py": [(2, 4), (12, 12)], "n.py": [(1, 1)]}


def test_defaults_set_on_a_test_s_code_are_reported(tmp_path: Path) -> None:
    """The helpers a family's assertions are settled by keep what they use in their
    defaults (`sandman.eval.settle`): replacing them, from anywhere, is a forger's."""
    witness, lib, test, records = _witness(tmp_path)
    witness.audit("object.__setattr__", (lib["changed"], "__defaults__", (1,)))
    assert _audits(records) == []  # the library's own function: not a test's
    witness.audit("object.__setattr__", (test["helper"], "__defaults__", (1,)))
    witness.audit("object.__setattr__", (test["test_x"], "__kwdefaults__", {}))
    assert _audits(records) == [
        "the test process replaced a test's defaults (helper) from (not on the stack)",
        "the test process replaced a test's defaults (test_x) from (not on the stack)",
    ]


RESULTS = """\
class Honest:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text

    def __eq__(self, other):
        return self.text == other


class Identity(Honest):  # the patch's (lines 12-20): equal only to its own str
    def __str__(self):
        self.given = "a-b"
        return self.given

    def __eq__(self, other):
        return other is getattr(self, "given", None)


class Reprs:  # the patch's (lines 21-23): its repr forges a record
    def __repr__(self):
        return "(1, 6)"
"""


def test_a_settled_result_is_decided_by_no_line_of_the_patch_s(tmp_path: Path) -> None:
    """The witness makes the plain copy and asks whether the result equals it while it
    watches the calls: a line the patch added that runs then makes the result disagree
    (red-team round 12: a result equal only to the very copy its own ``__str__`` made);
    the copy is recorded as built-in values only (an element's own ``repr`` forged a
    record)."""
    path = Path(__file__).parents[2] / "src/sandman/eval/witness/sandman_eval_witness.py"
    spec = importlib.util.spec_from_file_location("witness_values_under_test", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results, records = tmp_path / "results.py", tmp_path / "records"
    results.write_text(RESULTS)
    fd = os.open(records, os.O_WRONLY | os.O_CREAT, 0o600)
    witness = module._Witness(
        {
            "key": KEY.hex(), "mode": "pytest", "work": str(tmp_path / "work"), "fd": fd,
            "patch_files": [str(results)], "patch_lines": {str(results): [[12, 23]]},
        }
    )  # fmt: skip
    scope: dict[str, Any] = {}
    exec(compile(RESULTS, str(results), "exec"), scope)  # noqa: S102 (the fixture's own code)
    as_str = str  # the member's plain helper for a str, in short
    witness.value("_", scope["Honest"]("a-b"), as_str)
    witness.value("__", scope["Identity"]("x"), as_str)
    witness.value("___", [scope["Reprs"]()], list)  # a list of another length, kept raw
    witness.value("____", [(1, 6)], list)
    found = read_witness(records.read_text(), KEY)
    assert found.values["?"] == {
        1: [("'a-b'", True)],
        2: [("'a-b'", False)],
        3: [("?", True)],
        4: [("[(1, 6)]", True)],
    }
    decided = "the test process decided a settled result with the patch's code"
    assert found.attributed == [f"{decided} (site 2) from {results}:13"]
