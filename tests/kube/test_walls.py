"""The second walls on Kubernetes (issue 27): gVisor through a RuntimeClass, and a user
namespace per pod (``hostUsers: false``).

On the hack/kube cluster's real node: containerd's runtime handler ``runsc`` (gVisor's
shim, systrap, gVisor's own network stack) behind the RuntimeClass ``gvisor``, and
runc 1.5 (idmapped mounts), without which the kubelet refuses ``hostUsers: false``
("runtime does not support user namespaces"). Each sandbox is checked from inside
(the kernel it sees, its uid map) and from the node (the process that runs it, its
host uid), works (daemon, exec, files), and leaves nothing on the node once deleted:
no pod, no container, no process, no mount, no runsc state. The manifest tests at the
top need no cluster.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

import sandman
from sandman import errors
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import PoolConfig
from sandman.providers.kubernetes import pods
from sandman.settings import KubernetesConfig
from tests.kube import node_images
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import Admin, config_for, real_node_spec
from tests.support import wait_for

CONFIG = KubernetesConfig(server="https://127.0.0.1:6443", namespace="sandman")
LABELS = {"sandman.io/pool": "p1"}


def pod_spec(spec: SandboxSpec, **config: Any) -> dict[str, Any]:
    pod = pods.pod_manifest(
        name="sb-1", spec=spec, labels=LABELS, token="t", config=CONFIG.model_copy(update=config)
    )
    body: dict[str, Any] = pod["spec"]
    return body


# --- the manifest -------------------------------------------------------------------


def test_the_pool_runtime_class_applies_unless_the_spec_names_its_own() -> None:
    plain = SandboxSpec(image="x")
    assert "runtimeClassName" not in pod_spec(plain)
    assert pod_spec(plain, runtime_class_name="gvisor")["runtimeClassName"] == "gvisor"
    own = SandboxSpec(image="x", kubernetes=KubernetesOptions(runtime_class_name="kata"))
    assert pod_spec(own, runtime_class_name="gvisor")["runtimeClassName"] == "kata"
    with pytest.raises(ValueError, match="not a Kubernetes object name"):
        KubernetesConfig(runtime_class_name="gVisor")


def test_userns_gives_pods_their_own_user_namespace_unless_they_name_a_runtime() -> None:
    plain = SandboxSpec(image="x")
    assert "hostUsers" not in pod_spec(plain)  # off by default: the cluster's default
    assert pod_spec(plain, userns=True)["hostUsers"] is False
    # gVisor (and Kata) are walls of their own; gVisor's gofer cannot join the pod's
    # user namespace, so a pod with a RuntimeClass keeps the node's.
    assert "hostUsers" not in pod_spec(plain, userns=True, runtime_class_name="gvisor")
    own = SandboxSpec(image="x", kubernetes=KubernetesOptions(runtime_class_name="gvisor"))
    assert "hostUsers" not in pod_spec(own, userns=True)


@pytest.mark.parametrize("user", ["65536", "1000:70000", "4294967294"])
def test_a_user_the_pods_user_namespace_cannot_map_is_refused(user: str) -> None:
    with pytest.raises(errors.ConfigError, match="below 65536"):
        pod_spec(SandboxSpec(image="x", user=user), userns=True)
    assert pod_spec(SandboxSpec(image="x", user=user))["containers"][0]["securityContext"]
    fine = pod_spec(SandboxSpec(image="x", user="65535:65535"), userns=True)
    assert fine["containers"][0]["securityContext"]["runAsUser"] == 65535


# --- on the real node ---------------------------------------------------------------


def harness(cluster: KubeCluster, key: str) -> str:
    """A value of hack/kube/up's env file (``SANDMAN_KUBE_<key>``)."""
    lines = (cluster.state_dir / "env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    return env.get(f"SANDMAN_KUBE_{key}", "")


def containers(cluster: KubeCluster, pod: str) -> list[str]:
    """The ids of the pod's containers (its sandbox's too) in the node's containerd."""
    selector = f'labels."io.kubernetes.pod.name"=={pod}'
    return node_images.ctr(cluster, "containers", "ls", "-q", selector).split()


def task_pid(cluster: KubeCluster, container: str) -> int:
    """The host pid containerd reports for a running container."""
    for line in node_images.ctr(cluster, "tasks", "ls").splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == container:
            return int(fields[1])
    raise AssertionError(f"no task for container {container}")


def main_container(cluster: KubeCluster, pod: str) -> str:
    selector = (
        f'labels."io.kubernetes.pod.name"=={pod},'
        f'labels."io.kubernetes.container.name"=={pods.CONTAINER}'
    )
    (container,) = node_images.ctr(cluster, "containers", "ls", "-q", selector).split()
    return container


def processes_naming(ids: list[str]) -> list[str]:
    """The command lines of host processes that name one of ``ids``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if any(i in args for i in ids):
            found.append(args[:200])
    return found


def node_leftovers(cluster: KubeCluster, ids: list[str]) -> list[str]:
    """What of the containers ``ids`` the node still runs or holds: tasks, processes,
    mounts (a user namespace's pin too), runsc state, containerd's records."""
    left = [f"task {i}" for i in set(ctr_ids(cluster, "tasks")) & set(ids)]
    left += [f"container {i}" for i in set(ctr_ids(cluster, "containers")) & set(ids)]
    left += [f"process {p}" for p in processes_naming(ids)]
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    left += [f"mount {m.split()[1]}" for m in mounts if any(i in m for i in ids)]
    runsc = cluster.state_dir / "containerd" / "runsc" / "k8s.io"
    if runsc.is_dir():
        left += [f"runsc state {p}" for p in runsc.iterdir() if any(i in p.name for i in ids)]
    return left


def ctr_ids(cluster: KubeCluster, kind: str) -> list[str]:
    return node_images.ctr(cluster, kind, "ls", "-q").split()


async def gone_from_node(admin: Admin, cluster: KubeCluster, pod: str, ids: list[str]) -> None:
    """Wait until the deleted sandbox's pod and everything of its containers are gone."""

    async def pod_gone() -> bool:
        return await admin.pod(pod) is None

    await wait_for(f"pod {pod} to go", 30, pod_gone)
    last: list[str] = []

    async def node_clean() -> bool:
        last[:] = node_leftovers(cluster, ids)
        return not last

    try:
        # The processes go within seconds; the records of exited containers and the
        # pod sandbox (with its pinned user namespace) at the kubelet's next garbage
        # collection, once a minute.
        await wait_for(f"the node to drop pod {pod}'s containers", 90, node_clean)
    except AssertionError as error:
        raise AssertionError(f"{error}: left {last}") from None


@pytest.mark.kube
@pytest.mark.anyio
@pytest.mark.timeout(SETUP_TIMEOUT + 240)
async def test_a_sandbox_of_runtime_class_gvisor_runs_under_gvisor(
    kube_cluster: KubeCluster, real_node: str, admin: Admin, pool_name: str
) -> None:
    if "gvisor" not in harness(kube_cluster, "RUNTIME_CLASSES").split(","):
        pytest.skip("the cluster was started without gVisor (SANDMAN_KUBE_GVISOR=0)")
    # The pool's runtime class (KubernetesConfig.runtime_class_name): every sandbox.
    config = config_for(kube_cluster, runtime_class_name="gvisor")
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb,
    ):
        name = sb.id
        pod = await admin.pod(name)
        assert pod is not None
        assert pod["spec"]["runtimeClassName"] == "gvisor"
        assert pod["spec"]["nodeName"] == real_node
        # RuntimeClass admission added the class's overhead: it is the cluster's.
        assert pod["spec"]["overhead"] == {"cpu": "10m", "memory": "32Mi"}
        assert "hostUsers" not in pod["spec"]

        # Inside: gVisor's kernel, not the host's.
        seen = await sb.exec("dmesg | head -n 1; cat /proc/version; uname -r")
        assert seen.exit_code == 0, seen
        assert "Starting gVisor" in seen.stdout, seen.stdout
        assert "gvisor" in seen.stdout.splitlines()[1], seen.stdout
        assert seen.stdout.splitlines()[2] != os.uname().release
        # From the node: the pod's containers are served by a runsc sandbox process.
        ids = containers(kube_cluster, name)
        assert len(ids) == 3, ids  # the pod's sandbox, the daemon's installer, the main one
        sentries = [p for p in processes_naming(ids) if p.startswith("runsc-sandbox")]
        assert sentries, processes_naming(ids)

        # The daemon works as under runc: exec, exit codes, stderr, stdin.
        result = await sb.exec("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert (await sb.exec("cat", stdin="piped")).stdout == "piped"
        # Files, both ways, and a tree.
        blob = bytes(range(256)) * 4096  # 1 MiB
        await sb.write_file("/tmp/blob", blob)
        assert await sb.read_file("/tmp/blob") == blob
        digest = hashlib.sha256(blob).hexdigest()
        assert (await sb.exec("sha256sum < /tmp/blob")).stdout.split()[0] == digest
        assert (await sb.stat("/tmp/blob")).size == len(blob)
    await gone_from_node(admin, kube_cluster, name, ids)


def uid_map(text: str) -> list[tuple[int, int, int]]:
    return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in text.splitlines())]


