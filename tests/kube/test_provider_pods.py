"""Pods as sandboxes, without a cluster: the manifest for a spec and what pod statuses mean.

The statuses are the shapes the kubelet and scheduler write (copied from
the hack/kube cluster); the real-node tests check the same paths end to end.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from sandman import errors
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.providers.kubernetes import pods
from sandman.providers.kubernetes.api import raise_for_status
from sandman.providers.kubernetes.credentials import load_credentials
from sandman.providers.kubernetes.placement import image_affinity
from sandman.providers.local.oci import CAPABILITIES as LOCAL
from sandman.settings import KubernetesConfig

CONFIG = KubernetesConfig(server="https://127.0.0.1:6443", namespace="sandman")
LABELS = {
    "sandman.io/pool": "p1",
    "sandman.io/session": "s-1",
    "sandman.io/expires-at": "1800000000",
}


def manifest(spec: SandboxSpec, **overrides: Any) -> dict[str, Any]:
    return pods.pod_manifest(
        name="sb-1", spec=spec, labels=LABELS, token="secret", config=CONFIG, **overrides
    )


def test_the_task_image_runs_unmodified_with_the_daemon_from_an_emptydir() -> None:
    given = SandboxSpec(image="python:3.12", env={"A": "1"}, workdir="/work")
    pod = manifest(given)
    spec = pod["spec"]
    (main,) = spec["containers"]
    (init,) = spec["initContainers"]
    assert main["image"] == "python:3.12"
    assert main["command"] == ["/.sandman/sandmand"]
    assert main["args"] == ["--listen", "tcp:0.0.0.0:8731"]
    assert main["workingDir"] == "/work"
    assert {"name": "A", "value": "1"} in main["env"]
    assert {"name": "SANDMAND_TOKEN", "value": "secret"} in main["env"]
    assert main["volumeMounts"] == [{"name": "sandman", "mountPath": "/.sandman", "readOnly": True}]
    assert init["image"] == CONFIG.daemon_image
    assert init["command"] == ["/sandmand", "install", "/.sandman/sandmand"]
    assert spec["volumes"][0]["emptyDir"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["terminationGracePeriodSeconds"] == CONFIG.termination_grace
    metadata = pod["metadata"]
    assert metadata["labels"] == {**LABELS, "app.kubernetes.io/managed-by": "sandman"}
    assert metadata["annotations"] == {
        "sandman.io/expires-at": "1800000000",
        "sandman.io/spec": given.model_dump_json(exclude_defaults=True),
    }
    # The spec as given, for a snapshot's record and a restore's new pod.
    assert SandboxSpec.model_validate_json(metadata["annotations"]["sandman.io/spec"]) == given


def test_resources_and_placement_come_from_the_spec() -> None:
    k8s = KubernetesOptions(
        cpu_request=0.25,
        memory_request="256Mi",
        ephemeral_storage="2Gi",
        runtime_class_name="gvisor",
        node_selector={"pool": "sandboxes"},
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        affinity={"nodeAffinity": {}},
    )
    pod = manifest(SandboxSpec(image="x", cpu=1.5, memory="1Gi", user="1000:2000", kubernetes=k8s))
    spec = pod["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["limits"] == {
        "cpu": "1500m",
        "memory": str(2**30),
        "ephemeral-storage": str(2 * 2**30),
    }
    assert resources["requests"] == {
        "cpu": "250m",
        "memory": str(256 * 2**20),
        "ephemeral-storage": str(2 * 2**30),
    }
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["nodeSelector"] == {"pool": "sandboxes"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert spec["affinity"] == {"nodeAffinity": {}}
    security = spec["containers"][0]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (1000, 2000)


def test_pull_secrets_and_priority_come_from_the_pool_and_the_spec() -> None:
    config = CONFIG.model_copy(
        update={"image_pull_secrets": ["regcred", "mirror"], "priority_class_name": "batch"}
    )

    def pod_spec(k8s: KubernetesOptions) -> dict[str, Any]:
        spec = SandboxSpec(image="x", kubernetes=k8s)
        pod = pods.pod_manifest(name="sb-1", spec=spec, labels=LABELS, token="t", config=config)
        body: dict[str, Any] = pod["spec"]
        return body

    plain = pod_spec(KubernetesOptions())
    assert plain["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert plain["priorityClassName"] == "batch"
    # The spec's secrets are added (once each); its priority class replaces the pool's.
    own = pod_spec(
        KubernetesOptions(image_pull_secrets=["team-a", "regcred"], priority_class_name="urgent")
    )
    assert own["imagePullSecrets"] == [{"name": n} for n in ("regcred", "mirror", "team-a")]
    assert own["priorityClassName"] == "urgent"
    neither = manifest(SandboxSpec(image="x"))["spec"]
    assert "imagePullSecrets" not in neither and "priorityClassName" not in neither


@pytest.mark.parametrize("name", ["RegCred", "reg_cred", "-x", "x.", "", "a" * 254])
def test_secret_and_priority_class_names_must_be_dns_subdomains(name: str) -> None:
    for make in (
        lambda: KubernetesConfig(image_pull_secrets=[name]),
        lambda: KubernetesConfig(priority_class_name=name),
        lambda: KubernetesOptions(image_pull_secrets=[name]),
        lambda: KubernetesOptions(priority_class_name=name),
    ):
        with pytest.raises(ValidationError, match="not a Kubernetes object name"):
            make()
    fine = KubernetesOptions(image_pull_secrets=["a.b-1", "a" * 253], priority_class_name="x.y")
    assert fine.image_pull_secrets[0] == "a.b-1"


def test_node_lost_after_bounds_the_wait_on_a_node_that_is_away() -> None:
    config = CONFIG.model_copy(update={"node_lost_after": 30})
    away = [
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 30}
        for taint in ("not-ready", "unreachable")
    ]  # fmt: skip
    own = {"key": "dedicated", "operator": "Exists"}

    def tolerations(*given: dict[str, Any]) -> Any:
        spec = SandboxSpec(image="x", kubernetes=KubernetesOptions(tolerations=list(given)))
        pod = pods.pod_manifest(name="sb-1", spec=spec, labels=LABELS, token="t", config=config)
        return pod["spec"].get("tolerations")

    assert tolerations() == away
    assert tolerations(own) == [own, *away]
    # The spec's own toleration of a taint wins over the pool's.
    forever = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    assert tolerations(forever) == [forever, away[0]]
    everything = {"operator": "Exists"}  # every taint, every effect, forever
    assert tolerations(everything) == [everything]
    schedule_only = {"operator": "Exists", "effect": "NoSchedule"}
    assert tolerations(schedule_only) == [schedule_only, *away]
    assert "tolerations" not in manifest(SandboxSpec(image="x"))["spec"]  # None: the cluster's


def test_config_labels_and_annotations_go_on_every_pod() -> None:
    config = CONFIG.model_copy(update={"labels": {"team": "rl"}, "annotations": {"a/b": "c"}})
    pod = pods.pod_manifest(
        name="sb-1", spec=SandboxSpec(image="x"), labels=LABELS, token="t", config=config
    )
    assert pod["metadata"]["labels"]["team"] == "rl"
    annotations = pod["metadata"]["annotations"]
    assert annotations["a/b"] == "c"
    assert annotations["sandman.io/expires-at"] == "1800000000"


@pytest.mark.parametrize(
    ("network", "egress"), [("egress", True), ("none", False), ("isolated", False)]
)
def test_only_an_egress_sandbox_carries_the_label_the_egress_policy_selects(
    network: Literal["none", "isolated", "egress"], egress: bool
) -> None:
    labels = manifest(SandboxSpec(image="x", network=network))["metadata"]["labels"]
    if egress:
        assert labels["sandman.io/egress"] == "allow"
    else:
        assert "sandman.io/egress" not in labels
    # The label deploy/networkpolicy.yaml's egress policy selects is the one set here.
    policy = (Path(__file__).parents[2] / "deploy" / "networkpolicy.yaml").read_text()
    assert "{key: sandman.io/egress, operator: In, values: [allow]}" in policy


@pytest.mark.parametrize("key", ["sandman.io/egress", "sandman.io/client", "sandman.io/x"])
@pytest.mark.parametrize("where", ["spec", "config", "pool"])
def test_reserved_labels_cannot_be_had_any_way(where: str, key: str) -> None:
    """Issue 12: a sandbox labelled sandman.io/client=true would pass deploy/'s ingress
    policy as a client of every other sandbox; sandman.io/egress=allow, its egress one."""
    reserved = {key: "true"}
    with pytest.raises(ValidationError, match="reserved"):
        SandboxSpec(image="x", labels=reserved)
    spec = SandboxSpec(image="x")
    if where == "spec":  # as the service adds its tenant label: without validation
        spec = spec.model_copy(update={"labels": reserved})
    config = CONFIG.model_copy(update={"labels": reserved if where == "config" else {}})
    labels = {**LABELS, **reserved} if where == "pool" else LABELS
    with pytest.raises(errors.ConfigError, match=f"'{key}'.*reserved.*network='egress'"):
        pods.pod_manifest(name="sb-1", spec=spec, labels=labels, token="t", config=config)


def test_the_owners_of_reserved_labels_may_set_them() -> None:
    spec = SandboxSpec(image="x", network="egress")
    spec = spec.model_copy(update={"labels": {"sandman.io/tenant": "a"}})
    labels = manifest(spec)["metadata"]["labels"]
    assert labels == {
        **LABELS, "sandman.io/tenant": "a", "sandman.io/egress": "allow",
        "app.kubernetes.io/managed-by": "sandman",
    }  # fmt: skip


def test_baseline_security_context_by_default() -> None:
    """What Pod Security Standards baseline asks, and the capabilities of a local sandbox."""
    pod = manifest(SandboxSpec(image="x"))["spec"]
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    (main,) = pod["containers"]
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": list(pods.CAPABILITIES)},
    }
    # The same set as local sandboxes (Docker's default minus NET_RAW and MKNOD), all of
    # them in baseline's allowed list.
    assert {f"CAP_{c}" for c in pods.CAPABILITIES} == set(LOCAL)
    baseline = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # fmt: skip
    assert set(pods.CAPABILITIES) <= baseline and not {"NET_RAW", "MKNOD"} & set(pods.CAPABILITIES)
    (init,) = pod["initContainers"]
    assert init["securityContext"] == {
        "runAsUser": pods.INSTALLER_UID, "runAsGroup": pods.INSTALLER_UID, "runAsNonRoot": True,
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    for forbidden in ("hostNetwork", "hostPID", "hostIPC", "privileged"):
        assert forbidden not in pod and forbidden not in main["securityContext"]


def test_restricted_drops_every_capability_and_runs_as_non_root() -> None:
    config = CONFIG.model_copy(update={"pod_security": "restricted"})
    pod = pods.pod_manifest(
        name="sb-1", spec=SandboxSpec(image="x", user="1000"), labels=LABELS, token="t",
        config=config,
    )["spec"]  # fmt: skip
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True,
    }  # fmt: skip
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsUser": 1000,
    }  # fmt: skip
    assert pod["initContainers"][0]["securityContext"]["runAsNonRoot"] is True
    with pytest.raises(errors.ConfigError, match="non-root"):
        pods.pod_manifest(
            name="sb-1", spec=SandboxSpec(image="x", user="0:0"), labels=LABELS, token="t",
            config=config,
        )  # fmt: skip
    with pytest.raises(ValidationError):
        KubernetesConfig.model_validate({"pod_security": "privileged"})


@pytest.mark.parametrize("seccomp", ["unconfined", "/etc/profile.json"])
def test_a_spec_cannot_loosen_the_seccomp_profile(seccomp: str) -> None:
    with pytest.raises(errors.ConfigError, match="seccomp='default'"):
        manifest(SandboxSpec(image="x", seccomp=seccomp))


def test_the_image_preference_joins_the_callers_own_affinity() -> None:
    own: dict[str, Any] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                "matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "preference": {"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a"]}]}}],
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }  # fmt: skip
    spec = SandboxSpec(image="r.io/task:1", kubernetes=KubernetesOptions(affinity=own))
    before = copy.deepcopy(own)
    term = image_affinity("r.io/task:1", [
        {"metadata": {"name": "n1"}, "status": {"images": [{"names": ["r.io/task:1"]}]}}])  # fmt: skip
    assert term is not None
    affinity = manifest(spec, preferred=term)["spec"]["affinity"]
    node = affinity["nodeAffinity"]
    assert (
        node["requiredDuringSchedulingIgnoredDuringExecution"]
        == (own["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"])
    )
    assert node["preferredDuringSchedulingIgnoredDuringExecution"] == [
        own["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0],
        term,
    ]
    assert affinity["podAntiAffinity"] == own["podAntiAffinity"]
    assert spec.kubernetes.affinity == before  # the caller's spec is not changed
    # Without an affinity of its own, the pod gets the preference alone; without one, none.
    bare = manifest(SandboxSpec(image="r.io/task:1"), preferred=term)["spec"]["affinity"]
    assert bare == {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}}
    assert "affinity" not in manifest(SandboxSpec(image="r.io/task:1"), preferred=None)["spec"]


def test_requests_default_to_the_limits() -> None:
    resources = manifest(SandboxSpec(image="x", cpu=2, memory="512Mi"))["spec"]["containers"][0]
    assert resources["resources"]["requests"] == {"cpu": "2000m", "memory": str(512 * 2**20)}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SandboxSpec(image="x", user="nobody"), "numeric uid"),
        (SandboxSpec(image="x", labels={"bad key!": "v"}), "label key"),
        (SandboxSpec(image="x", labels={"k": "a value with spaces"}), "invalid value"),
    ],
)
def test_what_kubernetes_would_refuse_is_a_config_error_up_front(
    spec: SandboxSpec, message: str
) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        manifest(spec)


def test_an_invalid_pod_name_is_refused() -> None:
    with pytest.raises(errors.ConfigError, match="invalid sandbox id"):
        pods.pod_manifest(
            name="Not_A_Name", spec=SandboxSpec(image="x"), labels={}, token="t", config=CONFIG
        )


PENDING: dict[str, Any] = {
    "metadata": {"name": "sb-1", "creationTimestamp": "2026-11-29T14:00:00Z"},
    "spec": {
        "containers": [
            {"name": "sandbox", "image": "x", "env": [{"name": "SANDMAND_TOKEN", "value": "tok"}]}
        ]
    },
    "status": {"phase": "Pending"},
}


def status(**fields: Any) -> dict[str, Any]:
    pod = copy.deepcopy(PENDING)
    pod["status"].update(fields)
    return pod


def waiting(reason: str, init: bool = False, message: str = "m") -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    name = "sandman-install" if init else "sandbox"
    image = "sandman.local/sandmand:0" if init else "x"
    state = {"waiting": {"reason": reason, "message": message}}
    return status(**{key: [{"name": name, "image": image, "state": state}]})


def test_a_pending_pod_means_wait_on() -> None:
    assert pods.start_outcome(PENDING, "daemon") is None
    assert pods.start_outcome(waiting("ContainerCreating"), "daemon") is None
    assert pods.start_outcome(waiting("PodInitializing"), "daemon") is None


def test_what_a_starting_pod_waits_on_in_a_few_words() -> None:
    assert pods.waiting_on(PENDING) == "the pod waits to be scheduled"

    def on_node(pod: dict[str, Any]) -> dict[str, Any]:
        pod["spec"]["nodeName"] = "n1"
        return pod

    assert pods.waiting_on(on_node(status())) == "the pod is Pending on n1"
    assert (
        pods.waiting_on(on_node(waiting("ErrImagePull", init=True, message="503 x")))
        == "init container sandman-install on n1: ErrImagePull: 503 x"
    )
    long = pods.waiting_on(on_node(waiting("ContainerCreating", message="y" * 1000)))
    assert long.startswith("container sandbox on n1: ContainerCreating: yyy") and len(long) < 400


def test_image_failures_are_image_errors_naming_which_image() -> None:
    for reason in ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"):
        outcome = pods.start_outcome(waiting(reason), "daemon")
        assert isinstance(outcome, errors.ImageError), reason
        assert "image x" in str(outcome)
    outcome = pods.start_outcome(waiting("ErrImagePull", init=True), "daemon")
    assert isinstance(outcome, errors.ImageError)
    assert "daemon image sandman.local/sandmand:0" in str(outcome)


# The kubelet's (1.36) messages for a pull from a fault-injecting registry on 127.0.0.1
# (containerd 1.6.20), and wordings of other containerd 1.6 releases and registries.
SICK = "127.0.0.1:5991/sandman-test/sick:1"
RESOLVE = f'failed to pull and unpack image "{SICK}": failed to resolve reference "{SICK}": '
STATUS = f"{RESOLVE}pulling from host 127.0.0.1:5991 failed with status code [manifests 1]: "
HEAD = 'failed to do request: Head "http://127.0.0.1:5999/v2/sandman-test/sick/manifests/1": '
TRANSIENT = {
    "503": STATUS + "503 Service Unavailable",
    "429": STATUS + "429 Too Many Requests",
    "refused": RESOLVE + HEAD + "dial tcp 127.0.0.1:5999: connect: connection refused",
    "older 5xx": RESOLVE + "unexpected status from HEAD request to "
    "http://127.0.0.1:5999/v2/sandman-test/sick/manifests/1: 502 Bad Gateway",
    "token 503": RESOLVE + "failed to authorize: failed to fetch anonymous token: "
    "unexpected status: 503 Service Unavailable",
    "hub limit": "failed to copy: httpReadSeeker: failed open: unexpected status code "
    "https://registry-1.docker.io/v2/library/python/blobs/sha256:ab: 429 Too Many Requests - "
    "Server message: toomanyrequests: You have reached your pull rate limit.",
    "i/o timeout": RESOLVE + HEAD + "dial tcp 10.0.0.7:443: i/o timeout",
    "tls": RESOLVE + HEAD + "net/http: TLS handshake timeout",
    "eof": "failed to copy: read tcp 10.0.0.2:51234->10.0.0.7:443: read: unexpected EOF",
    "reset": "failed to copy: read tcp 10.0.0.2:51234->10.0.0.7:443: connection reset by peer",
    "dns outage": RESOLVE + HEAD + "dial tcp: lookup r.io on 10.96.0.10:53: server misbehaving",
    "kubelet qps": "pull QPS exceeded",
}
PERMANENT = {
    "404": f"{RESOLVE}{SICK}: not found",
    "401": STATUS + "401 Unauthorized",
    "403": STATUS + "403 Forbidden",
    "denied": f'failed to pull and unpack image "{SICK}": failed to resolve reference "{SICK}": '
    "pull access denied, repository does not exist or may require authorization: "
    "server message: insufficient_scope: authorization failed",
    "manifest unknown": RESOLVE + "manifest unknown: manifest unknown",
    "invalid reference": 'failed to pull and unpack image "Bad:Ref": invalid reference format',
    # The harness's offline registry name: NXDOMAIN, not an outage.
    "no such host": 'failed to pull and unpack image "sandman.local/no-such-image:1": '
    'failed to resolve reference "sandman.local/no-such-image:1": failed to do request: '
    'Head "https://sandman.local/v2/no-such-image/manifests/1": '
    "dial tcp: lookup sandman.local: no such host",
    # Unknown: permanent, as every pull failure was before.
    "x509": RESOLVE + HEAD + "tls: failed to verify certificate: x509: certificate signed by "
    "unknown authority",
    "unknown": "m",
}


def back_off(message: str) -> str:
    return f'Back-off pulling image "{SICK}": ErrImagePull: {message}'


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
@pytest.mark.parametrize("case", sorted(TRANSIENT))
def test_a_transient_pull_failure_waits_on_and_says_why(reason: str, case: str) -> None:
    message = TRANSIENT[case] if reason == "ErrImagePull" else back_off(TRANSIENT[case])
    outcome = pods.start_outcome(waiting(reason, message=message), "daemon")
    assert isinstance(outcome, pods.PullRetrying), outcome
    assert outcome.detail == f"image x: {reason}: {message}"
    daemon = pods.start_outcome(waiting(reason, init=True, message=message), "daemon")
    assert isinstance(daemon, pods.PullRetrying)
    assert daemon.detail.startswith("daemon image sandman.local/sandmand:0: ")


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
@pytest.mark.parametrize("case", sorted(PERMANENT))
def test_a_permanent_pull_failure_is_an_image_error_at_once(reason: str, case: str) -> None:
    message = PERMANENT[case] if reason == "ErrImagePull" else back_off(PERMANENT[case])
    outcome = pods.start_outcome(waiting(reason, message=message), "daemon")
    assert isinstance(outcome, errors.ImageError), outcome
    # A refusal of credentials says so first, and where they come from.
    hint = f"{pods._UNAUTHORIZED_HINT}: " if case == "401" else ""
    assert str(outcome) == f"pod sb-1: image x: {hint}{reason}: {message}"


def test_an_unauthorized_pull_says_so_whatever_the_image_is_called() -> None:
    message = STATUS.replace(SICK, "r.io/unauthorized:1") + "404 Not Found"
    outcome = pods.start_outcome(waiting("ErrImagePull", message=message), "daemon")
    assert "unauthorized" not in str(outcome).replace("r.io/unauthorized", "")


def test_the_status_code_and_the_cause_decide_not_the_image_name() -> None:
    sick = "r.io/denied/eof:1"
    refused = f'failed to pull and unpack image "{sick}": {HEAD}connect: connection refused'
    assert pods.transient_pull_failure("ErrImagePull", refused)
    x509 = f'failed to pull and unpack image "{sick}": x509: certificate has expired'
    assert not pods.transient_pull_failure("ErrImagePull", x509)
    # A 503 whose body says something permanent-sounding is still a 503.
    body = "Server message: unknown: blob store not found"
    assert pods.transient_pull_failure("ErrImagePull", f"{STATUS}503 Service Unavailable - {body}")


def test_only_pull_reasons_are_judged_by_their_message() -> None:
    refused = TRANSIENT["refused"]
    for reason in ("ErrImageNeverPull", "InvalidImageName", "ImageInspectError"):
        outcome = pods.start_outcome(waiting(reason, message=refused), "daemon")
        assert isinstance(outcome, errors.ImageError), reason
    unavailable = pods.start_outcome(waiting("RegistryUnavailable", message="m"), "daemon")
    assert isinstance(unavailable, pods.PullRetrying)


def test_a_back_off_without_its_cause_waits_on() -> None:
    # Older kubelets do not repeat the failed pull's message; that pull was judged already.
    bare = waiting("ImagePullBackOff", message=f'Back-off pulling image "{SICK}"')
    assert isinstance(pods.start_outcome(bare, "daemon"), pods.PullRetrying)
    assert not pods.transient_pull_failure("ErrImagePull", "")


def test_unschedulable_is_a_capacity_error() -> None:
    pod = status(
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/11 nodes are available: 11 Insufficient cpu.",
            }
        ]
    )
    outcome = pods.start_outcome(pod, "daemon")
    assert isinstance(outcome, errors.CapacityError)
    assert "Insufficient cpu" in str(outcome)


def test_a_pod_that_failed_or_whose_daemon_exited_is_a_provider_error() -> None:
    evicted = status(phase="Failed", reason="Evicted", message="low on ephemeral storage")
    outcome = pods.start_outcome(evicted, "daemon")
    assert isinstance(outcome, errors.ProviderError)
    assert "Evicted" in str(outcome)
    crashed = status(
        containerStatuses=[
            {"name": "sandbox", "state": {"terminated": {"exitCode": 2, "reason": "Error"}}}
        ]
    )
    assert "exited 2" in str(pods.start_outcome(crashed, "daemon"))


def test_running_with_an_ip_is_started_and_gives_the_endpoint() -> None:
    running = status(
        phase="Running",
        podIP="10.213.0.9",
        initContainerStatuses=[
            {"name": "sandman-install", "state": {"terminated": {"exitCode": 0}}}
        ],
        containerStatuses=[{"name": "sandbox", "state": {"running": {}}}],
    )
    assert pods.start_outcome(running, "daemon") == pods.Started("10.213.0.9")
    # Pod readiness waits for the Ready condition instead.
    assert pods.start_outcome(running, "pod") is None
    ready = status(phase="Running", conditions=[{"type": "Ready", "status": "True"}])
    assert pods.start_outcome(ready, "pod") == pods.Started(None)

    info = pods.pod_info(running, provider="kubernetes", port=8731)
    assert info.state == "running"
    assert info.endpoint is not None
    assert (info.endpoint.host, info.endpoint.port, info.endpoint.token) == (
        "10.213.0.9",
        8731,
        "tok",
    )
    assert info.created_at == 1795960800.0
    assert pods.pod_info(running, provider="kubernetes", port=8731, daemon=False).endpoint is None


def test_a_pod_that_is_gone_is_stopped_with_a_reason() -> None:
    oom = status(
        phase="Failed",
        containerStatuses=[
            {"name": "sandbox", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
        ],
    )
    info = pods.pod_info(oom, provider="kubernetes", port=1)
    assert info.state == "stopped"
    assert info.lost is not None and info.lost.reason == "oom"
    assert "OOMKilled" in info.lost.detail
    assert pods.loss(status(phase="Running")) is None


def _ended(exit_code: int, reason: str, **more: Any) -> dict[str, Any]:
    terminated = {"exitCode": exit_code, "reason": reason, **more}
    return {"name": "sandbox", "image": "x", "state": {"terminated": terminated}}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        # The kubelet evicted it (node pressure): phase Failed, reason Evicted.
        ({"phase": "Failed", "reason": "Evicted", "message": "low on resource: memory"},
         "evicted"),
        ({"phase": "Failed", "containerStatuses": [_ended(137, "OOMKilled")]}, "oom"),
        ({"phase": "Failed", "containerStatuses": [_ended(137, "Error")]}, "killed"),
        ({"phase": "Failed", "containerStatuses": [_ended(2, "Error")]}, "daemon_exit"),
        ({"phase": "Succeeded", "containerStatuses": [_ended(0, "Completed")]}, "daemon_exit"),
        ({"phase": "Failed", "reason": "NodeShutdown"}, "node_lost"),
        # Kubernetes 1.26+ says why a pod is going in its DisruptionTarget condition.
        ({"phase": "Running", "conditions": [
            {"type": "DisruptionTarget", "status": "True",
             "reason": "PreemptionByScheduler", "message": "preempted by pod x"}]},
         "preempted"),
        ({"phase": "Failed", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]},
         "node_lost"),
        ({"phase": "Failed", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]},
         "evicted"),
        ({"phase": "Failed"}, "unknown"),
    ],
)  # fmt: skip
def test_a_lost_pod_says_why(fields: dict[str, Any], reason: str) -> None:
    pod = status(**fields)
    if fields.get("phase") == "Running":
        pod["metadata"]["deletionTimestamp"] = "2026-11-20T10:00:00Z"  # being preempted
    lost = pods.loss(pod)
    assert lost is not None and lost.reason == reason, lost
    assert lost.sandbox_id == pod["metadata"]["name"]


def test_a_pod_deleted_by_someone_else_is_lost_as_deleted() -> None:
    running = status(phase="Running")
    assert pods.loss(running) is None
    deleted = pods.loss(running, deleted=True)
    assert deleted is not None and deleted.reason == "deleted"
    terminating = copy.deepcopy(running)
    terminating["metadata"]["deletionTimestamp"] = "2026-11-20T10:00:00Z"
    assert (pods.loss(terminating) or deleted).reason == "deleted"
    # Its main container OOM-killed before it went: that is why.
    oom = status(phase="Running", containerStatuses=[_ended(137, "OOMKilled")])
    assert (pods.loss(oom, deleted=True) or deleted).reason == "oom"


def test_credentials_come_from_a_kubeconfig_with_its_namespace(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        """
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://10.0.0.1:6443/", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: abc}
contexts:
- name: ctx
  context: {cluster: c, user: u, namespace: sandboxes}
