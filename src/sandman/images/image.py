"""What the store hands back: an unpacked image and the run settings from its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

__all__ = ["DEFAULT_PATH", "Image", "ImageConfig"]

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH docker gives a container whose image sets none."""


class ImageConfig(BaseModel):
    """How the image wants to be run, from the OCI/docker image config.

    `user` is as the image says: ``""`` (root), ``"uid"``, ``"uid:gid"`` or
    ``"name[:group]"``; turn it into numbers with `resolve_user`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    env: list[str] = []
    """``KEY=VALUE`` entries, in order."""
    working_dir: str = "/"
    user: str = ""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None

    @field_validator("working_dir")
    @classmethod
    def _root_when_empty(cls, value: str) -> str:
        # The OCI config spells "not set" as "", which means "/".
        return value or "/"


class Image(BaseModel):
    """An image in the local store, unpacked and ready to be overlayfs lower dirs.

    `id` is ``sha256:<hex>`` of the image config (docker/OCI) or of the
    tarball (plain rootfs imports). `lowers` are the directories to stack as
    overlayfs lower layers, topmost first (``lowerdir=":".join(lowers)``): the
    image's stored layers, shared with other images, or one merged directory
    when they are more than one mount can stack (`sandman.images.overlay`).
    `rootfs` is the whole root filesystem in one directory, for callers that
    take one: the layer itself for a single-layer image, else a tree of hard
    links to the layers' files. Both are owned as the layers say: treat them
    as read-only. `layers` are the diff ids of its layers, bottom first ([] for
    images stored before layers were). `size` counts the bytes of its regular
    files.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    names: list[str]
    rootfs: Path
    config: ImageConfig
    size: int
    lowers: list[Path] = []
    layers: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _lowers_default(cls, data: Any) -> Any:
        # An image given only a rootfs is that one directory.
        if isinstance(data, dict) and not data.get("lowers") and "rootfs" in data:
            return {**data, "lowers": [data["rootfs"]]}
        return data

    @property
    def short_id(self) -> str:
        """The first 12 hex digits of the id, as docker shows them."""
        return self.id.removeprefix("sha256:")[:12]
