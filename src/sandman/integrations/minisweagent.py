"""mini-swe-agent on Sandman: an `Environment` whose commands run in a Sandman sandbox.

Select it in a mini config (mini resolves a dotted ``environment_class``)::

    environment:
      environment_class: sandman.integrations.minisweagent.SandmanEnvironment
      image: swebench/sweb.eval.x86_64.django_1776_django-11099:latest
      cwd: /testbed
      timeout: 60

The sandbox comes from the service at ``url`` (or ``SANDMAN_URL``; the key only
from ``SANDMAN_API_KEY``, never from the config, which mini writes into every
trajectory) or else from an embedded local pool (see ``_client``). Each command
runs as mini's docker environment runs it (``interpreter`` + command, stderr
merged into stdout, a fresh shell each time, files persisting); what the model
sees of a long output is its head and its tail.

mini's SWE-bench runners (and SkyRL's copy) give the instance's image only to
the environments they know by name; `get_sb_environment` is a drop-in that
gives it to ours, and `patch_swebench_runner` (or ``python -m
sandman.integrations.minisweagent swebench ...``) puts it under mini's runner.

Both major versions of mini are served: 2.x (``execute(action: dict)``,
``Submitted`` raised here, a timeout is an output with return code -1) and the
1.x calling form SkyRL uses (``execute(command: str)``, a timeout raises
``subprocess.TimeoutExpired``, the agent detects the submission itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Literal

import minisweagent
from jinja2 import StrictUndefined, Template
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field

from sandman.client import AsyncSandbox
from sandman.errors import ExecTimeout, SandboxError, SandboxNotFound
from sandman.integrations._client import BackgroundClient, shared_client
from sandman.integrations._output import DEFAULT_KEEP, DEFAULT_READ_LIMIT, run_kept

__all__ = [
    "SandmanEnvironment",
    "SandmanEnvironmentConfig",
    "get_sb_environment",
    "main",
    "patch_swebench_runner",
    "swebench_image",
]

logger = logging.getLogger(__name__)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

MINI_MAJOR = int(minisweagent.__version__.split(".")[0])
"""The installed mini's major version: 1.x and 2.x differ in timeouts and submissions."""


class SandmanEnvironmentConfig(BaseModel):
    """A `SandmanEnvironment`'s settings: the keys under ``environment:`` in a mini config.

    The command fields are those of mini's ``DockerEnvironmentConfig``; the sandbox
    fields are `sandman.SandboxSpec`'s. No secret goes here: the service's key
    comes from ``SANDMAN_API_KEY`` only (mini serializes this config into
    every trajectory).
    """

    model_config = ConfigDict(extra="forbid")

    image: str
    """The task image (a Sandman image reference)."""
    cwd: str = ""
    """Working directory of each command; empty: the image's."""
    env: dict[str, str] = {}
    """Environment variables set for each command."""
    forward_env: list[str] = []
    """Host variables passed on to each command when set on the host (``env`` wins)."""
    timeout: int = 30
    """Seconds a command may run unless the caller gives its own."""
    interpreter: list[str] = ["bash", "-lc"]
    """Each command runs as ``[*interpreter, command]`` (``["sh", "-c"]`` for images without bash)."""
    output_keep: int = Field(default=DEFAULT_KEEP, ge=2)
    """Characters of a command's output handed back: its first and last halves, the middle
    elided (mini's own templates then show the model a head and a tail of that)."""
    output_read_limit: int = Field(default=DEFAULT_READ_LIMIT, ge=1)
    """Bytes of a command's output read from the sandbox at most; the rest is dropped there."""

    cpu: float = 1.0
    """CPU cores (a hard limit)."""
    memory: str | int = "2Gi"
    """Memory limit (bytes, or ``"2Gi"``)."""
    network: Literal["none", "isolated", "egress"] = "none"
    """The sandbox's network."""
    spec: dict[str, Any] = {}
    """Other `sandman.SandboxSpec` fields (``pids``, ``disk``, ``user``, ``workdir``, ``labels``...)."""

    url: str | None = None
    """A Sandman service; None: ``SANDMAN_URL`` if set, else the embedded local pool."""
    acquire_timeout: float | None = None
    """Seconds to wait for a sandbox (``CreateTimeout`` past it); None: as long as it takes."""


