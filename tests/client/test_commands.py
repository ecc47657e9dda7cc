"""What the framework adapters ask of a command (issue 16, gaps 1-5), through the SDK on
the real local provider: ``user=``, merged output, binary stdin, a shell timeout that
interrupts, and a cancelled exec that kills its command."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.providers.local import LocalProvider
from tests.images import builders
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = needs_root_and_crun

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"
GROUP = b"root:x:0:\nagent:x:1000:\nstaff:x:50:agent\n"


@pytest.fixture
def task(imported: LocalProvider, busybox_tar: Path, tmp_path: Path) -> Iterator[str]:
    """An image whose own user is ``agent`` (1000), imported as ``task``."""
    top = builders.layer_tar(
        [
            builders.file("etc/passwd", PASSWD),
            builders.file("etc/group", GROUP),
            builders.directory("home/agent", uid=1000, gid=1000),
        ]
    )
    layers = [busybox_tar.read_bytes(), top]
    config = builders.image_config(
        [builders.sha256(layer) for layer in layers], env=("PATH=/bin",), user="agent"
    )
    archive = builders.docker_archive(
        tmp_path / "task.tar", layers, repo_tags=("task:1",), config=config
    )
    asyncio.run(imported.images.import_archive(archive))
    yield "task:1"


async def _gone(sb: sandman.AsyncSandbox, pid: str) -> None:
    with anyio.fail_after(10):
        while (await sb.exec(["kill", "-0", pid])).exit_code == 0:
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_the_adapters_command_surface(task: str, local_state: Path) -> None:
    async with (
        sandman.local(state_dir=local_state) as client,
        client.sandbox(task, user="root") as sb,  # the daemon as root: it may switch users
    ):
        # 1. user=, resolved in the sandbox's /etc/passwd and /etc/group
        who = await sb.exec('echo "$(id -un) $(id -G) $HOME"', user="agent")
        assert who.stdout == "agent 1000 50 /home/agent\n"
        assert (await sb.exec(["id", "-u"], user=0)).stdout == "0\n"
        with pytest.raises(sandman.UnknownUser, match="unable to find user ghost"):
            await sb.exec(["true"], user="ghost")
        shell = await sb.create_shell(user="agent")
        assert (shell.uid, shell.gid, shell.user) == (1000, 1000, "agent")
        assert (await sb.run_in_shell(shell.id, "cd; pwd")).stdout == "/home/agent\n"

        # 2. merged output
        merged = await sb.exec("echo out; echo err >&2; echo out2", merge_stderr=True)
        assert (merged.stdout, merged.stderr) == ("out\nerr\nout2\n", "")
        run = await sb.run_in_shell(shell.id, "echo a; echo b >&2", merge_stderr=True)
        assert (run.stdout, run.stderr) == ("a\nb\n", "")

        # 3. binary stdin
        payload = bytes(range(256))
        copied = await sb.exec(["cat"], stdin=payload, encoding="base64")
        assert copied.stdout_bytes == payload

        # 4. a shell run that times out, interrupted: the shell lives on
        await sb.run_in_shell(shell.id, "export KEEP=1", check=True)
        late = await sb.run_in_shell(
            shell.id, "sleep 1000; echo never", timeout=0.3, on_timeout="interrupt"
        )
        assert late.timed_out and late.alive and late.exit_code == 130
        assert (await sb.run_in_shell(shell.id, "echo $KEEP")).stdout == "1\n"

        # 5. a cancelled exec kills its command's process group
        async with anyio.create_task_group() as tg:
            tg.start_soon(sb.exec, "sleep 1000 & echo $$ > /tmp/pid; wait")
            with anyio.fail_after(10):
                while not (await sb.exec(["cat", "/tmp/pid"])).stdout.endswith("\n"):
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        pid = (await sb.read_file("/tmp/pid")).decode().strip()
        await _gone(sb, pid)


@pytest.mark.anyio
async def test_a_daemon_that_is_not_root_runs_commands_as_itself_only(
    task: str, local_state: Path
) -> None:
    async with sandman.local(state_dir=local_state) as client, client.sandbox(task) as sb:
        assert (await sb.exec(["id", "-un"])).stdout == "agent\n"  # the image's user
        assert (await sb.exec(["id", "-un"], user="agent")).stdout == "agent\n"
        spawned = await sb.spawn(["true"])  # the daemon's own user, by its name
        assert (spawned.uid, spawned.gid, spawned.user) == (1000, 1000, "agent")
        with pytest.raises(sandman.PermissionDenied, match="cannot run commands as root"):
            await sb.exec(["true"], user="root")


def test_the_blocking_face_has_the_same_surface(task: str, local_state: Path) -> None:
    with (
        sandman.local_sync(state_dir=local_state) as client,
        client.sandbox(task, user="root") as sb,
    ):
        result = sb.exec(["cat"], stdin=b"\x00\xff", encoding="base64", user="agent")
        assert result.stdout_bytes == b"\x00\xff"
        spawned = sb.spawn("id -un; echo e >&2", user="agent", merge_stderr=True)
        assert (spawned.uid, spawned.user) == (1000, "agent")
        sb.wait(spawned.id, timeout=10)
        assert sb.read_output(spawned.id).stdout == "agent\ne\n"
        shell = sb.create_shell()
        late = sb.run_in_shell(shell.id, "sleep 1000", timeout=0.2, on_timeout="interrupt")
        assert late.timed_out and late.alive
