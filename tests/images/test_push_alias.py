"""An image pushed and pulled back into the store that pushed it is not stored twice: the
push records its new layer blobs as aliases of the stored layers (a real registry on
127.0.0.1, skopeo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.images import ImageStore
from sandman.images.layers import disk_usage
from tests.images.builders import file, layer_tar, oci_layout, sample_layers
from tests.images.registry_server import Registry, blob_fetches, missing_tools

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or ""),
]


def layer_dirs(store: ImageStore) -> set[str]:
    return {p.name for p in (store.root / "layers").iterdir() if p.is_dir()}


async def test_a_pushed_image_pulled_back_reuses_the_stored_layers(
    store: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    layout = oci_layout(tmp_path / "layout", sample_layers(), ref_name="1")
    original = await store.import_oci_layout(layout, name="sample:1")
    before = layer_dirs(store)
    assert len(before) == 3
    reference = f"{registry.host}/team/sample:1"
    await store.push("sample:1", reference, tls_verify=False)

    fetched = len(blob_fetches(registry))
    pulled = await store.pull(reference, tls_verify=False)
    # Only the config came down: every layer blob was found stored, by its pushed digest.
    assert len(blob_fetches(registry)) - fetched == 1
    assert layer_dirs(store) == before
    assert pulled.id != original.id  # a new config (new diff ids): docs/images.md
    assert pulled.lowers == original.lowers
    assert (pulled.rootfs / "bin/hello").read_bytes() == b"hello-v2"

    # A store that did not push them has no alias: it downloads what it lacks.
    fresh = ImageStore(tmp_path / "fresh")
    await fresh.pull(reference, tls_verify=False)
    assert len(blob_fetches(registry)) - fetched == 1 + 4  # then a config and 3 layers

    # Removing both images takes the layers and their aliases with them.
    await store.remove(reference)
    assert layer_dirs(store) == before
    await store.remove("sample:1")
    assert layer_dirs(store) == set()
    assert list((store.root / "aliases").iterdir()) == []
    assert disk_usage(store.root / "layers") < 64 * 1024


async def test_an_alias_survives_a_prune_of_other_layers(
    store: ImageStore, registry: Registry, tmp_path: Path
) -> None:
    layout = oci_layout(tmp_path / "layout", sample_layers(), ref_name="1")
    await store.import_oci_layout(layout, name="sample:1")
    await store.push("sample:1", f"{registry.host}/sample:1", tls_verify=False)
    # Another image, removed: its layer goes, and the digest index is cleaned.
    other = oci_layout(tmp_path / "other", [layer_tar([file("x", b"x")])], ref_name="1")
    await store.import_oci_layout(other, name="other:1")
    await store.remove("other:1")
    await store.prune()
    fetched = len(blob_fetches(registry))
    await store.pull(f"{registry.host}/sample:1", tls_verify=False)
    assert len(blob_fetches(registry)) - fetched == 1  # the config alone
    assert len(layer_dirs(store)) == 3
