"""Both adapters on a real distribution image (Debian with bash, Python and git, built offline
by debootstrap and cached): their defaults as the frameworks use them, a SWE-bench-like task
in ``/testbed``, bash's own syntax check, SWE-agent's ``/root/.bashrc``."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest

pytest.importorskip("minisweagent")
pytest.importorskip("swerex")

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output
from swerex.exceptions import BashIncorrectSyntaxError, CommandTimeoutError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CreateBashSessionRequest,
    ReadFileRequest,
)

from sandman.integrations.swerex import SandmanDeployment
from sandman.providers.local import LocalProvider
from tests.images.debian import debian_python_tar
from tests.integrations.conftest import adapters_on, state_with
from tests.integrations.test_minisweagent import CLASS_PATH, agent_config, observations

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the image
]

IMAGE = "debian-python"
REPO = (
    "mkdir -p /testbed && cd /testbed && git init -q && printf 'def add(a, b):\\n"
    "    return a - b\\n' > calc.py && git add . && git -c user.name=t -c user.email=t@t "
    "commit -qm init"
)


@pytest.fixture(scope="module")
def debian() -> Iterator[LocalProvider]:
    with state_with({IMAGE: debian_python_tar()}) as provider:
        yield provider


@pytest.fixture
def on_debian(debian: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with adapters_on(debian, monkeypatch):
        yield


@pytest.mark.usefixtures("on_debian")
def test_mini_fixes_a_repository_and_submits_its_diff() -> None:
    # mini's defaults: bash -lc, one fresh shell per command
    env = get_environment({"environment_class": CLASS_PATH, "image": IMAGE, "cwd": "/testbed"})
    setup = env.execute({"command": REPO}, cwd="/")
    assert setup["returncode"] == 0, setup
    steps = [
        "python3 -B -c 'import calc; assert calc.add(2, 3) == 5'",  # -B: no stale .pyc
        "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; print(calc.add(2, 3))'",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff",
    ]
    model = DeterministicModel(outputs=[make_output("", [{"command": c}]) for c in steps])
    agent = DefaultAgent(model, env, **agent_config())
    info = agent.run("make add add")
    failing, fixed = [m["extra"] for m in observations(agent)][:2]
    # a traceback goes to stderr: merged, its last line (the error) there
    assert failing["returncode"] == 1
    assert failing["raw_output"].rstrip().endswith("AssertionError")
    assert fixed["raw_output"] == "5\n"
    assert info["exit_status"] == "Submitted"
    assert info["submission"].startswith("diff --git a/calc.py b/calc.py")
    assert "+    return a + b" in info["submission"]
    env.cleanup()


@pytest.mark.usefixtures("on_debian")
def test_swe_agent_start_up_and_a_bash_session() -> None:
    deployment = SandmanDeployment(image=IMAGE)
    run = asyncio.run
    run(deployment.start())
    runtime = deployment.runtime
    # SWEEnv._init_deployment, then set_env_variables and reset
    run(runtime.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"])))
    for command in ("export LANG=C.UTF-8 && export LC_ALL=C.UTF-8", "cd /", REPO):
        obs = run(runtime.run_in_session(BashAction(command=command, timeout=60, check="silent")))
        assert obs.exit_code == 0, obs.output
    bashisms = "declare -a xs=(1 2); [[ ${#xs[@]} == 2 ]] && echo $LANG $(pwd)"
    obs = run(runtime.run_in_session(BashAction(command=bashisms)))
    assert obs.output == "C.UTF-8 /testbed\n"
    with pytest.raises(BashIncorrectSyntaxError) as bad:
        run(runtime.run_in_session(BashAction(command="if true; then echo")))
    assert "syntax error" in bad.value.extra_info["bash_stderr"]
    with pytest.raises(CommandTimeoutError):
        run(runtime.run_in_session(BashAction(command="python3 -c 'while 1: pass'", timeout=0.5)))
    run(runtime.run_in_session(BashInterruptAction()))
    obs = run(runtime.run_in_session(BashAction(command="git status --short; echo $LC_ALL")))
    assert obs.output == "C.UTF-8\n"
    assert (
        "return a - b" in run(runtime.read_file(ReadFileRequest(path="/testbed/calc.py"))).content
    )
    run(deployment.stop())
