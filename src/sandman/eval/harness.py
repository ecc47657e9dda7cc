"""`evaluate`: grade one patch on one instance in a fresh sandbox, by the SWE-bench harness's rules.

(About 1,040 lines, one procedure: each step relies on what the steps before it
set back, so its order is its defence; canaries, verdicts and evidence are
their own modules.)

The steps, each a command in the sandbox (never in the agent's):

1. check out ``base_commit``;
2. apply the patch with ``git apply``, else ``git apply --3way``, else
   ``patch --fuzz`` run on an export of the tree (no ``.git``, nothing
   outside it) whose result is applied with ``git apply`` again, setting the
   tree back between tries; binary hunks are refused unless the instance
   allows them;
3. set back the protected paths the patch changed (`is_protected`: whatever
   the test framework reads before it runs a test) and every file the image
   held that git does not track (build output, ``pip install -e``
   metadata), then check out the test files at ``base_commit`` and apply the
   test patch;
4. run ``pre_test`` (every command must succeed), then set back again what
   it changed of the protected paths;
5. rename the listed tests and plant canaries beside them
   (`sandman.eval.canaries`), write the witness under a fresh random name,
   run the test command under the wall-clock limit, and grade: the
   canaries must end as planted, and XFAIL or SKIPPED counts only where the
   test's own source declares it.

Its size is the steps' and one evaluation's state: what
is pure lives beside it (`protect`: what a patch may change; `canaries`: the
plan; `judge`: grading a finished run).

A run cut short is reported as what cut it short (``timeout``, ``oom``,
``sandbox_died``), never as failed tests, and nothing is retried. An OOM kill
is told from any other SIGKILL by the sandbox's own cgroup counter
(``oom_kill``): a test run that kills itself is graded on what it printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import posixpath
import random
import re
import secrets
import shlex
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandman import errors
from sandman.client import AsyncClient, AsyncSandbox
from sandman.eval import canaries, variants
from sandman.eval.conditions import Conditions
from sandman.eval.evidence import audit_patch
from sandman.eval.instances import Instance
from sandman.eval.judge import judge
from sandman.eval.parsers import TestStatus
from sandman.eval.protect import DEFAULT_PROTECTED, binary_hunks, git_paths, is_protected
from sandman.eval.verdict import ApplyAttempt, Report, Status, Verdict, inputs_hash
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

_WORK = "/tmp/sandman-eval"  # outside the repository: a patch cannot reach it
_WITNESS_CONFIG = "sandman-witness.json"  # the name witness.start reads
_PASS_WORDS = frozenset({"PASSED", "XFAIL"})
_ENV_MARK = "sandman-pre-test-environment"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The witness (sandman/eval/witness/) runs inside the test process: pytest loads
# it as a plugin (-p), other runners through its sitecustomize. Its records go
# to the test command's original stderr (kept as fd 3 for it), the test output
# to stdout, so the code under test cannot write the grader's evidence there.
_WITNESS_DIR = Path(__file__).parent / "witness"
_WITNESS_MODULE = "sandman_eval_witness"
_PYTEST_FAMILIES = ("pytest", "pytest_options", "pytest_v2", "matplotlib", "seaborn")
_WITNESS_MODES: dict[str, Literal["pytest", "unittest"]] = {
    **dict.fromkeys(_PYTEST_FAMILIES, "pytest"), "unittest": "unittest", "django": "unittest",
}  # fmt: skip
"""Families whose runner the witness knows (sympy's bin/test: not yet)."""
# The processes that may take the witness's configuration (see witness.start),
# and the framework's own files (a patch to them is the framework, not a forger).
_RUNNERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_PYTEST_FAMILIES, ("pytest",)), "unittest": ("unittest",),
    "django": ("runtests",),
}  # fmt: skip
_FRAMEWORK_PATHS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_PYTEST_FAMILIES, ("/_pytest/", "/pytest/", "/pluggy/")),
    "unittest": ("/unittest/",),
    "django": ("/unittest/", "/django/test/"),
    "sympy": ("/sympy/testing/", "/sympy/utilities/runtests"),
}  # fmt: skip
# Outcomes a family's log parser never names (SWE-bench's Django parser has no
# expected failures; seaborn's ignores skipped tests): no canary of that kind.
_UNSEEN: dict[str, tuple[canaries.Kind, ...]] = {"django": ("xfail",), "seaborn": ("skip",)}
# Where pre_test may write freely, and what in the rest is code the test run loads.
_NOT_INSTALLED = ("/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", "/root/.cache", _WORK)
_CODE_SUFFIXES = (".py", ".pyc", ".so", ".pth")
_INSTALLED_DIRS = ("/site-packages/", "/dist-packages/", "/lib/python")
# What `_after_run` runs in the sandbox, and what the loader reads for every program.
_LISTERS = ("/usr/bin/find", "/bin/sh")
_LOADER = ("/etc/ld.so.preload", "/etc/ld.so.cache")
_FRAMEWORK_FILES = ("/_pytest/", "/pytest/", "/pluggy/", "/unittest/", "/django/test/", "/py/_")
_PLANT_KEY = secrets.token_bytes(32)
"""This process's secret for drawing canaries (see `_Evaluation._plant`)."""
# Each instance's input variants, learnt once per process from its fix (`_calibrated`).
_CALIBRATED: dict[str, variants.Inputs] = {}
_CALIBRATING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)
_STEP_TIMEOUT = 300.0  # for git and patch; the test run has the conditions' limit
_MAX_OUTPUT = 32 * 2**20
# No hooks and no fsmonitor command, whatever the repository's config says.
_GIT = ("git", "-c", "safe.directory=*", "-c", "core.quotepath=off",
        "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")  # fmt: skip
