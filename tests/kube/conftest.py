"""A real single-machine Kubernetes cluster for tests marked ``kube``.

The session fixture ``kube_cluster`` builds the components (cached: a no-op
when ``hack/kube/.bin`` is current), starts the cluster with ``hack/kube/up``
and tears it down with ``hack/kube/down``, then checks that nothing is left.

Tests marked ``@pytest.mark.kube`` are skipped unless ``SANDMAN_KUBE=1``.
Other variables:

- ``SANDMAN_KUBE_DIR``: the cluster's state directory (default
  ``/var/lib/sandman-kube``).
- ``SANDMAN_KUBE_EXISTING=1``: use the cluster already started by
  ``hack/kube/up`` in that directory, and leave it running.
- The settings of ``hack/kube/lib.sh`` (ports, ``SANDMAN_KUBE_NET``,
  ``SANDMAN_KUBE_BRIDGE``, ``SANDMAN_KUBE_CGROUP_ROOT``, ...) are passed on to
  ``up`` and ``down``; a second cluster beside another needs its own of each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.kube.support import Admin

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack" / "kube"
DEFAULT_DIR = "/var/lib/sandman-kube"
# A cold build of the Kubernetes components takes about ten minutes on two
# cores; a cached one, and starting the cluster, well under one.
SETUP_TIMEOUT = 1800


@dataclass(frozen=True)
class KubeCluster:
    """What ``hack/kube/up`` wrote to ``$SANDMAN_KUBE_DIR/env``."""

    state_dir: Path
    server: str
    ca: Path
    token: str
    """The ordinary, non-exempt identity ``sandman`` (Role in ``namespace``)."""
    admin_token: str
    """``system:masters``: for the harness's own set-up and clean-up only."""
    kubeconfig: Path
    admin_kubeconfig: Path
    namespace: str
    real_node: str
    kwok_nodes: int
    kubectl: Path
    pod_subnet: str
    """The real node's pod addresses: ``10.213.0.0/24`` unless ``SANDMAN_KUBE_NET`` says."""
    ctr: Path
    """The ``ctr`` of the real node's containerd (``hack/kube/build`` built both)."""

    @classmethod
    def from_env_file(cls, path: Path) -> KubeCluster:
        env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        return cls(
            state_dir=Path(env["SANDMAN_KUBE_DIR"]),
            server=env["SANDMAN_KUBE_SERVER"],
            ca=Path(env["SANDMAN_KUBE_CA"]),
            token=env["SANDMAN_KUBE_TOKEN"],
            admin_token=env["SANDMAN_KUBE_ADMIN_TOKEN"],
            kubeconfig=Path(env["SANDMAN_KUBE_KUBECONFIG"]),
            admin_kubeconfig=Path(env["SANDMAN_KUBE_ADMIN_KUBECONFIG"]),
            namespace=env["SANDMAN_KUBE_NAMESPACE"],
            real_node=env["SANDMAN_KUBE_REAL_NODE"],
            kwok_nodes=int(env["SANDMAN_KUBE_KWOK_NODES"]),
            kubectl=Path(env["SANDMAN_KUBE_KUBECTL"]),
            # Defaults: what an up from before these settings ran.
            pod_subnet=env.get("SANDMAN_KUBE_POD_SUBNET", "10.213.0.0/24"),
            ctr=Path(env.get("SANDMAN_KUBE_CTR", "ctr")),
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SANDMAN_KUBE") == "1":
        return
    skip = pytest.mark.skip(reason="needs a Kubernetes cluster: set SANDMAN_KUBE=1")
    for item in items:
        if item.get_closest_marker("kube"):
            item.add_marker(skip)


def _run(*argv: str | Path, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [str(a) for a in argv], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
IPTABLES_NFT_TABLES = {f"table {f} {t}" for f in ("ip", "ip6") for t in ("filter", "nat", "mangle")}


@dataclass(frozen=True)
class _NetpolBefore:
    """What ``hack/kube/up`` recorded before it started kube-router (netpol.sh)."""

    bridge_nf: str
    nft_tables: frozenset[str]

    @classmethod
    def read(cls, state_dir: Path) -> _NetpolBefore | None:
        run = state_dir / "run"
        if not (run / "netpol.started").exists():
            return None  # no enforcement, or up failed before it: nothing of it to undo
        return cls(
            (run / "bridge-nf-call-iptables.before").read_text().strip(),
            frozenset((run / "before.nft").read_text().splitlines()),
        )


def _output(*argv: str) -> str:
    proc = subprocess.run(argv, check=False, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def _netpol_leftovers(before: _NetpolBefore) -> list[str]:
    """kube-router's state that ``hack/kube/down`` promises to remove."""
    found = []
    if BRIDGE_NF.exists() and BRIDGE_NF.read_text().strip() != before.bridge_nf:
        found.append(f"bridge-nf-call-iptables not put back to {before.bridge_nf}")
    chains = _output("iptables", "-w", "-t", "filter", "-S").splitlines()
    found += [f"iptables chain {c.split()[1]}" for c in chains if c.startswith("-N KUBE-")]
    sets = _output("ipset", "list", "-n").splitlines()
    found += [f"ipset {s}" for s in sets if s.startswith(("KUBE-SRC-", "KUBE-DST-"))]
    tables = set(_output("nft", "list", "tables").splitlines()) & IPTABLES_NFT_TABLES
    found += [f"nftables {t}" for t in sorted(tables - before.nft_tables)]
    return found


def _leftovers(
    state_dir: Path, ip_forward_before: str | None, netpol: _NetpolBefore | None = None
) -> list[str]:
    """What ``hack/kube/down`` promises to remove, if any of it is still there."""
    found = [] if netpol is None else _netpol_leftovers(netpol)
    if state_dir.exists():
        found.append(f"state directory {state_dir}")
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    found += [f"mount {m.split()[1]}" for m in mounts if f" {state_dir}/" in m]
    # Named as hack/kube/lib.sh names them, so that they are known even if up failed.
    cgroup_root = os.environ.get("SANDMAN_KUBE_CGROUP_ROOT", "sandman-kube")
    found += [f"cgroup {d}" for d in Path("/sys/fs/cgroup").glob(f"*/{cgroup_root}") if d.is_dir()]
    bridge = os.environ.get("SANDMAN_KUBE_BRIDGE", "sandmank8s0")
    if Path(f"/sys/class/net/{bridge}").exists():
        found.append(f"bridge {bridge}")
    # The value up saw, not the session's first: the local provider's tests switch
    # ip_forward on and back while the cluster is up (host-wide, theirs to restore).
    if ip_forward_before is not None and IP_FORWARD.read_text().strip() != ip_forward_before:
        found.append(f"ip_forward not put back to {ip_forward_before}")
    for name in ("etcd", "kube-apiserver", "kubelet", "containerd", "kwok", "kube-router"):
        pids = subprocess.run(
            ["pgrep", "-f", f"{name} .*{state_dir}"], check=False, capture_output=True, text=True
        ).stdout.split()
        found += [f"process {name} {pid}" for pid in pids]
    return found


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    state_dir = Path(os.environ.get("SANDMAN_KUBE_DIR", DEFAULT_DIR))
    env = {**os.environ, "SANDMAN_KUBE_DIR": str(state_dir), "GOTOOLCHAIN": "local"}
    if os.environ.get("SANDMAN_KUBE_EXISTING") == "1":
        yield KubeCluster.from_env_file(state_dir / "env")
        return
    _run(HACK / "build", env=env)
    try:
        _run(HACK / "up", env=env)
        yield KubeCluster.from_env_file(state_dir / "env")
    finally:
        recorded = state_dir / "run" / "ip_forward.before"  # what up saw; down restores it
        before = recorded.read_text().strip() if recorded.exists() else None
        netpol = _NetpolBefore.read(state_dir)
        _run(HACK / "down", env=env)
        leftovers = _leftovers(state_dir, before, netpol)
        assert not leftovers, f"hack/kube/down left: {leftovers}"


@pytest.fixture(scope="module")
def daemon_image(kube_cluster: KubeCluster) -> Iterator[str]:
    """This tree's sandmand as a daemon image on the real node, for one module's tests
    (`tests.kube.daemon_image`); skipped without a real node."""
    from tests.kube.daemon_image import current_daemon_image  # it imports this module

    if not kube_cluster.real_node:
        pytest.skip("the cluster has no real node (SANDMAN_KUBE_REAL_NODE=0)")
    with current_daemon_image(kube_cluster) as name:
        yield name


@pytest.fixture
def real_node(kube_cluster: KubeCluster) -> str:
    """The name of the harness's real node; the test is skipped on a cluster without one."""
    if not kube_cluster.real_node:
        pytest.skip("the cluster has no real node (SANDMAN_KUBE_REAL_NODE=0)")
    return kube_cluster.real_node


@pytest.fixture(scope="session")
def service_image(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """deploy/Dockerfile's image, built offline and imported into the real node (once for
    the tests that deploy it); removed after."""
    from tests.kube import node_images  # they import this module
    from tests.kube.service_image import build_archive

    if not kube_cluster.real_node:
        pytest.skip("the cluster has no real node (SANDMAN_KUBE_REAL_NODE=0)")
    work = tmp_path_factory.mktemp("service-image")
    archive, name = build_archive(work, f"test-{uuid.uuid4().hex[:8]}")
    try:
        node_images.ctr(kube_cluster, "images", "import", str(archive))
        shutil.rmtree(work)  # ~300 MB
        yield name
    finally:
        shutil.rmtree(work, ignore_errors=True)
        node_images.remove(kube_cluster, name)
        assert name not in node_images.image_refs(kube_cluster)


@pytest.fixture
async def admin(kube_cluster: KubeCluster) -> AsyncIterator[Admin]:
    """The harness's admin identity, for set-up, checks and sweeping (not the provider's)."""
    from tests.kube.support import Admin  # support imports this module

    admin = Admin(kube_cluster)
    try:
        yield admin
    finally:
        await admin.http.aclose()


@pytest.fixture
async def pool_name(admin: Admin) -> AsyncIterator[str]:
    """A pool name of this test only; its pods are swept at the end, and any left fail it."""
    name = f"t7-{uuid.uuid4().hex[:8]}"
    yield name
    left = await admin.sweep(name)
    assert not left, f"pods left behind: {left}"
