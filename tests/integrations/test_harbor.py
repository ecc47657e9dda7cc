"""Harbor's trials on Sandman: ``harbor trials start --env sandman.integrations.harbor:...``
on the local provider (the oracle, an agent timeout, refused tasks and options), and the
environment driven directly for what a trial does not show."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("harbor")

from harbor.environments.base import ExecResult
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.config import ResourceMode
from harbor.models.trial.paths import TrialPaths

from sandman.egress import Egress
from sandman.errors import ConfigError
from sandman.integrations._client import close_loop_clients
from sandman.integrations.harbor import SandmanEnvironment
from sandman.providers.local import LocalProvider, egress, network
from tests.integrations.conftest import leftovers, needs_local
from tests.integrations.images import BUSYBOX

# A harbor CLI run starts Python, harbor and a pool: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.integrations, needs_local, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ENV = "sandman.integrations.harbor:SandmanEnvironment"
HARBOR = Path(sys.executable).parent / "harbor"

SOLVE = """\
#!/bin/sh
echo "solving in $(pwd) as $(id -un)"
echo 42 > /app/answer.txt
"""

TEST = """\
#!/bin/sh
if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def task(
    root: Path,
    *,
    image: str | None = BUSYBOX,
    solve: str = SOLVE,
    agent_timeout: float = 60.0,
    environment: str = "",
) -> Path:
    """A task directory: its image, ``solution/solve.sh``, ``tests/test.sh`` (the reward)."""
    path = root / "task"
    (path / "solution").mkdir(parents=True)
    (path / "tests").mkdir()
    (path / "environment").mkdir()
    image_line = f'docker_image = "{image}"' if image else ""
    (path / "task.toml").write_text(
        textwrap.dedent(f"""\
            schema_version = "1.4"

            [verifier]
            timeout_sec = 60.0

            [agent]
            timeout_sec = {agent_timeout}

            [environment]
            {image_line}
            workdir = "/app"
            cpus = 0.5
            memory_mb = 256
            """)
        + environment
    )
    (path / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    (path / "solution" / "solve.sh").write_text(solve)
    (path / "tests" / "test.sh").write_text(TEST)
    return path


def harbor(*args: str | Path, command: str = "trials") -> subprocess.CompletedProcess[str]:
    """``harbor trials start ARGS`` (or ``job start``), importing this tree's sandman, the
    embedded pool on the test's state directory (``SANDMAN_STATE_DIR``, `busybox_provider`)."""
    env = dict(os.environ, HARBOR_TELEMETRY="0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [str(HARBOR), command, "start", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def trial(trials: Path, *args: str | Path) -> tuple[dict[str, Any], Path]:
    """Run a trial of the oracle on Sandman; its ``result.json`` and its directory."""
    ran = harbor("-a", "oracle", "--env", ENV, "--trials-dir", trials, *args)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [result] = trials.glob("*/result.json")
    return json.loads(result.read_text()), result.parent


def test_the_oracle_solves_a_task_and_nothing_is_left(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    result, trial_dir = trial(tmp_path / "trials", "-p", task(tmp_path))
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    # solve.sh ran in the task's workdir, its output downloaded from the sandbox
    assert (trial_dir / "agent" / "oracle.txt").read_text() == "solving in /app as root\n"
    assert (trial_dir / "verifier" / "reward.txt").read_text() == "1\n"
    assert leftovers(busybox_provider) == []


def test_a_job_runs_its_trials_at_once_with_options(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    ran = harbor(
        "-p", task(tmp_path), "-a", "oracle", "--env", ENV, "-o", tmp_path / "jobs",
        "-k", "3", "-n", "3", "--ek", "acquire_timeout=60",
        command="job",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [job] = (tmp_path / "jobs").glob("*/result.json")
    stats = json.loads(job.read_text())["stats"]
    assert (stats["n_completed_trials"], stats["n_errored_trials"]) == (3, 0)
    assert stats["evals"]["oracle__adhoc"]["metrics"] == [{"mean": 1.0}]
    config = json.loads((job.parent / "config.json").read_text())
    assert config["environment"]["kwargs"] == {"acquire_timeout": 60}
    assert leftovers(busybox_provider) == []


def test_an_agent_past_its_timeout_is_stopped(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    slow = SOLVE.replace("echo 42", "sleep 60; echo 42")
    path = task(tmp_path, solve=slow, agent_timeout=1.0)
    started = time.monotonic()
    result, _ = trial(tmp_path / "trials", "-p", path)
    assert time.monotonic() - started < 30
    assert result["exception_info"]["exception_type"] == "AgentTimeoutError"
    assert result["verifier_result"]["rewards"] == {"reward": 0.0}
    assert leftovers(busybox_provider) == []


def test_a_task_without_an_image_or_a_dockerfile_is_refused(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    path = task(tmp_path, image=None)
    ran = harbor("-p", path, "-a", "oracle", "--env", ENV, "--trials-dir", tmp_path / "trials")
    said = " ".join((ran.stdout + ran.stderr).split())
    assert ran.returncode != 0
    assert "names no image and has no Dockerfile" in said, said
    assert leftovers(busybox_provider) == []


BUILT_TEST = TEST.replace(
    "= 42 ]; then", '= 42 ] && [ "$(cat /opt/built.txt)" = "built offline" ]; then'
)


def harbor_images(provider: LocalProvider) -> dict[str, str]:
    """The images the adapter built, name: id."""
    images = asyncio.run(provider.images.list())
    return {name: i.id for i in images for name in i.names if "harbor-" in name}


def test_a_task_with_only_a_dockerfile_is_built_once_and_solved(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    path = task(tmp_path, image=None)
    dockerfile = path / "environment" / "Dockerfile"
    dockerfile.write_text(f"FROM {BUSYBOX}\nCOPY built.txt /opt/built.txt\nRUN mkdir -p /app\n")
    (path / "environment" / "built.txt").write_text("built offline\n")
    (path / "tests" / "test.sh").write_text(BUILT_TEST)
    result, _ = trial(tmp_path / "trials", "-p", path)
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    [(name, first)] = harbor_images(busybox_provider).items()
    assert name.split("/")[-1].startswith("harbor-task:")

    # An unchanged task takes the image it built; a changed one is built again.
    result, _ = trial(tmp_path / "again", "-p", path)
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    assert harbor_images(busybox_provider) == {name: first}
    (path / "environment" / "built.txt").write_text("changed\n")
    result, _ = trial(tmp_path / "changed", "-p", path)
    assert result["verifier_result"]["rewards"] == {"reward": 0.0}
    assert len(harbor_images(busybox_provider)) == 2
    assert leftovers(busybox_provider) == []


def test_a_failing_dockerfile_fails_the_trial_by_its_step(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    path = task(tmp_path, image=None)
    (path / "environment" / "Dockerfile").write_text(f"FROM {BUSYBOX}\nRUN exit 3\n")
    ran = harbor("-p", path, "-a", "oracle", "--env", ENV, "--trials-dir", tmp_path / "trials")
    [result] = (tmp_path / "trials").glob("*/result.json")
    info = json.loads(result.read_text())["exception_info"]
    assert info is not None and "exit 3" in info["exception_message"], ran.stdout + ran.stderr
    assert harbor_images(busybox_provider) == {}
    assert leftovers(busybox_provider) == []


def test_the_state_dir_option_picks_the_embedded_pool_s_directory(
    busybox_provider: LocalProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without SANDMAN_STATE_DIR the default state directory would not have the image.
    monkeypatch.delenv("SANDMAN_STATE_DIR")
    state = busybox_provider.config.state_dir
    result, _ = trial(
        tmp_path / "trials", "-p", task(tmp_path), "--environment-kwarg", f"state_dir={state}"
    )
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    [config] = (tmp_path / "trials").glob("*/config.json")
    assert json.loads(config.read_text())["environment"]["kwargs"] == {"state_dir": str(state)}
    assert leftovers(busybox_provider) == []


@pytest.mark.anyio
async def test_a_state_dir_with_a_service_is_refused(tmp_path: Path) -> None:
    env = environment(tmp_path)
    env.options = SandmanEnvironment.parse_options({"url": "http://x", "state_dir": "/var/x"})
    with pytest.raises(ConfigError, match="state_dir /var/x is the embedded pool's"):
        await env.start(force_build=False)


@pytest.mark.anyio
async def test_a_service_does_not_build_a_dockerfile(tmp_path: Path) -> None:
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "Dockerfile").write_text("FROM busybox\n")
    env = environment(tmp_path, docker_image=None)
    env.options = SandmanEnvironment.parse_options({"url": "http://127.0.0.1:9"})
    with pytest.raises(ConfigError, match="does not build images: build on its host"):
        await env.start(force_build=False)
    await close_loop_clients()


def test_an_unknown_option_is_refused(busybox_provider: LocalProvider, tmp_path: Path) -> None:
    ran = harbor(
        "-p", task(tmp_path), "-a", "oracle", "--env", ENV, "--trials-dir", tmp_path / "trials",
        "--environment-kwarg", "bogus=1",
    )  # fmt: skip
    said = " ".join((ran.stdout + ran.stderr).split())
    assert ran.returncode != 0
    assert "Unknown option 'bogus'" in said, said
    assert not list((tmp_path / "trials").glob("*/result.json"))


# -- the environment itself ------------------------------------------------------------------


def environment(
    tmp_path: Path,
    *,
    network: NetworkMode = NetworkMode.NO_NETWORK,
    allowed_hosts: list[str] | None = None,
    limits: ResourceMode = ResourceMode.AUTO,
    phases: list[NetworkPolicy] | None = None,
    **config: Any,
) -> SandmanEnvironment:
    (tmp_path / "environment").mkdir(exist_ok=True)
    config.setdefault("docker_image", BUSYBOX)
    return SandmanEnvironment(
        environment_dir=tmp_path / "environment",
        environment_name="t",
        session_id="t__1__env",
        trial_paths=TrialPaths(tmp_path / "trial"),
        task_env_config=EnvironmentConfig(**config),
        network_policy=NetworkPolicy(network_mode=network, allowed_hosts=allowed_hosts or []),
        phase_network_policies=phases,
        cpu_enforcement_policy=limits,
        memory_enforcement_policy=limits,
    )


def test_the_task_s_resources_and_network_are_the_sandbox_s(tmp_path: Path) -> None:
    env = environment(
        tmp_path, cpus=0.5, memory_mb=256, storage_mb=64, workdir="/app", limits=ResourceMode.LIMIT
    )
    spec = env._spec(BUSYBOX)
    assert (spec.cpu, spec.memory, spec.disk) == (0.5, 256 * 2**20, 64 * 2**20)
    assert (spec.network, spec.workdir, spec.image) == ("none", "/app", BUSYBOX)
    public = environment(tmp_path, network=NetworkMode.PUBLIC, env={"A": "1"})._spec(BUSYBOX)
    assert (public.network, public.env) == (Egress(), {"A": "1"})
    hosts = ["example.com", "*.pythonhosted.org", "192.0.2.7", "2001:db8::/32"]
    listed = environment(tmp_path, network=NetworkMode.ALLOWLIST, allowed_hosts=hosts)
    assert listed._spec(BUSYBOX).network == Egress(allow=hosts)
    # Phases that change the policy: egress rules from the start, closed for now.
    closed = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
    phased = environment(tmp_path, phases=[closed])
    assert phased._spec(BUSYBOX).network == Egress(allow=[])
    with pytest.raises(RuntimeError, match="does not support GPU"):
        environment(tmp_path, gpus=1)
    assert SandmanEnvironment.parse_options({"url": "http://x", "acquire_timeout": "5"}) is not None


@pytest.fixture
async def started(
    busybox_provider: LocalProvider, tmp_path: Path
) -> AsyncIterator[SandmanEnvironment]:
    env = environment(tmp_path, workdir="/app", env={"FROM_TASK": "task"})
    await env.start(force_build=False)
    try:
        yield env
    finally:
        await env.stop(delete=True)
        await close_loop_clients()
    assert await asyncio.to_thread(leftovers, busybox_provider) == []


@pytest.mark.anyio
async def test_a_phase_changes_the_sandbox_s_egress_rules(
    busybox_provider: LocalProvider, tmp_path: Path
) -> None:
    setup = NetworkPolicy(network_mode=NetworkMode.PUBLIC)
    closed = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
    listed = NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org"])
    env = environment(tmp_path, network=NetworkMode.PUBLIC, phases=[closed, listed])
    await env.start(force_build=False)
    try:
        # The rules the provider's resolver and firewall hold for this sandbox now.
        _, host_if = network.names(env._require().id)
        held = egress.rules_path(busybox_provider.config.state_dir.resolve() / "network", host_if)

        def rules() -> tuple[bool, list[list[str]], int]:
            data = json.loads(held.read_text())
            return data["open"], data["allow"], data["generation"]

        # Made with egress rules (a sandbox without egress refuses new ones), open at first.
        assert rules() == (True, [], 1)
        await env.set_network_policy(closed)
        assert env.network_policy == closed and rules() == (False, [], 2)
        await env.set_network_policy(listed)
        assert env.network_policy == listed and rules() == (False, [["domain", "pypi.org"]], 3)
        await env.set_network_policy(setup)
        assert env.network_policy == setup and rules() == (True, [], 4)
    finally:
        await env.stop(delete=True)
        await close_loop_clients()
    assert await asyncio.to_thread(leftovers, busybox_provider) == []


@pytest.mark.anyio
async def test_commands_as_harbor_runs_them(started: SandmanEnvironment) -> None:
    env = started
    # sh -c (busybox has no bash), in the workdir, with the task's env and the call's
    said = await env.exec('echo "$FROM_TASK $FROM_CALL $(pwd)"; echo oops >&2; exit 3',
                          env={"FROM_CALL": "call"})  # fmt: skip
    assert said == ExecResult(stdout="task call /app\n", stderr="oops\n", return_code=3)
    assert (await env.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
    # users: the call's, the default one (the task's agent user), an unknown one
    assert (await env.exec("id -u", user="nobody")).stdout == "65534\n"
    with env.with_default_user("daemon"):
        assert (await env.exec("id -un")).stdout == "daemon\n"
    unknown = await env.exec("true", user="ghost")
    assert unknown.return_code == 126 and "unable to find user ghost" in (unknown.stderr or "")
    with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
        await env.exec("sleep 30", timeout_sec=1)
    # output as it happens, when Harbor follows a phase
    seen: list[tuple[str, str]] = []

    async def follow(text: str, stream: str) -> None:
        seen.append((stream, text))

    with env.scoped_output_callback(follow):
        streamed = await env.exec("echo out; echo err >&2")
    assert (streamed.stdout, streamed.stderr) == ("out\n", "err\n")
    assert sorted(seen) == [("stderr", "err\n"), ("stdout", "out\n")]


@pytest.mark.anyio
async def test_files_and_directories_both_ways(started: SandmanEnvironment, tmp_path: Path) -> None:
    env = started
    source = tmp_path / "up"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("a")
    (source / "sub" / "b.sh").write_text("#!/bin/sh\necho b\n")
    (source / "sub" / "b.sh").chmod(0o755)
    await env.upload_dir(source, "/srv/up")
    await env.upload_file(source / "a.txt", "/srv/one/a.txt")
    assert (await env.exec("/srv/up/sub/b.sh; cat /srv/one/a.txt")).stdout == "b\na"
    assert await env.is_dir("/srv/up/sub") and await env.is_file("/srv/up/a.txt")

    down = tmp_path / "down"
    down.mkdir()
    (down / "a.txt").write_text("stale")  # download_dir overwrites
    await env.download_dir("/srv/up", down)
    assert (down / "a.txt").read_text() == "a"
    assert (down / "sub" / "b.sh").read_text() == "#!/bin/sh\necho b\n"
    await env.download_file("/srv/one/a.txt", tmp_path / "deep" / "copy.txt")
    assert (tmp_path / "deep" / "copy.txt").read_text() == "a"


@pytest.mark.anyio
async def test_a_stopped_environment_says_so(started: SandmanEnvironment, tmp_path: Path) -> None:
    await started.stop(delete=True)
    await started.stop(delete=True)  # idempotent
    with pytest.raises(RuntimeError, match="has no sandbox"):
        await started.exec("true")
    with pytest.raises(RuntimeError, match="has no sandbox"):
        await started.download_dir("/logs/agent", tmp_path)
