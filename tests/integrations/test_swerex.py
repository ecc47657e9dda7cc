"""SandmanDeployment and SandmanRuntime driven as SWE-agent's SWEEnv drives a deployment:
every call in its own ``asyncio.run``, on the local provider."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("swerex")

from swerex.deployment.hooks.abstract import DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from sandman.errors import ImageNotFound, SandboxNotFound
from sandman.integrations.swerex import (
    SandmanDeployment,
    SandmanDeploymentConfig,
    SandmanRuntime,
    SandmanRuntimeError,
)
from sandman.providers.local import LocalProvider
from tests.integrations.conftest import assert_gone

pytestmark = pytest.mark.integrations

run = asyncio.run  # SWE-agent: asyncio.run(self.deployment.runtime.<call>(...)) for each call


class Steps(DeploymentHook):
    def __init__(self) -> None:
        self.steps: list[str] = []

    def on_custom_step(self, message: str) -> None:
        self.steps.append(message)


@pytest.fixture
def deployment(local_provider: LocalProvider) -> Iterator[SandmanDeployment]:
    deployment = SandmanDeployment(image="busybox")
    hook = Steps()
    deployment.add_hook(hook)
    run(deployment.start())
    assert hook.steps == ["Acquiring sandbox"]
    yield deployment
    run(deployment.stop())
    assert_gone(local_provider)


def bash(
    runtime: SandmanRuntime,
    command: str,
    *,
    timeout: float | None = None,
    check: Literal["silent", "raise", "ignore"] = "silent",
) -> tuple[str, int | None]:
    obs = run(runtime.run_in_session(BashAction(command=command, timeout=timeout, check=check)))
    return obs.output, obs.exit_code


def test_a_session_as_swe_agent_uses_it(deployment: SandmanDeployment) -> None:
    runtime = deployment.runtime
    assert run(deployment.is_alive())
    run(runtime.write_file(WriteFileRequest(path="/root/.rc", content="export RC=sourced\n")))
    made = run(
        runtime.create_session(
            CreateBashSessionRequest(startup_source=["/root/.rc", "/root/.bashrc"])
        )
    )
    assert made.output == "/root/.bashrc: No such file or directory\n"
    with pytest.raises(SessionExistsError):
        run(runtime.create_session(CreateBashSessionRequest()))

    # state persists: the startup file's exports, cd, export
    assert bash(runtime, "echo $RC") == ("sourced\n", 0)
    assert bash(runtime, "mkdir -p /tmp/sub && cd /tmp/sub && export X=1") == ("", 0)
    assert bash(runtime, "echo $X; basename $PWD") == ("1\nsub\n", 0)
    # multi-line commands, stderr merged in order
    assert bash(runtime, "echo out\necho err >&2\necho out again") == ("out\nerr\nout again\n", 0)
    # exit codes by `check`
    assert bash(runtime, "false") == ("", 1)
    assert bash(runtime, "false", check="ignore") == ("", None)
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        bash(runtime, "(exit 3)", check="raise")

    # a syntax error: nothing runs, the shell's complaint is in extra_info
    with pytest.raises(BashIncorrectSyntaxError) as bad:
        bash(runtime, "export X=2; echo 'unterminated")
    assert "unterminated" in bad.value.extra_info["bash_stderr"]
    assert bash(runtime, "echo $X") == ("1\n", 0)

    # a timeout interrupts the command; SWE-agent then interrupts the session, whose state is kept
    with pytest.raises(CommandTimeoutError):
        bash(runtime, "export X=2; echo before; sleep 30; echo never", timeout=0.5)
    assert run(runtime.run_in_session(BashInterruptAction())).exit_code == 0
    assert bash(runtime, "echo $X; pwd") == ("2\n/tmp/sub\n", 0)

    run(runtime.close_session(CloseBashSessionRequest()))
    with pytest.raises(SessionDoesNotExistError):
        bash(runtime, "true")
    with pytest.raises(SessionDoesNotExistError):
        run(runtime.run_in_session(BashInterruptAction()))


def test_a_command_deaf_to_ctrl_c_costs_the_session_not_the_run(
    deployment: SandmanDeployment,
) -> None:
    runtime = deployment.runtime
    run(runtime.create_session(CreateBashSessionRequest(session="s")))
    run(runtime.run_in_session(BashAction(command="export X=1", session="s")))
    deaf = BashAction(command="trap '' INT; sleep 30", timeout=0.3, session="s")
    with pytest.raises(CommandTimeoutError):
        run(runtime.run_in_session(deaf))
    # killed after its grace; the interrupt brings a fresh shell (its state is gone)
    assert run(runtime.run_in_session(BashInterruptAction(session="s"))).exit_code == 0
    obs = run(runtime.run_in_session(BashAction(command="echo [$X]", session="s")))
    assert (obs.output, obs.exit_code) == ("[]\n", 0)
    # so does a command after `exit`
    run(runtime.run_in_session(BashAction(command="exit 4", session="s", check="silent")))
    obs = run(runtime.run_in_session(BashAction(command="echo back", session="s")))
    assert obs.output == "back\n"


def test_a_slow_startup_file_times_out_but_leaves_the_session(
    deployment: SandmanDeployment,
) -> None:
    runtime = deployment.runtime
    run(runtime.write_file(WriteFileRequest(path="/root/.slow", content="sleep 30\n")))
    slow = CreateBashSessionRequest(startup_source=["/root/.slow"], startup_timeout=0.3)
    with pytest.raises(CommandTimeoutError):
        run(runtime.create_session(slow))
    with pytest.raises(SessionExistsError):  # registered all the same, as SWE-ReX does
        run(runtime.create_session(slow))
    assert bash(runtime, "echo ok") == ("ok\n", 0)


# A REPL: a prompt, each line answered with the session's state, "quit" to leave.
REPL = (
    "printf 'ready> '; while read -r l; do [ \"$l\" = quit ] && exit; "
    "echo \"[$l $X $(basename $PWD)]\"; printf 'ready> '; done"
)


def interactive(
    runtime: SandmanRuntime, command: str, expect: list[str], *, quit: bool = False
) -> tuple[str, str]:
    action = BashAction(
        command=command,
        is_interactive_command=not quit,
        is_interactive_quit=quit,
        expect=expect,
        timeout=10,
    )
    obs = run(runtime.run_in_session(action))
    assert obs.exit_code == 0
    return obs.output, obs.expect_string


def test_an_interactive_program_as_swe_agent_drives_it(deployment: SandmanDeployment) -> None:
    runtime = deployment.runtime
    run(runtime.create_session(CreateBashSessionRequest()))
    assert bash(runtime, "mkdir -p /tmp/repl && cd /tmp/repl && export X=1") == ("", 0)
    # Started in the session's directory with its exports; read up to the prompt.
    assert interactive(runtime, REPL, ["ready> "]) == ("", "ready> ")
    # Typed in: the answer without the echo of what was typed; patterns are regexes.
    assert interactive(runtime, "hello", ["ready> "]) == ("[hello 1 repl]", "ready> ")
    assert interactive(runtime, "again", [r"r\w+y> "]) == ("[again 1 repl]", r"r\w+y> ")
    with pytest.raises(CommandTimeoutError):
        run(
            runtime.run_in_session(
                BashAction(
                    command="slow", is_interactive_command=True, expect=["never"], timeout=0.5
                )
            )
        )
    # The plain session goes on meanwhile.
    assert bash(runtime, "echo $X") == ("1\n", 0)
    # Quitting ends it (its end is the match, as the shell's prompt is in SWE-ReX).
    output, matched = interactive(runtime, "quit", ["never"], quit=True)
    assert "quit" in output and matched == ""
    # Ctrl-C goes to a program that runs, then the shell has it again.
    assert interactive(runtime, REPL, ["ready> "]) == ("", "ready> ")
    assert run(runtime.run_in_session(BashInterruptAction(timeout=5))).exit_code == 0
    assert interactive(runtime, REPL, ["ready> "]) == ("", "ready> ")  # a new one
    run(runtime.close_session(CloseBashSessionRequest()))
    left = run(runtime.execute(Command(command="ps", shell=True))).stdout
    assert "read -r" not in left  # closing the session ended its program


def test_what_an_interactive_program_prints_is_bounded(local_provider: LocalProvider) -> None:
    deployment = SandmanDeploymentConfig(image="busybox", max_output=1 << 20).get_deployment()
    run(deployment.start())
    try:
        runtime = deployment.runtime
        run(runtime.create_session(CreateBashSessionRequest()))
        # 3 MB before the prompt: the tail (where the prompt is) is kept, 1 MiB of it.
        flood = "head -c 3000000 /dev/zero | tr '\\0' a; printf 'ready> '"
        output, matched = interactive(runtime, flood, ["ready> "])
        assert matched == "ready> " and output.startswith("[... output before the last")
        assert output.endswith("a" * 1000) and len(output) < (1 << 20) + 100
    finally:
        run(deployment.stop())
    assert_gone(local_provider)


def test_execute_is_subprocess_run(deployment: SandmanDeployment) -> None:
    runtime = deployment.runtime
    done = run(runtime.execute(Command(command=["sh", "-c", "echo o; echo e >&2; exit 3"])))
    assert (done.stdout, done.stderr, done.exit_code) == ("o\n", "e\n", 3)
    merged = run(
        runtime.execute(
            Command(command="echo o; echo e >&2", shell=True, merge_output_streams=True)
        )
    )
    assert (merged.stdout, merged.stderr, merged.exit_code) == ("o\ne\n", "", 0)
    there = run(
        runtime.execute(Command(command="echo $V; pwd", shell=True, env={"V": "v"}, cwd="/tmp"))
    )
    assert there.stdout == "v\n/tmp\n"
    # env replaces the environment, as subprocess.run(env=) does in SWE-ReX's own runtime
    only = run(runtime.execute(Command(command=["env"], env={"V": "v w", "PATH": "/bin"})))
    assert sorted(only.stdout.splitlines()) == ["PATH=/bin", "V=v w"]
    bare = Command(command="echo ${HOME-unset} ${V-unset}; ls -d /", shell=True, env={})
    assert run(runtime.execute(bare)).stdout == "unset unset\n/\n"  # found without PATH too
    assert run(runtime.execute(Command(command="echo $HOME", shell=True))).stdout == "/root\n"
    with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
        run(runtime.execute(Command(command="false", shell=True, check=True)))
    with pytest.raises(CommandTimeoutError):
        run(runtime.execute(Command(command=["sleep", "30"], timeout=0.3)))
    assert run(runtime.execute(Command(command="true", shell=True))).exit_code == 0


def test_files_round_trip(deployment: SandmanDeployment, tmp_path: Path) -> None:
    runtime = deployment.runtime
    run(runtime.write_file(WriteFileRequest(path="/root/tools/deep/a.txt", content="é\nline\n")))
    read = run(runtime.read_file(ReadFileRequest(path="/root/tools/deep/a.txt")))
    assert read.content == "é\nline\n"
    latin = run(
        runtime.read_file(ReadFileRequest(path="/root/tools/deep/a.txt", encoding="latin-1"))
    )
    assert latin.content == "Ã©\nline\n"
    run(runtime.execute(Command(command="printf 'a\\r\\nb' > /tmp/crlf", shell=True)))
    assert run(runtime.read_file(ReadFileRequest(path="/tmp/crlf"))).content == "a\nb"
    with pytest.raises(FileNotFoundError):
        run(runtime.read_file(ReadFileRequest(path="/nope")))

    (tmp_path / "bundle" / "bin").mkdir(parents=True)
    (tmp_path / "bundle" / "bin" / "tool").write_text("#!/bin/sh\necho tool ran\n")
    (tmp_path / "bundle" / "bin" / "tool").chmod(0o755)
    (tmp_path / "single.txt").write_text("single\n")
    run(
        runtime.upload(
            UploadRequest(source_path=str(tmp_path / "bundle"), target_path="/root/tools/bundle")
        )
    )
    run(
        runtime.upload(
            UploadRequest(source_path=str(tmp_path / "single.txt"), target_path="/root/x/s.txt")
        )
    )
    assert (
        run(runtime.execute(Command(command=["/root/tools/bundle/bin/tool"]))).stdout
        == "tool ran\n"
    )
    assert run(runtime.read_file(ReadFileRequest(path="/root/x/s.txt"))).content == "single\n"
    with pytest.raises(ValueError, match="not a file or directory"):
        run(runtime.upload(UploadRequest(source_path=str(tmp_path / "nope"), target_path="/x")))


def test_stop_releases_everything(local_provider: LocalProvider) -> None:
    deployment = SandmanDeploymentConfig(image="busybox").get_deployment()
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime  # noqa: B018
    with pytest.raises(DeploymentNotStartedError):
        run(deployment.is_alive())
    run(deployment.start())
    runtime = deployment.runtime
    run(runtime.create_session(CreateBashSessionRequest()))
    run(runtime.create_session(CreateBashSessionRequest(session="second")))
    assert bash(runtime, "sleep 1000 > /dev/null 2>&1 &") == ("", 0)  # a background job too
    run(runtime.close())
    run(deployment.stop())
    run(deployment.stop())  # idempotent
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime  # noqa: B018
    assert_gone(local_provider)
    # the runtime of a stopped deployment fails as SWE-agent expects of an environment error
    with pytest.raises(SandmanRuntimeError) as gone:
        run(runtime.execute(Command(command=["true"])))
    assert isinstance(gone.value, SwerexException)
    assert isinstance(gone.value.__cause__, SandboxNotFound)
    assert not run(runtime.is_alive())


def test_a_dropped_deployment_releases_its_sandbox(local_provider: LocalProvider) -> None:
    deployment = SandmanDeployment(image="busybox")
    run(deployment.start())
    del deployment
    gc.collect()
    assert_gone(local_provider)


def test_a_start_that_fails_is_a_startup_error(local_provider: LocalProvider) -> None:
    deployment = SandmanDeployment(image="no-such-image")
    with pytest.raises(DeploymentStartupError) as failed:
        run(deployment.start())
    assert isinstance(failed.value.__cause__, ImageNotFound)
    with pytest.raises(ValueError, match="imag"):
        SandmanDeployment(imag="busybox")
