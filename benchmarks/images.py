"""The layer store: 10 images over one base, on disk, imported and pulled; a re-pull's
downloads; create→ready from a single-layer and a layered image.

Builds 10 OCI images offline that share one base layer (``--base-mib`` of incompressible
files) and each add ``--own-mib`` of their own, then:

1. imports them into a fresh store and measures its disk (blocks of every inode once,
   directories and metadata included) against the base plus the 10 own layers, and
   against what the store took before layers (each image as its own full rootfs: the
   sum of the images' sizes);
2. with a registry (Debian's ``docker-registry`` and skopeo, as the tests use), pushes
   them, pulls all 10 into a fresh store counting the blobs the registry serves, then
   pulls all 10 again: ``repull_blobs`` is what that second round downloads;
3. as root with crun, times create→ready of sandboxes from a single-layer image and from
   a two-layer one, interleaved (``--ready N`` rounds; 0 skips it).

    python benchmarks/images.py                  # 80 MiB base, 1 MiB each, as the issue
    python benchmarks/images.py --base-mib 8     # quick

4. builds a Dockerfile over the busybox image with buildah, cold, then unchanged;
5. pushes the 10 imported images (`ImageStore.push`) to the registry, then again: the
   blobs each round uploads (the registry's log) and its seconds; then pulls the first
   pushed image back into the store that pushed it: the blobs that downloads
   (``pushback_blobs``: its config alone, the layers being the pushed ones' aliases);
6. builds a Dockerfile that installs a small Python project with pip from a wheel
   directory in the build context (no network: the project's wheel is made here with
   ``pip wheel``, and pip itself is Debian's ``/usr/share/python-wheels`` wheel, run from
   the wheel), over the Debian image the tests use (``tests/images/debian.py``), cold
   then unchanged (``--pip-build``; ``na`` without buildah or that image).

Last line: ``store_mib_10_images=<x> base_mib=<x> repull_blobs=<n> cold_build_s=<s>
cached_rebuild_s=<s>`` (the pip build's, 6.) then ``busybox_cold_build_s=<s>``,
``busybox_cached_rebuild_s=<s>`` (4.), ``push_blobs=<n>/<n>`` and ``push_s=<s>/<s>``
(first/second push, 5.), ``pushback_blobs=<n>``, ``own_mib=<x>``, ``before_mib=<x>`` (the
same images stored before layers), ``pull_blobs=<n>`` (the first round) and
``ready_p50_ms=<single>/<layered>``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import os
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from math import nan
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.images.registry_server
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from _common import new_cgroup_parent

from sandman.images import Image, ImageStore

IMAGES = 10
MIB = 1 << 20


def layer(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def random_files(prefix: str, mib: float) -> dict[str, bytes]:
    count = max(1, int(mib * 4))  # 256 KiB each
    size = int(mib * MIB) // count
    return {f"{prefix}/f{i:04d}": os.urandom(size) for i in range(count)}


def write_layout(path: Path, layers: list[bytes], tag: str) -> Path:
    """An OCI layout of one image made of `layers` (uncompressed), tagged `tag`."""
    import json

    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes, media_type: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    diff_ids = [f"sha256:{hashlib.sha256(x).hexdigest()}" for x in layers]
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }  # fmt: skip
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
        "layers": [blob(x, "application/vnd.oci.image.layer.v1.tar") for x in layers],
    }
    descriptor = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    descriptor["annotations"] = {"org.opencontainers.image.ref.name": tag}
    index = {"schemaVersion": 2, "manifests": [descriptor]}
    (path / "index.json").write_text(json.dumps(index))
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return path


def disk_bytes(root: Path) -> int:
    """What `root` takes on disk: the blocks of every inode under it, each counted once."""
    seen: set[int] = set()
    total = 0
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files, "."]:
            st = os.lstat(os.path.join(directory, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


async def imports(layouts: list[Path], state: Path) -> tuple[float, float, list[Image], ImageStore]:
    store = ImageStore(state / "import-store")
    started = time.monotonic()
    images = [
        await store.import_oci_layout(p, name=f"bench/img:{i}") for i, p in enumerate(layouts)
    ]
    elapsed = time.monotonic() - started
    stored = disk_bytes(store.root) / MIB
    before = sum(i.size for i in images) / MIB
    print(f"import of {IMAGES} images: {elapsed:.1f} s; store {stored:.1f} MiB on disk")
    print(f"before layers (each image a full rootfs): {before:.1f} MiB of files")
    return stored, before, images, store


def uploads(log: str) -> int:
    """Blob uploads in a registry's access log: each ends with a ``PUT`` of its digest."""
    return len(re.findall(r'"PUT /v2/\S+/blobs/uploads/\S*?[?&]digest=sha256', log))


