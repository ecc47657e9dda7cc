"""Building images from a Dockerfile with buildah: FROM an image of the store, offline;
the result's config and files; the base's layers stored once; buildah's cache; failures
that leave nothing (no containers, no mounts, nothing stored); the CLI; a sandbox."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandman.cli import build as cli
from sandman.errors import ImageError, ImageNotFound
from sandman.images import Image, ImageStore
from sandman.images.build import (
    BUILD_CAPABILITIES,
    BUILD_TAG,
    BuildahStorage,
    base_refs,
    filesystem_type,
    mounts_under,
    rewrite_from,
    storage_driver,
)
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.providers.local.oci import CAPABILITIES
from tests.images.builders import (
    OciLayout,
    directory,
    file,
    image_config,
    layer_tar,
    sha256,
    whiteout,
)
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready

pytestmark = pytest.mark.anyio

CAP_BITS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
    "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31,
}  # fmt: skip

needs_buildah = pytest.mark.skipif(
    shutil.which("buildah") is None, reason="needs buildah (apt-get install -y buildah)"
)

DOCKERFILE = """\
FROM busybox
ENV GREETING=hello APP_HOME=/app
WORKDIR /app
COPY hello.txt data/ /app/
RUN echo "built from $GREETING" > /app/out && chmod 0600 /app/out && cat /proc/net/dev > /app/net
CMD ["cat", "/app/out"]
"""


# -- the Dockerfile, rewritten (no buildah needed) -------------------------------------------


@pytest.mark.parametrize(
    ("dockerfile", "refs"),
    [
        ("FROM busybox\nRUN true\n", ["busybox"]),
        ("from busybox:1 AS build\nFROM build\nFROM scratch\n", ["busybox:1"]),
        ("FROM --platform=linux/amd64 a AS x\nFROM b\nFROM x\nFROM a\n", ["a", "b"]),
        ("ARG BASE=busybox\nFROM $BASE\n", []),
        ("RUN echo FROM busybox\n", []),
    ],
)
def test_the_images_a_dockerfile_names(dockerfile: str, refs: list[str]) -> None:
    assert base_refs(dockerfile) == refs


def test_from_lines_are_rewritten_and_nothing_else() -> None:
    dockerfile = (
        "FROM --platform=linux/amd64 busybox AS build\r\n"
        "RUN echo FROM busybox\n"
        "FROM build\n"
        "FROM busybox\n"
    )
    assert rewrite_from(dockerfile, {"busybox": "oci:/x:base", "build": "nope"}) == (
        "FROM --platform=linux/amd64 oci:/x:base AS build\r\n"
        "RUN echo FROM busybox\n"
        "FROM build\n"
        "FROM oci:/x:base\n"
    )


def test_buildah_stacks_overlay_only_where_it_can(tmp_path: Path) -> None:
    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(tmp_path) != ""
    expected = "vfs" if filesystem_type(tmp_path) == "overlay" else "overlay"
    assert storage_driver(tmp_path) == expected


# -- builds ------------------------------------------------------------------------------------


@pytest.fixture
async def based(store: ImageStore, busybox_tar: Path) -> ImageStore:
    await store.import_archive(busybox_tar, name="busybox")
    return store


@pytest.fixture
def context(tmp_path: Path) -> Path:
    path = tmp_path / "context"
    (path / "data").mkdir(parents=True)
    (path / "hello.txt").write_text("hello from the context\n")
    (path / "data" / "table.csv").write_text("a,b\n1,2\n")
    (path / "Dockerfile").write_text(DOCKERFILE)
    return path


def stored_layers(store: ImageStore) -> set[str]:
    return {p.name for p in (store.root / "layers").iterdir() if p.is_dir()}


def buildah_containers(store: ImageStore) -> list[str]:
    storage = BuildahStorage(store.root / "buildah", "buildah")
    command = storage.command("containers", "--quiet")
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()


def buildah_images(store: ImageStore) -> list[str]:
    storage = BuildahStorage(store.root / "buildah", "buildah")
    command = storage.command("images", "--format", "{{.Name}}:{{.Tag}}")
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()


def assert_nothing_left(store: ImageStore) -> None:
    """No buildah container, no mount under the store, no scratch directory."""
    assert buildah_containers(store) == []
    assert mounts_under(store.root) == []
    assert list((store.root / "tmp").iterdir()) == []


@needs_buildah
async def test_a_dockerfile_builds_over_a_store_image(based: ImageStore, context: Path) -> None:
    busybox = await based.get("busybox")
    image = await based.build(context / "Dockerfile", context, name="app:1")

    assert image.names == ["app:1"]
    assert "GREETING=hello" in image.config.env and "APP_HOME=/app" in image.config.env
    assert any(e.startswith("PATH=") for e in image.config.env)  # the base's, kept
    assert image.config.working_dir == "/app"
    assert image.config.cmd == ["cat", "/app/out"]
    root = image.rootfs
    assert (root / "app/out").read_text() == "built from hello\n"
    assert (root / "app/out").stat().st_mode & 0o777 == 0o600
    assert (root / "app/hello.txt").read_text() == "hello from the context\n"
    assert (root / "app/table.csv").read_text() == "a,b\n1,2\n"
    assert (root / "bin/busybox").read_bytes() == (busybox.rootfs / "bin/busybox").read_bytes()
    # RUN had no network: the loopback device only.
    devices = [line.split(":")[0].strip() for line in (root / "app/net").read_text().splitlines()]
    assert devices[2:] == ["lo"]

    # The base's layer is the store's own, not a second copy.
    assert image.layers[0] == busybox.layers[0]
    assert image.lowers[-1] == busybox.rootfs
    assert len(stored_layers(based)) == len(image.layers)
    assert_nothing_left(based)


@needs_buildah
async def test_a_base_of_several_layers_is_shared_whole(
    store: ImageStore, tmp_path: Path, busybox_tar: Path
) -> None:
    own = layer_tar(
        [
            whiteout("bin/ls"),
            directory("srv"),
            file("srv/base.txt", b"from the base"),
        ]
    )
    layers = [busybox_tar.read_bytes(), own]
    oci = OciLayout()
    config = image_config([sha256(layer) for layer in layers], user="", working_dir="/")
    oci.index.append(oci.image(layers, config=config))
    layout = oci.write_dir(tmp_path / "layout")
    base = await store.import_oci_layout(layout, name="layered:2")
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(
        "FROM layered:2\n"
        "RUN test ! -L /bin/ls && cat /srv/base.txt > /srv/copy && rm /srv/base.txt\n"
    )
    before = stored_layers(store)

    image = await store.build(context / "Dockerfile", context, name="over:1")

    assert image.layers[:2] == base.layers
    assert image.lowers[-2:] == base.lowers
    assert stored_layers(store) - before == {Path(image.lowers[0]).name}  # one new layer
    assert (image.rootfs / "srv/copy").read_bytes() == b"from the base"
    assert not (image.rootfs / "srv/base.txt").exists()
    assert not (image.rootfs / "bin/ls").is_symlink()
    assert_nothing_left(store)


@needs_buildah
async def test_an_unchanged_rebuild_uses_the_cache(based: ImageStore, context: Path) -> None:
    first = await based.build(context / "Dockerfile", context, name="app:1")
    layers = stored_layers(based)
    again = await based.build(context / "Dockerfile", context, name="app:2")
    assert again.id == first.id  # buildah reran no step: same config, same layers
    assert stored_layers(based) == layers

    (context / "hello.txt").write_text("changed\n")
    changed = await based.build(context / "Dockerfile", context, name="app:3")
    assert changed.id != first.id
    assert (changed.rootfs / "app/hello.txt").read_text() == "changed\n"
    assert changed.layers[0] == first.layers[0]
    assert_nothing_left(based)
    # The base went into buildah's storage once, under its store id; the result as BUILD_TAG.
    busybox = await based.get("busybox")
    base = f"localhost/sandman-base:{busybox.id.removeprefix('sha256:')}"
    assert set(buildah_images(based)) - {"<none>:<none>"} == {base, BUILD_TAG}


@needs_buildah
async def test_build_args_reach_the_build(based: ImageStore, context: Path) -> None:
    (context / "Dockerfile").write_text(
        "FROM busybox\nARG FLAVOUR=plain\nRUN echo $FLAVOUR > /flavour\n"
    )
    plain = await based.build(context / "Dockerfile", context)
    spicy = await based.build(context / "Dockerfile", context, build_args={"FLAVOUR": "spicy"})
    assert (plain.rootfs / "flavour").read_text() == "plain\n"
    assert (spicy.rootfs / "flavour").read_text() == "spicy\n"


@needs_buildah
async def test_a_store_path_need_not_be_a_valid_image_name(
    busybox_tar: Path, context: Path, tmp_path: Path
) -> None:
    store = ImageStore(tmp_path / "Odd Store_")
    await store.import_archive(busybox_tar, name="busybox")
    image = await store.build(context / "Dockerfile", context, name="app:1")
    assert (image.rootfs / "app/out").read_text() == "built from hello\n"


@needs_buildah
async def test_without_the_cache_nothing_of_buildah_stays(based: ImageStore, context: Path) -> None:
    image = await based.build(context / "Dockerfile", context, name="app:1", cache=False)
    assert (image.rootfs / "app/out").read_text() == "built from hello\n"
    assert not (based.root / "buildah").exists()
    assert mounts_under(based.root) == []
    assert list((based.root / "tmp").iterdir()) == []


@needs_buildah
async def test_a_failing_run_raises_and_leaves_nothing(based: ImageStore, context: Path) -> None:
    images = await based.list()
    layers = stored_layers(based)
    (context / "Dockerfile").write_text(
        "FROM busybox\nCOPY hello.txt /\nRUN echo the-step-said-no >&2; exit 7\n"
    )
    with pytest.raises(ImageError) as caught:
        await based.build(context / "Dockerfile", context, name="broken:1")
    message = str(caught.value)
    assert "buildah build failed" in message
    assert "the-step-said-no" in message and "exit status 7" in message
    assert [i.id for i in await based.list()] == [i.id for i in images]
    assert stored_layers(based) == layers
    assert_nothing_left(based)


def test_a_build_step_has_the_sandboxes_capabilities() -> None:
    assert BUILD_CAPABILITIES == CAPABILITIES


WALLS = """\
FROM busybox
RUN grep -E '^(CapEff|Seccomp):' /proc/self/status > /status \\
    && (mkdir /m && mount -t tmpfs none /m && echo mounted || echo refused) > /mount \\
    && echo mine > /owned && chown 1234:4321 /owned
