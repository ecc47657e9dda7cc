"""A pod's snapshot made an image in a registry, on the harness's real node
(``KubernetesProvider.save_image``, ``sandman snapshot save ID --as-image REF
--kubernetes``; docs/snapshots.md).

Debian's ``docker-registry`` runs on 127.0.0.1 (the node's containerd speaks plain HTTP
to a loopback registry). The base image is busybox plus a layer of its own, pushed
there; a sandbox of it writes files and removes some of each layer's; the saved image
is pulled by the node for a new sandbox, which must see the same tree. The registry's
log tells which blobs each save uploaded. The registry, the images on the node, the
pods, the snapshots and every scratch directory are gone at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import sandman
from sandman import errors
from sandman.pool import PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from tests.images import builders
from tests.images.registry_server import Registry, free_port, missing_tools, push, start_registry
from tests.kube import node_images
from tests.kube.conftest import REPO, SETUP_TIMEOUT, KubeCluster
from tests.kube.support import config_for, real_node_spec

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 600)]

REPOSITORY = "sandman-test/image"
UPLOAD = re.compile(
    r'"PUT /v2/(\S+)/blobs/uploads/\S*digest=(sha256%3A[0-9a-f]{64}|sha256:[0-9a-f]{64})'
)
MOUNT = re.compile(
    r'"POST /v2/(\S+)/blobs/uploads/\?\S*mount=(sha256%3A[0-9a-f]{64}|sha256:[0-9a-f]{64})'
)


@dataclass(frozen=True)
class Base:
    reference: str
    layers: list[str]
    """Its layer blobs' digests."""


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    missing = missing_tools()
    if missing:
        pytest.skip(missing)
    running = start_registry(tmp_path_factory.mktemp("registry"), access_log=True)
    try:
        yield running
    finally:
        running.stop()
        assert running.process.poll() is not None
        assert not running.root.exists()


@pytest.fixture(scope="module")
def base(
    registry: Registry, kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Base]:
    """busybox, and over it a layer of this run's: ``/base/{keep,gone,dir/x}``; every image
    of the registry is removed from the node afterwards."""
    nonce = secrets.token_hex(6)
    work = tmp_path_factory.mktemp("base")
    busybox = builders.busybox_rootfs_tar(work / "busybox.tar").read_bytes()
    own = builders.layer_tar(
        [
            builders.directory("base"),
            builders.file("base/keep", nonce.encode()),
            builders.file("base/gone", b"gone\n"),
            builders.directory("base/dir"),
            builders.file("base/dir/x", b"x\n"),
        ]
    )
    oci = builders.OciLayout()
    config = builders.image_config(
        [builders.sha256(layer) for layer in (busybox, own)], user="", working_dir="/"
    )
    oci.index.append(oci.image([busybox, own], config=config, annotations={builders.REF_NAME: "1"}))
    layout = oci.write_dir(work / "layout")
    reference = push(layout, "1", registry, f"{REPOSITORY}-base-{nonce}")
    layers = [builders.sha256(builders.gz(layer)) for layer in (busybox, own)]
    try:
        yield Base(reference, layers)
    finally:
        node_images.remove(kube_cluster, f"{registry.host}/")
        assert not [r for r in node_images.image_refs(kube_cluster) if registry.host in r]


@pytest.fixture
def snapshot_dir(tmp_path: Path) -> Iterator[Path]:
    """The pool's snapshot directory: no snapshot and no scratch directory left in it."""
    path = tmp_path / "snapshots"
    yield path
    left = list(path.rglob("*")) if path.exists() else []
    assert not left or all(p.is_dir() and p.parent == path for p in left), left


def uploads(registry: Registry, since: int) -> tuple[list[str], list[str]]:
    """The blobs uploaded, and those mounted from another repository, after byte ``since``
    of the registry's log."""
    log = registry.log()[since:]

    def fix(digest: str) -> str:
        return digest.replace("%3A", ":")

    return [fix(m[1]) for m in UPLOAD.findall(log)], [fix(m[1]) for m in MOUNT.findall(log)]