async def pushes(store: ImageStore, images: list[Image], registry: Any) -> dict[str, str]:
    """Push `images` twice; then pull the first back into `store`, which pushed it."""
    from tests.images.registry_server import blob_fetches

    counts: list[int] = []
    seconds: list[float] = []
    for _ in range(2):
        mark = uploads(registry.log())
        started = time.monotonic()
        for i, image in enumerate(images):
            await store.push(image.id, f"{registry.host}/bench/pushed:{i}", tls_verify=False)
        seconds.append(time.monotonic() - started)
        counts.append(uploads(registry.log()) - mark)
    print(
        f"push of {IMAGES} images: {seconds[0]:.1f} s, {counts[0]} blobs uploaded (a config "
        f"and a layer each, the base once: {2 * IMAGES + 1}); again: {seconds[1]:.1f} s, "
        f"{counts[1]} blobs"
    )
    layers = len(list((store.root / "layers").glob("*.json")))
    mark = len(blob_fetches(registry))
    await store.pull(f"{registry.host}/bench/pushed:0", tls_verify=False)
    back = len(blob_fetches(registry)) - mark
    added = len(list((store.root / "layers").glob("*.json"))) - layers
    print(f"pull of a pushed image into the pushing store: {back} blobs, {added} new layers")
    return {
        "push_blobs": f"{counts[0]}/{counts[1]}",
        "push_s": f"{seconds[0]:.2f}/{seconds[1]:.2f}",
        "pushback_blobs": str(back),
    }


async def pulls(
    layouts: list[Path], state: Path, pushed: tuple[ImageStore, list[Image]]
) -> tuple[str, str, dict[str, str]]:
    na = {"push_blobs": "na", "push_s": "na", "pushback_blobs": "na"}
    try:
        from tests.images.registry_server import blob_fetches, missing_tools, push, start_registry
    except ImportError:
        return "na(run from the repository)", "na", na
    missing = missing_tools()
    if missing is not None:
        print(f"no pull: {missing}")
        return "na(no registry)", "na", na
    registry = start_registry(state / "registry", access_log=True)
    try:
        references = [
            push(layout, str(i), registry, "bench/img") for i, layout in enumerate(layouts)
        ]
        store = ImageStore(state / "pull-store")
        before = len(blob_fetches(registry))
        started = time.monotonic()
        for reference in references:
            await store.pull(reference, tls_verify=False)
        first = len(blob_fetches(registry)) - before
        print(
            f"pull of {IMAGES} images: {time.monotonic() - started:.1f} s, {first} blobs "
            f"downloaded (a config and a layer each, and the base once: {2 * IMAGES + 1})"
        )
        print(f"pull store {disk_bytes(store.root) / MIB:.1f} MiB on disk")
        mark = len(blob_fetches(registry))
        started = time.monotonic()
        for reference in references:
            await store.pull(reference, tls_verify=False)
        again = len(blob_fetches(registry)) - mark
        print(f"re-pull of {IMAGES} images: {time.monotonic() - started:.2f} s, {again} blobs")
        return str(again), str(first), await pushes(*pushed, registry)
    finally:
        registry.stop()


