"""A sandbox from an image of several stored layers: deletions, opaque directories and
users across layers, seen from inside (the local provider, crun)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.images.builders import (
    PASSWD,
    OciLayout,
    directory,
    file,
    image_config,
    layer_tar,
    opaque,
    sha256,
    whiteout,
)
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


@pytest.fixture
async def provider(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    async with provider_for(config_for(state_dir), busybox_tar) as made:
        yield made


async def test_a_sandbox_sees_the_layers_merged(
    provider: LocalProvider, busybox_tar: Path, tmp_path: Path
) -> None:
    layers = [
        busybox_tar.read_bytes(),
        layer_tar(
            [
                directory("data"),
                file("data/old", b"old"),
                file("etc/removeme", b"x"),
                file("etc/passwd", (PASSWD + "app:x:2000:2000::/:/bin/sh\n").encode()),
            ]
        ),
        layer_tar(
            [whiteout("etc/removeme"), opaque("data"), file("data/new", b"new"), whiteout("bin/ls")]
        ),
    ]
    config = image_config([sha256(layer) for layer in layers], user="app", working_dir="/")
    oci = OciLayout()
    oci.index.append(oci.image(layers, config=config))
    layout = oci.write_dir(tmp_path / "layout")
    image = await provider.images.import_oci_layout(layout, name="layered:1")
    assert len(image.lowers) == 3
    # The busybox layer is the one the provider's own busybox image already stored.
    busybox = await provider.images.get("busybox")
    assert image.lowers[-1] == busybox.rootfs
    info = await provider.create(SandboxSpec(image="layered:1", memory="256Mi", pids=64))
    async with await ready(info) as sb:
        result = await sb.exec(
            "id -u; busybox ls /data; test -e /etc/removeme || echo removed; "
            "test -e /bin/ls || echo no-ls; cat /data/new"
        )
        assert result.stdout.split() == ["2000", "new", "removed", "no-ls", "new"]
        await sb.exec("echo changed > /data/new")
    assert (image.rootfs / "data/new").read_bytes() == b"new"  # the layers are untouched
    await provider.delete(info.id)