_GIT_APPLY = (*_GIT, "apply", "--verbose")
_FUZZ = ("patch", "--batch", "--fuzz=5", "-p1", "--no-backup-if-mismatch", "-i")
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

    def __init__(
        self,
        instance: Instance,
        patch: str,
        conditions: Conditions,
        model: str,
        inputs: variants.Inputs | None = None,
        calibrating: bool = False,
    ) -> None:
        self.instance = instance
        self.inputs = inputs
        self.calibrating = calibrating
        """A run that learns the input variants' values (`_calibrated`): an empty
        patch is the unpatched code's."""
        self.values: Mapping[str, Mapping[int, Sequence[tuple[str, bool]]]] = {}
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
        self.patch_files: list[str] = []
        self.suspicious: list[str] = []
        self._key = secrets.token_bytes(32)
        self._oom_kills: tuple[int | None, int | None] = (None, None)
        self._snapshotted = False
        self._patched = ""  # the tree right after the patch was applied
        self._paths: set[str] = set()
        self._listed_files: frozenset[str] = frozenset()
        self.plan = canaries.Plan()
        self.official: Status | None = None
        self.official_parser: str | None = None
        self._work = _WORK
        self._strong_before: list[str] = []
        self._before = _Snapshot("", frozenset())

    def report(
        self,
        status: Status,
        reason: str,
        f2p: dict[str, TestStatus] | None = None,
        p2p: dict[str, TestStatus] | None = None,
    ) -> Report:
        # Tokens and the run's directory are drawn at random; a verdict holds only
        # what its inputs decide (the report keeps them).
        def scrub(text: str) -> str:
            return self.plan.scrub(text).replace(self._work, f"{_WORK}/<run>")

        verdict = Verdict(
            instance_id=self.instance.instance_id,
            model=self.model,
            status=status,
            reason=scrub(reason),
            applied_with=self.applied_with,
            reverted=self.reverted,
            fail_to_pass=f2p or {},
            pass_to_pass=p2p or {},
            suspicious=sorted({scrub(item) for item in self.suspicious}),
            official=self.official,
            official_parser=self.official_parser,
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
            renamed=self.plan.renamed,
            canaries={c.token: c.describe() for c in self.plan.canaries},
        )

    async def run(self, client: AsyncClient, acquire_timeout: float) -> Report:
        if not self.patch.strip() and not self.calibrating:
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
            sandbox = await client.acquire(spec, timeout=acquire_timeout)
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
        await self._must(sb, [*_GIT, "reset", "-q", "--hard", base], f"check out {base}")
        # Everything the tree holds before the patch, untracked and ignored files too.
        before = self._before = await self._snapshot(sb)

        self.step = "apply"
        if self.patch.strip():
            await self._apply(sb, before)

        self.step = "protect"
        changed = await self._changed(sb, before)
        tracked = set(
            _nul(
                (
                    await self._must(
                        sb, [*_GIT, "ls-tree", "-r", "-z", "--name-only", base], "list base files"
                    )
                ).stdout
            )
        )
        self._paths = tracked | set(self.instance.test_files)
        self._listed_files = frozenset(t.path for t in self._targets())
        # A file the image held but git does not track is never the patch's to change.
        reverted = {
            path
            for path in changed
            if self._protected(path) or (path in before.paths and path not in tracked)
        }
        # What now stands where a set-back file's directory was (a symlink to other
        # tests in place of tests/) goes too.
        parents = {"/".join(p.split("/")[:i]) for p in reverted for i in range(1, p.count("/") + 1)}
        self.reverted = sorted(reverted | (parents & set(changed)))
        self.patch_files = sorted(set(changed) - set(self.reverted))
        if self.reverted:
            logger.info("%s: setting back %s", self.instance.instance_id, self.reverted)
            await self._set_back(sb, before, self.reverted)
        tests_in_base = [p for p in self.instance.test_files if p in tracked]
        if tests_in_base:
            await self._must(
                sb, [*_GIT, "checkout", base, "--", *tests_in_base], "check out the test files"
            )
        # On disk only while it is applied: its text tells the original FAIL_TO_PASS
        # test from its mutants (it holds the original's expected values), so no
        # process of the run may read it (round 5 of heldout/ found it in /tmp).
        await sb.write_file(f"{_WORK}/test.patch", self.instance.test_patch)
        try:
            applied = await self._exec(sb, [*_GIT_APPLY, f"{_WORK}/test.patch"])
        finally:
            await self._must(sb, ["rm", "-f", f"{_WORK}/test.patch"], "remove the test patch")
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

    async def _apply(self, sb: AsyncSandbox, before: _Snapshot) -> None:
        """Apply the model patch with ``git apply`` alone (see the module's docstring)."""
        if (hunks := binary_hunks(self.patch)) and not self.instance.allow_binary:
            raise _Abort(
                "patch_failed", f"the patch has {hunks} binary hunk(s); this task allows none"
            )
        patch = f"{_WORK}/model.patch"
        for method, argv in (
            ("git apply", [*_GIT_APPLY, patch]),
            ("git apply --3way", [*_GIT_APPLY, "--3way", patch]),
        ):
            result = await self._exec(sb, argv)
            self.attempts.append(
                ApplyAttempt(method=method, exit_code=result.exit_code, output=_both(result))
            )
            if result.exit_code == 0:
                self.applied_with = method
                return
            await self._reset(sb, before)
        # patch --fuzz follows Index: lines and context-diff headers git never
        # reads, and may write anywhere its paths lead: it runs on an export of
        # the tracked tree (no .git in it), and git apply takes what it made.
        fuzz, index = f"{_WORK}/fuzz", f"{_WORK}/fuzz.index"
        export = (
            f'rm -rf {fuzz} && mkdir -p {fuzz} && "$@" archive --format=tar '
            f"{self.instance.base_commit} | tar -x -C {fuzz}"
        )
        await self._must(sb, ["sh", "-c", export, "sh", *_GIT], "export the tree")
        result = await self._exec(sb, ["sh", "-c", f'cd {fuzz} && exec "$@"', "sh", *_FUZZ, patch])
        self.attempts.append(
            ApplyAttempt(method="patch --fuzz", exit_code=result.exit_code, output=_both(result))
        )
        if result.exit_code == 0:
            env = {"GIT_INDEX_FILE": index}
            work_tree = [*_GIT, f"--work-tree={fuzz}"]
            await self._must(
                sb, [*work_tree, "read-tree", self.instance.base_commit], "read the tree", env
            )
            await self._must(
                sb, [*work_tree, "add", "-A", "-f", "--", "."], "take the fuzzed tree", env
            )
            diff = await self._must(
                sb, [*work_tree, "diff", "--cached", "--binary", "--no-renames", self.instance.base_commit],
                "diff the fuzzed tree", env,
            )  # fmt: skip
            await sb.write_file(f"{_WORK}/fuzzed.patch", diff.stdout)
            await self._exec(sb, ["rm", "-rf", fuzz, index])
            again = await self._exec(sb, [*_GIT_APPLY, f"{_WORK}/fuzzed.patch"])
            if again.exit_code == 0 and diff.stdout.strip():
                self.applied_with = "patch --fuzz"
                return
            self.attempts.append(
                ApplyAttempt(
                    method="patch --fuzz, then git apply",
                    exit_code=again.exit_code,
                    output=_both(again),
                )
            )
            await self._reset(sb, before)
        raise _Abort(
            "patch_failed",
            "the patch applies neither with git apply, git apply --3way nor patch --fuzz",
        )

    def _targets(self) -> list[canaries.Target]:
        mode = _WITNESS_MODES.get(self.instance.log_parser)
        if mode is None:
            return []
        tests = [*self.instance.FAIL_TO_PASS, *self.instance.PASS_TO_PASS]
        return [t for t in (canaries.locate(i, mode, self._paths) for i in tests) if t is not None]

    def _protected(self, path: str) -> bool:
        return is_protected(self.instance, path, self._listed_files)

    async def _prepare_tests(self, sb: AsyncSandbox) -> dict[str, str] | None:
        """Run the instance's ``pre_test`` (conda activation, a reinstall) and return the
        environment it leaves; end every process it left behind; set back the
        protected paths it changed.

        Its own exec, before any file of the grader's (the witness, the
        canaries) exists: what it runs (a reinstall runs the patch's build
        scripts) finds none of them, and nothing it starts lives on into the
        test run. Every command must succeed, not just the last.
        """
        if not self.instance.pre_test:
            return None
        guarded = []
        for number, command in enumerate(self.instance.pre_test, start=1):
            guarded.append(
                f"{command}\n_sm_status=$?; if [ $_sm_status -ne 0 ]; then echo "
                f"'pre-test command {number} failed' >&2; exit $_sm_status; fi"
            )
        # A separator no command prints, then the environment (values may span lines).
        script = "\n".join(guarded) + f"\nprintf '\\0{_ENV_MARK}\\0'\nenv -0\n"
        git_state = await self._git_state(sb)
        prepared = await self._snapshot(sb)
        began = (await self._must(sb, ["date", "+%s"], "read the clock")).stdout.strip()
        done = await sb.exec(
            script,
            cwd=self.instance.repo_path,
            timeout=self.conditions.timeout,
            max_output=_MAX_OUTPUT,
        )
        await self._exec(sb, ["sh", "-c", "kill -9 -1 2>/dev/null; true"])
        if done.exit_code != 0 or done.timed_out:
            raise _Abort("error", f"the pre-test commands failed: {_both(done)[-1000:].strip()}")
        if await self._git_state(sb) != git_state:
            raise _Abort(
                "unresolved",
                "the pre-test commands (the patch's build) changed the repository's git configuration",
            )
        await self._outside(sb, began)
        again = [p for p in await self._changed(sb, prepared) if self._protected(p)]
        if again:
            self.suspicious.append(
                f"the pre-test commands changed protected paths: {', '.join(again[:5])}"
            )
            await self._set_back(sb, prepared, again)
        env = {}
        for item in done.stdout.rpartition(f"\0{_ENV_MARK}\0")[2].split("\0"):
            key, sep, value = item.partition("=")
            if sep and _ENV_NAME.fullmatch(key):
                env[key] = value
        return env

    async def _outside(self, sb: AsyncSandbox, began: str) -> None:
        """What ``pre_test`` wrote outside the repository: the test framework's own
        files are strong evidence, other installed code is listed.

        By status-change time, which no process in the sandbox can set back.
        """
        if not began.isdigit():
            return
        skip = " -o ".join(
            f"-path {shlex.quote(p)}" for p in (*_NOT_INSTALLED, self.instance.repo_path)
        )
        found = await self._exec(
            sb,
            [
                "sh",
                "-c",
                f"find / -xdev \\( {skip} \\) -prune -o -type f -newerct @{began} -print 2>/dev/null | head -n 2000",
            ],
        )
        changed = [p for p in found.stdout.splitlines() if p.endswith(_CODE_SUFFIXES)]
        framework = [p for p in changed if any(f in p for f in _FRAMEWORK_FILES)]
        if framework:
            self._strong_before.append(
                f"the pre-test commands (the patch's build) changed the test framework's files: "
                f"{', '.join(framework[:3])}"
            )
        elif changed:
            self.suspicious.append(
                f"the pre-test commands installed code outside the repository: {', '.join(changed[:3])}"
            )

    async def _git_state(self, sb: AsyncSandbox) -> str:
        """What of ``.git`` decides how the grader's git commands behave (config, attributes, hooks)."""
        show = 'cd "$("$@" rev-parse --git-dir)" && cat config info/* 2>/dev/null; ls -la hooks 2>/dev/null; true'
        return (await self._exec(sb, ["sh", "-c", show, "sh", *_GIT])).stdout

    async def _plant(
        self, sb: AsyncSandbox, mode: Literal["pytest", "unittest"], witness: str
    ) -> None:
        """Rename the listed tests and plant the canaries (`sandman.eval.canaries`); the
        families' assertions record their plain results with the witness (module
        ``witness``), and the expected values stay here."""
        targets = self._targets()
        files = {}
        for path in sorted({t.path for t in targets}):
            with contextlib.suppress(errors.SandboxError):
                data = await sb.read_file(posixpath.join(self.instance.repo_path, path))
                files[path] = data.decode("utf-8", errors="surrogateescape")
        conftests = {}
        for path in sorted(p for p in self._paths if posixpath.basename(p) == "conftest.py"):
            with contextlib.suppress(errors.SandboxError):
                data = await sb.read_file(posixpath.join(self.instance.repo_path, path))
                conftests[path] = data.decode("utf-8", errors="replace")
        kinds = [k for k in canaries.KINDS if k not in _UNSEEN.get(self.instance.log_parser, ())]
        # Drawn from a secret of this process and the inputs: the same inputs
        # plant the same canaries (re-grading gives the same verdict), and no
        # patch can know them, nor carry them to another patch (any change of
        # it draws anew).
        seed = hmac.new(
            _PLANT_KEY,
            inputs_hash(self.instance, self.patch, self.conditions, self.digest).encode(),
            hashlib.sha256,
        ).digest()
        self.plan = canaries.plan(
            files,
            targets,
            self.instance.FAIL_TO_PASS,
            mode,
            conftests,
            kinds=kinds,
            rng=random.Random(seed),
            recorder=witness,
            inputs=self.inputs,
        )
        # On disk, each file's stub (its families' expected values hidden); the
        # witness serves the planted text to the framework from its memory, so no
        # process or reader of the run finds the values in a file (round 8 of
        # heldout/ ran, read or forked a reader of the planted file).
        for path, text in self.plan.stubs.items():
            await sb.write_file(
                posixpath.join(self.instance.repo_path, path),
                text.encode("utf-8", errors="surrogateescape"),
            )

    async def _unshadow(self, sb: AsyncSandbox, env: dict[str, str] | None) -> None:
        """Set back what the patch added at the repository's root that shadows a
        module importable from outside it (``pytest/``, ``django/``, ``typing.py``).

        The root comes first on ``sys.path`` under ``python -m``: a new
        top-level name there replaces the framework or the standard library.
        The names are the test interpreter's own (after ``pre_test``), the
        repository taken off its path.
        """
        added: dict[str, list[str]] = {}
        existed = {p.split("/")[0] for p in self._before.paths}
        for path in self.patch_files:
            first = path.split("/")[0]
            if first in existed:
                continue
            name = first if "/" in path else first.split(".")[0]
            if "/" in path or first.endswith((".py", ".pyc", ".so")):
                added.setdefault(name, []).append(path)
        if not added:
            return
        listing = (
            "import pkgutil, sys; repo = sys.argv[1]; "
            "sys.path = [p for p in sys.path if p and not p.startswith(repo)]; "
            "print('\\n'.join({m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names)))"
        )
        found = await sb.exec(
            ["python3", "-I", "-c", listing, self.instance.repo_path],
            cwd="/",
            env=env,
            timeout=_STEP_TIMEOUT,
            max_output=_MAX_OUTPUT,
        )
        importable = set(found.stdout.split()) if found.exit_code == 0 else set()
        shadows = sorted(p for name, paths in added.items() if name in importable for p in paths)
        if shadows:
            logger.info("%s: shadowing %s", self.instance.instance_id, shadows)
            await self._set_back(sb, self._before, shadows)
            self.reverted = sorted({*self.reverted, *shadows})
            self.patch_files = sorted(set(self.patch_files) - set(shadows))

    async def _run_tests(self, sb: AsyncSandbox) -> ExecResult:
        env = await self._prepare_tests(sb)
        await self._unshadow(sb, env)
        directives = " ".join(shlex.quote(d) for d in self.instance.directives)
        mode = _WITNESS_MODES.get(self.instance.log_parser)
        # A fresh directory, named at random and made only now that pre_test is
        # over: nothing of the grader's was on disk while the patch's build ran,
        # and no module name the patch could shadow is known in advance.
        work = self._work = f"{_WORK}/{secrets.token_hex(8)}"
        prelude = ""
        if mode is not None:
            module = f"_sm{secrets.token_hex(8)}"
            await self._plant(sb, mode, module)
            await sb.write_file(
                f"{work}/{module}.py", (_WITNESS_DIR / f"{_WITNESS_MODULE}.py").read_bytes()
            )
            # Every runner starts the witness at the interpreter's start, before the
            # repository is on sys.path; pytest then takes it as its plugin (-p).
            site = (_WITNESS_DIR / "sitecustomize.py").read_text().replace(_WITNESS_MODULE, module)
            await sb.write_file(f"{work}/sitecustomize.py", site)
            # Read and deleted by the witness in the test runner's process before
            # any code under test runs: nothing secret is in an environment,
            # a command line or a file after that.
            config = {
                "key": self._key.hex(), "mode": mode, "work": work, "fd": 3,
                "argv_contains": list(_RUNNERS[self.instance.log_parser]),
                "framework_paths": list(_FRAMEWORK_PATHS[self.instance.log_parser]),
                "patch_files": [
                    posixpath.join(self.instance.repo_path, path) for path in self.patch_files
                ],
                "patch_lines": {
                    posixpath.join(self.instance.repo_path, path): ranges
                    for path, ranges in (await self._patch_lines(sb)).items()
                    if path in self.patch_files
                },
                "test_files": sorted(
                    posixpath.join(self.instance.repo_path, path) for path in self._listed_files
                ),
                "planted": {
                    posixpath.join(self.instance.repo_path, path): text
                    for path, text in self.plan.sources.items()
                },
                "markers": sorted(self.plan.markers),
            }  # fmt: skip
            await sb.write_file(f"{work}/{_WITNESS_CONFIG}", json.dumps(config), mode=0o600)
            # No bytecode written (nor pytest's rewrite cache): any that appears
            # during the run is a forger's (`_after_run`).
            prelude = (
                f"export PYTHONPATH={work}${{PYTHONPATH:+:$PYTHONPATH}} PYTHONDONTWRITEBYTECODE=1\n"
            )
            if mode == "pytest":
                directives = f"-p {module} {directives}"
        command = f"{prelude}{{ {self.instance.test_cmd} {directives}\n}} 3>&2 2>&1\n"
        before = await self._oom_kill_count(sb)
        anchors = await self._anchors(sb)
        began = (await self._must(sb, ["date", "+%s"], "read the clock")).stdout.strip()
        try:
            result = await sb.exec(
                command,
                cwd=self.instance.repo_path,
                timeout=self.conditions.timeout,
                max_output=_MAX_OUTPUT,
                env=env,
            )
        except errors.ExecTimeout as exc:
            # The daemon did not even answer within the limit plus its grace.
            raise _Abort("timeout", self._timeout_reason()) from exc
        finally:
            with contextlib.suppress(errors.SandboxError):
                await self._exec(sb, ["rm", "-f", f"{work}/{_WITNESS_CONFIG}"])
        self._oom_kills = (before, await self._oom_kill_count(sb))
        await self._after_run(sb, anchors, began)
        return result

    async def _anchors(self, sb: AsyncSandbox) -> dict[str, str]:
        """The bytes (read by the daemon, not by a program of the sandbox) of what
        `_after_run` runs in the sandbox: ``find``, ``sh``, the libraries and loader
        configuration they load. Unchanged after the run, their answer is the kernel's."""
        libs = await self._exec(sb, ["sh", "-c", f"ldd {' '.join(_LISTERS)} 2>/dev/null; true"])
        paths = {*_LISTERS, *_LOADER, *(t for t in libs.stdout.split() if t.startswith("/"))}
        found = {}
        for path in sorted(paths):
            try:
                data = await sb.read_file(path)
            except errors.SandboxError:
                data = b""
            found[path] = hashlib.sha256(data).hexdigest()
        return found

    async def _after_run(self, sb: AsyncSandbox, anchors: dict[str, str], began: str) -> None:
        """What the test run wrote that no honest run writes: installed code (the
        interpreter's library, site- and dist-packages, the framework's files) and
        bytecode anywhere (the run is told to write none). By status-change time,
        which no process of the sandbox can set back (that needs CAP_SYS_TIME);
        a file planted and deleted moves its directory's."""
        await self._exec(sb, ["sh", "-c", "kill -9 -1 2>/dev/null; true"])
        if not began.isdigit():
            return
        if await self._anchors(sb) != anchors:
            self._strong_before.append(
                "the test run changed the programs the grader lists files with"
            )
            return
        skip = " -o ".join(f"-path {shlex.quote(p)}" for p in (*_NOT_INSTALLED, "/.sandman"))
        repo = shlex.quote(self.instance.repo_path)
        listing = (
            rf"/usr/bin/find / -xdev \( {skip} \) -prune -o -newerct @{began} -print "
            rf"2>/dev/null | head -n 5000; /usr/bin/find {repo} -newerct @{began} "
            r"\( -name '*.pyc' -o -name '*.pyo' -o -name __pycache__ \) -print 2>/dev/null"
        )
        found = await self._exec(sb, ["/bin/sh", "-c", listing])
        repo_dir = self.instance.repo_path.rstrip("/") + "/"
        written = [p for p in found.stdout.splitlines() if p]
        bytecode = [p for p in written if p.endswith((".pyc", ".pyo")) or "/__pycache__" in p]
        code = [
            p
            for p in written
            if not p.startswith(repo_dir)
            and (p.endswith(_CODE_SUFFIXES) or any(d in p for d in _INSTALLED_DIRS))
        ]
        if bytecode:
            self._strong_before.append(
                f"the test run wrote bytecode: {', '.join(sorted(set(bytecode))[:3])}"
            )
        if code:
            self._strong_before.append(
                f"the test run changed installed code: {', '.join(sorted(set(code))[:3])}"
            )

    async def _oom_kill_count(self, sb: AsyncSandbox) -> int | None:
        """How many processes the OOM killer took in this sandbox so far; None: cannot tell."""
        found = _OOM_KILL_LINE.search((await self._exec(sb, ["sh", "-c", _OOM_KILLS])).stdout)
        return int(found.group(1)) if found else None

    def _judge(self, result: ExecResult) -> Report:
        self.test_output = result.stdout
        if result.timed_out:
            return self.report("timeout", self._timeout_reason())
        self.test_exit_code = result.exit_code
        if result.exit_code == _KILLED or result.signal == "KILL":
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
            # graded on what the framework reported; the tests it never did fail.
        parser = self.instance.log_parser
        leads = audit_patch(
            self.patch,
            is_test_file=self._set_back_path,
            framework_paths=_FRAMEWORK_PATHS.get(parser, ()),
        )
        judged = judge(
            self.instance,
            result,
            plan=self.plan,
            key=self._key,
            mode=_WITNESS_MODES.get(parser),
            strict=self.conditions.audit == "strict",
            leads=leads + self.suspicious,
            strong=self._strong_before,
        )
        self.official, self.suspicious = judged.official, judged.suspicious
        self.values = judged.values
        self.test_output += judged.addendum
        self.official_parser = judged.official_parser
        return self.report(judged.status, judged.reason, judged.fail_to_pass, judged.pass_to_pass)

    def _set_back_path(self, path: str) -> bool:
        return path in self.reverted or self._protected(path)

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
            list(argv),
            cwd=self.instance.repo_path,
            env=env,
            timeout=_STEP_TIMEOUT,
            max_output=_MAX_OUTPUT,
        )
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
                sb,
                ["sh", "-c", f'cp -- "$("$@" rev-parse --git-path index)" {index}', "sh", *_GIT],
                "copy the index",
            )
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
        after = self._patched = await self._snapshot_tree(sb)
        diff = await self._must(
            sb,
            [*_GIT, "diff-tree", "-r", "-z", "--name-only", "--no-renames", before.tree, after],
            "list changes",
        )
        return sorted(_nul(diff.stdout))

    async def _patch_lines(self, sb: AsyncSandbox) -> dict[str, list[tuple[int, int]]]:
        """The lines of the patch's files that the patch added or changed, by file:
        where the witness looks on the stack for the patch's own code reading a test."""
        if not self.patch_files or not self._patched:
            return {}
        diff = await self._must(
            sb,
            [*_GIT, "diff-tree", "-r", "-p", "-U0", "--no-color", "--no-renames", "--no-ext-diff",
             "--no-textconv", self._before.tree, self._patched, "--", *self.patch_files],
            "list changed lines",
        )  # fmt: skip
        return _added_lines(diff.stdout)

    async def _set_back(self, sb: AsyncSandbox, before: _Snapshot, paths: Sequence[str]) -> None:
        """Put ``paths`` back as they were in ``before``: restored, or removed if new.

        ``.gitattributes`` files first: they decide how git writes the rest.
        """
        first = [p for p in paths if posixpath.basename(p) == ".gitattributes"]
        for group in (first, [p for p in paths if p not in first]):
            restore = [p for p in group if p in before.paths]
            remove = [p for p in group if p not in before.paths]
            if remove:
                await self._must(sb, ["rm", "-f", "--", *remove], "remove files")
            if restore:
                # Through an index of its own: the repository's must not learn of untracked files.
                await self._must(
                    sb,
                    [*_GIT, "checkout", before.tree, "--", *restore],
                    "restore files",
                    {"GIT_INDEX_FILE": f"{_WORK}/restore.index"},
                )

    async def _reset(self, sb: AsyncSandbox, before: _Snapshot) -> None:
        """The tree as it was before the patch, after a try that failed (maybe halfway)."""
        await self._must(
            sb, [*_GIT, "reset", "-q", "--hard", self.instance.base_commit], "reset the tree"
        )
        await self._set_back(sb, before, await self._changed(sb, before))


