"""Write a single-layer OCI image archive from a directory, offline.

Usage: oci_archive.py ROOTFS_DIR OUT.tar NAME:TAG Entrypoint|Cmd -- ARGV...

The archive is an OCI image layout in a tar file (oci-layout, index.json,
blobs/sha256/...), which `ctr -n k8s.io images import` accepts. The image is
named by the `io.containerd.image.name` annotation. Standard library only;
the output is reproducible (fixed mtimes, sorted entries, root ownership).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

EPOCH = 0


def _layer(rootfs: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, rootfs))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = EPOCH
                if info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    info.mtime = EPOCH
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def main(argv: list[str]) -> int:
    if len(argv) < 6 or argv[3] not in ("Entrypoint", "Cmd") or argv[4] != "--":
        print(__doc__, file=sys.stderr)  # noqa: T201
        return 2
    rootfs, out, ref, key, args = argv[0], argv[1], argv[2], argv[3], argv[5:]
    raw = _layer(rootfs)
    gz = gzip.compress(raw, mtime=EPOCH)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {key: args, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
    }
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w") as tar:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        info = tarfile.TarInfo("oci-layout")
        info.size = len(layout)
        tar.addfile(info, io.BytesIO(layout))
        config_bytes = json.dumps(config, sort_keys=True).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _blob(tar, config_bytes),
                "size": len(config_bytes),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _blob(tar, gz),
                    "size": len(gz),
                }
            ],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _blob(tar, manifest_bytes),
                    "size": len(manifest_bytes),
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        index_bytes = json.dumps(index, sort_keys=True).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(index_bytes)
        tar.addfile(info, io.BytesIO(index_bytes))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
