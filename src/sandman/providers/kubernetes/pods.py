"""Pods as sandboxes, both ways: the manifest for a spec, and what a pod's status means.

(About 700 lines, one piece: the manifest and its reading must agree field
for field, and both are pure.)

Pure: no I/O. Everything the provider must know after a restart lives on
the pod itself: the labels (``sandman.io/pool``, ``sandman.io/session``,
``sandman.io/expires-at``, also an annotation), the image, and the daemon's
token (in the main container's environment; see `pod_manifest`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.base import DaemonEndpoint, Lost, SandboxInfo, SandboxState
from sandman.providers.kubernetes import egress
from sandman.providers.kubernetes.placement import parse_image, with_preference
from sandman.settings import KubernetesConfig

__all__ = [
    "CAPABILITIES",
    "CONTAINER",
    "DAEMON_DIR",
    "EGRESS",
    "KWOK_NO_DELAY",
    "MANAGED_BY",
    "RESERVED_PREFIX",
    "SPEC",
    "USERNS_IDS",
    "PullRetrying",
    "Started",
    "check_delivery",
    "daemon_volume",
    "loss",
    "pod_info",
    "pod_manifest",
    "pool_labels",
    "start_outcome",
    "transient_pull_failure",
    "validate_labels",
    "waiting_on",
]

CONTAINER = "sandbox"
INIT_CONTAINER = "sandman-install"
DAEMON_DIR = "/.sandman"
DAEMON_VOLUME = "sandman"
TOKEN_ENV = "SANDMAND_TOKEN"
MANAGED_BY = ("app.kubernetes.io/managed-by", "sandman")
EXPIRES = "sandman.io/expires-at"
SPEC = "sandman.io/spec"
RESERVED_PREFIX = "sandman.io/"
# The reserved labels a sandbox pod may carry, and who sets them: the pool (pool, session, owner,
# expires-at, as `pod_manifest`'s ``labels``), the service (tenant, in the spec) and
# this module (egress). Anything else under sandman.io/ -- sandman.io/client above all,
# which deploy/networkpolicy.yaml trusts -- never reaches a sandbox pod.
_POOL_LABELS = frozenset(
    {"sandman.io/pool", "sandman.io/session", "sandman.io/expires-at", "sandman.io/owner"}
)
_SPEC_LABELS = frozenset({"sandman.io/tenant"})
CAPABILITIES = (
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
)  # fmt: skip
"""What the task container keeps under ``pod_security="baseline"``: Docker's default set
minus NET_RAW (raw sockets: spoofing, ARP/ICMP tricks on the pod network) and MKNOD
(device nodes), the same set local sandboxes get. Enough for a root task image (chown,
setuid to a build user, bind :80, chroot); every one is allowed by Pod Security
Standards baseline. ``restricted`` drops them all."""
USERNS_IDS = 65536
"""The ids each pod's user namespace maps (`KubernetesConfig.userns`): the kubelet's."""
INSTALLER_UID = 65532
"""The init container that copies the daemon runs as this uid (nobody's; it only writes
a 0555 file into the emptyDir, which is world-writable)."""
EGRESS = ("sandman.io/egress", "allow")
"""On pods whose spec asks for ``network="egress"``: deploy/networkpolicy.yaml's second
policy selects it. No other pod carries the key."""

KWOK_NO_DELAY: dict[str, str] = {
    f"{stage}.stage.kwok.x-k8s.io/{key}": "0s"
    for stage in (
        "pod-create",
        "pod-init-container-running",
        "pod-init-container-completed",
        "pod-ready",
    )
    for key in ("delay", "jitter-delay")
}
"""Pod annotations (`KubernetesConfig.annotations`) for simulated KWOK nodes: their
general pod stages wait 1-6 s each to imitate slow nodes; a benchmark or test of the
API server (``readiness="pod"``) needs no such wait."""

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_USER = re.compile(r"^(\d+)(?::(\d+))?$")
# Kubelet reasons for a container that waits on its image; `transient_pull_failure` says
# which are worth waiting on (a failed pull is judged by its message).
_IMAGE_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "ImageInspectError",
        "RegistryUnavailable",
    }
)
_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})
# The kubelet's wordings around containerd's (1.6) and Go's errors, e.g. "...: failed to
# resolve reference "r/i:1": pulling from host r failed with status code [manifests 1]:
# 503 Service Unavailable" or "...: dial tcp 127.0.0.1:5999: connect: connection refused".
_BACK_OFF = re.compile(r'^Back-off pulling image ""(: ErrImagePull)?')
_QUOTED = re.compile(r'"[^"]*"')  # image references and URLs: a name may say "denied" or "eof"
_RETRY_STATUS = re.compile(r"\b(?:429|5\d\d) [A-Z]|toomanyrequests")  # the registry's answer
_PERMANENT = re.compile(
    r"not ?found|manifest unknown|name unknown|unauthorized|denied|forbidden"
    r"|invalid reference format"
    r"|no such host",  # NXDOMAIN: a misspelt registry (an outage reads "server misbehaving")
    re.IGNORECASE,
)
_TRANSIENT = re.compile(
    r"connection refused|connection reset|broken pipe|dial tcp|i/o timeout|handshake timeout"
    r"|\beof\b|no route to host|network is unreachable|server misbehaving|temporary failure"
    r"|deadline exceeded|pull qps exceeded",
    re.IGNORECASE,
)
_UNAUTHORIZED = re.compile(r"\b401\b|unauthorized|no basic auth credentials", re.IGNORECASE)
_UNAUTHORIZED_HINT = (
    "the pull was unauthorized: the registry wants credentials the pod lacks, or refused"
    " those it has (image_pull_secrets names the Secrets the kubelet pulls with)"
)
_CONFIG_REASONS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff"}
)
# What a runtime that cannot mount image volumes says about the daemon's: the kubelet
# sends the mount with an image and no host path, which older runtimes do not read.
_NO_IMAGE_VOLUME = re.compile(
    r'mkdir "": '  # containerd < 2.1 (seen on 1.6.20): 'failed to mkdir "": mkdir : ...'
    r"|mount\.HostPath is empty"  # CRI-O < 1.31
    r'|"/\.sandman/sandmand": (?:stat \S+: )?no such file',  # one that mounted nothing
    re.IGNORECASE,
)
_UNSUPPORTED = (
    "the container runtime of node {node} cannot mount image volumes (containerd >= 2.1 "
    "and CRI-O >= 1.31 can): use daemon_delivery='init-container'"
)


def pool_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Those of a pod's labels that the pool gave it (`pod_manifest`'s ``labels``): what
    a pod made again in its place is given."""
    return {key: value for key, value in labels.items() if key in _POOL_LABELS}


