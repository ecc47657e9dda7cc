"""Pull task images onto nodes ahead of a run: one short-lived pod per image and node.

A burst on cold nodes is dominated by image pulls, so ``sandman prepare`` pulls
first. Each pull pod is pinned to its node (``nodeName``, tolerating every
taint) and runs the task image with a command that cannot exist in it
(`NEVER_RUNS`): the kubelet pulls the image, then fails to start the
container. Nothing from the image ever runs, and any image works, with or
without a shell. The pod's status says how the pull went:

- the container has an ``imageID``, has run or terminated, or waits for a
  reason the kubelet reaches only after the pull (`AFTER_PULL`): pulled;
- it waits with ``ErrImagePull``, ``ImagePullBackOff``, ``InvalidImageName``...:
  failed at the first such report, unless the failure is transient (the
  registry's 429 or 5xx, a network error; `pods.transient_pull_failure`): the
  kubelet retries those, so the pull waits on, and if it is still failing at
  the deadline its report says so and names the failure;
- the pod failed before any container (the kubelet refused it): failed.

One watch follows every pull pod of a run (label ``sandman.io/prepare``); each
pod is deleted as soon as its outcome is known, and whatever is left is
deleted at the end, also on error or cancellation. At most `per_node` pulls
run on a node at once (the kubelet serialises pulls by default anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sandman import errors
from sandman.models import check_object_name
from sandman.providers.kubernetes.api import BadRequest, Forbidden, KubeAPI
from sandman.providers.kubernetes.placement import parse_image
from sandman.providers.kubernetes.pods import transient_pull_failure
from sandman.providers.kubernetes.watch import PodWatch

__all__ = [
    "NEVER_RUNS",
    "PullResult",
    "check_images",
    "check_pull_secrets",
    "list_nodes",
    "prepare_images",
    "pull_outcome",
    "pull_pod",
]

logger = logging.getLogger(__name__)

LABEL = "sandman.io/prepare"
"""On every pull pod: the run's id. Select a run's pods with ``sandman.io/prepare=<run>``."""
NEVER_RUNS = "/.sandman-prepare/never-runs"
"""The pull container's command: absent from every image, so the container never starts."""
PULL_FAILURES = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RegistryUnavailable",
        "SignatureValidationFailed",
        "ErrImageInspect",
    }
)
"""Waiting reasons of a container whose image could not be pulled."""
AFTER_PULL = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "StartError",
        "PreCreateHookError",
        "PreStartHookError",
        "PostStartHookError",
    }
)
"""Waiting reasons the kubelet reaches only once the image is there: it ensures the image
before it builds the container's config (e.g. a user name the image's passwd lacks)."""
_CREATE_RETRIES = 8
_CREATES_IN_FLIGHT = 32  # however many nodes: the API server is shared


@dataclass(frozen=True)
class PullResult:
    """How pulling one image onto one node went."""

    image: str
    node: str
    ok: bool
    detail: str
    """``pulled`` (with the image's digest when known), or the reason and the kubelet's message."""
    seconds: float


def pull_outcome(pod: dict[str, Any]) -> tuple[bool, str] | None:
    """(pulled?, detail) once the pod's status settles the pull; None while it is open."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in PULL_FAILURES or "Image" in reason:  # also reasons newer than this list
            message = waiting.get("message", "")
            return False, f"{reason}: {message}" if message else reason
        pulled = reason in AFTER_PULL or "running" in state or "terminated" in state
        if pulled or container.get("imageID"):
            return True, f"pulled {container.get('imageID') or container.get('image', '')}".strip()
    if status.get("phase") == "Failed":  # refused by the kubelet before any container
        reason = status.get("reason") or "Failed"
        return False, f"{reason}: {status.get('message', '')}".rstrip(": ")
    return None


def _transient(detail: str) -> bool:
    reason, _, message = detail.partition(": ")  # as pull_outcome writes it
    return transient_pull_failure(reason, message)


def pull_pod(
    name: str, image: str, node: str, run: str, *, pull_secrets: Sequence[str] = ()
) -> dict[str, Any]:
    """The pod that pulls `image` onto `node` and runs nothing."""
    spec: dict[str, Any] = {
        "nodeName": node,  # no scheduler: exactly this node, even a full or cordoned one
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "tolerations": [{"operator": "Exists"}],
        "containers": [
            {
                "name": "pull",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": [NEVER_RUNS],
                # Never runs, so the strictest context fits any namespace's level.
                "securityContext": {
                    "runAsUser": 65532,
                    "runAsNonRoot": True,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "resources": {
                    "requests": {"cpu": "1m", "memory": "4Mi"},
                    "limits": {"cpu": "10m", "memory": "16Mi"},
                },
            }
        ],
    }
    if pull_secrets:
        spec["imagePullSecrets"] = [{"name": secret} for secret in pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {LABEL: run, "app.kubernetes.io/managed-by": "sandman"},
            "annotations": {"sandman.io/image": image},
        },
        "spec": spec,
    }


def check_images(images: Sequence[str]) -> None:
    """Raise ConfigError for the first string that is not an image reference."""
    for image in images:
        try:
            parse_image(image)
        except ValueError as exc:
            raise errors.ConfigError(str(exc)) from None


def check_pull_secrets(names: Sequence[str]) -> None:
    """Raise ConfigError for the first name that cannot be a Secret's."""
    for name in names:
        try:
            check_object_name(name)
        except ValueError as exc:
            raise errors.ConfigError(f"image pull secret: {exc}") from None


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not (node.get("spec") or {}).get("unschedulable", False)