def blob_size(registry: Registry, digest: str) -> int:
    data = registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256"
    hexa = digest.removeprefix("sha256:")
    return (data / hexa[:2] / hexa / "data").stat().st_size


async def sh(sb: sandman.AsyncSandbox, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=60)
    assert result.exit_code == 0, (script, result.stdout, result.stderr)
    return result.stdout


# The workload: writes, a setuid mode, links, and removals of a file of each layer and
# of a directory of the image's own layer.
PREPARE = (
    "mkdir -p /work/src && echo 'print(1)' > /work/src/main.py && chmod 4750 /work/src/main.py"
    " && head -c 300000 /dev/urandom > /work/blob && ln /work/blob /work/blob-link"
    " && ln -s ../etc/passwd /work/rel-link && echo extra >> /etc/passwd"
    " && rm /bin/yes /base/gone && rm -rf /base/dir && echo mine > /base/new"
    " && rm -rf /root && mkdir /root && echo again > /root/file"
)
CHECK = (
    "cat /work/src/main.py; stat -c %a /work/src/main.py; busybox md5sum < /work/blob;"
    " stat -c %i /work/blob /work/blob-link | sort -u | wc -l; readlink /work/rel-link;"
    " tail -n 1 /etc/passwd; test -e /bin/yes || echo no-yes; test -e /bin/ls && echo ls;"
    " test -e /base/gone || echo no-gone; test -e /base/dir || echo no-dir;"
    " cat /base/keep /base/new; ls -A /root"
)


async def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The ``sandman`` command in a process of its own."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "from sandman.cli import main; main()", *argv],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")},
    )  # fmt: skip


def kube_args(cluster: KubeCluster) -> list[str]:
    return ["--kubernetes", "--kubeconfig", str(cluster.kubeconfig), "--namespace",
            cluster.namespace]  # fmt: skip


