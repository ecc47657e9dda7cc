"""``user=`` on exec, exec_stream, spawn and shells: resolved in the sandbox's own
/etc/passwd and /etc/group (a busybox rootfs, the daemon its PID 1, as root)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandman
from tests.daemon.rootfs import BUSYBOX_APPLETS, Pid1, make_rootfs, needs_unshare, run_pid1

pytestmark = [pytest.mark.anyio, needs_unshare]

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "agent:x:1000:1000:Agent:/home/agent:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\nagent:x:1000:\ndocker:x:998:agent\nnogroup:x:65534:\n"
WHO = 'echo "$(id -un) $(id -u) $(id -g) $(id -G) $HOME"'


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Pid1]:
    """sandmand as PID 1 of a rootfs whose users are not the host's."""
    root = tmp_path / "rootfs"
    make_rootfs(root, (*BUSYBOX_APPLETS, "id", "whoami", "touch", "stat", "wc", "mkdir"))
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    (root / "home" / "agent").mkdir(parents=True)
    os.chown(root / "home" / "agent", 1000, 1000)
    with run_pid1(root, tmp_path / "sandmand.log") as running:
        yield running


async def test_exec_runs_as_the_named_user_with_its_groups_and_home(sandbox: Pid1) -> None:
    async with sandbox.client() as client:
        assert (await client.exec(["id", "-un"])).stdout == "root\n"  # the daemon's own
        agent = "agent 1000 1000 1000 998 /home/agent\n"
        assert (await client.exec(WHO, user="agent")).stdout == agent
        assert (await client.exec(WHO, user=1000)).stdout == agent
        assert (await client.exec(WHO, user="agent:nogroup")).stdout == (
            "agent 1000 65534 65534 /home/agent\n"
        )
        # A uid the sandbox does not know: gid 0, HOME / (as docker does).
        unknown_uid = await client.exec(["sh", "-c", "echo $(id -u) $(id -g) $HOME"], user=4242)
        assert unknown_uid.stdout == "4242 0 /\n"
        await client.exec(["touch", "/home/agent/mine"], user="agent", check=True)
        owner = await client.exec(["stat", "-c", "%u:%g", "/home/agent/mine"])
        assert owner.stdout == "1000:1000\n"
        denied = await client.exec(["mkdir", "/etc/x"], user="agent")
        assert denied.exit_code != 0 and "Permission denied" in denied.stderr


async def test_a_user_added_by_a_command_is_found_by_the_next(sandbox: Pid1) -> None:
    async with sandbox.client() as client:
        with pytest.raises(sandman.UnknownUser, match="unable to find user newbie"):
            await client.exec(["true"], user="newbie")
        await client.exec(
            "echo 'newbie:x:1500:1500::/tmp:/bin/sh' >> /etc/passwd", user="root", check=True
        )
        assert (await client.exec(["whoami"], user="newbie")).stdout == "newbie\n"


async def test_unknown_user_or_group_is_a_clear_error_everywhere(sandbox: Pid1) -> None:
    async with sandbox.client() as client:
        for user in ("ghost", "agent:ghosts"):
            with pytest.raises(sandman.UnknownUser) as caught:
                await client.exec(["true"], user=user)
            assert caught.value.code == "unknown_user" and caught.value.status == 404
            assert isinstance(caught.value, LookupError)
            with pytest.raises(sandman.UnknownUser):
                async with client.exec_stream(["true"], user=user) as events:
                    _ = [event async for event in events]
            with pytest.raises(sandman.UnknownUser):
                await client.spawn(["true"], user=user)
            with pytest.raises(sandman.UnknownUser):
                await client.create_shell(user=user)
        with pytest.raises(sandman.InvalidRequest):
            await client.exec(["true"], user="a:b:c")
        with pytest.raises(sandman.ConfigError):
            await client.exec(["true"], user=-1)


async def test_stream_spawn_and_shell_run_as_the_user(sandbox: Pid1) -> None:
    async with sandbox.client() as client:
        async with client.exec_stream(["id", "-un"], user="agent") as events:
            assert "".join([e.data async for e in events if e.event == "stdout"]) == "agent\n"
        proc = await client.spawn(["id", "-un"], user="agent")  # (tty: daemon/ tests it)
        await client.wait(proc.id, timeout=10)
        assert (await client.read_output(proc.id)).stdout == "agent\n"
        sh = await client.create_shell(shell="/bin/sh", user="agent")
        result = await client.run_in_shell(sh.id, "cd; pwd; id -un", check=True)
        assert result.stdout == "/home/agent\nagent\n"


def _who(info: sandman.ProcessInfo | sandman.ShellInfo) -> tuple[int, int, str | None]:
    return info.uid, info.gid, info.user


async def test_processes_and_shells_say_whom_they_run_as(sandbox: Pid1) -> None:
    async with sandbox.client() as client:
        for user, who in (
            (None, (0, 0, "root")),  # the daemon's own
            ("agent", (1000, 1000, "agent")),
            (1000, (1000, 1000, "agent")),  # a uid gets its passwd name
            ("agent:nogroup", (1000, 65534, "agent")),
            (4242, (4242, 0, None)),  # a uid passwd does not list: no name
        ):
            proc = await client.spawn(["sleep", "30"], user=user)
            assert _who(proc) == who, user
            assert _who(await client.poll(proc.id)) == who
            await client.kill(proc.id)
            sh = await client.create_shell(shell="/bin/sh", user=user)
            assert _who(sh) == who, user
            assert _who(await client.get_shell(sh.id)) == who
            uid = await client.run_in_shell(sh.id, "id -u", check=True)
            assert uid.stdout == f"{who[0]}\n"
            await client.close_shell(sh.id)
        # Listed, and for a program that could not start: whom it would have run as.
        missing = await client.spawn(["/no/such/program"], user="agent")
        assert missing.exit_code == 127 and _who(missing) == (1000, 1000, "agent")
        assert [_who(p) for p in await client.list_processes()] == [(1000, 1000, "agent")]
        await client.create_shell(shell="/bin/sh", user="nobody")
        assert [_who(s) for s in await client.list_shells()] == [(65534, 65534, "nobody")]