async def list_nodes(api: KubeAPI, selector: str = "") -> list[dict[str, Any]]:
    """The Ready, schedulable nodes matching the label `selector` (a cluster-scoped read,
    consistent: a node labelled a moment ago is there)."""
    try:
        nodes = await api.list_nodes(selector)
    except BadRequest as exc:
        raise errors.ConfigError(f"bad node selector {selector!r}: {exc.reason}") from None
    except Forbidden:
        raise errors.ConfigError(
            f"list nodes {selector!r}: forbidden; prepare needs get/list on nodes "
            "(cluster-scoped) besides pods"
        ) from None
    return [node for node in nodes if _ready(node)]


async def prepare_images(
    api: KubeAPI,
    images: Sequence[str],
    nodes: Sequence[str],
    *,
    timeout: float = 1800.0,
    per_node: int = 2,
    pull_secrets: Sequence[str] = (),
    on_result: Callable[[PullResult], None] | None = None,
) -> list[PullResult]:
    """Pull every image onto every node; one result per (image, node), in that order.

    A pull still open at `timeout` (seconds from the start) fails with
    ``timed out``. Every pull pod is gone when this returns or raises.
    """
    if not images or not nodes:
        raise errors.ConfigError("prepare needs at least one image and one node")
    if per_node < 1:
        raise errors.ConfigError(f"per_node must be at least 1, not {per_node}")
    check_images(images)
    check_pull_secrets(pull_secrets)
    run = secrets.token_hex(4)
    selector = f"{LABEL}={run}"
    deadline = time.monotonic() + timeout
    watch = PodWatch(api, selector)
    results: dict[tuple[str, str], PullResult] = {}
    names = _names(run, images, nodes)
    creating = asyncio.Semaphore(_CREATES_IN_FLIGHT)

    async def pull(image: str, node: str) -> None:
        name = names[image, node]
        started = time.monotonic()
        outcome: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        retrying = ""  # the transient failure the kubelet retries, for the report at the deadline

        def waiter(kind: str, pod: dict[str, Any]) -> None:
            nonlocal retrying
            if outcome.done():
                return
            if kind == "DELETED":
                outcome.set_result((False, "pull pod deleted by someone else"))
            elif (settled := pull_outcome(pod)) is None:
                return
            elif not settled[0] and _transient(settled[1]):
                retrying = settled[1]
            else:
                outcome.set_result(settled)

        watch.add(name, waiter)
        try:
            async with creating:
                await _create(api, pull_pod(name, image, node, run, pull_secrets=pull_secrets))
            try:
                ok, detail = await asyncio.wait_for(outcome, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                ok, detail = False, f"timed out after {timeout:g} s (still pulling, or no answer)"
                if retrying:
                    detail = f"timed out after {timeout:g} s, still failing (transient): {retrying}"
        except errors.SandboxError as exc:
            ok, detail = False, f"could not create the pull pod: {exc}"
        finally:
            watch.remove(name)
        result = PullResult(image, node, ok, detail, time.monotonic() - started)
        results[image, node] = result
        if on_result is not None:
            on_result(result)
        with contextlib.suppress(errors.SandboxError):  # the final sweep retries
            await api.delete_pod(name)

    async def node_worker(node: str) -> None:
        limit = asyncio.Semaphore(per_node)

        async def one(image: str) -> None:
            async with limit:
                await pull(image, node)

        await asyncio.gather(*(one(image) for image in images))

    try:
        await watch.ensure_started()
        await asyncio.gather(*(node_worker(node) for node in nodes))
    finally:
        await watch.aclose()
        await asyncio.shield(_sweep(api, selector))
    return [results[image, node] for image in images for node in nodes]


def _names(run: str, images: Sequence[str], nodes: Sequence[str]) -> dict[tuple[str, str], str]:
    # Pod names carry no image or node name: those can be long or have characters
    # a name cannot; the annotation and nodeName say which is which.
    return {
        (image, node): f"sandman-prepare-{run}-{i}-{j}"
        for i, image in enumerate(images)
        for j, node in enumerate(nodes)
    }


async def _create(api: KubeAPI, body: dict[str, Any]) -> None:
    """Create the pod, waiting out throttling (429, 5xx) a few times."""
    for attempt in range(_CREATE_RETRIES):
        try:
            await api.create_pod(body)
            return
        except errors.ThrottledError as exc:
            if attempt == _CREATE_RETRIES - 1:
                raise
            await asyncio.sleep(exc.retry_after or min(0.2 * 2**attempt, 10.0))


async def _sweep(api: KubeAPI, selector: str) -> None:
    """Delete every pod of the run that is still there; retry until none is."""
    for attempt in range(20):
        try:
            pods, _ = await api.list_pods(selector)
            if not pods:
                return
            for pod in pods:
                await api.delete_pod(pod["metadata"]["name"])
        except errors.SandboxError as exc:
            logger.warning("deleting pull pods (%s): %s", selector, exc)
        await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
    logger.error(
        "pull pods %s may be left: delete them with kubectl delete pods -l %s", *[selector] * 2
    )