@pytest.mark.timeout(SETUP_TIMEOUT + 900)
async def test_a_pod_saved_as_an_image_makes_sandboxes_with_its_files(
    kube_cluster: KubeCluster,
    pool_name: str,
    daemon_image: str,
    snapshot_dir: Path,
    registry: Registry,
    base: Base,
) -> None:
    config = config_for(kube_cluster, daemon_image=daemon_image, snapshot_dir=snapshot_dir)
    spec = real_node_spec(kube_cluster).model_copy(update={"image": base.reference})
    repository = f"{registry.host}/{REPOSITORY}-saved-{secrets.token_hex(4)}"
    provider = KubernetesProvider(config)  # the pool's snapshot store, as a caller sees it
    try:
        async with (
            sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
            client.sandbox(spec, timeout=180) as sb,
        ):
            await sh(sb, PREPARE)
            expected = await sh(sb, CHECK)
            assert "4750" in expected and "no-yes" in expected and "no-dir" in expected
            snap = await sb.snapshot(ttl=600)

            # Bad input first: typed, at once, and nothing left.
            began = time.monotonic()
            with pytest.raises(errors.SnapshotNotFound):
                await provider.save_image("sn-000000000000", f"{repository}:1", tls_verify=False)
            with pytest.raises(errors.SnapshotNotFound, match="not a snapshot id"):
                await provider.save_image("../../etc", f"{repository}:1", tls_verify=False)
            with pytest.raises(errors.ImageError, match="invalid image name"):
                await provider.save_image(snap.id, "Not A Reference!", tls_verify=False)
            with pytest.raises(errors.ImageError, match="name a tag"):
                await provider.save_image(snap.id, f"{repository}@sha256:{'0' * 64}")
            closed = f"127.0.0.1:{free_port()}/sandman-test/x:1"
            with pytest.raises(errors.ImageError, match="unreachable"):
                await provider.save_image(snap.id, closed, tls_verify=False)
            assert time.monotonic() - began < 15
            assert [p.name for p in snapshot_dir.rglob(".image-*")] == []

            # The image: its manifest is the base's layers and one more.
            since = len(registry.log())
            began = time.monotonic()
            digest = await provider.save_image(snap.id, f"{repository}:1", tls_verify=False)
            first_save = time.monotonic() - began
            uploaded, _ = uploads(registry, since)
            assert not set(base.layers) & set(uploaded), "the base's layers were uploaded again"
            manifest = json.loads(
                (await asyncio.to_thread(
                    subprocess.run,
                    ["skopeo", "inspect", "--raw", "--tls-verify=false",
                     f"docker://{repository}@{digest}"],
                    capture_output=True, text=True, check=True, timeout=60,
                )).stdout
            )  # fmt: skip
            layers = [layer["digest"] for layer in manifest["layers"]]
            assert layers[:2] == base.layers and len(layers) == 3
            assert layers[2] in uploaded
            assert blob_size(registry, layers[2]) < 600_000  # the changes, not the image

            async with client.sandbox(
                spec.model_copy(update={"image": f"{repository}@{digest}"}), timeout=180
            ) as made:
                assert await sh(made, CHECK) == expected

            # A second save, by the CLI (its own snapshot, deleted after): only the new
            # layer and the config travel.
            await sh(sb, "echo later > /work/later")
            since = len(registry.log())
            done = await cli(
                "snapshot", "save", sb.id, "--as-image", f"{repository}:2", "--insecure",
                *kube_args(kube_cluster),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            again = done.stdout.strip()
            assert again.startswith(f"{repository}@sha256:")
            uploaded, _ = uploads(registry, since)
            sizes = {d: blob_size(registry, d) for d in uploaded}
            assert not set(base.layers) & set(uploaded)
            assert len(uploaded) == 2, sizes  # the layer and the config
            sys.stderr.write(f"save_image: first {first_save:.2f} s; then uploaded {sizes}\n")
            async with client.sandbox(spec.model_copy(update={"image": again}), timeout=180) as two:
                assert await sh(two, "cat /work/later; test -e /base/gone || echo no-gone") == (
                    "later\nno-gone\n"
                )
            await client.delete_snapshot(snap)
    finally:
        await provider.aclose()
    assert not list(snapshot_dir.rglob(".image-*"))


async def test_an_image_not_in_a_registry_says_so(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, snapshot_dir: Path,
    registry: Registry,
) -> None:  # fmt: skip
    # The harness's busybox was imported into the node: no registry has it.
    config = config_for(kube_cluster, daemon_image=daemon_image, snapshot_dir=snapshot_dir)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        await sh(sb, "echo x > /x")
        done = await cli(
            "snapshot", "save", sb.id, "--as-image", f"{registry.host}/{REPOSITORY}-no:1",
            "--insecure", *kube_args(kube_cluster),
        )  # fmt: skip
        assert done.returncode == 1
        assert "cannot be fetched by this host" in done.stderr, done.stderr
        assert "sandman.local/busybox:1.35" in done.stderr
        assert "registry that both this host and the nodes reach" in done.stderr
        assert "Traceback" not in done.stderr
        done = await cli(
            "snapshot", "save", sb.id, "--as-image", f"127.0.0.1:{free_port()}/x:1",
            "--insecure", *kube_args(kube_cluster),
        )  # fmt: skip
        assert done.returncode == 1 and "is unreachable" in done.stderr, done.stderr
        done = await cli(
            "snapshot", "save", "sb-000000000000", "--as-image",
            f"{registry.host}/{REPOSITORY}-no:1", "--insecure", *kube_args(kube_cluster),
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert f"no pod sb-000000000000 in namespace {kube_cluster.namespace}" in done.stderr
        # Usage errors, before anything is made.
        done = await cli("snapshot", "save", sb.id, *kube_args(kube_cluster))
        assert done.returncode == 2 and "--kubernetes goes with --as-image" in done.stderr
        done = await cli("snapshot", "save", sb.id, "--as-image", "x:1", "--insecure")
        assert done.returncode == 2 and "go with --kubernetes" in done.stderr
