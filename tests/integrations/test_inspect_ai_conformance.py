"""inspect_ai's own conformance suite for sandbox providers
(`inspect_ai.util._sandbox.self_check`), against Sandman on the local provider.

Every check runs in a fresh sandbox as root (the image's user, as docker's
default); the checks of file permissions run again as ``nobody``, where
permissions apply. What fails does so for the reasons in `XFAIL`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.self_check import *

from sandman.integrations.inspect_ai import (
    SandmanSandboxEnvironment,
    SandmanSandboxEnvironmentConfig,
)
from sandman.providers.local import LocalProvider
from tests.integrations.conftest import busybox_state, needs_local
from tests.integrations.images import INSPECT_IMAGE

pytestmark = [pytest.mark.integrations, pytest.mark.anyio, needs_local]

PERMISSIONS = (
    "test_read_file_not_allowed",
    "test_write_text_file_without_permissions",
    "test_write_binary_file_without_permissions",
)

_ROOT = "root ignores file modes: the sandbox runs as root, as docker's does by default"
_RENAME = (
    "write_file replaces a file atomically (a new file renamed over it), so a read-only "
    "file in a writable directory is replaced, as `mv` would do; inspect's docker "
    "provider writes in place (tee) and is refused"
)
XFAIL = {
    "root": dict.fromkeys(PERMISSIONS, _ROOT),
    "nobody": {
        "test_write_text_file_without_permissions": _RENAME,
        "test_write_binary_file_without_permissions": _RENAME,
    },
}
"""The checks that fail, and why: none of them is a gap in the adapter's mapping."""

TASK = "conformance"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sandbox_env" in metafunc.fixturenames:
        users = ["root", "nobody"] if metafunc.function.__name__ in PERMISSIONS else ["root"]
        metafunc.parametrize("sandbox_user", users)


@pytest.fixture(scope="module")
def state(busybox_tar: Path, inspect_tar: Path) -> Iterator[LocalProvider]:
    with busybox_state(busybox_tar, inspect_tar) as provider:
        yield provider


@pytest.fixture(scope="module")
async def task(state: LocalProvider) -> AsyncIterator[None]:
    """inspect's task around the checks: the pool is made once and closed at the end."""
    config = SandmanSandboxEnvironmentConfig(image=INSPECT_IMAGE)
    await SandmanSandboxEnvironment.task_init(TASK, config)
    yield
    await SandmanSandboxEnvironment.task_cleanup(TASK, config, True)


@pytest.fixture
async def sandbox_env(
    request: pytest.FixtureRequest, task: None, sandbox_user: str
) -> AsyncIterator[SandboxEnvironment]:
    reason = XFAIL[sandbox_user].get(request.node.originalname)
    if reason:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    config = SandmanSandboxEnvironmentConfig(
        image=INSPECT_IMAGE,
        # a working directory the user may write to (the runtime makes it, as root)
        workdir="/work" if sandbox_user == "root" else "/tmp",
        user=None if sandbox_user == "root" else sandbox_user,
    )
    environments = await SandmanSandboxEnvironment.sample_init(TASK, config, {})
    try:
        yield environments["default"]
    finally:
        await SandmanSandboxEnvironment.sample_cleanup(TASK, config, environments, False)
