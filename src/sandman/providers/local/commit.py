"""A snapshot made an image: its files over its image's, as one layer, under a new name.

The snapshot's layer (what the sandbox wrote, with overlayfs' whiteouts for what it
removed) and its image's rootfs are mounted read-only as the two lower layers of an
overlay, in a mount namespace of its own (nothing appears in the host's mount table),
and tarred as they merge. The tar becomes the single layer of an OCI image layout
whose config is the source image's (env, working directory, user, command), which the
image store imports like any other. tar archives symlinks, devices and fifos as
entries: nothing the sandbox wrote is followed or read as anything but a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from sandman import errors
from sandman.images import Image

__all__ = ["oci_layout_of"]

_TIMEOUT = 1800


def oci_layout_of(image: Image, upper: Path, layout: Path, *, source: str) -> None:
    """Write an OCI image layout at ``layout`` (absent): ``image``'s rootfs with ``upper``
    (an overlay upper directory) over it, as one layer, with ``image``'s config."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    merged = layout / "merged"
    merged.mkdir()
    tar = layout / "layer.tar"
    # /dev's entries are the runtime's (its devices, links and mount points, made in a
    # sandbox's layer: `views.make_dev`), and every runtime hides an image's /dev: the
    # directory is kept, empty.
    script = (
        'mount -t overlay overlay -o "ro,lowerdir=$1:$2" "$3" && '
        'exec tar --numeric-owner --xattrs --xattrs-include="*" --acls --exclude="./dev/*" '
        '-C "$3" -cf "$4" .'
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "commit",
         str(upper), str(image.rootfs), str(merged), str(tar)],
        capture_output=True, text=True, timeout=_TIMEOUT, check=False,
    )  # fmt: skip
    merged.rmdir()
    if done.returncode != 0:
        raise errors.ProviderError(f"cannot read the files of {source}: {done.stderr.strip()}")
    digest = _sha256(tar)
    os.rename(tar, blobs / digest)
    config = {
        "architecture": _arch(), "os": "linux",
        "config": {
            "Env": image.config.env, "WorkingDir": image.config.working_dir,
            "User": image.config.user, "Entrypoint": image.config.entrypoint,
            "Cmd": image.config.cmd, "Labels": {"io.sandman.source": source},
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
        "history": [{"created_by": f"sandman snapshot save {source} --as-image"}],
    }  # fmt: skip
    config_digest = _blob(blobs, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": f"sha256:{config_digest}",
            "size": (blobs / config_digest).stat().st_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": f"sha256:{digest}",
                "size": (blobs / digest).stat().st_size,
            }
        ],
    }
    manifest_digest = _blob(blobs, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": f"sha256:{manifest_digest}",
                "size": (blobs / manifest_digest).stat().st_size,
                "platform": {"architecture": _arch(), "os": "linux"},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


def _blob(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return digest


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def _arch() -> str:
    machine = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
