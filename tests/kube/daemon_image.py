"""This tree's sandmand as a daemon image on the harness's real node.

``hack/kube/up`` imports the daemon image of the tree it was started from; a test of
something the daemon learnt since (``/v1/changes``) needs the daemon built now. The
image gets a name of its own, so that nothing else on the cluster changes daemon.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sandman.daemon import daemon_path
from tests.kube import node_images
from tests.kube.conftest import HACK, KubeCluster


@contextmanager
def current_daemon_image(cluster: KubeCluster) -> Iterator[str]:
    """The name of an image holding this tree's sandmand, imported into the real node;
    removed after the block."""
    name = f"sandman.local/sandmand:test-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="sandmand-image-"))
    try:
        root = work / "root"
        root.mkdir()
        shutil.copy2(daemon_path(), root / "sandmand")
        (root / "sandmand").chmod(0o555)
        # Content of its own: `node_images.remove` removes every name of the same digest.
        (root / "image-id").write_text(name)
        archive = work / "sandmand.tar"
        subprocess.run(
            [sys.executable, str(HACK / "images" / "oci_archive.py"), str(root), str(archive),
             name, "Entrypoint", "--", "/sandmand"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        node_images.ctr(cluster, "images", "import", str(archive))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        yield name
    finally:
        node_images.remove(cluster, name)
