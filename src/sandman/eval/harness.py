"""`evaluate`: grade one patch on one instance in a fresh sandbox, by the SWE-bench harness's rules.

The steps, each a command in the sandbox (never in the agent's):

1. check out ``base_commit``;
2. apply the patch with ``git apply``, else ``git apply --3way``, else
   ``patch --fuzz``, setting the tree back between tries;
3. set back the protected paths the patch changed (`is_protected`: the test
   patch's files and the test directories holding them, pytest's
   configuration files, ``conftest.py``, ``sitecustomize.py``, package
   metadata, the instance's own globs) and every file the image held that
   git does not track (build output, ``pip install -e`` metadata), then
   check out the test files at ``base_commit`` and apply the test patch;
4. run the test command under the wall-clock limit, between start and end
   markers that carry a random nonce, and parse what is between them.

A run cut short is reported as what cut it short (``timeout``, ``oom``,
``sandbox_died``), never as failed tests, and nothing is retried. An OOM kill
is told from any other SIGKILL by the sandbox's own cgroup counter
(``oom_kill``): a test run that kills itself is graded on what it printed.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import posixpath
import re
import secrets
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sandman import errors
from sandman.client import AsyncClient, AsyncSandbox
from sandman.eval.conditions import Conditions
from sandman.eval.instances import Instance
from sandman.eval.parsers import TestStatus, parse_log
from sandman.eval.verdict import ApplyAttempt, Report, Status, Verdict, grade_tests, inputs_hash
from sandman.images import ImageStore
from sandman.models import ExecResult, SandboxSpec

__all__ = [
    "DEFAULT_PROTECTED",
    "evaluate",
    "evaluate_report",
    "git_paths",
    "is_protected",
    "pin_image",
]

logger = logging.getLogger(__name__)

DEFAULT_PROTECTED = (
    "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
    "sitecustomize.py", "usercustomize.py",
)  # fmt: skip
"""File names a model patch may not add or change anywhere in the repository.

