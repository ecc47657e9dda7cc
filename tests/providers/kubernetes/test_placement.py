"""Steering toward nodes that hold an image: reference parsing and the affinity term."""

from __future__ import annotations

from typing import Any

import pytest

from sandman.providers.kubernetes.placement import (
    ImageRef,
    image_affinity,
    nodes_with_image,
    parse_image,
    with_preference,
)

DIGEST = "sha256:" + "ab" * 32


def node(name: str, *images: list[str]) -> dict[str, Any]:
    """A Node as the API returns it, holding `images` (each a list of names)."""
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"host-{name}"}},
        "status": {"images": [{"names": names, "sizeBytes": 1} for names in images]},
    }


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("busybox", ImageRef("docker.io/library/busybox", "latest", None)),
        ("busybox:1.36", ImageRef("docker.io/library/busybox", "1.36", None)),
        ("docker.io/busybox:1", ImageRef("docker.io/library/busybox", "1", None)),
        ("org/app:v1", ImageRef("docker.io/org/app", "v1", None)),
        ("127.0.0.1:5000/x/y", ImageRef("127.0.0.1:5000/x/y", "latest", None)),
        ("127.0.0.1:5000/x/y:T2", ImageRef("127.0.0.1:5000/x/y", "T2", None)),
        ("localhost/app:1", ImageRef("localhost/app", "1", None)),
        ("ghcr.io/o/r@" + DIGEST, ImageRef("ghcr.io/o/r", None, DIGEST)),
        ("ghcr.io/o/r:1@" + DIGEST, ImageRef("ghcr.io/o/r", "1", DIGEST)),
    ],
)
def test_parse_image_canonicalises_like_containerd(reference: str, expected: ImageRef) -> None:
    assert parse_image(reference) == expected


@pytest.mark.parametrize(
    "reference", ["", "  ", "busy box", "busybox:", "busybox@", "x/", "Busybox:1", "x@md5:00"]
)
def test_parse_image_refuses_garbage(reference: str) -> None:
    with pytest.raises(ValueError, match="not an image reference"):
        parse_image(reference)


def test_nodes_with_image_matches_any_spelling() -> None:
    nodes = [
        node("a", ["docker.io/library/busybox:1.36", "docker.io/library/busybox@" + DIGEST]),
        node("b", ["docker.io/library/python:3.12"]),
        node("c", ["docker.io/library/busybox@" + DIGEST]),  # only the digest
        {"metadata": {"name": "d"}, "status": {}},  # a node that reports no images
    ]
    assert nodes_with_image("busybox:1.36", nodes) == ["a"]
    assert nodes_with_image("docker.io/library/busybox@" + DIGEST, nodes) == ["a", "c"]
    assert nodes_with_image("busybox:1.35", nodes) == []
    assert nodes_with_image("python:3.12", nodes) == ["b"]


def test_image_affinity_prefers_holders_by_node_name() -> None:
    nodes = [node("n2", ["r.io/t:1"]), node("n1", ["r.io/t:1"]), node("n3", ["r.io/u:1"])]
    assert image_affinity("r.io/t:1", nodes, weight=50) == {
        "weight": 50,
        "preference": {
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}]
        },
    }
    assert image_affinity("r.io/v:1", nodes) is None
    with pytest.raises(ValueError, match="weight"):
        image_affinity("r.io/t:1", nodes, weight=0)


def test_with_preference_keeps_the_callers_affinity_and_does_not_mutate_it() -> None:
    theirs: dict[str, Any] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {}}],
        },
        "podAntiAffinity": {"x": 1},
    }
    term = image_affinity("r.io/t:1", [node("n1", ["r.io/t:1"])])
    assert term is not None
    merged = with_preference(theirs, term)
    preferred = merged["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred == [{"weight": 1, "preference": {}}, term]
    assert merged["podAntiAffinity"] == {"x": 1}
    assert "requiredDuringSchedulingIgnoredDuringExecution" in merged["nodeAffinity"]
    assert len(theirs["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 1
    assert with_preference(None, term) == {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}
    }
