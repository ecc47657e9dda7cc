"""Pulling images from a real registry on 127.0.0.1 (Debian's docker-registry) with skopeo."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sandman.errors import ConfigError, ImageError, ImageNotFound
from sandman.images import ImageConfig, ImageStore, RegistryAuth
from sandman.images.registry import (
    Reference,
    auth_file,
    parse_reference,
    probe_registry,
    pull_error,
    skopeo_command,
)
from tests.images.builders import check_sample_rootfs, oci_layout, sample_layers
from tests.images.registry_server import (
    Registry,
    SilentServer,
    UnansweredPort,
    free_port,
    missing_tools,
    push,
    start_registry,
)
from tests.support import eventually

pytestmark = pytest.mark.anyio

USER, PASSWORD = "alice", "s3cret-Pa55"
SAMPLE_CONFIG = ImageConfig(
    env=["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], working_dir="/home/user", user="user",
    cmd=["/bin/sh"],
)  # fmt: skip

needs_registry = pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or "")


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sandman.images")


@pytest.fixture(scope="session")
def sample_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return oci_layout(tmp_path_factory.mktemp("layout"), sample_layers(), ref_name="1.0")


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory, sample_layout: Path) -> Iterator[Registry]:
    """An open registry holding ``sample:1.0``."""
    server = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        push(sample_layout, "1.0", server, "sample")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def private_registry(
    tmp_path_factory: pytest.TempPathFactory, sample_layout: Path
) -> Iterator[Registry]:
    """A registry with htpasswd auth holding ``team/sample:1.0``."""
    server = start_registry(tmp_path_factory.mktemp("private"), username=USER, password=PASSWORD)
    try:
        push(sample_layout, "1.0", server, "team/sample")
        yield server
    finally:
        server.stop()


def unpacks(caplog: pytest.LogCaptureFixture) -> int:
    return sum("unpacking image" in r.getMessage() for r in caplog.records)


def assert_no_scratch(store: ImageStore) -> None:
    assert list((store.root / "tmp").iterdir()) == []


# -- pulling -----------------------------------------------------------------------------------


@needs_registry
async def test_pull(
    store: ImageStore, registry: Registry, sample_layout: Path, tmp_path: Path
) -> None:
    reference = f"{registry.host}/sample:1.0"
    image = await store.pull(reference, tls_verify=False)
    assert image.names == [reference]
    assert image.config == SAMPLE_CONFIG
    check_sample_rootfs(image.rootfs)
    # The same image as importing the layout directly.
    direct = await ImageStore(tmp_path / "other").import_oci_layout(sample_layout)
    assert image.id == direct.id
    assert await store.get(reference) == image
    assert_no_scratch(store)


@needs_registry
async def test_pull_again_reuses_the_unpacked_image(
    store: ImageStore, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    reference = f"{registry.host}/sample:1.0"
    first = await store.pull(reference, tls_verify=False)
    inode = first.rootfs.stat().st_ino
    second = await store.pull(reference, tls_verify=False)
    assert second == first
    assert second.rootfs.stat().st_ino == inode
    assert unpacks(caplog) == 1
    assert_no_scratch(store)


@needs_registry
async def test_pull_latest_by_default(store: ImageStore, registry: Registry) -> None:
    with pytest.raises(ImageNotFound, match=r"sample:latest.*no such repository or tag"):
        await store.pull(f"{registry.host}/sample", tls_verify=False)


@needs_registry
@pytest.mark.parametrize("path", ["sample:nope", "nothere/sample:1.0"])
async def test_unknown_tag_or_repository(store: ImageStore, registry: Registry, path: str) -> None:
    with pytest.raises(ImageNotFound, match="no such repository or tag") as caught:
        await store.pull(f"{registry.host}/{path}", tls_verify=False)
    assert isinstance(caught.value, ImageError)
    assert registry.host in str(caught.value)
    assert await store.list() == []
    assert_no_scratch(store)


@needs_registry
async def test_tls_verify_against_plain_http_registry(
    store: ImageStore, registry: Registry
) -> None:
    with pytest.raises(ImageError, match="tls_verify=False"):
        await store.pull(f"{registry.host}/sample:1.0")
    assert_no_scratch(store)


# -- credentials -------------------------------------------------------------------------------


@needs_registry
async def test_private_registry_with_credentials(
    store: ImageStore, private_registry: Registry, skopeo_shim: Path
) -> None:
    reference = f"{private_registry.host}/team/sample:1.0"
    image = await store.pull(
        reference, auth=RegistryAuth(username=USER, password=PASSWORD), tls_verify=False
    )
    assert image.names == [reference]
    check_sample_rootfs(image.rootfs)
    # The password went in a private file, not on the command line, and the file is gone.
    args = (skopeo_shim / "args").read_text()
    assert PASSWORD not in args
    assert "--src-authfile" in args and "--src-creds" not in args
    assert (skopeo_shim / "authfile-mode").read_text().strip() == "600"
    document = json.loads((skopeo_shim / "authfile").read_text())
    assert document == json.loads(
        auth_file(parse_reference(reference), RegistryAuth(username=USER, password=PASSWORD))
    )
    scratch = Path((skopeo_shim / "cwd").read_text().strip())
    assert scratch.parent == store.root / "tmp"
    assert not scratch.exists()
    assert_no_scratch(store)


@needs_registry
async def test_wrong_credentials(
    store: ImageStore,
    private_registry: Registry,
    skopeo_shim: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrong = "not-the-Pa55word"
    with pytest.raises(ImageError, match="authentication failed") as caught:
        await store.pull(
            f"{private_registry.host}/team/sample:1.0",
            auth=RegistryAuth(username=USER, password=wrong),
            tls_verify=False,
        )
    assert not isinstance(caught.value, ImageNotFound)
    assert USER in str(caught.value)
    assert wrong not in str(caught.value)
    assert wrong not in caplog.text
    assert (skopeo_shim / "authfile").exists()
    assert not Path((skopeo_shim / "cwd").read_text().strip()).exists()
    assert_no_scratch(store)


@needs_registry
async def test_no_credentials(store: ImageStore, private_registry: Registry) -> None:
    with pytest.raises(ImageError, match=r"authentication failed.*auth=RegistryAuth"):
        await store.pull(f"{private_registry.host}/team/sample:1.0", tls_verify=False)
    assert_no_scratch(store)


def test_auth_hides_the_password() -> None:
    auth = RegistryAuth(username=USER, password=PASSWORD)
    assert PASSWORD not in repr(auth) and PASSWORD not in str(auth)
    document = json.loads(auth_file(parse_reference("localhost:5000/x:1"), auth))
    assert document == {"auths": {"localhost:5000": {"auth": "YWxpY2U6czNjcmV0LVBhNTU="}}}


# -- failing fast, timeouts, cancellation ------------------------------------------------------


@needs_registry
async def test_unreachable_registry_fails_at_once(store: ImageStore) -> None:
    host = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ImageError, match=rf"registry {host} is unreachable.*refused"):
        await store.pull(f"{host}/sample:1.0", tls_verify=False)
    assert time.monotonic() - started < 2
    assert_no_scratch(store)


async def test_probe_gives_up_on_a_host_that_does_not_answer() -> None:
    port = UnansweredPort()
    try:
        started = time.monotonic()
        with pytest.raises(ImageError, match=rf"{port.host} is unreachable.*no answer within 0.5s"):
            await probe_registry(
                parse_reference(f"{port.host}/sample:1.0"), tls_verify=False, timeout=0.5
            )
        assert time.monotonic() - started < 2
    finally:
        port.close()


@needs_registry
async def test_timeout_kills_skopeo(store: ImageStore, skopeo_shim: Path) -> None:
    silent = SilentServer()
    try:
        started = time.monotonic()
        with pytest.raises(ImageError, match=r"timed out after 1s"):
            await store.pull(f"{silent.host}/sample:1.0", tls_verify=False, timeout=1)
        assert time.monotonic() - started < 5
    finally:
        silent.close()
    pid = int((skopeo_shim / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()
    assert_no_scratch(store)


@needs_registry
async def test_cancel_kills_skopeo(store: ImageStore, skopeo_shim: Path) -> None:
    silent = SilentServer()
    try:
        async with anyio.create_task_group() as group:

            async def pull() -> None:
                await store.pull(
                    f"{silent.host}/sample:1.0",
                    auth=RegistryAuth(username=USER, password=PASSWORD),
                    tls_verify=False,
                )

            group.start_soon(pull)
            await eventually((skopeo_shim / "pid").exists, what="the shim's pid file to appear")
            group.cancel_scope.cancel()
    finally:
        silent.close()
    pid = int((skopeo_shim / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()
    assert (skopeo_shim / "authfile").exists()
    assert_no_scratch(store)


@needs_registry
async def test_asyncio_cancel_kills_skopeo_and_start_up_spares_running_pulls(
    store: ImageStore, skopeo_shim: Path
) -> None:
    silent = SilentServer()
    try:
        task = asyncio.create_task(store.pull(f"{silent.host}/sample:1.0", tls_verify=False))
        await eventually((skopeo_shim / "pid").exists, what="the shim's pid file to appear")
        scratch = Path((skopeo_shim / "cwd").read_text().strip())
        # Another store on the same root starts up: it must not clean a pull in progress.
        await ImageStore(store.root).list()
        assert scratch.is_dir()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        silent.close()
    pid = int((skopeo_shim / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()
    assert_no_scratch(store)


async def test_missing_skopeo(
    store: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ImageError, match=r"apt-get install -y skopeo"):
        await store.pull("localhost:5000/busybox:1.0", tls_verify=False)
    assert_no_scratch(store)


async def test_bad_arguments(store: ImageStore) -> None:
    with pytest.raises(ImageError, match="invalid image name"):
        await store.pull("-rf /")
    with pytest.raises(ConfigError, match="timeout"):
        await store.pull("localhost:5000/busybox:1.0", timeout=0)
    assert_no_scratch(store)


async def test_stale_pull_scratch_is_removed_at_start(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ImageStore(root)
    stale = root / "tmp" / "pulls.0123abcd"
    (stale / "image" / "blobs").mkdir(parents=True)
    (stale / "auth.json").write_text("{}")
    await ImageStore(root).list()
    assert not stale.exists()


# -- the pure parts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name", "registry", "tag"),
    [
        ("docker.io/library/python:3.11", "python:3.11", "docker.io", "3.11"),
        ("busybox", "busybox:latest", "docker.io", "latest"),
        ("user/app:2", "user/app:2", "docker.io", "2"),
        ("localhost:5000/busybox:1.0", "localhost:5000/busybox:1.0", "localhost:5000", "1.0"),
        ("localhost/busybox", "localhost/busybox:latest", "localhost", "latest"),
        ("ghcr.io/org/img:v1", "ghcr.io/org/img:v1", "ghcr.io", "v1"),
        ("127.0.0.1:5000/x@sha256:" + "a" * 64, "127.0.0.1:5000/x@sha256:" + "a" * 64,
         "127.0.0.1:5000", None),
    ],
)  # fmt: skip
def test_parse_reference(text: str, name: str, registry: str, tag: str | None) -> None:
    assert parse_reference(text) == Reference(name=name, registry=registry, tag=tag)


def test_endpoints() -> None:
    assert parse_reference("python:3.11").endpoints(True) == [("registry-1.docker.io", 443)]
    assert parse_reference("localhost:5000/x").endpoints(True) == [("localhost", 5000)]
    assert parse_reference("example.com/x").endpoints(False) == [
        ("example.com", 443),
        ("example.com", 80),
    ]


def test_skopeo_command() -> None:
    command = skopeo_command(
        "skopeo", parse_reference("localhost:5000/x:1"), tls_verify=False, authfile="auth.json"
    )
    assert command == [
        "skopeo", "copy", "--retry-times", "0", "--remove-signatures",
        "--src-tls-verify=false", "--src-authfile", "auth.json",
        "docker://localhost:5000/x:1", "oci:image:1",
    ]  # fmt: skip
    digest = parse_reference("localhost:5000/x@sha256:" + "b" * 64)
    assert skopeo_command("skopeo", digest, tls_verify=True, authfile=None)[-1] == "oci:image"


def test_pull_error_names_unreachable_registry_and_hides_password() -> None:
    reference = parse_reference("registry.example:5000/x:1")
    stderr = (
        'time="2026-01-01T00:00:00Z" level=fatal msg="initializing source '
        "docker://registry.example:5000/x:1: pinging container registry registry.example:5000: "
        'Get \\"https://registry.example:5000/v2/\\": dial tcp: lookup registry.example: '
        'no such host hunter2"\n'
    )
    auth = RegistryAuth(username="bob", password="hunter2")
    error = pull_error(reference, stderr, auth=auth, tls_verify=True)
    assert "registry.example:5000" in str(error) and "unreachable" in str(error)
    assert "hunter2" not in str(error)
    assert not isinstance(error, ImageNotFound)
