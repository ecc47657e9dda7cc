"""The inspect_ai adapter: evals with inspect's mock model, the registry through the entry
point, and the contract's corners the conformance suite does not reach."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, generate, solver, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import (
    OutputLimitExceededError,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandbox,
)
from inspect_ai.util._sandbox.limits import override_max_exec_output_size

from sandman.integrations.inspect_ai import (
    SandmanSandboxEnvironment,
    SandmanSandboxEnvironmentConfig,
)
from sandman.providers.local import LocalProvider
from tests.integrations.conftest import needs_local
from tests.integrations.images import BUSYBOX, INSPECT_IMAGE

pytestmark = pytest.mark.integrations

ROOT = Path(__file__).resolve().parents[2]
MODEL = "mockllm/model"


@scorer(metrics=[accuracy()])  # type: ignore[untyped-decorator]
def answer_file() -> object:
    """Correct when the sandbox's ``answer.txt`` holds the target."""

    async def score(state: TaskState, target: Target) -> Score:
        answer = await sandbox().read_file("answer.txt")
        return Score(value="C" if answer.strip() == target.text else "I", answer=answer)

    return score


@solver  # type: ignore[untyped-decorator]
def shout() -> object:
    """Scripted: the sample's input, upper-cased by a command, into ``answer.txt``."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        await sandbox().write_file("said.txt", state.input_text)
        result = await sandbox().exec(["sh", "-c", "tr a-z A-Z < said.txt > answer.txt"])
        assert result.success, result.stderr
        return state

    return solve


def _inspects_own_warnings(test: Callable[..., None]) -> Callable[..., None]:
    """What inspect itself warns of, whatever the sandbox (its own "local" too): a memory
    stream per sample left unclosed (collected in `_run`, where the filter applies), and
    its model retries calling tenacity with a deprecated parameter."""
    for ignored in (
        "ignore:Unclosed <MemoryObjectReceiveStream:ResourceWarning",
        "ignore:The 'initial' parameter is deprecated:DeprecationWarning",
    ):
        test = pytest.mark.filterwarnings(ignored)(test)
    return test


def _run(task: Task, log_dir: Path, **kwargs: object) -> EvalLog:
    [log] = eval(task, display="none", log_dir=str(log_dir), ctl_server=False, **kwargs)
    gc.collect()
    assert log.status == "success", log.error
    return log


def _accuracy(log: EvalLog) -> float:
    assert log.results is not None
    return log.results.scores[0].metrics["accuracy"].value


@needs_local
@_inspects_own_warnings
def test_an_eval_with_a_scripted_solver(busybox_provider: LocalProvider, tmp_path: Path) -> None:
    config = SandmanSandboxEnvironmentConfig(
        image=INSPECT_IMAGE, workdir="/task", cpu=0.5, memory="256Mi"
    )
    words = ["alpha", "beta", "gamma"]
    task = Task(
        dataset=[
            Sample(input=word, target=word.upper(), files={"given.txt": word}) for word in words
        ],
        solver=shout(),
        scorer=answer_file(),
        sandbox=("sandman", config),
    )
    log = _run(task, tmp_path, model=MODEL)
    assert _accuracy(log) == 1.0
    assert log.samples is not None and len(log.samples) == 3
    # The config is in the log as given, and nothing in it is a secret.
    assert log.eval.sandbox is not None and log.eval.sandbox.config == config


@needs_local
@_inspects_own_warnings
def test_an_eval_whose_model_calls_the_bash_tool(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)  # else tiktoken, online
    outputs = [
        ModelOutput.for_tool_call(MODEL, "bash", {"command": "echo 42 > answer.txt; echo ok"}),
        ModelOutput.from_content(MODEL, "done"),
    ]
    for output in outputs:
        output.usage = usage
    task = Task(
        dataset=[Sample(input="write 42 to answer.txt", target="42")],
        solver=[use_tools([bash(timeout=30)]), generate()],
        scorer=answer_file(),
        sandbox=("sandman", SandmanSandboxEnvironmentConfig(image=INSPECT_IMAGE)),
    )
    log = _run(task, tmp_path, model=get_model(MODEL, custom_outputs=outputs))
    assert _accuracy(log) == 1.0
    assert log.samples is not None
    tool_messages = [m for m in log.samples[0].messages if m.role == "tool"]
    assert [m.text for m in tool_messages] == ["ok\n"]


def _entry_point(tmp_path: Path) -> Path:
    """A distribution's metadata declaring pyproject.toml's ``inspect_ai`` entry points,
    as ``pip install sandman-rl`` writes them (the shared venv may predate them)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    points = project["project"]["entry-points"]["inspect_ai"]
    assert points == {"sandman": "sandman.integrations.inspect_ai"}
    info = tmp_path / "site" / "sandman_rl_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sandman-rl-entry-points\n")
    lines = [f"{name} = {target}" for name, target in points.items()]
    (info / "entry_points.txt").write_text("[inspect_ai]\n" + "\n".join(lines) + "\n")
    return info.parent