async def ready_times(rounds: int, state: Path, layered: Path) -> str:
    if rounds <= 0:
        return "na(skipped)"
    if os.geteuid() != 0 or shutil.which("crun") is None:
        return "na(needs root and crun)"

    from sandman.images.busybox import busybox_rootfs_tar
    from sandman.models import SandboxSpec
    from sandman.providers.local import LocalProvider
    from sandman.settings import LocalConfig

    short = Path(tempfile.mkdtemp(prefix="smi-", dir="/tmp"))  # socket paths are short
    provider = LocalProvider(LocalConfig(state_dir=short, cgroup_parent=new_cgroup_parent()))
    try:
        busybox = busybox_rootfs_tar(short / "busybox.tar")
        await provider.images.import_archive(busybox, name="single")
        extra = layer({"opt/extra": b"x" * 4096})
        layout = write_layout(state / "ready-layout", [busybox.read_bytes(), extra], "1")
        await provider.images.import_oci_layout(layout, name="layered:1")
        samples: dict[str, list[float]] = {"single": [], "layered:1": []}
        for _ in range(rounds):
            for image, times in samples.items():
                started = time.monotonic()
                info = await provider.create(SandboxSpec(image=image, memory="128Mi", pids=32))
                assert info.endpoint is not None
                client = info.endpoint.client()
                await client.wait_ready(timeout=10)
                times.append(time.monotonic() - started)
                await client.aclose()
                await provider.delete(info.id)
        single, two = (statistics.median(v) * 1000 for v in samples.values())
        print(f"create->ready p50: single-layer {single:.0f} ms, two layers {two:.0f} ms")
    finally:
        await provider.aclose()
        shutil.rmtree(short, ignore_errors=True)
    return f"{single:.0f}/{two:.0f}"


async def build_twice(store: ImageStore, context: Path, name: str) -> tuple[float, float]:
    """Seconds to build ``context``'s Dockerfile as ``name`` cold, then again unchanged
    (from the build cache); the cache is dropped after, so the next build starts cold."""
    took: list[float] = []
    for _ in range(2):
        started = time.monotonic()
        await store.build(context / "Dockerfile", context, name=name)
        took.append(time.monotonic() - started)
    await store.drop_build_cache()
    return took[0], took[1]


BUILD = """\
FROM busybox
COPY app /app
RUN i=0; while [ $i -lt 2000 ]; do echo $i > /app/f$i; i=$((i+1)); done
ENV APP=/app
CMD ["sh", "/app/run.sh"]
"""


async def builds(state: Path) -> tuple[float, float]:
    """A Dockerfile over the busybox image built cold, then rebuilt unchanged (cached)."""
    from sandman.images.busybox import busybox_rootfs_tar

    if shutil.which("buildah") is None:
        print("no build: buildah is not installed (apt-get install -y buildah)")
        return float("nan"), float("nan")
    store = ImageStore(state / "build-store")
    await store.import_archive(busybox_rootfs_tar(state / "busybox.tar"), name="busybox")
    context = state / "context"
    (context / "app").mkdir(parents=True)
    (context / "app" / "run.sh").write_text("echo hello\n")
    (context / "Dockerfile").write_text(BUILD)
    cold, cached = await build_twice(store, context, "app:1")
    print(f"build over busybox: cold {cold:.2f} s, unchanged rebuild {cached:.2f} s")
    return cold, cached


PIP_BUILD = """\
FROM debian-python
COPY wheels /wheels
RUN python3 /wheels/{pip}/pip install --no-index --find-links /wheels --no-cache-dir \\
        --break-system-packages tinyproj \\
    && python3 -c 'import tinyproj; assert tinyproj.hello() == "hello"'
CMD ["python3", "-c", "import tinyproj; print(tinyproj.hello())"]
"""

PIP_WHEEL = Path("/usr/share/python-wheels")


