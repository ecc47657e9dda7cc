"""A sandbox honours its image's env, working dir and user; the spec overrides them."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.images import builders
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.leaks import assert_nothing_left

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"
GROUP = b"root:x:0:\nagent:x:1000:\n"


@pytest.fixture(scope="module")
def task_image(busybox_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer docker-save image: busybox, then a user, a home and a work dir."""
    top = builders.layer_tar(
        [
            builders.file("etc/passwd", PASSWD),
            builders.file("etc/group", GROUP),
            builders.directory("home/agent", uid=1000, gid=1000),
            builders.directory("work", uid=1000, gid=1000),
            builders.file("work/README", b"task files\n", uid=1000, gid=1000),
        ]
    )
    layers = [busybox_tar.read_bytes(), top]
    config = builders.image_config(
        [builders.sha256(layer) for layer in layers],
        env=("PATH=/bin", "FOO=from-image"),
        working_dir="/work",
        user="agent",
    )
    path = tmp_path_factory.mktemp("task") / "task.tar"
    return builders.docker_archive(path, layers, repo_tags=("task:1",), config=config)


async def test_image_env_workdir_and_user(provider: LocalProvider, task_image: Path) -> None:
    await provider.images.import_archive(task_image)
    info = await provider.create(SandboxSpec(image="task:1"))
    assert info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=10)
        result = await sb.exec("id -u; pwd; echo $FOO; cat README")
        assert result.stdout.split("\n") == ["1000", "/work", "from-image", "task files", ""]
        await sb.write_file("/work/out.txt", "mine")
        assert (await sb.exec("stat -c %u /work/out.txt")).stdout.strip() == "1000"
        with pytest.raises(sandman.PermissionDenied):
            await sb.write_file("/root/forbidden", "x")

    override = SandboxSpec(image="task:1", env={"FOO": "from-spec"}, workdir="/tmp", user="root")
    info = await provider.create(override)
    assert info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=10)
        result = await sb.exec("id -u; pwd; echo $FOO")
        assert result.stdout.split() == ["0", "/tmp", "from-spec"]


async def test_unknown_user_is_a_clear_error(provider: LocalProvider, task_image: Path) -> None:
    await provider.images.import_archive(task_image)
    with pytest.raises(sandman.ImageError, match="nosuchuser"):
        await provider.create(SandboxSpec(image="task:1", user="nosuchuser"))


async def test_runc_works_too(busybox_tar: Path, state_dir: Path) -> None:
    config = LocalConfig(state_dir=state_dir, runtime="runc", cgroup_parent="/sandman-test/runc")
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    info = await provider.create(SandboxSpec(image="busybox", memory="64Mi"))
    assert info.endpoint is not None
    try:
        async with info.endpoint.client() as sb:
            assert (await sb.wait_ready(timeout=10)).pid == 1
            assert (await sb.exec(["echo", "hi"])).stdout == "hi\n"
        limit = Path(f"/sys/fs/cgroup/memory/sandman-test/runc/{info.id}/memory.limit_in_bytes")
        assert int(limit.read_text()) == 64 * 2**20
    finally:
        await provider.delete(info.id)
        await provider.aclose()
    await assert_nothing_left(provider)
