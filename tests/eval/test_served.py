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


def _run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "lib.py").write_text(LIBRARY)
    test = repo / "test_t.py"
    test.write_text(STUB)
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
        "test_files": [str(test)], "planted": {str(test): PLANTED},
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