def validate_labels(labels: Mapping[str, str]) -> None:
    """ConfigError for a key or value Kubernetes would refuse (422 comes later and slower)."""
    for key, value in labels.items():
        if len(key) > 316 or not _LABEL_KEY.match(key):
            raise errors.ConfigError(f"invalid Kubernetes label key {key!r}")
        if not _LABEL_VALUE.match(value):
            raise errors.ConfigError(
                f"invalid value {value!r} of label {key!r}: at most 63 of [A-Za-z0-9-_.], "
                "starting and ending alphanumeric"
            )


def _cpu(cores: float) -> str:
    return f"{math.ceil(cores * 1000)}m"


def _resources(spec: SandboxSpec) -> dict[str, Any]:
    k8s = spec.kubernetes
    limits: dict[str, str] = {"cpu": _cpu(spec.cpu), "memory": str(spec.memory)}
    requests: dict[str, str] = {
        "cpu": _cpu(k8s.cpu_request if k8s.cpu_request is not None else spec.cpu),
        "memory": str(k8s.memory_request if k8s.memory_request is not None else spec.memory),
    }
    if k8s.ephemeral_storage is not None:
        limits["ephemeral-storage"] = requests["ephemeral-storage"] = str(k8s.ephemeral_storage)
    return {"limits": limits, "requests": requests}


