"""The SDK through the service's daemon proxy route: for clients that cannot reach daemons."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import anyio
import httpx
import pytest

import sandman
from sandman.client.remote import ProxiedEndpoint, RemoteBackend
from sandman.providers.base import DaemonEndpoint
from tests.daemon.tcp import count_then_answer, echo, http_hello
from tests.daemon.tcp import serve as serve_tcp
from tests.server.conftest import KEY_A, KEY_B, serve
from tests.support import alive, eventually

pytestmark = pytest.mark.anyio


async def test_an_endpoint_is_reachable_only_if_its_socket_is_here(tmp_path: Path) -> None:
    backend = RemoteBackend("http://127.0.0.1:1", api_key="k")
    here = tmp_path / "sock"
    here.touch()
    assert await backend._reachable(DaemonEndpoint(uds=str(here), token="t"))
    assert not await backend._reachable(DaemonEndpoint(uds=str(tmp_path / "gone"), token="t"))
    await backend.aclose()


async def test_tcp_endpoints_are_tried_once_and_the_answer_kept() -> None:
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: refused at once
    open_port = listening.getsockname()[1]
    try:
        refused = RemoteBackend("http://127.0.0.1:1", api_key="k")
        assert not await refused._reachable(
            DaemonEndpoint(host="127.0.0.1", port=closed_port, token="t")
        )
        # Kept: a pod IP that would connect is not tried any more.
        assert not await refused._reachable(
            DaemonEndpoint(host="127.0.0.1", port=open_port, token="t")
        )
        direct = RemoteBackend("http://127.0.0.1:1", api_key="k")
        assert await direct._reachable(DaemonEndpoint(host="127.0.0.1", port=open_port, token="t"))
        assert await direct._reachable(
            DaemonEndpoint(host="127.0.0.1", port=closed_port, token="t")
        )
        for backend in (refused, direct):
            await backend.aclose()
    finally:
        listening.close()


def test_the_proxied_endpoint_is_the_route_under_the_services_url() -> None:
    backend = RemoteBackend("https://sandman.example/prefix/", api_key="k" * 16)
    endpoint = backend.proxied("sb-1")
    assert (endpoint.host, endpoint.port, endpoint.tls) == ("sandman.example", 443, True)
    assert endpoint.base_path == "/prefix/v1/sandboxes/sb-1/daemon"
    assert endpoint.token == "k" * 16  # the API key; the service adds the daemon's token
    with pytest.raises(sandman.ConfigError, match="not a service URL"):
        RemoteBackend("localhost:8000")


async def test_exec_stream_files_and_archives_through_the_proxy(tmp_path: Path) -> None:
    with serve() as served:
        async with (
            sandman.connect(served.url, api_key=KEY_A, via_proxy=True) as client,
            client.sandbox("task", timeout=20) as sb,
        ):
            endpoint = sb._lease.endpoint
            assert isinstance(endpoint, ProxiedEndpoint)
            assert endpoint.base_path == f"/v1/sandboxes/{sb.id}/daemon"

            result = await sb.exec("echo through $0; exit 4")
            assert result.exit_code == 4 and result.stdout.startswith("through")

            clock = asyncio.get_running_loop().time
            seen: list[tuple[float, str]] = []
            script = "for i in 1 2 3; do echo line$i; sleep 0.2; done"
            async with sb.exec_stream(["sh", "-c", script]) as events:
                seen.extend([(clock(), e.event + ":" + e.data) async for e in events])
            assert seen[-1][1] == "exit:" and "line3" in "".join(s for _, s in seen)
            assert seen[-1][0] - seen[0][0] > 0.25  # the output arrived as it happened

            # The fake's daemons run on this host: paths under tmp_path.
            box = str(tmp_path / "box")
            await sb.write_file(f"{box}/a.bin", b"\x00\xffdata", mode=0o600)
            assert await sb.read_file(f"{box}/a.bin") == b"\x00\xffdata"
            assert (await sb.stat(f"{box}/a.bin")).size == 6
            with pytest.raises(sandman.PathNotFound):
                await sb.read_file(f"{box}/missing")

            tree = tmp_path / "tree"
            (tree / "sub").mkdir(parents=True)
            (tree / "top.txt").write_text("top")
            (tree / "sub" / "deep.txt").write_text("deep")
            await sb.upload(tree, f"{box}/tree")
            names = [s.name for s in await sb.list_dir(f"{box}/tree")]
            assert names == ["sub", "top.txt"]
            await sb.download(f"{box}/tree", tmp_path / "back")
            assert (tmp_path / "back" / "sub" / "deep.txt").read_text() == "deep"
        # Released: the route answers sandbox_not_found, which the SDK reports as such.
        with pytest.raises(sandman.SandboxNotFound):
            await sb.exec("true")
        await eventually(lambda: served.provider.live == 0)


async def test_a_vanished_sandbox_is_not_found_through_the_proxy() -> None:
    with serve() as served:
        async with sandman.connect(served.url, api_key=KEY_A, via_proxy=True) as client:
            sb = await client.acquire("task", timeout=20)
            sandbox_id = sb.id

            async def lose() -> None:
                # On the server's loop: the fake's daemon task must live there.
                served.provider.lose(sandbox_id)

            await asyncio.to_thread(served.run, lose())
            with pytest.raises(sandman.SandboxNotFound):
                await sb.exec("true")
            await sb.release()
        await eventually(lambda: served.provider.live == 0)


async def test_another_tenants_key_cannot_use_the_route() -> None:
    with serve() as served:
        async with (
            sandman.connect(served.url, api_key=KEY_A) as client,
            client.sandbox("task", timeout=20) as sb,
        ):
            other = RemoteBackend(served.url, api_key=KEY_B)
            foreign = other.proxied(sb.id).client()
            try:
                with pytest.raises(sandman.DaemonUnavailable) as refused:
                    await foreign.exec("true")
                assert refused.value.code == "sandbox_not_found"
            finally:
                await foreign.aclose()
                await other.aclose()
        await eventually(lambda: served.provider.live == 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a command as another user needs root")
async def test_the_adapters_command_surface_through_the_proxy(tmp_path: Path) -> None:
    """Issue 16, gaps 1-5 through the route: the fake's daemons run on this host, as root."""
    with serve() as served:
        async with (
            sandman.connect(served.url, api_key=KEY_A, via_proxy=True) as client,
            client.sandbox("task", timeout=20) as sb,
        ):
            assert isinstance(sb._lease.endpoint, ProxiedEndpoint)
            # 1. user=, from this host's /etc/passwd here
            assert (await sb.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"
            with pytest.raises(sandman.UnknownUser, match="unable to find user ghost-user"):
                await sb.exec(["true"], user="ghost-user")
            # 2. merged output, also streamed
            merged = await sb.exec("echo out; echo err >&2", merge_stderr=True)
            assert (merged.stdout, merged.stderr) == ("out\nerr\n", "")
            async with sb.exec_stream("echo o; echo e >&2", merge_stderr=True) as events:
                kinds = {e.event async for e in events}
            assert kinds == {"stdout", "exit"}
            # 3. binary stdin
            payload = b"\x00\xff\xfe" * 1000
            copied = await sb.exec(["cat"], stdin=payload, encoding="base64")
            assert copied.stdout_bytes == payload
            # 4. a shell run that times out, interrupted
            shell = await sb.create_shell(shell="/bin/bash", user="nobody")
            assert (shell.uid, shell.user) == (65534, "nobody")
            assert (await sb.get_shell(shell.id)).user == "nobody"
            await sb.run_in_shell(shell.id, "X=kept", check=True)
            late = await sb.run_in_shell(
                shell.id, "sleep 1000", timeout=0.3, on_timeout="interrupt", merge_stderr=True
            )
            assert late.timed_out and late.alive
            assert (await sb.run_in_shell(shell.id, "echo $X $(id -un)")).stdout == (
                "kept nobody\n"
            )
            # 5. a cancelled exec: the client's connection to the service closes, the
            # service's to the daemon too, and the daemon kills the command's group.
            pidfile = tmp_path / "pid"
            async with anyio.create_task_group() as tg:
                tg.start_soon(sb.exec, f"sleep 1000 & echo $! > {pidfile}; wait")
                with anyio.fail_after(10):
                    while not pidfile.exists() or not pidfile.read_text().endswith("\n"):
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            child = int(pidfile.read_text())
            with anyio.fail_after(10):
                while alive(child):
                    await anyio.sleep(0.01)
        await eventually(lambda: served.provider.live == 0)


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_port_through_the_proxy(http: str) -> None:
    """Issue 16, gap 6 through the route: the full-duplex form, to servers on this host
    (the fake's daemons run here), with both of uvicorn's HTTP implementations."""
    async with (
        serve_tcp(http_hello) as web,
        serve_tcp(echo) as echoed,
        serve_tcp(count_then_answer) as counted,
    ):
        with serve(http=http) as served:
            async with (
                sandman.connect(served.url, api_key=KEY_A, via_proxy=True) as client,
                client.sandbox("task", timeout=20) as sb,
            ):
                assert isinstance(sb._lease.endpoint, ProxiedEndpoint)
                exposed = await sb.expose(web.port)
                async with httpx.AsyncClient(base_url=exposed.url) as web_client:
                    for path in ("/a", "/b"):
                        assert (await web_client.get(path)).text == f"hello from {path}"
                # Bulk both ways at once, then the half-close, both carried as chunks.
                data = os.urandom(8 * 1024 * 1024)
                async with await sb.expose(echoed.port) as tunnel:
                    reader, writer = await asyncio.open_connection(tunnel.host, tunnel.port)
                    sending = asyncio.ensure_future(_write_all(writer, data))
                    back = await reader.readexactly(len(data))
                    await sending
                    assert back == data
                    writer.write_eof()
                    assert await reader.read() == b""
                    writer.close()
                    await writer.wait_closed()
                counter = await sb.expose(counted.port)
                reader, writer = await asyncio.open_connection(counter.host, counter.port)
                writer.write(b"z" * 300_000)
                writer.write_eof()
                assert await reader.read() == b"got 300000"
                writer.close()
                await writer.wait_closed()
                # Nothing listens: the daemon's refusal, passed on by the service.
                with socket.create_server(("127.0.0.1", 0)) as probe:
                    closed_port = probe.getsockname()[1]
                nowhere = await sb.expose(closed_port)
                reader, writer = await asyncio.open_connection(nowhere.host, nowhere.port)
                assert await reader.read() == b""
                writer.close()
                await writer.wait_closed()
                assert nowhere.last_failure is not None
                assert nowhere.last_failure.startswith("connection_refused: nothing listens")
                # The route's own refusals: a port out of range, another tenant's sandbox.
                route = f"{served.url}/v1/sandboxes/{sb.id}/daemon/v1/ports"
                async with httpx.AsyncClient() as raw:
                    answer = await raw.post(
                        f"{route}/0/connect", headers={"Authorization": f"Bearer {KEY_A}"}
                    )
                    assert answer.status_code == 422
                    answer = await raw.post(
                        f"{route}/{echoed.port}/connect",
                        headers={"Authorization": f"Bearer {KEY_B}"},
                    )
                    assert answer.json()["error"]["code"] == "sandbox_not_found"
                # A caller that leaves mid-stream: the service lets go of the daemon's
                # connection, and the daemon of the port's.
                left = await sb.expose(echoed.port)
                reader, writer = await asyncio.open_connection(left.host, left.port)
                writer.write(b"ping")
                assert await reader.readexactly(4) == b"ping"
                writer.close()
                await writer.wait_closed()
                await eventually(lambda: echoed.active == 0 and left.connections == 0)
            assert exposed.closed and counter.closed and left.closed
            await eventually(lambda: served.provider.live == 0)
        assert web.active == echoed.active == counted.active == 0


async def _write_all(writer: asyncio.StreamWriter, data: bytes) -> None:
    for i in range(0, len(data), 1024 * 1024):
        writer.write(data[i : i + 1024 * 1024])
        await writer.drain()


def _unix_sockets() -> int:
    """This process's unix-domain sockets (the service's connections to daemons among them)."""
    unix = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += target.startswith("socket:[") and target[8:-1] in unix
    return count


async def test_the_service_lets_go_of_a_released_sandboxs_daemon() -> None:
    with serve() as served:
        async with sandman.connect(served.url, api_key=KEY_A, via_proxy=True) as client:
            before = _unix_sockets()
            for _ in range(3):
                async with client.sandbox("task", timeout=20) as sb:
                    await sb.exec(["true"])
                    assert _unix_sockets() > before  # kept for the next call
                # Released: nobody will call its daemon again.
                await eventually(lambda: _unix_sockets() == before, what="the connection closed")
