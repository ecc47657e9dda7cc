"""mini-swe-agent's own DefaultAgent, driven by its DeterministicModel (scripted actions, no
LLM), with SandmanEnvironment selected by class path, on the local provider."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("minisweagent")

from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from sandman.errors import SandboxNotFound
from sandman.integrations import minisweagent as mini
from sandman.integrations._client import ENV_API_KEY, ENV_STATE_DIR, ENV_URL, close_shared
from sandman.providers.local import LocalProvider
from tests.integrations.conftest import assert_gone, leftovers

pytestmark = pytest.mark.integrations

CLASS_PATH = "sandman.integrations.minisweagent.SandmanEnvironment"
# busybox has no bash: sh is the interpreter.
ENV: dict[str, Any] = {"image": "busybox", "interpreter": ["sh", "-c"], "cwd": "/tmp", "timeout": 2}


def agent_config() -> dict[str, Any]:
    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())["agent"]
    return {**config, "cost_limit": 100.0}  # the default (3.0 at 1.0 a call) stops it early


def observations(agent: DefaultAgent) -> list[dict[str, Any]]:
    return [m for m in agent.messages if m.get("role") == "user"][1:]  # after the task


def test_the_agent_runs_a_task_to_its_submission(
    local_provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDMAN_API_KEY", "sk-never-in-a-trajectory")
    env = get_environment({"environment_class": CLASS_PATH, **ENV})
    assert isinstance(env, mini.SandmanEnvironment)
    steps = [
        "mkdir -p w && cd w && printf 'a\\n' > f.txt && echo made >&2",
        "cat w/f.txt; exit 3",
        "echo partial; sleep 30",
        "echo after the timeout",
        "seq 1 200000",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat w/f.txt",
    ]
    model = DeterministicModel(
        outputs=[make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(steps)]
    )
    agent = DefaultAgent(model, env, **agent_config())
    env.config.output_keep = 2000  # so that step 4's output is cut

    info = agent.run("make a file and submit it")

    assert info["exit_status"] == "Submitted"
    assert info["submission"] == "a\n"
    made, cat, timed_out, after, long, *_ = observations(agent)
    # stderr merged into the output
    assert made["extra"]["raw_output"] == "made\n"
    # files persist between calls; the exit code is data
    assert cat["extra"]["returncode"] == 3
    assert cat["extra"]["raw_output"] == "a\n"
    # a timeout: -1, partial output, the exception says so; the next call works
    assert timed_out["extra"]["returncode"] == -1
    assert timed_out["extra"]["raw_output"] == "partial\n"
    assert "timed out after 2 seconds" in timed_out["extra"]["exception_info"]
    assert timed_out["extra"]["exception_type"] == "TimeoutExpired"
    assert after["extra"]["raw_output"] == "after the timeout\n"
    assert after["extra"]["returncode"] == 0
    # a long output: its head and its tail reach the model, the middle is elided
    raw = long["extra"]["raw_output"]
    assert raw.startswith("1\n2\n3\n")
    assert raw.endswith("199999\n200000\n")
    assert "characters elided" in raw
    assert len(raw) < 2100
    # no secret in the trajectory
    assert "sk-never" not in json.dumps(agent.serialize())
    assert agent.serialize()["info"]["config"]["environment_type"] == CLASS_PATH

    # mini 1.x's calling form (SkyRL): a string
    assert env.execute("echo hi") == {"output": "hi\n", "returncode": 0, "exception_info": ""}
    env.cleanup()
    env.cleanup()  # idempotent
    assert_gone(local_provider)


def test_mini_1x_timeouts_raise_and_submissions_are_left_to_the_agent(
    local_provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mini, "MINI_MAJOR", 1)
    env = mini.SandmanEnvironment(**ENV)
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        env.execute("echo partial; sleep 30", timeout=1)
    assert expired.value.output == b"partial\n"
    assert expired.value.timeout == 1
    out = env.execute("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo patch")
    assert out["output"] == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\npatch\n"
    env.cleanup()


def test_a_dropped_environment_releases_its_sandbox(local_provider: LocalProvider) -> None:
    # mini's runners never call cleanup: they drop the environment.
    env = mini.SandmanEnvironment(**ENV)
    assert env.execute({"command": "true"})["returncode"] == 0
    assert leftovers(local_provider)
    del env
    gc.collect()
    assert_gone(local_provider)


def test_a_released_sandbox_ends_the_run(local_provider: LocalProvider) -> None:
    env = mini.SandmanEnvironment(**ENV)
    env.cleanup()
    with pytest.raises(SandboxNotFound):
        env.execute({"command": "true"})


def test_the_exit_is_quiet_when_the_service_is_already_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("prometheus_client")  # the server extra
    from tests.server.conftest import KEY_A, serve

    monkeypatch.delenv(ENV_STATE_DIR, raising=False)
    with serve() as served:
        monkeypatch.setenv(ENV_URL, served.url)
        monkeypatch.setenv(ENV_API_KEY, KEY_A)
        env = mini.SandmanEnvironment(image="task", interpreter=["sh", "-c"], timeout=2)
        assert env.execute({"command": "true"})["returncode"] == 0
    # The run's end stopped the service first; then the process exits (atexit: close_shared).
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        close_shared()
    # Nothing a user sees at the default level; the remote client says at INFO why.
    said = [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno > logging.INFO]
    assert said == []
    assert "not closed, the service is not reached" in caplog.text
    del env


def test_unknown_settings_are_refused(local_provider: LocalProvider) -> None:
    with pytest.raises(ValueError, match="timout"):
        mini.SandmanEnvironment(image="busybox", timout=3)


def test_the_swebench_image_of_an_instance() -> None:
    assert mini.swebench_image({"instance_id": "x", "image_name": "img:1"}) == "img:1"
    assert mini.swebench_image({"instance_id": "x", "docker_image": "img:2"}) == "img:2"
    assert mini.swebench_image({"instance_id": "django__django-11099"}) == (
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert mini.swebench_image({"instance_id": "A__b-1"}, "SWE-Gym/SWE-Gym") == (
        "xingyaoww/sweb.eval.x86_64.a_s_b-1:latest"
    )


def test_get_sb_environment_gives_the_instance_image_and_runs_the_startup_command(
    local_provider: LocalProvider,
) -> None:
    config = {
        "environment": {"environment_class": "docker", **ENV, "image": "ignored"},
        "run": {"env_startup_command": "echo {{ instance_id }} > /tmp/id"},
    }
    env = mini.get_sb_environment(config, {"instance_id": "a__b", "image_name": "busybox"})
    assert env.config.image == "busybox"
    assert env.execute({"command": "cat /tmp/id"})["output"] == "a__b\n"
    env.cleanup()

    config["run"] = {"env_startup_command": "exit 7"}
    with pytest.raises(RuntimeError, match="startup command"):
        mini.get_sb_environment(config, {"instance_id": "a__b", "image_name": "busybox"}, "skyrl")
    assert_gone(local_provider)


def test_mini_swebench_runner_on_sandman(local_provider: LocalProvider, tmp_path: Path) -> None:
    """``python -m sandman.integrations.minisweagent swebench``: mini's batch runner, a local
    dataset, the deterministic model, every instance in a Sandman sandbox."""
    data = tmp_path / "data"
    data.mkdir()
    instances = [
        {"instance_id": f"demo__demo-{i}", "image_name": "busybox", "problem_statement": "fix"}
        for i in (1, 2)
    ]
    (data / "test.jsonl").write_text("".join(json.dumps(i) + "\n" for i in instances))
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat /tmp/patch"
    outputs = [
        make_output("work", [{"command": "echo the-patch > /tmp/patch"}]),
        make_output("submit", [{"command": submit}]),
    ]
    config = yaml.safe_load((builtin_config_dir / "benchmarks" / "swebench.yaml").read_text())
    config["environment"] = {**ENV, "environment_class": "docker"}
    config["agent"]["cost_limit"] = 100.0
    config["model"] = {**config["model"], "model_class": "deterministic", "outputs": outputs}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable, "-m", "sandman.integrations.minisweagent", "swebench",
            "--subset", str(data), "--split", "test", "-o", str(out),
            "-c", str(tmp_path / "config.yaml"), "-m", "deterministic",
        ],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    preds = json.loads((out / "preds.json").read_text())
    assert {p["model_patch"] for p in preds.values()} == {"the-patch\n"}
    traj = json.loads((out / "demo__demo-1" / "demo__demo-1.traj.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted"
    assert traj["info"]["config"]["environment_type"] == CLASS_PATH
    assert_gone(local_provider)
