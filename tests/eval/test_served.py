"""The planted test file reaches the framework from the witness's memory, not from disk.

A real pytest process, started as the harness starts it (the witness from
``sitecustomize``, its plugin by ``-p``, a one-time configuration beside it): the
file on disk is the stub, whose expected value is hidden; the planted text is in
the configuration only. The tests below run inside it, with a "patch" (``lib.py``,
every line of it the patch's) that tries what round 8 of heldout/ did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sandman.eval.evidence import read_witness

KEY = b"w" * 32
WITNESS = Path(__file__).parents[2] / "src/sandman/eval/witness"

LIBRARY = """\
import os
import subprocess
import threading


def value():
    return 17


def child_reads(path):
    return subprocess.run(["cat", path], capture_output=True, text=True).stdout


def fork_reads_code(function):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            function.__code__
            os.write(write, b"read")
        except RuntimeError:
            os.write(write, b"refused")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    return os.read(read, 100).decode()


def on_a_thread(function):
    thread = threading.Thread(target=function)
    thread.start()
    thread.join()


def call(function):
    function()


def code_of(function):
    return function.__code__


def code_on_a_thread(function):
    import operator

    thread = threading.Thread(target=operator.attrgetter("__code__"), args=(function,))
    thread.start()
    thread.join()
"""

PLANTED = """\
import lib


def test_served():
    assert lib.value() == 17


def test_a_child_reads_the_stub():
    text = lib.child_reads(__file__)
    assert "def test_served" in text
    assert str(16 + 1) not in text


def test_a_fork_may_not_read_a_test_s_code():
    assert lib.fork_reads_code(test_served) == "refused"
"""
STUB = PLANTED.replace("== 17", "== (...)")

# A family member as `sandman.eval.settle` writes it: its first line reads a helper's
# code, which tells the witness the member started.
MEMBER = """\
import lib


def test_member():
    _h = lambda v: v; _h.__code__
    assert lib.value() == 17


def test_calls_the_member_on_a_thread():
    lib.on_a_thread(test_member)


def test_calls_the_member():
    lib.call(test_member)


def test_a_library_reads_a_lambda_s_code():
    _h = lambda v: v  # a lambda of the test file, named as a marker but not a member's
    assert lib.code_of(_h) is not None
    assert lib.code_of(lambda: 0) is not None
"""


def _run(
    tmp_path: Path, planted: str = PLANTED, stub: str = STUB
) -> tuple[subprocess.CompletedProcess[str], Path]:
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "lib.py").write_text(LIBRARY)
    test = repo / "test_t.py"
    test.write_text(stub)
    module = "_smwitness0test"
    (work / f"{module}.py").write_text((WITNESS / "sandman_eval_witness.py").read_text())
    site = (WITNESS / "sitecustomize.py").read_text().replace("sandman_eval_witness", module)
    (work / "sitecustomize.py").write_text(site)
    records = tmp_path / "records"
    fd = os.open(records, os.O_WRONLY | os.O_CREAT, 0o600)
    config = {
        "key": KEY.hex(), "mode": "pytest", "work": str(work), "fd": fd,
        "argv_contains": ["pytest"], "framework_paths": ["/_pytest/", "/pluggy/"],
        "patch_files": [str(repo / "lib.py")],
        "patch_lines": {str(repo / "lib.py"): [[1, LIBRARY.count("\n")]]},
        "test_files": [str(test)], "planted": {str(test): planted}, "markers": ["_h"],
    }  # fmt: skip
    (work / "sandman-witness.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", module, "-p", "no:cacheprovider", "-q",
             "-rA", "test_t.py"],
            cwd=repo, env=env, capture_output=True, text=True, timeout=120, pass_fds=(fd,),
            check=False,
        )  # fmt: skip
    finally:
        os.close(fd)
    return done, records


def test_the_framework_runs_the_planted_code_and_the_disk_holds_the_stub(tmp_path: Path) -> None:
    done, records = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert not (tmp_path / "work" / "sandman-witness.json").exists()  # taken and deleted
    assert (tmp_path / "repo" / "test_t.py").read_text() == STUB
    witnessed = read_witness(records.read_text(), KEY)
    assert witnessed.served == {str(tmp_path / "repo" / "test_t.py")}
    assert witnessed.statuses  # the framework's own word, as ever
    # The patch's child process and its fork were not a forger's acts the parent saw.
    assert not [a for a in witnessed.attributed if "test's code" in a], witnessed.attributed


def test_without_the_witness_the_stub_runs_and_fails(tmp_path: Path) -> None:
    """The stub on its own is Python whose expected value is hidden: run as it lies on
    disk (a child of the run's, a runner around the witness), its test fails."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib.py").write_text(LIBRARY)
    (repo / "test_t.py").write_text(STUB)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_t.py",
         "-k", "served"],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "1 failed" in done.stdout, done.stdout
    assert "assert lib.value() == (...)" in done.stdout  # the stub's line, as shown


def test_a_member_run_by_anything_but_the_framework_is_reported(tmp_path: Path) -> None:
    """A member called by the code under test (on a thread of its own, or from its own
    lines) is an oracle for the values the code tries: the witness names it, so
    strict auditing grades the run unresolved. The framework's own run is not named,
    nor the library's reading a lambda's code (toolz's ``curry`` does)."""
    done, records = _run(tmp_path, MEMBER, MEMBER.replace("== 17", "== (...)"))
    assert "4 passed" in done.stdout, done.stdout + done.stderr
    lib = tmp_path / "repo" / "lib.py"
    line = LIBRARY.splitlines().index("    function()") + 1
    outside = "(outside the framework)"
    said = "the test process ran a test outside the test framework (test_member while"
    assert sorted(read_witness(records.read_text(), KEY).attributed) == [
        f"{said} the framework ran test_calls_the_member) from {lib}:{line}",
        f"{said} the framework ran test_calls_the_member_on_a_thread) from {outside}",
    ]


THREAD = """\
import lib


def test_x():
    pass


def test_reads_on_a_thread():
    lib.code_on_a_thread(test_x)
"""


def test_a_test_s_code_read_on_a_thread_of_its_own_is_the_patch_s(tmp_path: Path) -> None:
    """A reader on another thread (a pool worker, a thread whose target is C) shows no
    line of the patch's on its stack: there the read is taken as the patch's (round 9
    of heldout/ read the family's values so)."""
    done, records = _run(tmp_path, THREAD, THREAD)
    assert "2 passed" in done.stdout, done.stdout + done.stderr
    test = tmp_path / "repo" / "test_t.py"
    assert read_witness(records.read_text(), KEY).attributed == [
        f"the test process read a test's code ({test}) from (a thread of its own)"
    ]
