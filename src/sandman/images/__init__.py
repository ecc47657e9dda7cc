"""The local image store: import docker/OCI archives and rootfs tarballs, or pull from a
registry (`ImageStore.pull`, with skopeo); unpack once, reuse; push to a registry
(`ImageStore.push`).

Layers are stored once (`sandman.images.layerstore`) and shared by the images made of
them. The local provider turns an `Image` into overlayfs lower dirs (`Image.lowers`,
or the one merged directory `Image.rootfs`) and runs it with the settings in
`Image.config` (`resolve_user` gives the numeric ids of its user).
"""

from sandman.images.image import Image, ImageConfig
from sandman.images.registry import RegistryAuth
from sandman.images.store import ImageStore, PruneReport
from sandman.images.users import resolve_user

__all__ = ["Image", "ImageConfig", "ImageStore", "PruneReport", "RegistryAuth", "resolve_user"]
