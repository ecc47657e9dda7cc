"""The Kubernetes provider's snapshot store on the pool's host: records made whole or not
at all, a delete that waits for the creates holding a snapshot, and no id that is a path
(the provider's calls are on the harness: tests/kube/test_snapshots.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.kubernetes import pods
from sandman.providers.kubernetes.snapshots import SnapshotStore, spec_of
from tests.support import until


def _made(store: SnapshotStore, snapshot_id: str, data: bytes = b"tar") -> None:
    store.record(snapshot_id, {"labels": {"sandman.io/pool": "p"}, "image": "busybox"})
    store.partial(snapshot_id).write_bytes(data)
    store.complete(snapshot_id)


def test_a_snapshot_is_usable_once_complete_and_listed_before(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    store.record("sn-half", {"labels": {"sandman.io/pool": "p"}, "image": "busybox"})
    with pytest.raises(errors.SnapshotNotFound):
        store.get("sn-half")  # half-made: found by list (to be deleted), never used
    assert [s.id for s in store.list({"sandman.io/pool": "p"})] == ["sn-half"]
    store.partial("sn-half").write_bytes(b"x" * 1000)
    store.complete("sn-half")
    info = store.get("sn-half")
    assert (info.size, info.image, info.provider) == (1000, "busybox", "kubernetes")
    assert store.files("sn-half").read_bytes() == b"x" * 1000
    assert store.list({"sandman.io/pool": "other"}) == []
    store.delete("sn-half")
    store.delete("sn-half")  # idempotent
    assert store.list() == []
    assert list((tmp_path / "store").iterdir()) == []


def test_a_delete_waits_for_the_create_that_holds_the_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    _made(store, "sn-held")
    deleted = threading.Event()

    def delete() -> None:
        store.delete("sn-held")
        deleted.set()

    with store.using("sn-held") as held:
        assert held.id == "sn-held"
        deleter = threading.Thread(target=delete)
        deleter.start()
        # The delete is blocked on the lock, however long the create takes.
        assert not deleted.wait(0.3)
        assert store.files("sn-held").exists()
    until("the delete to finish once released", deleted.is_set)
    deleter.join()
    with pytest.raises(errors.SnapshotNotFound), store.using("sn-held"):
        pass


@pytest.mark.parametrize("bad", ["../etc", "sn-../../x", "/abs", "sn-UPPER", ""])
def test_an_id_is_never_a_path(tmp_path: Path, bad: str) -> None:
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(errors.SnapshotNotFound, match="not a snapshot id"):
        store.get(bad)
    with pytest.raises(errors.SnapshotNotFound):
        store.delete(bad)


def test_strays_of_a_make_or_delete_killed_half_way_go(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store")
    _made(store, "sn-keep")
    (tmp_path / "store" / ".old-sn-x.1234").mkdir()
    assert store.remove_strays() == [".old-sn-x.1234"]
    assert [s.id for s in store.list()] == ["sn-keep"]


def test_the_spec_of_a_pod_is_its_annotation() -> None:
    spec = SandboxSpec(image="busybox", cpu=0.5, env={"A": "1"})
    pod = {"metadata": {"name": "sb-1", "annotations": {pods.SPEC: spec.model_dump_json()}}}
    assert spec_of(pod) == spec
    with pytest.raises(errors.ConfigError, match="older Sandman"):
        spec_of({"metadata": {"name": "sb-2", "annotations": {}}})
    with pytest.raises(errors.ConfigError, match="recorded spec"):
        spec_of({"metadata": {"name": "sb-3", "annotations": {pods.SPEC: '{"cpu": -1}'}}})