def tiny_project(path: Path) -> Path:
    """A small Python project (hatchling, as this repository builds itself)."""
    (path / "src" / "tinyproj").mkdir(parents=True)
    (path / "src" / "tinyproj" / "__init__.py").write_text(
        'def hello() -> str:\n    return "hello"\n'
    )
    (path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "tinyproj"\nversion = "1.0"\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["src/tinyproj"]\n'
    )
    return path


async def pip_builds(state: Path) -> tuple[float, float]:
    """A Dockerfile that pip-installs a local project's wheel from the build context, over
    the tests' Debian image (python3, no pip), cold then unchanged; offline."""
    if shutil.which("buildah") is None:
        return float("nan"), float("nan")
    pips = sorted(PIP_WHEEL.glob("pip-*.whl"))
    if not pips:
        print(f"no pip build: no pip wheel in {PIP_WHEEL} (apt-get install -y python3-pip-whl)")
        return float("nan"), float("nan")
    try:
        from tests.images.debian import debian_python_tar
    except ImportError:
        return float("nan"), float("nan")
    context = state / "pip-context"
    wheels = context / "wheels"
    wheels.mkdir(parents=True)
    await anyio.run_process(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--wheel-dir", str(wheels), str(tiny_project(state / "proj"))],
        stdout=None,
    )  # fmt: skip
    shutil.copy(pips[-1], wheels)
    (context / "Dockerfile").write_text(PIP_BUILD.format(pip=pips[-1].name))
    store = ImageStore(state / "pip-store")
    started = time.monotonic()
    await store.import_archive(debian_python_tar(), name="debian-python")
    print(f"import of the Debian image: {time.monotonic() - started:.1f} s")
    cold, cached = await build_twice(store, context, "tinyproj:1")
    print(f"pip install of a local wheel over Debian: cold {cold:.2f} s, unchanged {cached:.2f} s")
    return cold, cached


async def run(args: argparse.Namespace, state: Path) -> str:
    base = layer(random_files("base", args.base_mib))
    own = [layer(random_files(f"own{i}", args.own_mib)) for i in range(IMAGES)]
    layouts = [write_layout(state / f"layout{i}", [base, own[i]], str(i)) for i in range(IMAGES)]
    stored, before, images, store = await imports(layouts, state)
    repull, first, pushed = await pulls(layouts, state, (store, images))
    ready = await ready_times(args.ready, state, layouts[0])
    cold, cached = await builds(state)
    pip_cold, pip_cached = await pip_builds(state) if args.pip_build else (nan, nan)
    base_mib = args.base_mib
    own_mib = args.own_mib * IMAGES
    print(f"base {base_mib:.1f} MiB + own layers {own_mib:.1f} MiB = {base_mib + own_mib:.1f} MiB")
    return (
        f"store_mib_10_images={stored:.1f} base_mib={base_mib:.1f} repull_blobs={repull} "
        f"cold_build_s={pip_cold:.2f} cached_rebuild_s={pip_cached:.2f} "
        f"busybox_cold_build_s={cold:.2f} busybox_cached_rebuild_s={cached:.2f} "
        f"push_blobs={pushed['push_blobs']} push_s={pushed['push_s']} "
        f"pushback_blobs={pushed['pushback_blobs']} own_mib={own_mib:.1f} "
        f"before_mib={before:.1f} pull_blobs={first} ready_p50_ms={ready}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mib", type=float, default=80.0, help="the shared base layer")
    parser.add_argument("--own-mib", type=float, default=1.0, help="each image's own layer")
    parser.add_argument("--ready", type=int, default=10, help="create->ready rounds (0: skip)")
    parser.add_argument(
        "--pip-build",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the pip build over the Debian image (its import takes a while)",
    )
    parser.add_argument("--state-dir", type=Path, help="an empty directory (default: a new one)")
    args = parser.parse_args()
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="smb-images-", dir="/var/tmp"))
    try:
        line = asyncio.run(run(args, state))
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