def _security(spec: SandboxSpec, level: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's and the task container's securityContext (`KubernetesConfig.pod_security`)."""
    if spec.seccomp != "default":
        # The tenant writes the spec: it must not loosen what the operator chose, and a
        # host path means nothing to a node.
        raise errors.ConfigError(
            f"seccomp {spec.seccomp!r}: the kubernetes provider runs every pod under the "
            "runtime's default profile (seccomp='default')"
        )
    pod: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    container: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": list(CAPABILITIES)},
    }
    uid = None
    if spec.user is not None:
        match = _USER.match(spec.user)
        if match is None:
            # Kubernetes runs as numeric ids only; names would need the image's /etc/passwd.
            raise errors.ConfigError(
                f"user {spec.user!r}: the kubernetes provider needs a numeric uid or uid:gid"
            )
        uid = int(match[1])
        container["runAsUser"] = uid
        if match[2] is not None:
            container["runAsGroup"] = int(match[2])
    if level == "restricted":
        if uid == 0:
            raise errors.ConfigError(
                "user '0': pod_security='restricted' runs sandboxes as non-root only"
            )
        pod["runAsNonRoot"] = True
        container["capabilities"] = {"drop": ["ALL"]}
    return pod, container


def _installer_security() -> dict[str, Any]:
    """The init container's: restricted whatever the level; it only copies a file."""
    return {
        "runAsUser": INSTALLER_UID,
        "runAsGroup": INSTALLER_UID,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _check_reserved(config: KubernetesConfig, spec: SandboxSpec, labels: Mapping[str, str]) -> None:
    """ConfigError for a label under sandman.io/ from anywhere but its owner."""
    for source, given, allowed in (
        ("KubernetesConfig.labels", config.labels, frozenset[str]()),
        ("the spec's labels", spec.labels, _SPEC_LABELS),
        ("the pool's labels", labels, _POOL_LABELS),
    ):
        reserved = sorted(k for k in given if k.startswith(RESERVED_PREFIX) and k not in allowed)
        if reserved:
            raise errors.ConfigError(
                f"label {reserved[0]!r} in {source}: labels under {RESERVED_PREFIX} are "
                "reserved for Sandman (network='egress' asks for egress)"
            )


_NODE_AWAY = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def _node_lost(config: KubernetesConfig, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tolerations that bound how long a pod waits on a node that is away
    (`KubernetesConfig.node_lost_after`), but for the taints the spec tolerates itself."""
    if config.node_lost_after is None:
        return []

    def tolerated(key: str) -> bool:
        # The taint manager takes the shortest of the matching tolerations: ours would
        # cut short what the spec asked for (a key-less Exists tolerates every taint).
        return any(
            (t.get("key") == key or (not t.get("key") and t.get("operator") == "Exists"))
            and t.get("effect") in (None, "", "NoExecute")
            for t in own
        )

    return [
        {"key": key, "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": config.node_lost_after}
        for key in _NODE_AWAY
        if not tolerated(key)
    ]  # fmt: skip


def pod_manifest(
    *,
    name: str,
    spec: SandboxSpec,
    labels: Mapping[str, str],
    token: str,
    config: KubernetesConfig,
    preferred: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The pod for one sandbox: the unmodified task image runs sandmand from ``/.sandman``,
    an emptyDir an init container copies it into, or the daemon image itself mounted as
    an image volume (``config.daemon_delivery``).

    ``preferred`` is a preferred node-affinity term (`placement.image_affinity`),
    added to the spec's own affinity, which stays as it is.

    Security: `KubernetesConfig.pod_security` (seccomp RuntimeDefault, no privilege
    escalation, `CAPABILITIES` or none); the init container runs as `INSTALLER_UID`
    with nothing. Labels under ``sandman.io/`` come only from their owners.

    Image pull secrets: the config's, then the spec's; the priority class: the spec's,
    else the config's; `KubernetesConfig.node_lost_after` adds NoExecute tolerations of a
    node that is away, unless the spec tolerates those taints itself.

    The token is in the main container's environment: the daemon reads and
    unsets it before it starts anything, so no command in the sandbox sees
    it. The provider's Role has no access to Secrets (least privilege), and
    whoever can read this pod's spec can also ``pods/exec`` into it, so the
    token reveals nothing that identity could not reach already.
    """
    if not _NAME.match(name):
        raise errors.ConfigError(
            f"invalid sandbox id {name!r}: lowercase letters, digits and '-', at most 63"
        )
    # SandboxSpec refuses sandman.io/ labels already; a spec built without validation
    # (model_copy, model_construct) or the operator's config must not add one either.
    _check_reserved(config, spec, labels)
    all_labels = {**config.labels, **spec.labels, **labels, MANAGED_BY[0]: MANAGED_BY[1]}
    all_labels.update(egress.pod_labels(name, spec))  # ConfigError for a domain rule
    validate_labels(all_labels)
    annotations = dict(config.annotations)
    if EXPIRES in all_labels:
        annotations[EXPIRES] = all_labels[EXPIRES]
    # The spec itself, for a snapshot's record and a restore's new pod (snapshots.py).
    annotations[SPEC] = spec.model_dump_json(exclude_defaults=True)
    pod_security, container_security = _security(spec, config.pod_security)
    env = [{"name": k, "value": v} for k, v in spec.env.items() if k != TOKEN_ENV]
    env.append({"name": TOKEN_ENV, "value": token})
    mount = {"name": DAEMON_VOLUME, "mountPath": DAEMON_DIR}
    main: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": config.image_pull_policy,
        # command replaces the image's ENTRYPOINT and args its CMD: the image
        # itself stays as it is.
        "command": [f"{DAEMON_DIR}/sandmand"],
        "args": ["--listen", f"tcp:0.0.0.0:{config.daemon_port}"],
        "env": env,
        "resources": _resources(spec),
        "volumeMounts": [{**mount, "readOnly": True}],
        "ports": [{"name": "sandmand", "containerPort": config.daemon_port}],
        "securityContext": container_security,
    }
    if spec.workdir:
        main["workingDir"] = spec.workdir
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": config.termination_grace,
        "securityContext": pod_security,
    }
    if config.daemon_delivery == "image-volume":
        # The volume is the image's root filesystem, whose /sandmand is then
        # /.sandman/sandmand: the same command, no subPath. Read-only by definition.
        pod_spec["containers"] = [main]
        pod_spec["volumes"] = [{
            "name": DAEMON_VOLUME,
            "image": {"reference": config.daemon_image, "pullPolicy": config.image_pull_policy},
        }]  # fmt: skip
    else:
        init = {
            "name": INIT_CONTAINER,
            "image": config.daemon_image,
            "imagePullPolicy": config.image_pull_policy,
            "command": ["/sandmand", "install", f"{DAEMON_DIR}/sandmand"],
            "volumeMounts": [mount],
            "securityContext": _installer_security(),
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                          "limits": {"cpu": "500m", "memory": "64Mi"}},
        }  # fmt: skip
        pod_spec["initContainers"] = [init]
        pod_spec["containers"] = [main]
        pod_spec["volumes"] = [{"name": DAEMON_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}]
    k8s = spec.kubernetes
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    if runtime_class := k8s.runtime_class_name or config.runtime_class_name:
        pod_spec["runtimeClassName"] = runtime_class
    elif config.userns:
        # Not with a RuntimeClass: gVisor's gofer cannot join the pod's user namespace.
        pod_spec["hostUsers"] = False
        ids = [container_security.get(key) for key in ("runAsUser", "runAsGroup")]
        if any(i is not None and i >= USERNS_IDS for i in ids):
            # The kubelet maps 65,536 ids per pod; it would fail the container at start.
            raise errors.ConfigError(
                f"user {spec.user!r}: with userns=True a sandbox's uid and gid must be "
                f"below {USERNS_IDS}"
            )
    # The pool's, then the spec's own; the kubelet tries each for every image of the pod.
    pull_secrets = list(dict.fromkeys([*config.image_pull_secrets, *k8s.image_pull_secrets]))
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in pull_secrets]
    if priority := k8s.priority_class_name or config.priority_class_name:
        pod_spec["priorityClassName"] = priority
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    tolerations = [dict(t) for t in k8s.tolerations] + _node_lost(config, k8s.tolerations)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if preferred:
        pod_spec["affinity"] = with_preference(k8s.affinity, preferred)
    elif k8s.affinity:
        pod_spec["affinity"] = dict(k8s.affinity)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": all_labels, "annotations": annotations},
        "spec": pod_spec,
    }