@pytest.mark.kube
@pytest.mark.anyio
@pytest.mark.timeout(SETUP_TIMEOUT + 240)
async def test_with_userns_root_in_each_sandbox_is_its_own_unprivileged_host_range(
    kube_cluster: KubeCluster, real_node: str, admin: Admin, pool_name: str, tmp_path: Path
) -> None:
    assert harness(kube_cluster, "USERNS") == "1", (
        "the harness's node cannot run user namespaces: hack/kube/build builds runc "
        "(idmapped mounts) only with libseccomp-dev installed (see hack/kube/README.md)"
    )
    config = config_for(kube_cluster, userns=True)
    maps: list[tuple[int, int, int]] = []
    ids: dict[str, list[str]] = {}
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb,
        client.sandbox(real_node_spec(kube_cluster), timeout=120) as other,
    ):
        for box in (sb, other):
            pod = await admin.pod(box.id)
            assert pod is not None
            # Stored as asked: an API server without the feature would drop the field.
            assert pod["spec"]["hostUsers"] is False
            ids[box.id] = containers(kube_cluster, box.id)

            # Inside: root, mapped onto a range of 65,536 host ids that is not 0.
            inside = await box.exec("cat /proc/self/uid_map; echo; id -u")
            assert inside.exit_code == 0, inside
            mapping_text, uid = inside.stdout.split("\n\n")
            assert uid.strip() == "0"
            ((first, host, count),) = uid_map(mapping_text)
            assert (first, count) == (0, 65536) and host >= 65536, mapping_text
            maps.append((first, host, count))

            # From the node: the daemon (the container's PID 1) runs as that host uid.
            pid = task_pid(kube_cluster, main_container(kube_cluster, box.id))
            status = Path(f"/proc/{pid}/status").read_text()
            uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
            assert uids.split()[1:] == [str(host)] * 4, uids
        # Each sandbox has a range of its own.
        (_, a, _), (_, b, _) = maps
        assert abs(a - b) >= 65536, maps

        # The daemon, exec as another user, and files both ways with their owners.
        as_user = await sb.exec("id -u; touch /tmp/theirs; stat -c %u /tmp/theirs", user="65534")
        assert as_user.stdout.split() == ["65534", "65534"], as_user
        await sb.write_file("/tmp/up.txt", b"uploaded")
        assert (await sb.exec("stat -c %u:%g /tmp/up.txt")).stdout.strip() == "0:0"
        assert await sb.read_file("/tmp/up.txt") == b"uploaded"
        local = tmp_path / "tree"
        (local / "sub").mkdir(parents=True)
        (local / "sub" / "f.txt").write_bytes(b"in a tree")
        await sb.upload(local, "/tmp/tree")
        listed = await sb.exec("cat /tmp/tree/sub/f.txt; echo; stat -c %u /tmp/tree/sub/f.txt")
        assert listed.stdout.split("\n")[:2] == ["in a tree", "0"], listed
        await sb.download("/tmp/tree", tmp_path / "back")
        assert (tmp_path / "back" / "sub" / "f.txt").read_bytes() == b"in a tree"
        # The emptyDir the daemon came in: the init container (uid 65532 in the
        # pod's namespace) wrote it, and the mount maps it back to that uid.
        owner = await sb.exec("stat -c %u /.sandman/sandmand")
        assert owner.stdout.strip() == str(pods.INSTALLER_UID), owner
    for name, containers_of in ids.items():
        await gone_from_node(admin, kube_cluster, name, containers_of)