"""


@needs_buildah
async def test_a_run_step_is_walled_like_a_sandbox(based: ImageStore, context: Path) -> None:
    (context / "Dockerfile").write_text(WALLS)
    image = await based.build(context / "Dockerfile", context, name="walls:1")
    root = image.rootfs
    status = dict(line.split(":\t") for line in (root / "status").read_text().splitlines())
    assert status["Seccomp"] == "2"  # a filter
    assert int(status["CapEff"], 16) == sum(1 << CAP_BITS[c] for c in BUILD_CAPABILITIES)
    assert (root / "mount").read_text() == "refused\n"  # no CAP_SYS_ADMIN
    owned = (root / "owned").stat()
    assert (owned.st_uid, owned.st_gid) == (1234, 4321)
    assert_nothing_left(based)


@needs_buildah
async def test_a_run_step_past_its_memory_fails_the_build(based: ImageStore, context: Path) -> None:
    (context / "Dockerfile").write_text(
        "FROM busybox\nRUN dd if=/dev/zero of=/dev/null bs=200M count=1\n"
    )
    with pytest.raises(ImageError, match="buildah build failed"):
        await based.build(context / "Dockerfile", context, memory=64 * 2**20)
    assert_nothing_left(based)


def running(argv: list[str]) -> list[int]:
    """The pids of the processes whose command line is `argv`."""
    wanted = "\0".join(argv).encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_buildah
async def test_a_build_past_its_timeout_stops_its_step(based: ImageStore, context: Path) -> None:
    (context / "Dockerfile").write_text("FROM busybox\nRUN sleep 987\n")
    with pytest.raises(ImageError, match="timed out after 2s"):
        await based.build(context / "Dockerfile", context, timeout=2)
    assert running(["sleep", "987"]) == []  # buildah stopped the step's container
    assert_nothing_left(based)


@needs_buildah
@pytest.mark.parametrize(
    ("dockerfile", "words"),
    [
        ("FROM busybox\nFROBNICATE now\n", "FROBNICATE"),
        ("FROM busybox\nCOPY missing.txt /\n", "missing.txt"),
    ],
)
async def test_a_bad_dockerfile_gives_buildahs_message(
    based: ImageStore, context: Path, dockerfile: str, words: str
) -> None:
    (context / "Dockerfile").write_text(dockerfile)
    with pytest.raises(ImageError, match=words):
        await based.build(context / "Dockerfile", context)
    assert_nothing_left(based)


@needs_buildah
async def test_a_base_not_in_the_store_says_what_to_run(based: ImageStore, context: Path) -> None:
    (context / "Dockerfile").write_text("FROM python:3.11\nRUN true\n")
    with pytest.raises(ImageNotFound, match=r"sandman images pull python:3.11"):
        await based.build(context / "Dockerfile", context)


# -- the CLI and a sandbox ---------------------------------------------------------------------


@needs_buildah
def test_the_cli_builds(busybox_tar: Path, context: Path) -> None:
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    runner = CliRunner()
    base = ["--state-dir", str(state)]
    try:
        imported = runner.invoke(
            cli(), [*base, "images", "import", str(busybox_tar), "--name", "busybox"]
        )
        assert imported.exit_code == 0, imported.output
        built = runner.invoke(
            cli(), [*base, "images", "build", "-f", str(context / "Dockerfile"), str(context),
                    "-t", "app:1"]
        )  # fmt: skip
        assert built.exit_code == 0, built.output
        assert built.output.split()[1:] == ["app:1"]
        assert "app:1" in runner.invoke(cli(), [*base, "images", "ls"]).output
        pruned = runner.invoke(cli(), [*base, "images", "prune", "--build-cache"])
        assert pruned.exit_code == 0 and "dropped the build cache" in pruned.output
        assert not (state / "images" / "buildah").exists()
        assert "app:1" in runner.invoke(cli(), [*base, "images", "ls"]).output

        (context / "Dockerfile").write_text("FROM busybox\nRUN exit 3\n")
        failed = runner.invoke(cli(), [*base, "images", "build", str(context)])
        assert failed.exit_code == 1
        assert "error:" in failed.output and "exit status 3" in failed.output
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
async def provider(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    async with provider_for(config_for(state_dir), busybox_tar) as made:
        yield made


@needs_buildah
@needs_root_and_crun
async def test_a_sandbox_runs_the_built_image(provider: LocalProvider, context: Path) -> None:
    image: Image = await provider.images.build(context / "Dockerfile", context, name="app:1")
    info = await provider.create(SandboxSpec(image="app:1", memory="256Mi", pids=64))
    async with await ready(info) as sb:
        result = await sb.exec('cat /app/out; echo "$GREETING"; pwd; cat hello.txt')
        assert result.stdout.splitlines() == [
            "built from hello",
            "hello",
            "/app",
            "hello from the context",
        ]
    await provider.delete(info.id)
    assert image.lowers[-1] == (await provider.images.get("busybox")).rootfs