@dataclass(frozen=True)
class Started:
    """A pod that got far enough: running with an IP (or Ready, in pod-readiness mode)."""

    pod_ip: str | None


@dataclass(frozen=True)
class PullRetrying:
    """An image pull that failed in a way the kubelet's retries can get past: wait on."""

    detail: str
    """Which image and the kubelet's reason and message, for the error at the deadline."""


def transient_pull_failure(reason: str, message: str) -> bool:
    """Whether a container waiting with ``reason`` and the kubelet's ``message`` may yet
    get its image: the registry answered 429 or 5xx, or could not be reached.

    Not found, unauthorized, denied, an invalid reference: permanent. So is a message
    this does not know, as every pull failure was before: misread as permanent it fails
    a sandbox at once, with the kubelet's words; misread as transient it would hold every
    sandbox of a burst until its deadline, and again, as the pool retries a timeout.
    """
    if reason == "RegistryUnavailable":
        return True
    if reason not in _PULL_REASONS:
        return False
    message = _QUOTED.sub('""', message)
    cause = _BACK_OFF.sub("", message).strip(": ")
    if not cause:
        # A back-off that does not repeat its cause (older kubelets): the failed pull
        # before it was judged already, and was not permanent.
        return reason == "ImagePullBackOff"
    if _RETRY_STATUS.search(cause):
        return True
    return not _PERMANENT.search(cause) and bool(_TRANSIENT.search(cause))


