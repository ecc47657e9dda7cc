"""Extended attributes of image files: file capabilities (``security.capability``) and
``user.*`` are kept through import, push and pull, and seen inside a sandbox; overlayfs'
own and the host's labels are never taken from a layer."""

from __future__ import annotations

import os
import secrets
import shutil
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandman.images import ImageStore
from sandman.images.export import export_layer
from sandman.models import SandboxSpec
from tests.images.builders import (
    REF_NAME,
    Entry,
    OciLayout,
    directory,
    file,
    image_config,
    layer_tar,
    oci_layout,
    sha256,
)
from tests.images.registry_server import Registry
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready
from tests.support import eventually

pytestmark = pytest.mark.anyio

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="security.capability needs root")

# VFS_CAP_REVISION_2 with the effective flag; permitted: CAP_NET_RAW (13): "cap_net_raw=ep".
NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)
CAPABILITY = "security.capability"


def with_xattrs(entry: Entry, xattrs: dict[str, bytes]) -> Entry:
    """`entry` with PAX ``SCHILY.xattr.*`` records, as docker and buildah write them."""
    entry.info.pax_headers = {
        f"SCHILY.xattr.{name}": value.decode("utf-8", "surrogateescape")
        for name, value in xattrs.items()
    }
    return entry


def capability_layer() -> bytes:
    return layer_tar(
        [
            directory("bin"),
            with_xattrs(
                file("bin/ping", b"#!/bin/sh\n", mode=0o755),
                {CAPABILITY: NET_RAW, "user.note": b"\xffbinary"},
            ),
            # Never taken from a layer: overlayfs' own, and a host's label.
            with_xattrs(
                directory("data"),
                {"trusted.overlay.opaque": b"y", "user.overlay.opaque": b"y"},
            ),
            with_xattrs(file("data/f", b"f"), {"security.selinux": b"system_u:object_r:x:s0"}),
        ]
    )


def xattrs(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n, follow_symlinks=False) for n in os.listxattr(path)}


def assert_kept(root: Path) -> None:
    assert xattrs(root / "bin/ping") == {CAPABILITY: NET_RAW, "user.note": b"\xffbinary"}
    assert xattrs(root / "data") == {}
    assert "security.selinux" not in xattrs(root / "data/f")
    if shutil.which("getcap") is not None:
        shown = subprocess.run(
            ["getcap", str(root / "bin/ping")], capture_output=True, text=True, check=True
        )
        assert "cap_net_raw=ep" in shown.stdout


@needs_root
async def test_capabilities_survive_import_and_export(store: ImageStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", [capability_layer()], ref_name="1")
    image = await store.import_oci_layout(layout, name="caps:1")
    assert_kept(image.rootfs)
    blob = export_layer(image.rootfs, tmp_path / "blobs", compress=False)
    with tarfile.open(tmp_path / "blobs" / blob.digest.removeprefix("sha256:")) as tar:
        headers = tar.getmember("bin/ping").pax_headers
        assert headers[f"SCHILY.xattr.{CAPABILITY}"].encode("utf-8", "surrogateescape") == NET_RAW
        assert not any("overlay" in k for k in tar.getmember("data").pax_headers)


@needs_root
async def test_capabilities_survive_push_and_pull(
    store: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    layout = oci_layout(tmp_path / "layout", [capability_layer()], ref_name="1")
    await store.import_oci_layout(layout, name="caps:1")
    reference = f"{registry.host}/caps:1"
    await store.push("caps:1", reference, tls_verify=False)
    fresh = await ImageStore(tmp_path / "fresh").pull(reference, tls_verify=False)
    assert_kept(fresh.rootfs)


def host_pid_of(command: list[str]) -> int | None:
    """The host pid of the process whose command line is `command`, if one runs."""
    wanted = "\0".join(command).encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    return int(entry.name)
            except OSError:
                continue  # gone meanwhile
    return None


@needs_root_and_crun
async def test_a_sandbox_sees_the_capability(
    state_dir: Path, busybox_tar: Path, tmp_path: Path
) -> None:
    """The busybox image plus a layer with ``/bin/ping`` capable of CAP_NET_RAW. busybox
    has no getfattr, so the sandbox's own root (its overlay, in its mount namespace) is
    read from the host through ``/proc/<pid>/root`` of a process in it."""
    layers = [busybox_tar.read_bytes(), capability_layer()]
    config = image_config([sha256(layer) for layer in layers], user="", working_dir="/")
    oci = OciLayout()
    oci.index.append(oci.image(layers, config=config, annotations={REF_NAME: "1"}))
    layout = oci.write_dir(tmp_path / "layout")
    marker = ["sleep", str(900_000 + secrets.randbelow(99_999))]
    async with provider_for(config_for(state_dir), busybox_tar) as provider:
        await provider.images.import_oci_layout(layout, name="caps:1")
        info = await provider.create(SandboxSpec(image="caps:1", memory="128Mi", pids=32))
        client = await ready(info)
        try:
            await client.exec(f"{' '.join(marker)} </dev/null >/dev/null 2>&1 &")
            found: list[int] = []

            def running() -> bool:
                pid = host_pid_of(marker)
                found[:] = [pid] if pid is not None else []
                return pid is not None

            await eventually(running, what="the sandbox's sleep")
            root = Path(f"/proc/{found[0]}/root")
            # The sandbox has its own user namespace: the kernel shows the capability
            # as a v3 one, for the namespace's root (its host uid appended).
            shown = os.getxattr(root / "bin/ping", CAPABILITY)
            magic, permitted, *_ = struct.unpack_from("<II", shown)
            assert (magic, permitted) == (0x03000001, 1 << 13), shown
            assert os.getxattr(root / "bin/ping", "user.note") == b"\xffbinary"
        finally:
            await client.aclose()
            await provider.delete(info.id)