pytest reads its configuration (``addopts``, ``-p`` plugins, warning filters)
from all of the ``.ini``, ``.cfg`` and ``.toml`` ones; the test run never
reinstalls the package, so their other contents cannot matter to it.
"""
# Directories of package metadata: an entry point in one on sys.path (the
# repository root is) makes pytest load a plugin by itself.
_METADATA_DIRS = (".dist-info", ".egg-info")

_WORK = "/tmp/sandman-eval"  # outside the repository: a patch cannot reach it
# A pytest plugin the harness adds (-p): it marks where pytest's own short test
# summary begins, after every section that can carry the tests' output, so a
# test that prints a summary of its own (pytest's pytester does, and so can a
# tampering patch) cannot stand in for the real one.
_SUMMARY_PLUGIN = "sandman_eval_summary"
_SUMMARY_PLUGIN_SOURCE = """\
import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(os.environ["SANDMAN_EVAL_SUMMARY_MARK"])
"""
_STEP_TIMEOUT = 300.0  # for git and patch; the test run has the conditions' limit
_MAX_OUTPUT = 32 * 2**20
# No hooks and no fsmonitor command, whatever the repository's config says.
_GIT = ("git", "-c", "safe.directory=*", "-c", "core.quotepath=off",
        "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")  # fmt: skip
_PATCH_PATH = re.compile(
    r"^(?:diff --git a/(\S+) b/(\S+)|(?:---|\+\+\+) (?:[ab]/)?(\S+))", re.MULTILINE
)
_APPLY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("git apply", (*_GIT, "apply", "--verbose")),
    ("git apply --3way", (*_GIT, "apply", "--verbose", "--3way")),
    ("patch --fuzz", ("patch", "--batch", "--fuzz=5", "-p1", "--no-backup-if-mismatch", "-i")),
)
_TEST_DIRS = frozenset({"test", "tests", "testing"})
_KILLED = 128 + 9  # what a shell reports for a child killed by SIGKILL
# The sandbox's cgroup as it sees it (read-only): v2, then v1. Kernel-kept, so
# the code under test cannot fake it.
_OOM_KILLS = "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null"
_OOM_KILL_LINE = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


async def pin_image(image: str, images: ImageStore | None) -> tuple[str, str | None]:
    """The reference to run and the digest to record for ``image``.

    With a local image store, the name is resolved to the image's id and the
    sandbox is made from that id, so the recorded digest is what ran. Without
    one, a reference that carries a digest (``name@sha256:...``, ``sha256:...``)
    records it; a bare name records none.
    """
    if images is not None:
        found = await images.get(image)
        return found.id, found.id
    if "@sha256:" in image:
        return image, image.rsplit("@", 1)[1]
    if image.startswith("sha256:"):
        return image, image
    return image, None


def is_protected(instance: Instance, path: str) -> bool:
    """Whether a model patch's change to ``path`` is set back before the tests run.

    Protected: the test patch's files; everything under a test directory
    (``test``, ``tests``, ``testing``, ``test_*``) holding one of them; the
    `DEFAULT_PROTECTED` names anywhere; everything in a ``*.dist-info`` or
    ``*.egg-info`` directory and ``*.pth`` files; the instance's ``protected``
    globs.
    """
    name = posixpath.basename(path)
    if path in instance.test_files or name in DEFAULT_PROTECTED or name.endswith(".pth"):
        return True
    if any(part.endswith(_METADATA_DIRS) for part in path.split("/")[:-1]):
        return True
    for test_file in instance.test_files:
        parts = test_file.split("/")[:-1]
        # The outermost test directory: tests/ for tests/queries/tests.py.
        for depth, name in enumerate(parts, start=1):
            if name in _TEST_DIRS or name.startswith("test_"):
                if path.startswith("/".join(parts[:depth]) + "/"):
                    return True
                break
    return any(fnmatch.fnmatchcase(path, glob) for glob in instance.protected)


def git_paths(patch: str) -> list[str]:
    """The paths inside ``.git`` a patch names (``patch`` would write there; ``git apply`` not).

    A patch that may touch the repository's own database (refs, replace
    objects, config, hooks) could change what the harness checks out, so it
    is refused.
    """
    found = []
    for match in _PATCH_PATH.finditer(patch):
        for path in filter(None, match.groups()):
            if ".git" in path.split("/") and path not in found:
                found.append(path)
    return found


@dataclass(frozen=True)
class _Snapshot:
    """The work tree at one moment: a git tree object and the paths in it."""

    tree: str
    paths: frozenset[str]


class _Abort(Exception):
    """Ends the grading early with this status and reason."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Evaluation:
    """One evaluation's state: what it tried, saw and decided."""

    def __init__(self, instance: Instance, patch: str, conditions: Conditions, model: str) -> None:
        self.instance = instance
        self.patch = patch
        self.conditions = conditions
        self.model = model
        self.ref = instance.image
        self.digest: str | None = None
        self.step = "start"
        self.started_at = time.time()
        self.durations: dict[str, float] = {}
        self.attempts: list[ApplyAttempt] = []
        self.applied_with: str | None = None
        self.reverted: list[str] = []
        self.sandbox_id: str | None = None
        self.test_output = ""
        self.test_exit_code: int | None = None
        self._summary_mark: str | None = None
        self._oom_kills: tuple[int | None, int | None] = (None, None)
        self._snapshotted = False

    def report(
        self,
        status: Status,
        reason: str,
        f2p: dict[str, TestStatus] | None = None,
        p2p: dict[str, TestStatus] | None = None,
    ) -> Report:
        verdict = Verdict(
            instance_id=self.instance.instance_id,
            model=self.model,
            status=status,
            reason=reason,
            applied_with=self.applied_with,
            reverted=self.reverted,
            fail_to_pass=f2p or {},
            pass_to_pass=p2p or {},
            image=self.instance.image,
            image_digest=self.digest,
            conditions=self.conditions,
            inputs_hash=inputs_hash(self.instance, self.patch, self.conditions, self.digest),
        )
        self.durations["total"] = round(time.time() - self.started_at, 3)
        return Report(
            verdict=verdict,
            sandbox_id=self.sandbox_id,
            started_at=self.started_at,
            durations=self.durations,
            apply_attempts=self.attempts,
            test_exit_code=self.test_exit_code,
            test_output=self.test_output,
            patch=self.patch,
        )

    async def run(self, pool: AsyncClient, acquire_timeout: float) -> Report:
        if not self.patch.strip():
            return self.report("patch_failed", "the patch is empty")
        if touched := git_paths(self.patch):
            return self.report("patch_failed", f"the patch touches .git: {', '.join(touched)}")
        spec = SandboxSpec(
            image=self.ref,
            cpu=self.conditions.cpu,
            memory=self.conditions.memory,
            pids=self.conditions.pids,
            network=self.conditions.network,
            env=dict(self.conditions.env),
        )
        self.step = "acquire"
        begun = time.monotonic()
        try:
            sandbox = await pool.acquire(spec, timeout=acquire_timeout)
        except errors.SandboxError as exc:
            return self.report("error", f"no sandbox for the evaluation: {exc}")
        self.durations["acquire"] = round(time.monotonic() - begun, 3)
        self.sandbox_id = sandbox.id
        try:
            return await self._grade(sandbox)
        except _Abort as stop:
            return self.report(stop.status, stop.reason)
        except (errors.SandboxNotFound, errors.DaemonUnavailable):
            return self.report("sandbox_died", f"the sandbox went away during {self.step}")
        except errors.SandboxError as exc:
            return self.report("error", f"{type(exc).__name__} during {self.step}: {exc}")
        finally:
            with contextlib.suppress(errors.SandboxError):
                await sandbox.release()

    # -- the steps ------------------------------------------------------------------------

    async def _grade(self, sb: AsyncSandbox) -> Report:
        base = self.instance.base_commit
        begun = time.monotonic()
        self.step = "checkout"
        await sb.write_file(f"{_WORK}/model.patch", self.patch)
        await sb.write_file(f"{_WORK}/test.patch", self.instance.test_patch)
        if self.instance.log_parser == "pytest":
            await sb.write_file(f"{_WORK}/{_SUMMARY_PLUGIN}.py", _SUMMARY_PLUGIN_SOURCE)
        await self._must(sb, [*_GIT, "reset", "-q", "--hard", base], f"check out {base}")
        # Everything the tree holds before the patch, untracked and ignored files too.
        before = await self._snapshot(sb)

        self.step = "apply"
        for method, argv in _APPLY:
            result = await self._exec(sb, [*argv, f"{_WORK}/model.patch"])
            self.attempts.append(
                ApplyAttempt(method=method, exit_code=result.exit_code, output=_both(result))
            )
            if result.exit_code == 0:
                self.applied_with = method
                break
            await self._reset(sb, before)
        else:
            raise _Abort(
                "patch_failed",
                "the patch applies neither with git apply, git apply --3way nor patch --fuzz",
            )

        self.step = "protect"
        changed = await self._changed(sb, before)
        tracked = set(
            _nul((await self._must(sb, [*_GIT, "ls-tree", "-r", "-z", "--name-only", base],
                                   "list base files")).stdout)
        )  # fmt: skip
        # A file the image held but git does not track is never the patch's to change.
        reverted = {
            path for path in changed
            if is_protected(self.instance, path) or (path in before.paths and path not in tracked)
        }  # fmt: skip
        # What now stands where a set-back file's directory was (a symlink to other
        # tests in place of tests/) goes too.
        parents = {"/".join(p.split("/")[:i]) for p in reverted for i in range(1, p.count("/") + 1)}
        self.reverted = sorted(reverted | (parents & set(changed)))
        if self.reverted:
            logger.info("%s: setting back %s", self.instance.instance_id, self.reverted)
            await self._set_back(sb, before, self.reverted)
        tests_in_base = [p for p in self.instance.test_files if p in tracked]
        if tests_in_base:
            await self._must(
                sb, [*_GIT, "checkout", base, "--", *tests_in_base], "check out the test files"
            )
        applied = await self._exec(sb, [*_GIT, "apply", "--verbose", f"{_WORK}/test.patch"])
        if applied.exit_code != 0:
            raise _Abort("error", f"the test patch does not apply: {_both(applied).strip()}")
        self.durations["apply"] = round(time.monotonic() - begun, 3)

        self.step = "tests"
        begun = time.monotonic()
        try:
            run = await self._run_tests(sb)
        finally:
            self.durations["tests"] = round(time.monotonic() - begun, 3)
        return self._judge(run)

    async def _run_tests(self, sb: AsyncSandbox) -> tuple[ExecResult, str, str]:
        nonce = secrets.token_hex(8)
        start, end = f">>>>> Start Test Output {nonce}", f">>>>> End Test Output {nonce}"
        directives = " ".join(shlex.quote(d) for d in self.instance.directives)
        plugin = ""
        self._summary_mark = None
        if self.instance.log_parser == "pytest":
            self._summary_mark = f">>>>> Test Summary {nonce}"
            plugin = (
                f"export SANDMAN_EVAL_SUMMARY_MARK='{self._summary_mark}' "
                f"PYTHONPATH={_WORK}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            )
            directives = f"-p {_SUMMARY_PLUGIN} {directives}"
        command = (
            f"echo '{start}'\n"
            f"{plugin}"
            f"{{ {self.instance.test_cmd} {directives}\n}} 2>&1\n"
            # On a line of its own even if the output did not end one.
            f'sandman_rc=$?\necho\necho "{end} rc=$sandman_rc"\n'
        )
        before = await self._oom_kill_count(sb)
        try:
            result = await sb.exec(
                command, cwd=self.instance.repo_path, timeout=self.conditions.timeout,
                max_output=_MAX_OUTPUT,
            )  # fmt: skip
        except errors.ExecTimeout as exc:
            # The daemon did not even answer within the limit plus its grace.
            raise _Abort("timeout", self._timeout_reason()) from exc
        self._oom_kills = (before, await self._oom_kill_count(sb))
        return result, start, end

    async def _oom_kill_count(self, sb: AsyncSandbox) -> int | None:
        """How many processes the OOM killer took in this sandbox so far; None: cannot tell."""
        found = _OOM_KILL_LINE.search((await self._exec(sb, ["sh", "-c", _OOM_KILLS])).stdout)
        return int(found.group(1)) if found else None

    def _judge(self, run: tuple[ExecResult, str, str]) -> Report:
        result, start, end = run
        lines = result.stdout.split("\n")
        first = next((i for i, line in enumerate(lines) if line == start), None)
        last = next(
            (i for i, line in enumerate(lines) if first is not None and i > first
             and line.startswith(end + " rc=")),
            None,
        )  # fmt: skip
        if first is not None:
            body = lines[first + 1 : last]
            if last is not None and body and body[-1] == "":
                body.pop()  # the newline put before the end marker
            self.test_output = "\n".join(body) + "\n"
        if last is not None:
            self.test_exit_code = int(lines[last].rsplit("rc=", 1)[1])
        if result.timed_out:
            return self.report("timeout", self._timeout_reason())
        killed = self.test_exit_code == _KILLED or (last is None and result.signal == "KILL")
        if killed:
            before, after = self._oom_kills
            if before is None or after is None:
                # No counter to read (a sandbox without its cgroup): SIGKILL
                # without a timeout is most likely the OOM killer.
                return self.report(
                    "oom",
                    f"the test run was killed (SIGKILL), presumably at the memory limit "
                    f"of {self.conditions.memory} bytes",
                )
            if after > before:
                return self.report(
                    "oom",
                    f"the test run was killed by the OOM killer at the memory limit of "
                    f"{self.conditions.memory} bytes",
                )
            # Killed by something else (the code under test can SIGKILL itself):
            # graded on what it printed; the tests it never reported fail.
        elif first is None or last is None:
            return self.report(
                "error",
                f"the test run ended (exit {result.exit_code}) without both output markers",
            )
        log = self.test_output
        if self._summary_mark is not None:
            # Only pytest's own summary, which follows the mark (see _SUMMARY_PLUGIN).
            # No mark: pytest never got to it (the code under test exited or was
            # killed), and what the output says instead is not pytest's word.
            _, marked, log = log.partition(self._summary_mark)
            log = log if marked else ""
        results = parse_log(self.instance.log_parser, log)
        status, reason, f2p, p2p = grade_tests(self.instance, results)
        return self.report(status, reason, f2p, p2p)

    def _timeout_reason(self) -> str:
        return (
            f"the test run passed its wall-clock limit of {self.conditions.timeout:g} s "
            "and was killed"
        )

    # -- helpers ----------------------------------------------------------------------------

    async def _exec(
        self, sb: AsyncSandbox, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> ExecResult:
        result = await sb.exec(
            list(argv), cwd=self.instance.repo_path, env=env, timeout=_STEP_TIMEOUT,
            max_output=_MAX_OUTPUT,
        )  # fmt: skip
        if result.timed_out:
            raise _Abort("error", f"{argv[0]} ran past {_STEP_TIMEOUT:g} s during {self.step}")
        return result

    async def _must(
        self, sb: AsyncSandbox, argv: Sequence[str], what: str, env: dict[str, str] | None = None
    ) -> ExecResult:
        result = await self._exec(sb, argv, env)
        if result.exit_code != 0:
            raise _Abort("error", f"could not {what}: {_both(result).strip()}")
        return result

    async def _snapshot_tree(self, sb: AsyncSandbox) -> str:
        # A tree object of the whole work tree, in an index of its own (the
        # repository's stays untouched). The first starts from a copy of the
        # repository's index, later ones from the last: git hashes only files whose
        # stat data changed. Objects uncompressed: an image's untracked build output
        # can be large, and the sandbox is thrown away.
        index = f"{_WORK}/snapshot.index"
        if not self._snapshotted:
            await self._must(
                sb, ["sh", "-c", f'cp -- "$("$@" rev-parse --git-path index)" {index}', "sh",
                     *_GIT], "copy the index",
            )  # fmt: skip
            self._snapshotted = True
        env = {"GIT_INDEX_FILE": index}
        # -f: ignored files too (a patch may hide a new conftest.py behind a .gitignore).
        add = [*_GIT, "-c", "core.looseCompression=0", "add", "-A", "-f", "--", "."]
        await self._must(sb, add, "snapshot the tree", env)
        tree = await self._must(sb, [*_GIT, "write-tree"], "snapshot the tree", env)
        return tree.stdout.strip()

    async def _snapshot(self, sb: AsyncSandbox) -> _Snapshot:
        tree = await self._snapshot_tree(sb)
        listed = await self._must(
            sb, [*_GIT, "ls-tree", "-r", "-z", "--name-only", tree], "list the snapshot"
        )
        return _Snapshot(tree, frozenset(_nul(listed.stdout)))

    async def _changed(self, sb: AsyncSandbox, before: _Snapshot) -> list[str]:
        """Every path added, changed or removed since ``before``, tracked or not."""
        after = await self._snapshot_tree(sb)
        diff = await self._must(
            sb, [*_GIT, "diff-tree", "-r", "-z", "--name-only", "--no-renames", before.tree,
                 after], "list changes",
        )  # fmt: skip
        return sorted(_nul(diff.stdout))

    async def _set_back(self, sb: AsyncSandbox, before: _Snapshot, paths: Sequence[str]) -> None:
        """Put ``paths`` back as they were in ``before``: restored, or removed if new."""
        restore = [p for p in paths if p in before.paths]
        remove = [p for p in paths if p not in before.paths]
        if remove:
            await self._must(sb, ["rm", "-f", "--", *remove], "remove files")
        if restore:
            # Through an index of its own: the repository's must not learn of untracked files.
            await self._must(
                sb, [*_GIT, "checkout", before.tree, "--", *restore], "restore files",
                {"GIT_INDEX_FILE": f"{_WORK}/restore.index"},
            )  # fmt: skip

    async def _reset(self, sb: AsyncSandbox, before: _Snapshot) -> None:
        """The tree as it was before the patch, after a try that failed (maybe halfway)."""
        await self._must(
            sb, [*_GIT, "reset", "-q", "--hard", self.instance.base_commit], "reset the tree"
        )
        await self._set_back(sb, before, await self._changed(sb, before))


def _nul(text: str) -> list[str]:
    return [part for part in text.split("\0") if part]


def _both(result: ExecResult) -> str:
    return result.stdout + result.stderr


async def evaluate_report(
    instance: Instance,
    patch: str,
    *,
    pool: AsyncClient,
    conditions: Conditions | None = None,
    images: ImageStore | None = None,
    model: str = "model",
    acquire_timeout: float = 600.0,
) -> Report:
    """Like `evaluate`, with the logs, timings and apply attempts around the verdict."""
    evaluation = _Evaluation(instance, patch, conditions or Conditions(), model)
    try:
        evaluation.ref, evaluation.digest = await pin_image(instance.image, images)
    except errors.ImageError as exc:
        return evaluation.report("error", f"image {instance.image!r}: {exc}")
    return await evaluation.run(pool, acquire_timeout)


async def evaluate(
    instance: Instance,
    patch: str,
    *,
    pool: AsyncClient,
    conditions: Conditions | None = None,
    images: ImageStore | None = None,
    model: str = "model",
    acquire_timeout: float = 600.0,
) -> Verdict:
    """Grade ``patch`` on ``instance`` in a fresh sandbox from ``pool`` (an `AsyncClient`).

    For an RL reward: ``(await evaluate(instance, patch, pool=client)).resolved``.
    ``conditions`` fixes the sandbox's CPU, memory, network and environment
    and the test run's wall-clock limit (`Conditions` defaults). With
    ``images`` (the local image store) the image is pinned to its id. Never
    raises for what the patch or the sandbox does: that is the verdict's
    ``status``.
    """
    report = await evaluate_report(
        instance, patch, pool=pool, conditions=conditions, images=images, model=model,
        acquire_timeout=acquire_timeout,
    )  # fmt: skip
    return report.verdict
