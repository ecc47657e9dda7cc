"""Sandman as a Harbor environment.

```
harbor trials start -p TASK -a oracle --env sandman.integrations.harbor:SandmanEnvironment
harbor job start ... --env sandman.integrations.harbor:SandmanEnvironment --ek url=http://sandman:8080
```

Each trial's environment is a sandbox of the task's ``[environment].docker_image``,
or, for a task without one, of the image built from its ``environment/Dockerfile``
(on the embedded pool, with buildah, on first use: named by the environment
directory's content, so a trial of an unchanged task reuses it and a changed one
builds again; ``--force-build`` rebuilds without the cache), from one pool per process (paced creation, readiness, cleanup), from the
service at ``url`` or ``$SANDMAN_URL`` (key: ``$SANDMAN_API_KEY``, never an
option, so never in a trial's ``config.json``), else the embedded local pool
(on the ``state_dir`` option, else ``$SANDMAN_STATE_DIR``, else the local
provider's default). Options (`SandmanHarborOptions`): ``url``, ``state_dir``,
``acquire_timeout``, ``build_network``; anything else is refused before a trial starts.

What the task asks for maps to the sandbox: ``cpus`` (fractions too) and
``memory_mb`` are hard limits, ``storage_mb`` what it may write, ``workdir``
and ``env`` as given; network ``no-network`` is no network, ``public`` is
egress (NAT; the provider's walls stay), ``allowlist`` is egress to the
``allowed_hosts`` only (`sandman.Egress`: names, ``*.`` wildcards, addresses and
CIDRs). A trial whose phases change the policy (setup with the network, the
agent without) gets egress rules from the start, changed between phases
(`set_network_policy`); one policy throughout with no network gets no network
interface at all.
A service does not build (a task with only a Dockerfile is refused there: build
it on the service's host), and host mounts are not available. Commands run in ``bash -c``
when the image has bash, else ``sh -c``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, NetworkPolicy
from pydantic import Field

from sandman import errors
from sandman.client import AsyncSandbox
from sandman.egress import Egress
from sandman.integrations._client import loop_client
from sandman.models import ExecResult as SandmanResult
from sandman.models import SandboxSpec

__all__ = ["SandmanEnvironment", "SandmanHarborOptions"]

logger = logging.getLogger(__name__)

_MAX_OUTPUT = 16 * 2**20
"""Bytes of each output stream kept per command (the first ones)."""


def _egress(policy: NetworkPolicy) -> Egress:
    """The egress rules of a Harbor network policy."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return Egress(allow=[])
    if policy.network_mode == NetworkMode.ALLOWLIST:
        return Egress(allow=policy.allowed_hosts)
    return Egress()


class SandmanHarborOptions(EnvironmentOptions):
    """``--ek`` (``harbor job start``) / ``--environment-kwarg`` (``harbor trials start``)."""

    url: str | None = None
    """The Sandman service; default ``$SANDMAN_URL``, else an embedded local pool."""
    state_dir: str | None = None
    """The embedded local pool's state directory (its images and sandboxes); default
    ``$SANDMAN_STATE_DIR``, else the local provider's. Refused with a service."""
    acquire_timeout: float | None = Field(default=None, gt=0)
    """Seconds to wait for a sandbox before the trial fails (`CreateTimeout`)."""
    build_network: bool = False
    """Whether the ``RUN`` steps of a task's ``environment/Dockerfile`` get the network
    (the host's); by default they get none."""