current-context: ctx
"""
    )
    credentials = load_credentials(KubernetesConfig(kubeconfig=kubeconfig))
    assert credentials.server == "https://10.0.0.1:6443"
    assert credentials.namespace == "sandboxes"
    assert credentials.bearer() == "abc"
    with pytest.raises(errors.ConfigError, match="no context named 'other'"):
        load_credentials(KubernetesConfig(kubeconfig=kubeconfig, context="other"))
    with pytest.raises(errors.ConfigError, match="cannot read kubeconfig"):
        load_credentials(KubernetesConfig(kubeconfig=tmp_path / "missing"))


def test_api_failures_become_typed_errors() -> None:
    def status(code: int, message: str, headers: dict[str, str] | None = None) -> None:
        body = f'{{"kind": "Status", "message": "{message}"}}'.encode()
        raise_for_status(code, headers or {}, body, "create pod sb-1")

    with pytest.raises(errors.ThrottledError, match="429 too many requests") as throttled:
        status(429, "too many requests", {"Retry-After": "2"})
    assert throttled.value.retry_after == 2.0
    with pytest.raises(errors.ThrottledError) as unavailable:
        status(503, "etcd timeout")
    assert unavailable.value.retry_after is None
    quota = 'pods "sb-1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=10'
    with pytest.raises(errors.CapacityError, match="exceeded quota"):
        status(403, quota)
    uncounted = "pods is forbidden: status unknown for quota: q, resources: pods"
    with pytest.raises(errors.CapacityError, match="status unknown for quota"):
        status(403, uncounted)
    with pytest.raises(errors.ConfigError, match="Role"):
        status(403, "pods is forbidden: User cannot create")
    with pytest.raises(errors.SandboxNotFound):
        status(404, "not found")
    with pytest.raises(errors.ConfigError, match="Invalid value"):
        status(422, "Pod is invalid: Invalid value")
    status(201, "created")  # a success raises nothing


# -- daemon delivery by an image volume ------------------------------------------------

VOLUME_CONFIG = CONFIG.model_copy(update={"daemon_delivery": "image-volume"})
DAEMON_IMAGE = "sandman.local/nope:0"
NODE = "sandman-node"


def test_the_init_container_is_the_default_delivery() -> None:
    assert KubernetesConfig().daemon_delivery == "init-container"
    assert "initContainers" in manifest(SandboxSpec(image="x"))["spec"]


@pytest.mark.parametrize("policy", ["Always", "IfNotPresent", "Never"])
def test_the_image_volume_mounts_the_daemon_image_instead_of_an_init_container(
    policy: Literal["Always", "IfNotPresent", "Never"],
) -> None:
    spec = SandboxSpec(image="python:3.12", env={"A": "1"}, workdir="/work", user="1000")
    config = VOLUME_CONFIG.model_copy(update={"image_pull_policy": policy})
    with_volume = pods.pod_manifest(name="sb-1", spec=spec, labels=LABELS, token="t", config=config)
    pod_spec = with_volume["spec"]
    assert "initContainers" not in pod_spec
    assert pod_spec["volumes"] == [
        {"name": "sandman", "image": {"reference": CONFIG.daemon_image, "pullPolicy": policy}}
    ]
    (main,) = pod_spec["containers"]
    # The image's root is the mount: its /sandmand runs as /.sandman/sandmand, no subPath.
    assert main["command"] == ["/.sandman/sandmand"]
    assert main["volumeMounts"] == [{"name": "sandman", "mountPath": "/.sandman", "readOnly": True}]
    # Everything else is what the init-container delivery makes.
    by_init = pods.pod_manifest(
        name="sb-1", spec=spec, labels=LABELS, token="t",
        config=config.model_copy(update={"daemon_delivery": "init-container"}),
    )  # fmt: skip
    assert by_init["spec"].pop("initContainers")[0]["imagePullPolicy"] == policy
    assert by_init["spec"].pop("volumes") == [
        {"name": "sandman", "emptyDir": {"sizeLimit": "64Mi"}}
    ]
    pod_spec.pop("volumes")
    assert with_volume == by_init


@pytest.mark.parametrize("value", ["volume", "image_volume", "", None])
def test_an_unknown_delivery_is_refused_naming_the_choices(value: object) -> None:
    with pytest.raises(ValidationError, match="'init-container' or 'image-volume'"):
        KubernetesConfig(daemon_delivery=value)
    # The service reads the provider's settings as JSON (SANDMAN_KUBERNETES).
    with pytest.raises(ValidationError, match="daemon_delivery"):
        KubernetesConfig.model_validate_json(f'{{"daemon_delivery": "{value}"}}')
    config = KubernetesConfig.model_validate_json('{"daemon_delivery": "image-volume"}')
    assert config.daemon_delivery == "image-volume"


def by_volume(pod: dict[str, Any], reference: str = DAEMON_IMAGE) -> dict[str, Any]:
    """``pod`` as the image-volume delivery makes it, scheduled to the real node."""
    pod["spec"]["volumes"] = [
        {"name": "sandman", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}
    ]
    pod["spec"]["nodeName"] = NODE
    return pod


# The kubelet (1.36) pulls an image volume before the container's own image and reports
# a failure on the container that mounts it (hack/kube real node, containerd 1.6.20).
NO_HOST = (
    f'failed to pull and unpack image "{DAEMON_IMAGE}": failed to resolve reference '
    f'"{DAEMON_IMAGE}": failed to do request: Head "https://sandman.local/v2/nope/manifests/0": '
    "dial tcp: lookup sandman.local: no such host"
)
VOLUME_PULL_FAILURES = {
    "ErrImagePull": NO_HOST,
    "ImagePullBackOff": f'Back-off pulling image "{DAEMON_IMAGE}": ErrImagePull: {NO_HOST}',
    "ErrImageNeverPull": f'Container image "{DAEMON_IMAGE}" is not present with pull policy of '
    "Never",
}


@pytest.mark.parametrize("reason", sorted(VOLUME_PULL_FAILURES))
def test_a_daemon_image_the_volume_cannot_pull_is_named_as_the_daemon_image(reason: str) -> None:
    pod = by_volume(waiting(reason, message=VOLUME_PULL_FAILURES[reason]))
    outcome = pods.start_outcome(pod, "daemon")
    assert isinstance(outcome, errors.ImageError), outcome
    assert str(outcome).startswith(f"pod sb-1: daemon image {DAEMON_IMAGE}: {reason}: ")
    # The task image's own pull failure on the same pod is still the task image's.
    task = by_volume(waiting(reason, message=PERMANENT["404"]))
    assert str(pods.start_outcome(task, "daemon")).startswith("pod sb-1: image x: ")


def test_a_transient_pull_of_the_daemon_image_volume_waits_on_naming_it() -> None:
    message = TRANSIENT["503"].replace(SICK, "127.0.0.1:5991/sandmand:1")
    pod = by_volume(waiting("ErrImagePull", message=message), "127.0.0.1:5991/sandmand:1")
    outcome = pods.start_outcome(pod, "daemon")
    assert isinstance(outcome, pods.PullRetrying)
    assert outcome.detail.startswith("daemon image 127.0.0.1:5991/sandmand:1: ErrImagePull: ")


def test_the_daemon_image_is_recognised_however_the_runtime_spells_it() -> None:
    # containerd spells references out in full; the kubelet adds :latest to a bare name.
    for reference, message in [
        ("sandmand", 'failed to pull and unpack image "docker.io/library/sandmand:latest": x'),
        ("sandmand", 'Back-off pulling image "sandmand:latest"'),
        (
            "docker.io/sandmand",
            'failed to pull and unpack image "docker.io/library/sandmand:latest"',
        ),
        (
            "r.io/s/sandmand@sha256:ab",
            'failed to pull and unpack image "r.io/s/sandmand@sha256:ab"',
        ),
        ("r.io/sandmand:1", "image pull failed for r.io/sandmand:1 because the registry is down"),
    ]:
        pod = by_volume(waiting("ErrImagePull", message=message), reference)
        assert f"daemon image {reference}:" in str(pods.start_outcome(pod, "daemon")), reference
    # A name that only begins like the daemon image's is another image.
    other = by_volume(
        waiting("ErrImagePull", message='image "r.io/sandmand:10"'), "r.io/sandmand:1"
    )
    assert "pod sb-1: image x:" in str(pods.start_outcome(other, "daemon"))


# What the main container shows on a node whose runtime cannot mount image volumes: the
# hack/kube real node (containerd 1.6.20) and CRI-O before 1.31 refuse a mount without a
# host path; a runtime that ignored the mount would start the container without the daemon.
CONTAINERD_16 = (
    'failed to generate container "5ed50a980ed3efb6bbf3b378d849397a7e6c115647a336681c8a52d2a4877919" '
    'spec: failed to generate spec: failed to mkdir "": mkdir : no such file or directory'
)
CRIO_130 = "mount.HostPath is empty"
EMPTY_MOUNT = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
    'runc create failed: unable to start container process: exec: "/.sandman/sandmand": '
    "stat /.sandman/sandmand: no such file or directory: unknown"
)


@pytest.mark.parametrize(
    ("reason", "message"),
    [("CreateContainerError", CONTAINERD_16), ("CreateContainerError", CRIO_130),
     ("RunContainerError", EMPTY_MOUNT)],
)  # fmt: skip
def test_a_runtime_that_cannot_mount_image_volumes_is_a_config_error_naming_the_fix(
    reason: str, message: str
) -> None:
    outcome = pods.start_outcome(by_volume(waiting(reason, message=message)), "daemon")
    assert isinstance(outcome, errors.ConfigError), outcome
    text = str(outcome)
    assert f"the container runtime of node {NODE} cannot mount image volumes" in text
    assert "daemon_delivery='init-container'" in text
    assert message in text  # the runtime's own words, for whoever digs further
    # With the init container, the same words are the runtime's failure, not our setting.
    plain = pods.start_outcome(waiting(reason, message=message), "daemon")
    assert type(plain) is errors.ProviderError


def test_a_daemon_that_cannot_start_from_an_empty_mount_is_the_same_config_error() -> None:
    failed = by_volume(status(containerStatuses=[{"name": "sandbox", "image": "x", "state": {
        "terminated": {"exitCode": 128, "reason": "StartError", "message": EMPTY_MOUNT}}}]))  # fmt: skip
    outcome = pods.start_outcome(failed, "daemon")
    assert isinstance(outcome, errors.ConfigError)
    assert "cannot mount image volumes" in str(outcome)
    # Any other failure of an image-volume pod stays what it was.
    other = by_volume(waiting("CreateContainerConfigError", message='secret "s" not found'))
    assert type(pods.start_outcome(other, "daemon")) is errors.ProviderError


def test_a_pod_stored_without_its_image_volume_is_a_config_error() -> None:
    # An API server whose ImageVolume feature is off drops the volume and its mounts.
    pod = pods.pod_manifest(
        name="sb-1", spec=SandboxSpec(image="x"), labels=LABELS, token="t", config=VOLUME_CONFIG
    )
    assert pods.daemon_volume(pod) == CONFIG.daemon_image
    pods.check_delivery(pod, VOLUME_CONFIG)  # kept: fine
    dropped = copy.deepcopy(pod)
    del dropped["spec"]["volumes"]
    del dropped["spec"]["containers"][0]["volumeMounts"]
    with pytest.raises(
        errors.ConfigError, match="dropped the daemon's image volume.*init-container"
    ):
        pods.check_delivery(dropped, VOLUME_CONFIG)
    # The init-container delivery has no image volume to lose.
    assert pods.daemon_volume(manifest(SandboxSpec(image="x"))) is None
    pods.check_delivery(manifest(SandboxSpec(image="x")), CONFIG)


def test_an_unauthorized_pull_is_waited_on_while_the_pods_secrets_may_be_syncing() -> None:
    """In a pod's first seconds, the kubelet may have pulled before its cache held the pod's
    pull secret: a 401 then waits for the kubelet's next try; any other refusal does not."""
    for reason in ("ErrImagePull", "ImagePullBackOff"):
        message = PERMANENT["401"] if reason == "ErrImagePull" else back_off(PERMANENT["401"])
        pod = waiting(reason, message=message)
        syncing = pods.start_outcome(pod, "daemon", secrets_syncing=True)
        assert isinstance(syncing, pods.PullRetrying), syncing
        assert syncing.detail == f"image x: {pods._UNAUTHORIZED_HINT}: {reason}: {message}"
        assert isinstance(pods.start_outcome(pod, "daemon"), errors.ImageError)
    missing = pods.start_outcome(
        waiting("ErrImagePull", message=PERMANENT["404"]), "daemon", secrets_syncing=True
    )
    assert isinstance(missing, errors.ImageError), missing
