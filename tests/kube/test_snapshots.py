"""Snapshots of pods' files on the harness's real node: snapshot, fork, restore, and a
hostile daemon's answer refused (docs/snapshots.md, Kubernetes).

Every sandbox runs the unmodified busybox image with this tree's daemon (imported
under a name of this module's). Each test keeps its snapshots in a directory of its
own, which must be empty at its end, and its pods carry its own pool name (the
``pool_name`` fixture fails the test if any is left).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import sandman
from sandman import errors
from sandman.pool import PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 600)]


@pytest.fixture
def snapshot_dir(tmp_path: Path) -> Iterator[Path]:
    """The pool's snapshot directory; nothing may be left in it at the end."""
    path = tmp_path / "snapshots"
    yield path
    left = list(path.rglob("*")) if path.exists() else []
    assert not [p for p in left if p.is_file()], f"snapshot files left behind: {left}"


def settings(cluster: KubeCluster, daemon_image: str, snapshot_dir: Path, **more: Any) -> Any:
    return config_for(cluster, daemon_image=daemon_image, snapshot_dir=snapshot_dir, **more)


async def sh(sb: sandman.AsyncSandbox, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=60)
    assert result.exit_code == 0, (script, result.stdout, result.stderr)
    return result.stdout


# What a workload does to the image's tree before the snapshot: writes, creates,
# removes (a file and a directory of the image), links, modes.
PREPARE = (
    "mkdir -p /work/src && echo 'print(1)' > /work/src/main.py && chmod 4750 /work/src/main.py"
    " && head -c 300000 /dev/urandom > /work/blob && echo changed > /etc/passwd-note"
    " && echo extra >> /etc/passwd && rm /bin/wget && rm -rf /root"
    " && ln -s /work/src/main.py /work/abs-link && ln -s ../etc/passwd /work/rel-link"
    " && ln /work/blob /work/blob-link && mkdir /work/empty && chmod 700 /work/empty"
)
# What each sandbox made from the snapshot must see, one line per fact.
CHECK = (
    "cat /work/src/main.py; stat -c %a /work/src/main.py; md5sum < /work/blob;"
    " cat /etc/passwd-note; tail -n 1 /etc/passwd; test -e /bin/wget || echo no-wget;"
    " test -e /root || echo no-root; readlink /work/abs-link; readlink /work/rel-link;"
    " stat -c %i /work/blob /work/blob-link | uniq | wc -l; stat -c %a /work/empty;"
    " cat /work/abs-link"
)


@pytest.mark.timeout(SETUP_TIMEOUT + 900)
async def test_snapshot_fork_and_restore_on_pods(
    kube_cluster: KubeCluster,
    admin: Admin,
    pool_name: str,
    daemon_image: str,
    snapshot_dir: Path,
) -> None:
    config = settings(kube_cluster, daemon_image, snapshot_dir)
    spec = real_node_spec(kube_cluster)
    async with sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client:
        async with client.sandbox(spec, timeout=180) as sb:
            await sh(sb, PREPARE)
            expected = await sh(sb, CHECK)
            assert "4750" in expected and "no-wget" in expected and "no-root" in expected
            assert expected.splitlines()[9] == "1"  # the two names are one file

            snap = await sb.snapshot(ttl=600)
            assert snap.image == spec.image and snap.source == sb.id and not snap.memory
            assert 300_000 < snap.size < 2_000_000  # the changes, not the image
            assert [s.id for s in await client.snapshots()] == [snap.id]

            # Fork N: each has every change, and is its own.
            forks = [await client.acquire(snapshot=snap, timeout=180) for _ in range(3)]
            try:
                for fork in forks:
                    assert fork.id != sb.id
                    assert await sh(fork, CHECK) == expected
                await sh(forks[0], "echo mine > /work/only-0 && rm /work/blob")
                for other in (forks[1], forks[2], sb):
                    assert "absent" in await sh(other, "test -e /work/only-0 || echo absent")
                    assert "here" in await sh(other, "test -e /work/blob && echo here")

                # A fork's own snapshot holds the parent's changes and its own.
                again = await forks[0].snapshot()
                async with client.sandbox(snapshot=again, timeout=180) as grandchild:
                    assert await sh(grandchild, "cat /work/only-0") == "mine\n"
                    assert "gone" in await sh(grandchild, "test -e /work/blob || echo gone")
                    assert "no-wget" in await sh(grandchild, "test -e /bin/wget || echo no-wget")
                await client.delete_snapshot(again)
            finally:
                for fork in forks:
                    await fork.release()

            # Restore in place: same id and lease, a new pod, the snapshot's files, no
            # process of before.
            before = await admin.pod(sb.id)
            assert before is not None
            await sh(sb, "rm -rf /work && echo later > /etc/later && touch /bin/new")
            process = await sb.spawn(["sleep", "1000"])
            await sb.restore(snap)
            after = await admin.pod(sb.id)
            assert after is not None
            assert after["metadata"]["uid"] != before["metadata"]["uid"]
            assert after["metadata"]["labels"] == before["metadata"]["labels"]
            assert await sh(sb, CHECK) == expected
            assert "clean" in await sh(sb, "test -e /etc/later || test -e /bin/new || echo clean")
            assert process.pid not in [p.pid for p in await sb.list_processes()]
            assert "sleep 1000" not in await sh(sb, "ps")

            await client.delete_snapshot(snap)
            with pytest.raises(errors.SnapshotNotFound):
                await client.acquire(snapshot=snap.id, timeout=60)
            sandbox_id = sb.id

        async def gone() -> bool:
            return await admin.pod(sandbox_id) is None

        await wait_for("the released sandbox's pod to go", 60, gone)