class SandmanEnvironment:
    """mini-swe-agent's ``Environment`` protocol over one Sandman sandbox.

    The sandbox is acquired in the constructor (blocking; ``CreateTimeout`` or
    ``ImageNotFound`` propagate, which mini records as the instance's exit
    status) and released by `cleanup` (mini's runners leave that to ``__del__``).
    """

    def __init__(
        self,
        *,
        config_class: type[SandmanEnvironmentConfig] = SandmanEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._client: BackgroundClient = shared_client(self.config.url)
        self._sandbox: AsyncSandbox | None = None
        spec = {
            "cpu": self.config.cpu, "memory": self.config.memory,
            "network": self.config.network, **self.config.spec,
        }  # fmt: skip
        self._sandbox = self._client.call(
            self._client.client.acquire, self.config.image,
            timeout=self.config.acquire_timeout, **spec,
        )  # fmt: skip
        self.logger.info("acquired sandbox %s (%s)", self._sandbox.id, self.config.image)

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox's id; None once released."""
        return self._sandbox.id if self._sandbox is not None else None

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                },
            }
        }

    def _env(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        return {**forwarded, **self.config.env}

    def execute(
        self, action: dict[str, Any] | str, cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run one command (``action["command"]``, or the string itself, as mini 1.x passes it).

        Returns ``{"output", "returncode", "exception_info"}`` (plus ``"extra"`` on
        an error). Under mini 2.x a timeout is such an output with return code
        -1, and a first output line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
        (exit 0) raises ``Submitted`` with the rest as the submission; under 1.x
        a timeout raises ``subprocess.TimeoutExpired``. A sandbox that is gone
        (lost, expired, released) raises `SandboxNotFound`: the run ends there.
        """
        command = action if isinstance(action, str) else action.get("command", "")
        if self._sandbox is None:
            raise SandboxNotFound("the environment's sandbox was released (cleanup)")
        limit = timeout or self.config.timeout
        argv = [*self.config.interpreter, command]
        try:
            outcome = self._client.call(
                run_kept, self._sandbox, argv, cwd=cwd or self.config.cwd or None,
                env=self._env(), timeout=limit, keep=self.config.output_keep,
                read_limit=self.config.output_read_limit,
            )  # fmt: skip
        except SandboxNotFound:
            raise
        except (ExecTimeout, SandboxError) as exc:
            if MINI_MAJOR < 2 and isinstance(exc, ExecTimeout):
                raise subprocess.TimeoutExpired(argv, limit) from exc
            if MINI_MAJOR < 2:
                raise
            return _failed("", exc)
        if outcome.timed_out:
            expired = subprocess.TimeoutExpired(argv, limit, output=outcome.output.encode())
            if MINI_MAJOR < 2:
                raise expired
            return _failed(outcome.output, expired)
        output = {"output": outcome.output, "returncode": outcome.exit_code, "exception_info": ""}
        if MINI_MAJOR >= 2:
            _check_submitted(output)
        return output

    def cleanup(self) -> None:
        """Release the sandbox (idempotent; without waiting when called from a finalizer)."""
        sandbox, self._sandbox = getattr(self, "_sandbox", None), None
        if sandbox is None:
            return
        try:
            self._client.call(sandbox.release)
        except RuntimeError:  # on the client's own loop thread, or at exit
            self._client.submit(sandbox.release)
        except SandboxError as exc:
            self.logger.warning("releasing sandbox %s failed: %s", sandbox.id, exc)

    def __del__(self) -> None:
        # mini's runners never call cleanup; they drop the environment. The
        # client's close (at exit) and the pool's watchdog back this up.
        with contextlib.suppress(Exception):
            self.cleanup()


def _failed(output: str, exc: BaseException) -> dict[str, Any]:
    return {
        "output": output,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }


def _check_submitted(output: dict[str, Any]) -> None:
    from minisweagent.exceptions import Submitted  # 2.x only

    lines = output["output"].lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
        submission = "".join(lines[1:])
        raise Submitted(
            {
                "role": "exit",
                "content": submission,
                "extra": {"exit_status": "Submitted", "submission": submission},
            }
        )


# -- the SWE-bench runners -------------------------------------------------------------------


def swebench_image(instance: dict[str, Any], data_source: str | None = None) -> str:
    """An instance's image: its ``image_name`` or ``docker_image``, else the SWE-bench
    (or, when ``data_source`` names SWE-Gym, SkyRL's SWE-Gym) naming of its id."""
    image = instance.get("image_name") or instance.get("docker_image")
    if image:
        return str(image)
    iid = str(instance["instance_id"])
    if data_source is not None and "swe-gym" in data_source.lower():
        return f"xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}:latest".lower()
    return f"docker.io/swebench/sweb.eval.x86_64.{iid.replace('__', '_1776_')}:latest".lower()


def get_sb_environment(
    config: dict[str, Any], instance: dict[str, Any], data_source: str | None = None
) -> SandmanEnvironment:
    """Drop-in for ``minisweagent.run.benchmarks.swebench.get_sb_environment`` and
    SkyRL's ``mini_swe_utils.get_sb_environment`` (``data_source`` is SkyRL's third
    argument): a `SandmanEnvironment` on the instance's image, whatever
    ``environment_class`` the config names, with ``run.env_startup_command``
    (a Jinja template over the instance) run first; RuntimeError if it fails.
    """
    env_config = {**config.get("environment", {})}
    env_config.pop("environment_class", None)
    env_config["image"] = swebench_image(instance, data_source)
    env = SandmanEnvironment(**env_config)
    if startup := config.get("run", {}).get("env_startup_command"):
        command = Template(startup, undefined=StrictUndefined).render(**instance)
        out = env.execute({"command": command})
        if out["returncode"] != 0:
            env.cleanup()
            raise RuntimeError(f"Error executing startup command: {out}")
    return env


def patch_swebench_runner() -> None:
    """Make mini's SWE-bench runners (``swebench``, ``swebench_single``) use `get_sb_environment`."""
    from minisweagent.run.benchmarks import swebench, swebench_single

    swebench.get_sb_environment = get_sb_environment
    swebench_single.get_sb_environment = get_sb_environment


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m sandman.integrations.minisweagent {swebench|swebench-single} [mini's options]``:
    mini's SWE-bench runner with every instance in a Sandman sandbox."""
    args = list(sys.argv[1:] if argv is None else argv)
    runners = {"swebench": "swebench", "swebench-single": "swebench_single"}
    if not args or args[0] not in runners:
        sys.exit(
            "usage: python -m sandman.integrations.minisweagent "
            "{swebench|swebench-single} [mini's options, see --help]"
        )
    patch_swebench_runner()
    from importlib import import_module

    runner = import_module(f"minisweagent.run.benchmarks.{runners[args[0]]}")
    runner.app(args[1:], prog_name=f"sandman-mini-{args[0]}")


if __name__ == "__main__":
    # Run the imported module's main, so that the environment's class path in the
    # trajectories is sandman.integrations.minisweagent's, not __main__'s.
    from sandman.integrations.minisweagent import main as _main

    _main()