def daemon_volume(pod: Mapping[str, Any]) -> str | None:
    """The daemon image a pod mounts as its image volume, or None (init-container delivery)."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if volume.get("name") == DAEMON_VOLUME and volume.get("image"):
            reference = volume["image"].get("reference")
            return str(reference) if reference else None
    return None


def check_delivery(pod: Mapping[str, Any], config: KubernetesConfig) -> None:
    """ConfigError if the API server stored the pod without the daemon's image volume.

    An API server whose ``ImageVolume`` feature is off (off by default before 1.35)
    drops the volume and its mounts without a word, and the pod would then fail on a
    missing /.sandman/sandmand.
    """
    if config.daemon_delivery == "image-volume" and daemon_volume(pod) is None:
        name = (pod.get("metadata") or {}).get("name", "?")
        raise errors.ConfigError(
            f"pod {name}: the API server dropped the daemon's image volume (its ImageVolume "
            "feature is off; on by default from Kubernetes 1.35): use "
            "daemon_delivery='init-container'"
        )


def _mentions(message: str, image: str) -> bool:
    """Whether the kubelet's or runtime's message names ``image`` (as given, defaulted
    to ``:latest``, or spelt out in full)."""
    wanted = parse_image(image)
    for word in re.split(r'[\s"]+', message):
        try:
            if parse_image(word.rstrip(":,;.")) == wanted:
                return True
        except ValueError:  # most words are not image references
            continue
    return False


def _statuses(pod: Mapping[str, Any]) -> list[tuple[bool, dict[str, Any]]]:
    status = pod.get("status") or {}
    return [(True, s) for s in status.get("initContainerStatuses") or []] + [
        (False, s) for s in status.get("containerStatuses") or []
    ]


def waiting_on(pod: Mapping[str, Any]) -> str:
    """What a starting pod waits on, in a few words: the scheduler, a container's
    waiting reason (and the kubelet's message), or its phase on its node."""
    node = (pod.get("spec") or {}).get("nodeName")
    if not node:
        return "the pod waits to be scheduled"
    for is_init, container in _statuses(pod):
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            which = "init container" if is_init else "container"
            message = waiting.get("message", "")
            said = f": {message[:300]}" if message else ""
            return f"{which} {container.get('name')} on {node}: {waiting.get('reason', '')}{said}"
    phase = (pod.get("status") or {}).get("phase", "Pending")
    return f"the pod is {phase} on {node}"


def start_outcome(
    pod: Mapping[str, Any], readiness: str, *, secrets_syncing: bool = False
) -> Started | PullRetrying | errors.SandboxError | None:
    """What a starting pod's latest state means: started, a typed failure, or wait on
    (None, or `PullRetrying` while the kubelet retries a transient pull failure).

    Failures are known as soon as the status says so: an image that cannot be
    pulled does not wait out the whole deadline. Except, with ``secrets_syncing``
    (a pod naming pull secrets, in its first seconds), an unauthorized pull: the
    kubelet can pull before its cache holds a Secret made a moment before ("failed
    to sync secret cache"), and its next try, with the secret, succeeds.
    """
    name = (pod.get("metadata") or {}).get("name", "?")
    status = pod.get("status") or {}
    phase = status.get("phase")
    # With the image volume, the daemon image is pulled for the main container (before
    # its own image) and a failure is reported on it, naming the daemon image.
    volume = daemon_volume(pod)
    if phase in ("Failed", "Succeeded"):
        return errors.ProviderError(f"pod {name} {phase.lower()} while starting: {_why(status)}")
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return errors.CapacityError(f"pod {name} unschedulable: {condition.get('message', '')}")
    for is_init, container in _statuses(pod):
        state = container.get("state") or {}
        image = container.get("image", "?")
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason", "")
        detail = f"{reason}: {waiting.get('message', '')}".rstrip(": ")
        if reason in _IMAGE_REASONS:
            which = "daemon image" if is_init else "image"
            if volume and not is_init and _mentions(waiting.get("message", ""), volume):
                which, image = "daemon image", volume
            if transient_pull_failure(reason, waiting.get("message", "")):
                return PullRetrying(f"{which} {image}: {detail}")
            if _UNAUTHORIZED.search(_QUOTED.sub('""', waiting.get("message", ""))):
                detail = f"{_UNAUTHORIZED_HINT}: {detail}"
                if secrets_syncing:
                    return PullRetrying(f"{which} {image}: {detail}")
            return errors.ImageError(f"pod {name}: {which} {image}: {detail}")
        terminated = state.get("terminated")
        if volume and (reason in _CONFIG_REASONS or terminated):
            said = waiting.get("message", "") or (terminated or {}).get("message", "")
            if _NO_IMAGE_VOLUME.search(said):
                node = (pod.get("spec") or {}).get("nodeName", "?")
                unsupported = _UNSUPPORTED.format(node=node)
                return errors.ConfigError(f"pod {name}: {unsupported} ({said})")
        if reason in _CONFIG_REASONS:
            return errors.ProviderError(f"pod {name}: container {container.get('name')}: {detail}")
        if terminated and not (is_init and terminated.get("exitCode") == 0):
            return errors.ProviderError(
                f"pod {name}: container {container.get('name')} exited "
                f"{terminated.get('exitCode')} ({terminated.get('reason', '')}): "
                f"{terminated.get('message', '')}".rstrip(": ")
            )
    if readiness == "pod":
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return Started(status.get("podIP")) if ready else None
    running = any(
        not is_init and "running" in (c.get("state") or {}) for is_init, c in _statuses(pod)
    )
    if phase == "Running" and running and status.get("podIP"):
        return Started(status["podIP"])
    return None


def _why(status: Mapping[str, Any]) -> str:
    reasons = [status.get("reason"), status.get("message")]
    for _, container in _statuses({"status": status}):
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated.get("reason"):
            reasons.append(f"{container.get('name')}: {terminated['reason']}")
    return "; ".join(str(r) for r in reasons if r) or "no reason given"


def _state(pod: Mapping[str, Any]) -> SandboxState:
    phase = (pod.get("status") or {}).get("phase")
    if (pod.get("metadata") or {}).get("deletionTimestamp") or phase in ("Failed", "Succeeded"):
        return "stopped"
    if phase == "Running":
        return "running"
    return "creating" if phase == "Pending" else "unknown"


# The DisruptionTarget condition's reasons (Kubernetes 1.26+): why the pod is going.
_DISRUPTIONS = {
    "PreemptionByScheduler": "preempted",
    "PreemptionByKubeScheduler": "preempted",
    "DeletionByTaintManager": "node_lost",
    "DeletionByPodGC": "node_lost",
    "EvictionByEvictionAPI": "evicted",
    "TerminationByKubelet": "evicted",
}
_POD_REASONS = {
    "Evicted": "evicted",
    "Preempting": "preempted",
    "NodeLost": "node_lost",
    "NodeShutdown": "node_lost",
    "Terminated": "node_lost",  # the kubelet's graceful node shutdown
}


def loss(pod: Mapping[str, Any], *, deleted: bool = False) -> Lost | None:
    """Why the sandbox of a pod that ran is gone, or None while it is not (a pod the
    watch saw ``deleted`` is gone whatever its status says).

    The reason (`sandman.SandboxLost.REASONS`): a ``DisruptionTarget`` condition
    (preempted, node_lost, evicted) or the pod's own reason (``Evicted``...) first;
    then the main container's end: ``OOMKilled`` is ``oom``; a pod being deleted by
    someone else ``deleted``; killed by a signal (exit 137 and up) ``killed``; any
    other exit ``daemon_exit``.
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if not deleted and _state(pod) != "stopped":
        return None
    name = str(metadata.get("name", ""))
    detail = _why(status)

    def lost(reason: str, said: str = detail) -> Lost:
        return Lost(sandbox_id=name, reason=reason, detail=said)

    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            reason = _DISRUPTIONS.get(str(condition.get("reason")))
            if reason is not None:
                said = f"{condition.get('reason')}: {condition.get('message', '')}".rstrip(": ")
                return lost(reason, said)
    if status.get("reason") in _POD_REASONS:
        return lost(_POD_REASONS[status["reason"]])
    ended = [
        (c.get("state") or {}).get("terminated") or {}
        for is_init, c in _statuses(pod)
        if not is_init and c.get("name") == CONTAINER
    ]
    terminated = next((t for t in ended if t), None)
    if terminated is not None and terminated.get("reason") == "OOMKilled":
        return lost("oom")
    if deleted or metadata.get("deletionTimestamp"):
        return lost("deleted", f"the pod was deleted ({detail})")
    if terminated is not None:
        code = terminated.get("exitCode")
        if terminated.get("signal") or (isinstance(code, int) and code > 128):
            return lost("killed")
        return lost("daemon_exit")
    return lost("unknown")


def _created_at(pod: Mapping[str, Any]) -> float:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return 0.0
    try:
        return datetime.fromisoformat(stamp).timestamp()  # 3.11 reads the "Z"
    except ValueError:
        return 0.0


def pod_info(
    pod: Mapping[str, Any], *, provider: str, port: int, daemon: bool = True
) -> SandboxInfo:
    """A SandboxInfo rebuilt from the pod alone (labels, image, token, IP).

    ``daemon=False`` (pod readiness, simulated nodes) gives no endpoint.
    """
    metadata = pod.get("metadata") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    main: dict[str, Any] = next((c for c in containers if c.get("name") == CONTAINER), {})
    token = next(
        (e.get("value") for e in main.get("env") or [] if e.get("name") == TOKEN_ENV), None
    )
    state = _state(pod)
    ip = (pod.get("status") or {}).get("podIP")
    endpoint = (
        DaemonEndpoint(host=ip, port=port, token=token)
        if daemon and state == "running" and ip and token
        else None
    )
    return SandboxInfo(
        id=metadata.get("name", ""),
        provider=provider,
        state=state,
        labels=dict(metadata.get("labels") or {}),
        created_at=_created_at(pod),
        image=main.get("image", ""),
        endpoint=endpoint,
        lost=loss(pod) if state == "stopped" else None,
    )