def _nul(text: str) -> list[str]:
    return [part for part in text.split("\0") if part]


_HUNK = re.compile(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@")


def _added_lines(diff: str) -> dict[str, list[tuple[int, int]]]:
    """Per file of a git diff (its ``b/`` side), the line ranges its hunks added."""
    found: dict[str, list[tuple[int, int]]] = {}
    path: str | None = None
    header = False
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            header, path = True, None
        elif header and line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None  # /dev/null: removed
        elif line.startswith("@@"):
            header = False
            match = _HUNK.match(line)
            if path is not None and match is not None:
                start, count = int(match[1]), int(match[2] if match[2] is not None else 1)
                if count:
                    found.setdefault(path, []).append((start, start + count - 1))
    return found


def _both(result: ExecResult) -> str:
    return result.stdout + result.stderr


async def evaluate_report(
    instance: Instance,
    patch: str,
    *,
    client: AsyncClient,
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
    if instance.patch and patch.strip() and instance.log_parser in _WITNESS_MODES:
        evaluation.inputs = await _calibrated(evaluation, client, acquire_timeout)
    return await evaluation.run(client, acquire_timeout)


async def _calibrated(
    evaluation: _Evaluation, client: AsyncClient, acquire_timeout: float
) -> variants.Inputs:
    """The instance's input variants and what each must record: its fix and the
    unpatched code run once each (side by side) on every variant drawn, in this
    process; kept are those the fix answers and the unpatched code answers otherwise.

    None where the fix does not pass the instance's tests here: the grade goes on
    without variants (as for an instance without a fix), said in the log."""
    instance = evaluation.instance
    # The grader's own runs: the fix's tests must pass; what the audit lists of them
    # (the image's own bytecode, say) is no evidence about the patch being graded.
    conditions = evaluation.conditions.model_copy(update={"audit": "record"})
    key = inputs_hash(instance, "", conditions, evaluation.digest)
    locks = _CALIBRATING.setdefault(asyncio.get_running_loop(), {})
    async with locks.setdefault(key, asyncio.Lock()):
        if key in _CALIBRATED:
            return _CALIBRATED[key]
        # Drawn from this process's secret: the same for every grade of the instance,
        # and known to no patch (and not from the image's digest: a rebuilt image draws
        # alike).
        seed = inputs_hash(instance, "", conditions, None).encode()
        drawing = variants.Inputs(hmac.new(_PLANT_KEY, seed, hashlib.sha256).digest())
        runs = [
            _Evaluation(instance, patch, conditions, "calibration", drawing, calibrating=True)
            for patch in (instance.patch or "", "")
        ]
        for run in runs:
            run.ref, run.digest = evaluation.ref, evaluation.digest
        fix, _ = await asyncio.gather(*(run.run(client, acquire_timeout) for run in runs))
        if fix.verdict.status != "resolved":
            logger.warning(
                "%s: its own fix is graded %s here (%s): graded without input variants",
                instance.instance_id,
                fix.verdict.status,
                fix.verdict.reason,
            )
            learnt = variants.Inputs(drawing.seed, {})
            if fix.verdict.category != "error":  # a sandbox lost or a timeout: try again
                _CALIBRATED[key] = learnt
            return learnt
        fixed, unpatched = ((run.plan.variants, run.values) for run in runs)
        learnt = variants.Inputs(drawing.seed, variants.learnt(fixed, unpatched))
        logger.info(
            "%s: %d input variant(s) learnt from its fix (of %d drawn)",
            instance.instance_id,
            len(learnt.values or {}),
            len(runs[0].plan.variants),
        )
        _CALIBRATED[key] = learnt
        return learnt


async def evaluate(
    instance: Instance,
    patch: str,
    *,
    client: AsyncClient,
    conditions: Conditions | None = None,
    images: ImageStore | None = None,
    model: str = "model",
    acquire_timeout: float = 600.0,
) -> Verdict:
    """Grade ``patch`` on ``instance`` in a fresh sandbox from ``client`` (an `AsyncClient`).

    For an RL reward: ``(await evaluate(instance, patch, client=client)).resolved``.
    ``conditions`` fixes the sandbox's CPU, memory, network and environment
    and the test run's wall-clock limit (`Conditions` defaults). With
    ``images`` (the local image store) the image is pinned to its id. Never
    raises for what the patch or the sandbox does: that is the verdict's
    ``status``.
    """
    report = await evaluate_report(
        instance,
        patch,
        client=client,
        conditions=conditions,
        images=images,
        model=model,
        acquire_timeout=acquire_timeout,
    )
    return report.verdict