async def test_a_sandbox_that_runs_as_nobody_is_snapshotted_and_forked(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, snapshot_dir: Path
) -> None:
    # Its daemon cannot read /root, nor give /tmp (root's) its owner, mode or times.
    config = settings(kube_cluster, daemon_image, snapshot_dir)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster, user="65534"), timeout=180) as sb,
    ):
        await sh(sb, "mkdir -p /tmp/work && echo mine > /tmp/work/file")
        forks = await sb.fork(2)
        try:
            for fork in forks:
                assert await sh(fork, "id -u; cat /tmp/work/file") == "65534\nmine\n"
        finally:
            for fork in forks:
                await fork.release()


async def test_the_pools_close_deletes_its_snapshots(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, snapshot_dir: Path
) -> None:
    config = settings(kube_cluster, daemon_image, snapshot_dir)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        await sh(sb, "echo kept > /kept")
        snap = await sb.snapshot()
        assert (await client.snapshots())[0].id == snap.id
        assert any(p.name == "files.tar" for p in snapshot_dir.rglob("*"))
    # The fixture checks that nothing of it is left on disk.


async def test_memory_is_a_clear_error_on_kubernetes(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, snapshot_dir: Path
) -> None:
    # pause() without memory: tests/kube/test_pause.py.
    config = settings(kube_cluster, daemon_image, snapshot_dir)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        with pytest.raises(errors.ConfigError, match="gVisor"):
            await sb.snapshot(memory=True)
        with pytest.raises(errors.ConfigError, match=r"gVisor.*pause\(\) stops every process"):
            await sb.pause(memory=True)
        assert not sb.paused
        assert (await sb.exec(["true"])).exit_code == 0  # and it goes on


# -- a hostile daemon ---------------------------------------------------------------


def _tar(name: str, body: bytes, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.size = (
            kind,
            link,
            len(body) if kind == tarfile.REGTYPE else 0,
        )
        tar.addfile(info, io.BytesIO(body) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


HOSTILE = {
    "dotdot": (_tar("../../../../escape", b"x"), errors.UnsafeArchive, "'..' component"),
    "absolute": (_tar("/tmp/escape", b"x"), errors.UnsafeArchive, "is absolute"),
    "the daemon's own": (_tar(".sandman/sandmand", b"x"), errors.UnsafeArchive, "the daemon's"),
    "a hard link out": (
        _tar("h", b"", tarfile.LNKTYPE, "../../etc/shadow"),
        errors.UnsafeArchive,
        "'..'",
    ),
    "oversize": (_tar("big", b"\0" * (2 * 2**20)), errors.FileTooLarge, "more than 1048576"),
}
HOSTILE_PORT = 9999


@pytest.fixture
async def hostile(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, snapshot_dir: Path
) -> AsyncIterator[tuple[sandman.AsyncSandbox, KubernetesProvider]]:
    """A sandbox whose workload serves crafted answers on a port of its own, and a
    provider that takes that port for the daemon's: a daemon that lies."""
    config = settings(kube_cluster, daemon_image, snapshot_dir)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        await sb.write_file("/www/index.html", "a daemon that lies\n")
        await sb.spawn(["busybox", "httpd", "-f", "-p", f"0.0.0.0:{HOSTILE_PORT}", "-h", "/www"])
        liar = KubernetesProvider(
            settings(
                kube_cluster, daemon_image, snapshot_dir,
                daemon_port=HOSTILE_PORT, snapshot_max_bytes=2**20,
            )
        )  # fmt: skip
        try:
            yield sb, liar
        finally:
            await liar.aclose()


async def test_a_hostile_daemons_answer_is_refused_and_nothing_is_kept(
    hostile: tuple[sandman.AsyncSandbox, KubernetesProvider], snapshot_dir: Path, tmp_path: Path
) -> None:
    sb, liar = hostile
    for case, (body, error, says) in HOSTILE.items():
        await sb.write_file("/www/v1/changes", body)
        with pytest.raises(error, match=says):
            await liar.snapshot(sb.id, labels={POOL: "hostile"})
        kept = [p for p in snapshot_dir.rglob("*") if p.is_file()]
        assert kept == [], (case, kept)
        assert not (tmp_path / "escape").exists()
        assert not list(snapshot_dir.parent.glob("escape*"))
    assert await liar.snapshots() == []
