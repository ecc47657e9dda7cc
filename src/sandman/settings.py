"""Configuration objects. Library code takes these as arguments; only the CLI and
the server read them from the environment."""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandman._version import __version__
from sandman.models import Bytes, KubeObjectName

__all__ = ["KubernetesConfig", "LocalConfig"]


class LocalConfig(BaseModel):
    """The local provider: containers run by an OCI runtime on this machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["local"] = "local"
    state_dir: Path = Path("/var/lib/sandman")
    """Images, sandboxes and the runtime's state live under here."""
    runtime: Literal["crun", "runc", "runsc"] = "crun"
    """Which OCI runtime runs the containers. ``runsc`` is gVisor: a user-space
    kernel between the workload and the host's (a second wall, at a cost per
    system call); its daemon is reached over TCP on the sandbox's own network
    namespace, which every runsc sandbox then has (``network="none"`` acts as
    ``"isolated"``: the sandbox can reach nothing, the host reaches it)."""
    runsc_platform: str = Field(default="ptrace", pattern=r"^[a-z0-9]+$")
    """gVisor's platform (``--platform``): ``ptrace`` works everywhere; ``systrap``
    needs runsc >= 2023 (``hack/gvisor/build``); ``kvm`` needs hardware
    virtualization (not a paravirtual ``/dev/kvm``: hack/gvisor/README.md)."""
    runsc_network: Literal["host", "sandbox"] = "host"
    """gVisor's network stack (``--network``) inside the sandbox's own network
    namespace. ``sandbox``: gVisor's user-space stack, so no socket call reaches the
    host kernel; memory snapshots need it. ``host`` (the default): socket calls served
    by the host kernel, in that namespace only; it cannot be checkpointed. Not yet the
    default: under ``sandbox`` a sandbox killed from the host answers nothing (no
    reset), so a call to it waits out its timeout instead of failing at once. Debian
    12's runsc mistakes every namespace for the root one on kernels >= 6.x; the
    provider hides ``/proc/sys/net`` from it (``sandmand hide-sys-net``)."""
    runsc_args: list[str] = Field(default_factory=list)
    """More runsc global flags, after the provider's own (so they win). The provider's:
    ``--platform``, ``--network``, ``--overlay2=none``, and, where the binary accepts it
    (runsc >= 2025, ``hack/gvisor/build``; probed once with ``runsc flags``),
    ``--gofer-network-namespace=new``."""
    runtime_path: str | None = None
    """The runtime binary; default: ``runtime`` looked up on PATH."""
    userns: bool = True
    """Under crun, each sandbox in a user namespace of its own: root inside is an
    unprivileged host uid range that no other sandbox has (65,536 ids from
    ``2**30``, handed out host-wide), so per-user kernel limits (inotify instances...)
    are the sandbox's own, and what escapes is nobody on the host. The image's layers
    are shared through idmapped mounts (kernel >= 5.19); ``sandman doctor`` checks.
    runc and runsc (gVisor's own wall) run without."""
    cgroup_parent: str = Field(default="/sandman", pattern=r"^/[A-Za-z0-9_./-]*$")
    """Every sandbox's cgroup is ``<cgroup_parent>/<sandbox id>`` in each hierarchy."""
    cgroup_parent_pids: int | None = Field(default=None, ge=1)
    """The most tasks (processes and threads) all sandboxes together may run: the
    ``pids.max`` of ``cgroup_parent``, set when the provider starts. None: 3/4 of the
    host's ``kernel.pid_max``, the rest left to the host."""
    daemon_path: Path | None = None
    """The sandmand binary mounted into sandboxes; default: the one built with this package."""
    stop_timeout: float = Field(default=10.0, gt=0)
    """How long a runtime command may take before it counts as failed."""
    subnet: str = "10.200.0.0/16"
    """Sandboxes with network ``isolated`` or ``egress`` each get a /30 from here."""
    uplink: str | None = None
    """The interface ``egress`` sandboxes are NATed out of; default: the default route's."""
    conntrack_max: int = Field(default=4096, ge=1)
    """The most connections one sandbox with a network may have tracked by the host's
    connection tracking at once (they outlive closed sockets: TCP's TIME_WAIT, UDP's
    timeouts); past it, its new connections are dropped. The table
    (``nf_conntrack_max``) is the host's, shared with every sandbox."""
    ptys: int = Field(default=256, ge=1)
    """The most pseudo-terminals a sandbox may hold at once (its devpts ``max``). Every
    container's come from one host budget, ``kernel.pty.max`` less ``kernel.pty.reserve``
    (3072 by default)."""
    dev_tmpfs: bool = False
    """Under crun, each sandbox's /dev and /dev/shm are tmpfs of their own (64 MiB each,
    in its memory). Off (the default): /dev is a directory of the sandbox's own files,
    which the runtime fills with the usual device nodes, and /dev/shm a directory in it
    (on the sandbox's disk limit, in its snapshots). Each tmpfs is a superblock, and the
    kernel's memory for superblocks grows with the square of the sandbox count
    (docs/security.md)."""
    own_sysfs: bool = False
    """Under crun, each sandbox without a network gets a sysfs of its own (a superblock
    each). Off (the default): they all see one read-only sysfs, of an empty network
    namespace: what their own would show (only ``lo`` in /sys/class/net), but one set of
    inodes for all. A sandbox with a network always sees its own (its interfaces)."""
    disk: Bytes | None = Field(default=10 * 2**30, ge=16 * 2**20)
    """What a sandbox may write (its layer over the image, data and metadata) when its
    spec sets no ``disk``; past it, writes fail ("Disk quota exceeded", the daemon's
    ``no_space``). Enforced by btrfs quotas on one loop-mounted image under
    ``state_dir`` (needs ``btrfs-progs``; ``sandman doctor`` checks). None: no
    default limit -- a spec's own ``disk`` is still enforced."""
    egress_deny: list[IPv4Network] | None = None
    """IPv4 ranges ``egress`` sandboxes may not reach. None: link-local 169.254.0.0/16
    (cloud metadata and its credentials), the private ranges 10.0.0.0/8, 172.16.0.0/12,
    192.168.0.0/16, the shared 100.64.0.0/10, and 0.0.0.0/8, 127.0.0.0/8, multicast and
    reserved (``providers.local.network.DEFAULT_EGRESS_DENY``); ``[]`` denies none. The
    host's own addresses and other sandboxes are unreachable whatever this says."""
    beyond_host: Literal["warn", "refuse"] = "warn"
    """A spec asking for more memory than this host has, or more CPUs than it has (where
    such a limit limits nothing): ``warn`` logs a warning once per size and creates the
    sandbox; ``refuse`` fails its create with a `ConfigError` (``SANDMAN_BEYOND_HOST`` for
    the CLI and ``sandman serve``)."""
    egress_allow: list[IPv4Network] = Field(default_factory=list)
    """Exceptions to ``egress_deny``, e.g. a package mirror (``["10.0.0.5/32"]``). Applies to
    sandboxes created after."""
    dns_upstream: list[str] = Field(default_factory=list)
    """Where the egress resolver asks for the names egress sandboxes look up (``host`` or
    ``host:port``); default: the ``nameserver`` lines of the host's /etc/resolv.conf.
    Every egress sandbox's /etc/resolv.conf names that resolver (on its gateway)."""