class SandmanEnvironment(BaseEnvironment):
    """A trial's sandbox: ``--env sandman.integrations.harbor:SandmanEnvironment``."""

    options_model = SandmanHarborOptions
    options: SandmanHarborOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sandbox: AsyncSandbox | None = None
        self._shell = "bash"
        self._warned_users: set[str] = set()
        super().__init__(*args, **kwargs)
        if self._host_mounts:  # the output directories alone are made in the sandbox
            raise ValueError(
                "the sandman environment cannot mount host paths into a sandbox: "
                f"{[mount['target'] for mount in self._host_mounts]}"
            )

    @staticmethod
    def type() -> str:
        return "sandman"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True,
            dynamic_network_policy=True,
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    def _validate_definition(self) -> None:
        if not self.task_env_config.docker_image and not self._dockerfile.is_file():
            raise ValueError(
                f"{self.environment_name} names no image and has no Dockerfile: set "
                f"[environment].docker_image in its task.toml or add {self._dockerfile}"
            )

    @property
    def _dockerfile(self) -> Path:
        return Path(self.environment_dir) / "Dockerfile"

    # -- lifecycle ----------------------------------------------------------------

    def _spec(self, image: str) -> SandboxSpec:
        config = self.task_env_config
        fields: dict[str, Any] = {
            "network": self._network(),
            "env": dict(self._persistent_env),
        }
        if (cpus := self._effective_cpus) is not None:
            fields["cpu"] = float(cpus)
        if (memory := self._effective_memory_mb) is not None:
            fields["memory"] = f"{memory}Mi"
        if (storage := self._effective_storage_mb) is not None:
            fields["disk"] = f"{storage}Mi"
        if config.workdir:
            fields["workdir"] = config.workdir
        return SandboxSpec(image=image, **fields)

    def _network(self) -> str | Egress:
        policy = self._network_policy
        if policy.network_mode == NetworkMode.NO_NETWORK and not self._phase_network_policies:
            return "none"  # no interface at all, for good
        return _egress(policy)

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await self._require().set_egress(_egress(network_policy))

    async def start(self, force_build: bool) -> None:
        client = await loop_client(self.options.url, state_dir=self.options.state_dir)
        image = self.task_env_config.docker_image
        if image is None:
            image = await client.build_image(
                self._dockerfile,
                self.environment_dir,
                name=_built_name(self.environment_name, Path(self.environment_dir)),
                network=self.options.build_network,
                cache=not force_build,
                reuse=not force_build,
            )
        elif force_build:
            self.logger.warning(
                "sandman runs the prebuilt image %s: --force-build has nothing to build", image
            )
        sandbox = await client.acquire(self._spec(image), timeout=self.options.acquire_timeout)
        self.logger.debug("sandman: sandbox %s for %s", sandbox.id, self.session_id)
        try:
            has_bash = await sandbox.exists("/bin/bash") or await sandbox.exists("/usr/bin/bash")
            self._shell = "bash" if has_bash else "sh"
            self._sandbox = sandbox
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            self._sandbox = None
            with contextlib.suppress(errors.SandboxError):
                await sandbox.release()
            raise

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return
        if not delete:
            self.logger.info(
                "sandman: --no-delete: a sandbox lives no longer than its pool's process; "
                "released now"
            )
        try:
            await sandbox.release()
        except errors.SandboxError as exc:  # the pool reaps it whatever happens
            self.logger.warning("sandman: releasing sandbox %s: %s", sandbox.id, exc)

    def _require(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError(
                f"the sandman environment {self.session_id} has no sandbox: "
                "start() did not succeed, or stop() ran"
            )
        return self._sandbox

    # -- commands -----------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        sandbox = self._require()
        user = self._resolve_user(user)
        argv = [self._shell, "-c", command]
        options: dict[str, Any] = {
            "cwd": cwd or self.task_env_config.workdir,
            "env": self._merge_env(env),
            "timeout": timeout_sec,
            "max_output": _MAX_OUTPUT,
        }
        try:
            result = await self._run(sandbox, argv, user=user, **options)
        except errors.UnknownUser as exc:  # as docker exec says it: a failed command
            return ExecResult(stdout=None, stderr=f"{exc.message}\n", return_code=126)
        except errors.PermissionDenied:
            if user is None:
                raise
            # The image runs as a user that cannot switch users: run as it (as
            # Harbor's providers without user switching do), once told.
            if str(user) not in self._warned_users:
                self._warned_users.add(str(user))
                self.logger.warning(
                    "sandman: sandbox %s cannot run commands as %r (its image's user is "
                    "not root): running them as the image's user",
                    sandbox.id,
                    user,
                )
            result = await self._run(sandbox, argv, user=None, **options)
        if result.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        if result.truncated:
            self.logger.warning(
                "sandman: output past %d bytes per stream was dropped: %s", _MAX_OUTPUT, command
            )
        return ExecResult(
            stdout=result.stdout or None,
            stderr=result.stderr or None,
            return_code=result.exit_code,
        )

    async def _run(self, sandbox: AsyncSandbox, argv: list[str], **options: Any) -> SandmanResult:
        callback = self._output_callback()
        if callback is None:
            return await sandbox.exec(argv, **options)
        # Harbor is following this phase's output as it happens.
        stdout: list[str] = []
        stderr: list[str] = []
        async with sandbox.exec_stream(argv, **options) as events:
            async for event in events:
                if event.event == "exit":
                    return SandmanResult(
                        exit_code=event.exit_code if event.exit_code is not None else -1,
                        signal=event.signal,
                        stdout="".join(stdout),
                        stderr="".join(stderr),
                        timed_out=event.timed_out,
                        truncated=event.truncated,
                        duration_seconds=event.duration_seconds or 0.0,
                    )
                (stdout if event.event == "stdout" else stderr).append(event.data)
                await callback(event.data, event.event)
        raise errors.DaemonUnavailable(f"sandbox {sandbox.id}: the stream ended without an exit")

    # -- files --------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._require().upload(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._require().upload(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._require().download(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._require().download(source_dir, target_dir)


def _built_name(environment: str, context: Path) -> str:
    """``harbor-<environment>:<digest>``: the digest of every path, mode, link and byte
    under ``context``, so an unchanged task names the image it built before."""
    digest = hashlib.sha256()
    for path in sorted(context.rglob("*")):
        relative = path.relative_to(context).as_posix()
        mode = path.lstat().st_mode
        kind = stat.S_IFMT(mode) | (mode & 0o111)  # a checkout's umask is not the task's
        digest.update(f"{relative}\0{kind:o}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    repository = re.sub(r"[^a-z0-9._-]+", "-", environment.lower()).strip("-._")[:64]
    return f"harbor-{repository or 'task'}:{digest.hexdigest()[:16]}"
