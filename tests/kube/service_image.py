"""The service image for the harness, built offline: what deploy/Dockerfile makes, without docker.

Two layers: the cached Debian rootfs with python3 (`tests.images.debian`) and
``/opt/sandman``, this checkout with its ``cli``, ``server`` and ``kubernetes`` extras
installed by pip (``--target``). The entrypoint is ``sandman`` (via python3),
as in the Dockerfile. The archive is written streaming (the base layer is
~270 MB) for ``ctr images import`` on the real node (`tests.kube.node_images`).
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from tests.images.debian import debian_python_tar
from tests.kube.conftest import REPO

NAME = "sandman.local/sandman-service"
LAYER = "application/vnd.oci.image.layer.v1.tar"
ENTRYPOINT = [
    "/usr/bin/python3", "-c",
    "import sys; sys.argv[0] = 'sandman'; from sandman.cli import main; main()",
]  # fmt: skip


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


def _packages_layer(work: Path) -> Path:
    """A tar of ``opt/sandman``: the package and its dependencies, installed by pip."""
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target",
         str(target), f"{REPO}[cli,server,kubernetes]"],
        check=True, capture_output=True, timeout=900,
    )  # fmt: skip
    layer = work / "packages.tar"
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:

        def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            return info

        tar.add(target, arcname="opt/sandman", filter=owned_by_root)
    return layer


def build_archive(work: Path, tag: str) -> tuple[Path, str]:
    """Write the image as an OCI archive under `work`; the archive and the image's name."""
    work.mkdir(parents=True, exist_ok=True)
    layers = [debian_python_tar(), _packages_layer(work)]
    digests = [_digest(layer) for layer in layers]
    run = {
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONPATH=/opt/sandman",
                "PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp"],
        "Entrypoint": ENTRYPOINT,
        "Cmd": ["serve", "--provider", "kubernetes", "--host", "0.0.0.0"],
        "User": "65532:65532",
    }  # fmt: skip
    rootfs = {"type": "layers", "diff_ids": digests}
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": run, "rootfs": rootfs})
    blobs: dict[str, bytes | Path] = dict(zip(digests, layers, strict=True))
    config_bytes = config.encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    blobs[config_digest] = config_bytes
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": LAYER, "digest": d, "size": p.stat().st_size}
            for d, p in zip(digests, layers, strict=True)
        ],
    }
    manifest_bytes = json.dumps(manifest).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    blobs[manifest_digest] = manifest_bytes
    name = f"{NAME}:{tag}"
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": manifest["mediaType"],
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    archive = work / "service.tar"
    with tarfile.open(archive, "w") as tar:
        for arcname, data in [
            ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ]:
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for digest, blob in blobs.items():
            arcname = f"blobs/sha256/{digest.removeprefix('sha256:')}"
            if isinstance(blob, Path):
                tar.add(blob, arcname=arcname)
            else:
                info = tarfile.TarInfo(arcname)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    return archive, name