class KubernetesConfig(BaseModel):
    """The Kubernetes provider: one pod per sandbox in one namespace of a cluster.

    Credentials come from ``kubeconfig`` (its ``context``, else the current
    one); without it, from ``server`` + ``token_file`` + ``ca_file``; without
    those, from the pod's own service account (in-cluster); else from
    ``~/.kube/config``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["kubernetes"] = "kubernetes"
    kubeconfig: Path | list[Path] | None = None
    """A kubeconfig file, or several merged as kubectl merges ``KUBECONFIG`` (a list, or
    paths joined by ``os.pathsep``: the first file to name a cluster, user or context
    wins, and to set current-context; a missing one is skipped). Tokens, client
    certificates and exec plugins (``aws eks get-token``, ``gke-gcloud-auth-plugin``,
    ``kubelogin``); needs the ``kubernetes`` extra for YAML."""
    context: str | None = None
    """The kubeconfig context; default: its current context."""
    server: str | None = None
    """The API server's URL, when no kubeconfig is given."""
    token_file: Path | None = None
    """A file holding the bearer token; re-read now and then (tokens rotate)."""
    ca_file: Path | None = None
    """The CA bundle that signed the API server's certificate."""
    namespace: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    """Where the pods go; default: the kubeconfig context's namespace, in-cluster the pod's own."""
    daemon_image: str = f"sandman.local/sandmand:{__version__}"
    """The daemon image (``daemon/Dockerfile``): sandmand at its root, delivered into each
    pod as ``daemon_delivery`` says. Build and push it, then name it here; its version
    must match this package's."""
    daemon_delivery: Literal["init-container", "image-volume"] = "init-container"
    """How sandmand gets into each pod, at ``/.sandman/sandmand``. ``init-container``: an
    init container copies it from ``daemon_image`` into an emptyDir (works on any
    cluster). ``image-volume``: ``daemon_image`` is mounted read-only as an image volume,
    no init container and no copy; needs the ``ImageVolume`` feature (on by default from
    Kubernetes 1.35, GA in 1.36) and a runtime that mounts image volumes (containerd >= 2.1,
    CRI-O >= 1.31): on a node whose runtime cannot, create fails at once with a ConfigError."""
    daemon_port: int = Field(default=8731, ge=1, le=65535)
    """The TCP port sandmand listens on, on the pod IP."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """For the task images and the daemon image."""
    readiness: Literal["daemon", "pod"] = "daemon"
    """``daemon``: the pod runs and the pool then waits for sandmand's health over the pod IP.
    ``pod``: the pod's Ready condition only and no endpoint -- for benchmarks on simulated
    (KWOK) nodes, which run no containers."""
    start_timeout: float = Field(default=600.0, gt=0)
    """How long a pod may take from create until it runs (scheduling, image pull)."""
    termination_grace: int = Field(default=2, ge=0)
    """The pods' ``terminationGracePeriodSeconds`` (our own deletes use 0)."""
    service_account: str | None = None
    """The pods' service account; its token is never mounted."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on every pod."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra annotations on every pod (e.g. ``cluster-autoscaler.kubernetes.io/safe-to-evict``)."""
    request_timeout: float = Field(default=30.0, gt=0)
    """One API request (not a watch)."""
    max_connections: int = Field(default=64, ge=1)
    """HTTP connections to the API server; bursts are paced by the pool, not here."""
    pod_security: Literal["baseline", "restricted"] = "baseline"
    """The securityContext of every sandbox pod, after the Pod Security Standards level it
    meets (a namespace may enforce it: ``pod-security.kubernetes.io/enforce``). Both:
    seccomp ``RuntimeDefault``, ``allowPrivilegeEscalation: false``, no service-account
    token. ``baseline``: root images work; the task container keeps only Docker's default
    capabilities minus NET_RAW and MKNOD (as local sandboxes do). ``restricted``: every
    capability dropped and ``runAsNonRoot``: for images whose USER is a numeric non-root
    uid, or specs with a non-root ``user``; a spec with ``user="0"`` is refused."""
    runtime_class_name: KubeObjectName | None = None
    """The RuntimeClass of every pod, unless its spec names one
    (`KubernetesOptions.runtime_class_name`): e.g. ``gvisor`` (GKE Sandbox, or
    hack/kube's), to run every sandbox behind gVisor's kernel as a second wall. A spec's
    own must be allowed by the server (``runtime_classes``); this one is the operator's."""
    userns: bool = False
    """Each pod in a user namespace of its own (``spec.hostUsers: false``): root in the
    sandbox is an unprivileged host uid range no other pod has, so per-user kernel limits
    are the pod's own and what escapes is nobody on the node. Needs Kubernetes >= 1.33
    (``UserNamespacesSupport``, on by default) and nodes whose runtime does idmapped
    mounts (containerd >= 2.0 with runc >= 1.2 or crun >= 1.9; Linux >= 6.3). Off by
    default: on a node whose runtime cannot, the kubelet never starts the pod ("runtime
    does not support user namespaces") and the create fails only at ``start_timeout``.
    A spec's ``user`` must then be below 65536. Pods with a RuntimeClass (this config's
    or the spec's) are left as they are: gVisor and Kata are walls of their own, and
    gVisor fails to start in a user namespace."""
    owner_lease: int = Field(default=15, ge=3)
    """Seconds of the ``leaseDurationSeconds`` of each pool process's Lease (the owner its
    pods name, ``sandman.io/owner=k.<lease>``); renewed every third of it."""
    owner_grace: float = Field(default=10.0, ge=0)
    """Seconds an expired Lease must further be seen unchanged (on the observer's own
    clock) before its owner counts as dead and its pods may be reaped."""
    image_pull_secrets: list[KubeObjectName] = Field(default_factory=list)
    """Image pull secrets of every pod (and of ``sandman prepare``'s pull pods): names of
    ``kubernetes.io/dockerconfigjson`` Secrets in the namespace, for private registries.
    The kubelet reads them; the provider's identity needs no access to Secrets. A spec's
    own (`KubernetesOptions.image_pull_secrets`) are added."""
    priority_class_name: KubeObjectName | None = None
    """The PriorityClass of every pod, unless a spec names its own: sandboxes of a lower
    class are preempted for higher ones (they are then lost, reason ``preempted``)."""
    node_lost_after: int | None = Field(default=None, ge=0)
    """Seconds a pod stays on a node that stopped answering (``NotReady`` or unreachable)
    before Kubernetes evicts it and its sandbox is lost (``node_lost``): the
    ``tolerationSeconds`` of the pods' NoExecute tolerations of
    ``node.kubernetes.io/not-ready`` and ``unreachable``. None: the cluster's default
    (300 s). A sandbox whose node is away cannot be used meanwhile, so a short wait tells
    its holder sooner; a spec's own tolerations of those taints win."""
    prefer_nodes_with_image: bool = False
    """Steer each pod toward the nodes that already hold its image (a preferred node
    affinity, added to the spec's own): a cold pull is slower, never a failure. Needs
    ``list`` on ``nodes`` (``deploy/node-reader/``); without it, a warning and no steering."""
    snapshot_dir: Path = Path("/var/lib/sandman/kubernetes-snapshots")
    """Where the pool keeps its snapshots of pods' files (docs/snapshots.md), one
    directory per API server and namespace below it: the files each sandbox changed,
    streamed from its daemon, checked and kept here, and streamed into each sandbox made
    from them. On the pool's host, not in the cluster."""
    snapshot_max_bytes: Bytes = Field(default=16 * 2**30, ge=2**20)
    """The most file bytes one snapshot may hold; past it, the snapshot fails with
    `FileTooLarge` and nothing of it is kept."""
    snapshot_timeout: float = Field(default=1800.0, gt=0)
    """How long taking or applying one snapshot's files may take (a daemon that stalls
    its stream is given up on)."""
