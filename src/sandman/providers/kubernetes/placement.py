"""Steer sandboxes toward nodes that already hold their image: pure functions over Node objects.

The kubelet reports the images a node holds in ``status.images`` (each with
its ``names``: tags and ``repo@sha256:`` digests). `image_affinity` turns that
into a *preferred* node affinity, so the scheduler favours those nodes but
still places the pod elsewhere when they are full: a cold pull is slower,
never a failure.

Two limits of the source: the kubelet lists at most ``nodeStatusMaxImages``
(default 50) images per node, largest first, and refreshes the list with the
node's status (about every 10 s to 1 min). An image missing from a node's list
may still be there; a listed one is. The caller lists nodes (``get``/``list``
on ``nodes``, a cluster-scoped read) and refreshes that list now and then.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ImageRef", "image_affinity", "nodes_with_image", "parse_image", "with_preference"]

DEFAULT_WEIGHT = 80
"""Of 1-100: strong enough to beat the default spreading scores, not a requirement."""
MAX_NODES = 500
"""Names in one affinity term at most; past that the pod spec grows for little gain."""


@dataclass(frozen=True)
class ImageRef:
    """An image reference in the canonical form the kubelet reports (``docker.io/library/…``)."""

    repository: str
    tag: str | None
    digest: str | None

    def names(self) -> set[str]:
        """The spellings of this image that can appear in a node's ``status.images``."""
        found = set()
        if self.tag is not None:
            found.add(f"{self.repository}:{self.tag}")
        if self.digest is not None:
            found.add(f"{self.repository}@{self.digest}")
        return found


def parse_image(reference: str) -> ImageRef:
    """Canonicalise ``busybox``, ``busybox:1``, ``reg:5000/x/y:t``, ``x@sha256:…`` the way
    containerd names images: a registry host (default ``docker.io``), ``library/`` for
    Docker Hub's single-name images, tag ``latest`` when neither tag nor digest is given."""
    ref = reference.strip()
    if not ref or any(c.isspace() for c in ref) or ref.endswith(("@", ":", "/")):
        raise ValueError(f"not an image reference: {reference!r}")
    name, _, digest = ref.partition("@")
    tag: str | None = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:  # a tag, not a registry port
        name, tag = name[:colon], name[colon + 1 :]
    # Repository names are lowercase (tags need not be).
    if not name or name != name.lower() or (digest and not digest.startswith("sha256:")):
        raise ValueError(f"not an image reference: {reference!r}")
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name}"  # no registry host: Docker Hub
    if name.startswith("docker.io/") and name.count("/") == 1:
        name = f"docker.io/library/{name.removeprefix('docker.io/')}"
    if tag is None and not digest:
        tag = "latest"
    return ImageRef(repository=name, tag=tag, digest=digest or None)


def nodes_with_image(image: str, nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the `nodes` (Node objects as the API returns them) that list `image`, sorted."""
    wanted = parse_image(image).names()
    held = []
    for node in nodes:
        for entry in (node.get("status") or {}).get("images") or []:
            if wanted.intersection(entry.get("names") or ()):
                held.append(node["metadata"]["name"])
                break
    return sorted(held)


def image_affinity(
    image: str, nodes: Iterable[Mapping[str, Any]], *, weight: int = DEFAULT_WEIGHT
) -> dict[str, Any] | None:
    """A preferred scheduling term (``preferredDuringSchedulingIgnoredDuringExecution`` entry)
    toward the nodes that hold `image`, or None when none does."""
    if not 1 <= weight <= 100:
        raise ValueError(f"weight must be 1..100, not {weight}")
    held = nodes_with_image(image, nodes)[:MAX_NODES]
    if not held:
        return None
    # matchFields on metadata.name: the node's name, whatever labels it carries.
    return {
        "weight": weight,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": held}]},
    }


def with_preference(affinity: Mapping[str, Any] | None, term: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a pod's `affinity` with `term` added to its preferred node affinity; the
    caller's own required and preferred terms stay as they are."""
    merged: dict[str, Any] = copy.deepcopy(dict(affinity or {}))
    node = merged.setdefault("nodeAffinity", {})
    node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
        copy.deepcopy(dict(term))
    )
    return merged