def _fresh_python(code: str, site: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "src")])
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_inspect_finds_the_provider_through_the_entry_point(tmp_path: Path) -> None:
    found = _fresh_python(
        "import sys\n"
        "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
        "assert 'sandman' not in sys.modules\n"
        "print(registry_find_sandboxenv('sandman').__qualname__)\n",
        _entry_point(tmp_path),
    )
    assert found.strip() == "SandmanSandboxEnvironment"


def test_a_log_reads_back_with_its_config(tmp_path: Path) -> None:
    config = SandmanSandboxEnvironmentConfig(image="img", cpu=0.5, network="egress")
    log_file = tmp_path / "log.json"
    spec = {"type": "sandman", "config": config.model_dump(mode="json")}
    header = {
        "task": "t", "task_id": "1", "run_id": "1", "created": "2026-01-01T00:00:00",
        "dataset": {}, "model": MODEL, "config": {}, "sandbox": spec,
    }  # fmt: skip
    log = {"version": 2, "status": "started", "eval": header, "plan": {}, "samples": []}
    log_file.write_text(json.dumps(log))
    said = _fresh_python(
        "from inspect_ai.log import read_eval_log\n"
        f"log = read_eval_log({str(log_file)!r})\n"
        "print(type(log.eval.sandbox.config).__name__, log.eval.sandbox.config.model_dump_json())\n",
        _entry_point(tmp_path),
    )
    name, dumped = said.split(" ", 1)
    assert name == "SandmanSandboxEnvironmentConfig"
    assert SandmanSandboxEnvironmentConfig.model_validate_json(dumped) == config


# -- the contract's corners ----------------------------------------------------------------


def test_configs_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="image"):
        SandmanSandboxEnvironmentConfig.model_validate({})
    with pytest.raises(ValueError, match="invalid sandman sandbox config"):
        SandmanSandboxEnvironmentConfig(image="x", memory="1Ki")
    with pytest.raises(ValueError, match="api_key"):  # keys come from the environment only
        SandmanSandboxEnvironmentConfig.model_validate({"image": "x", "api_key": "secret"})


@pytest.mark.anyio
async def test_a_dockerfile_or_no_config_is_refused() -> None:
    with pytest.raises(ValueError, match="it does not build them"):
        await SandmanSandboxEnvironment.task_init("t", "/task/compose.yaml")
    with pytest.raises(ValueError, match="needs an image"):
        await SandmanSandboxEnvironment.sample_init("t", None, {})


@pytest.fixture
async def environment(
    busybox_provider: LocalProvider,
) -> AsyncIterator[SandmanSandboxEnvironment]:
    config = SandmanSandboxEnvironmentConfig(image=BUSYBOX)
    await SandmanSandboxEnvironment.task_init("t", config)
    environments = await SandmanSandboxEnvironment.sample_init("t", config, {})
    env = environments["default"]
    assert isinstance(env, SandmanSandboxEnvironment)
    try:
        yield env
    finally:
        await SandmanSandboxEnvironment.sample_cleanup("t", config, environments, False)
        await SandmanSandboxEnvironment.task_cleanup("t", config, True)


@needs_local
@pytest.mark.anyio
async def test_output_past_the_limit_raises(environment: SandmanSandboxEnvironment) -> None:
    with override_max_exec_output_size(1024), pytest.raises(OutputLimitExceededError) as caught:
        await environment.exec(["sh", "-c", "yes | head -c 5000"])
    assert caught.value.truncated_output == "y\n" * 512


@needs_local
@pytest.mark.anyio
async def test_large_binary_stdin_goes_through_a_pipe(
    environment: SandmanSandboxEnvironment,
) -> None:
    payload = bytes(range(256)) * (40 * 1024 * 4)  # 40 MiB: base64 would not fit a request
    result = await environment.exec(["sh", "-c", "wc -c; head -c 3 >&2"], input=payload)
    assert (result.returncode, result.stdout.strip()) == (0, str(len(payload)))
    with pytest.raises(TimeoutError, match="timed out after 1 seconds"):
        await environment.exec(["sleep", "30"], input=payload, timeout=1)


@needs_local
@pytest.mark.anyio
async def test_a_released_sandbox_is_unavailable(environment: SandmanSandboxEnvironment) -> None:
    await environment.sandbox.release()
    with pytest.raises(SandboxUnavailableError):
        await environment.exec(["true"])
    with pytest.raises(SandboxUnavailableError):
        await environment.read_file("/etc/passwd")


@needs_local
@pytest.mark.anyio
async def test_a_sandbox_of_another_user_cannot_switch_users(
    busybox_provider: LocalProvider,
) -> None:
    config = SandmanSandboxEnvironmentConfig(image=BUSYBOX, user="nobody", workdir="/tmp")
    await SandmanSandboxEnvironment.task_init("t", config)
    environments = await SandmanSandboxEnvironment.sample_init("t", config, {})
    env = environments["default"]
    try:
        assert (await env.exec(["id", "-u"])).stdout == "65534\n"
        assert (await env.exec(["id", "-u"], user="nobody")).stdout == "65534\n"
        with pytest.raises(SandboxUserUnsupportedError, match="cannot run commands as 'root'"):
            await env.exec(["id", "-u"], user="root")
    finally:
        await SandmanSandboxEnvironment.sample_cleanup("t", config, environments, False)
        await SandmanSandboxEnvironment.task_cleanup("t", config, True)
