"""What the store hands back: an unpacked image and the run settings from its config."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

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
    """An image in the local store, unpacked and ready to be an overlayfs lower dir.

    `id` is ``sha256:<hex>`` of the image config (docker/OCI) or of the
    tarball (plain rootfs imports). `rootfs` is the flattened root filesystem,
    owned as the layers say: treat it as read-only. `size` counts the bytes of
    its regular files.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    names: list[str]
    rootfs: Path
    config: ImageConfig
    size: int

    @property
    def short_id(self) -> str:
        """The first 12 hex digits of the id, as docker shows them."""
        return self.id.removeprefix("sha256:")[:12]
