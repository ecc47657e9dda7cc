"""Sandman beside kubernetes-sigs/agent-sandbox: the same burst of sandboxes on the
same cluster, through each.

agent-sandbox's controller (``sigs.k8s.io/agent-sandbox``, `VERSION`) is built from the
Go module proxy into a cache this machine reuses (``--cache``; the build takes 10+
minutes on two cores) and runs as a host process against the cluster, with its
extensions on and its documented rapid-burst tuning: no client-side rate limit
(``--kube-api-qps=-1``) and 1,000 workers for each of its controllers. It runs as a
ServiceAccount bound to the ClusterRoles it ships (so API Priority and Fairness treats
it as it would in its own Deployment), its CRDs are installed with conversion
``None`` (its conversion webhook is off: only v1beta1 is used).

Then the same burst as ``k8s_burst.py`` (``--requests`` sandboxes from ``--clients``
clients, the same pod spec on KWOK nodes, ready when the pod's Ready condition is
True), once through each:

1. sandman: ``k8s_burst.py``'s paced burst, through one `Pool`.
2. agent-sandbox: one ``Sandbox`` object per sandbox, all created at once (429s
   waited out), each ready when its Ready condition is True.
3. agent-sandbox claims: one ``SandboxClaim`` per sandbox from an empty
   ``SandboxWarmPool`` (replicas 0), each ready when the claim is Ready.

The clients are the harness's ordinary identity ``sandman`` (not exempt from Priority
and Fairness), given a Role for the agent-sandbox objects in the run's own namespace.
Printed for each: t50, t100, failures, 429s the clients saw and the API server
answered (all identities), API writes per sandbox from the API server's
``apiserver_request_total`` (successful POST/PUT/PATCH/DELETE/APPLY; until all are
ready, and with the deletes), and what was left after deleting everything. The
cluster is shared: writes of anyone else in the same window count too. Last line:
``sandman_t100=<s> agent_sandbox_t100=<s> ratio=<r>``, agent-sandbox's t100 being the
faster of its two paths. If some of an arm's were never ready (its t100 is ``inf``), the
ratio is of the times at the highest share both reached, and says which
(``ratio=0.24 at=99.55% (t=<s> vs <s>)``).

Under the unthrottled controller the API server falls behind KWOK's node heartbeats;
a node then turns NotReady, its pods not Ready, and KWOK never makes them Ready again.
Start the harness with ``SANDMAN_KUBE_NODE_GRACE=10m`` for runs of thousands, so that
such a lapse strands no pod (and counts as no failure of either arm).

Everything the run installs (namespace, CRDs, ClusterRoles and bindings, the
controller process, KWOK nodes it added) is removed at the end, also on failure.

``--skip-claims`` leaves phase 3 out; ``--timeout`` bounds each agent-sandbox burst
(those not ready by then are failures, and its t100 is ``inf``), ``--deadline`` the
whole run (a shared machine's slot). ``--quick`` never
builds: with the controller cached it runs phases 1 and 2, without it phase 1 only
(``agent_sandbox_t100=skipped``). The test suite runs it so.

    .venv/bin/python benchmarks/peers/agent_sandbox.py --requests 10000 --clients 8 \\
        --kubeconfig /var/lib/sandman-kube/sandman.kubeconfig \\
        --admin-kubeconfig /var/lib/sandman-kube/admin.kubeconfig
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from k8s_burst import (
    PODS_PER_KWOK_NODE,
    RUN_LABEL,
    SPEC,
    Burst,
    config_for,
    kwok_capacity,
    log,
    paced_burst,
    run_workers,
)

from sandman import errors
from sandman.providers.kubernetes import pods as pod_specs
from sandman.providers.kubernetes.api import KubeAPI, retry_after
from sandman.providers.kubernetes.credentials import Credentials, load_credentials
from sandman.settings import KubernetesConfig

VERSION = "v0.5.6"
MODULE = "sigs.k8s.io/agent-sandbox"
DEFAULT_CACHE = Path("/var/cache/sandman/peers")
BINARY = "agent-sandbox-controller"
CRDS = (
    "agents.x-k8s.io_sandboxes.yaml",
    "extensions.agents.x-k8s.io_sandboxclaims.yaml",
    "extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
)
RBAC = ("rbac.generated.yaml", "extensions-rbac.generated.yaml")
# Its rapid-burst recipe (dev/load-test/test-recipes/README-rapid-burst.md), the
# template's workers too: 1,000 per controller.
TUNING = (
    "--kube-api-qps=-1",
    "--sandbox-concurrent-workers=1000",
    "--sandbox-claim-concurrent-workers=1000",
    "--sandbox-warm-pool-concurrent-workers=1000",
    "--sandbox-template-concurrent-workers=1000",
)
CORE = ("agents.x-k8s.io", "v1beta1")
EXT = ("extensions.agents.x-k8s.io", "v1beta1")
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"}
_METRIC = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# -- building (once per machine) ---------------------------------------------------


def cached(cache: Path) -> Path | None:
    """The cached controller of `VERSION` (with its CRDs and RBAC), if built."""
    home = cache / f"agent-sandbox-{VERSION}"
    return home if (home / BINARY).is_file() and (home / "k8s" / CRDS[0]).is_file() else None


def build(cache: Path) -> Path:
    """Build the controller from the Go module proxy into ``cache`` (once: later runs
    on this machine reuse it); its CRDs and RBAC are copied beside it."""
    if (home := cached(cache)) is not None:
        return home
    home = cache / f"agent-sandbox-{VERSION}"
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    log(f"building {MODULE}@{VERSION} into {home} (10+ minutes on two cores)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:  # outside any module
        out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"],
                             cwd=scratch, env=env, check=True, capture_output=True, text=True)  # fmt: skip
    source = Path(json.loads(out.stdout)["Dir"])
    partial = cache / f".agent-sandbox-{VERSION}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "k8s").mkdir(parents=True)
    subprocess.run(["nice", "-n", "15", "go", "build", "-trimpath", "-o", str(partial / BINARY),
                    f"./cmd/{BINARY}"], cwd=source, env=env, check=True)  # fmt: skip
    for name in CRDS:
        shutil.copy(source / "k8s" / "crds" / name, partial / "k8s" / name)
    for name in RBAC:
        shutil.copy(source / "k8s" / name, partial / "k8s" / name)
    shutil.rmtree(home, ignore_errors=True)
    partial.rename(home)
    log(f"built in {time.monotonic() - started:.0f}s")
    return home


# -- the API server ----------------------------------------------------------------


def api_for(kubeconfig: Path, namespace: str | None = None) -> tuple[KubeAPI, Credentials]:
    credentials = load_credentials(KubernetesConfig(kubeconfig=kubeconfig, namespace=namespace))
    return KubeAPI(credentials, max_connections=64), credentials


def collection(server: str, group_version: tuple[str, str], plural: str, ns: str) -> str:
    group, version = group_version
    return f"{server}/apis/{group}/{version}/namespaces/{ns}/{plural}"


@dataclass
class Requests:
    """``apiserver_request_total`` at one moment: successful writes and 429s, by kind."""

    writes: Counter[str]
    throttled: int

    def __sub__(self, before: Requests) -> Requests:
        return Requests(self.writes - before.writes, self.throttled - before.throttled)

    def per(self, count: int) -> str:
        total = sum(self.writes.values())
        top = ", ".join(f"{k} {v / count:.2f}" for k, v in self.writes.most_common(6))
        return f"{total / count:.2f} ({top})"


async def requests_now(admin: Credentials) -> Requests:
    """The API server's request counters (its /metrics, as the admin)."""
    connector = aiohttp.TCPConnector(ssl=admin.ssl_context)
    headers = {"Authorization": f"Bearer {admin.bearer()}"}
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"{admin.server}/metrics", headers=headers) as response,
    ):
        response.raise_for_status()
        text = await response.text()
    writes: Counter[str] = Counter()
    throttled = 0
    for line in text.splitlines():
        if not (match := _METRIC.match(line)):
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        value = int(float(match["value"]))
        if labels.get("code") == "429":
            throttled += value
        elif labels.get("verb") in WRITE_VERBS and labels.get("code", "").startswith("2"):
            kind = labels.get("resource", "?")
            if labels.get("subresource"):
                kind += "/" + labels["subresource"]
            writes[f"{labels['verb']} {kind}"] += value
    return Requests(writes, throttled)


async def watch_ready(
    api: KubeAPI,
    credentials: Credentials,
    url: str,
    selector: str,
    started: float,
    ready: dict[str, float],
) -> None:
    """Record in ``ready`` when each object under ``url`` matching ``selector`` first has
    the condition Ready True (seconds since ``started``); runs until cancelled."""

    def seen(obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        conditions = (obj.get("status") or {}).get("conditions") or []
        if name not in ready and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
        ):
            ready[name] = time.monotonic() - started

    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=330)
    connector = aiohttp.TCPConnector(ssl=credentials.ssl_context)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        version = ""
        while True:
            if not version:
                params: dict[str, str | int] = {"labelSelector": selector}
                listed = await api.request("GET", url, "list", params=params)
                for obj in listed.get("items") or []:
                    seen(obj)
                version = listed["metadata"]["resourceVersion"]
            params = {"watch": 1, "labelSelector": selector, "resourceVersion": version,
                      "allowWatchBookmarks": "true", "timeoutSeconds": 300}  # fmt: skip
            headers = {"Authorization": f"Bearer {credentials.bearer()}"}
            async with session.get(url, params=params, headers=headers) as response:
                if response.status == 410:
                    version = ""
                    continue
                if response.status == 429:
                    # API Priority and Fairness sheds the watch while the unthrottled
                    # controller floods the server (a 10k run died of it): wait, again.
                    await asyncio.sleep(retry_after(response.headers) or 1.0)
                    continue
                response.raise_for_status()
                async for line in response.content:  # one event a line
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        version = ""  # expired (410): list again
                        break
                    version = obj["metadata"].get("resourceVersion", version)
                    if event["type"] in ("ADDED", "MODIFIED"):
                        seen(obj)


async def create_all(
    api: KubeAPI, url: str, bodies: list[dict[str, Any]], clients: int, burst: Burst
) -> None:
    """POST every body at once, from ``clients`` clients (each its share), 429s waited out."""

    async def one(body: dict[str, Any]) -> None:
        while True:
            try:
                await api.request("POST", url, f"create {body['metadata']['name']}", body=body)
                return
            except errors.ThrottledError as exc:
                burst.throttled += 1
                await asyncio.sleep(exc.retry_after or 0.5)
            except errors.SandboxError as exc:
                burst.failures += 1
                burst.errors[type(exc).__name__] = burst.errors.get(type(exc).__name__, 0) + 1
                return

    async def client(share: list[dict[str, Any]]) -> None:
        await asyncio.gather(*(one(body) for body in share))

    await asyncio.gather(*(client(bodies[i::clients]) for i in range(clients)))


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(1)
    log(f"  gave up waiting for {what} after {timeout:.0f}s")
    return False


# -- the run -----------------------------------------------------------------------


@asynccontextmanager
async def namespace(admin: KubeAPI, server: str, name: str) -> AsyncIterator[None]:
    """The run's namespace, where the ``sandman`` identity may manage pods and the
    agent-sandbox objects; deleted (and waited for) at the end."""
    url = f"{server}/api/v1/namespaces"
    body = {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {RUN_LABEL: "peer"}}}  # fmt: skip
    await admin.request("POST", url, f"create namespace {name}", body=body)
    try:
        rbac = f"{server}/apis/rbac.authorization.k8s.io/v1/namespaces/{name}"
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "peer-client"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"],
                 "verbs": ["create", "get", "list", "watch", "delete", "patch"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                 "verbs": ["create", "delete", "get", "list", "patch"]},
                {"apiGroups": [CORE[0], EXT[0]],
                 "resources": ["sandboxes", "sandboxclaims", "sandboxtemplates",
                               "sandboxwarmpools"],
                 "verbs": ["create", "get", "list", "watch", "delete", "deletecollection"]},
            ],
        }  # fmt: skip
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "peer-client"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "peer-client"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": "sandman"}],
        }  # fmt: skip
        await admin.request("POST", f"{rbac}/roles", "create role", body=role)
        await admin.request("POST", f"{rbac}/rolebindings", "create rolebinding", body=binding)
        yield
    finally:
        await admin.request("DELETE", f"{url}/{name}", f"delete namespace {name}", missing_ok=True)

        async def gone() -> bool:
            got = await admin.request("GET", f"{url}/{name}", "get namespace", missing_ok=True)
            return not got

        await wait_for(f"namespace {name} to go", gone, 300)
        log(f"{now()} namespace {name} deleted")


@asynccontextmanager
async def crds(admin: KubeAPI, server: str, home: Path) -> AsyncIterator[None]:
    """agent-sandbox's CRDs, conversion None (no webhook); refused when already there,
    so that another installation is never touched; deleted at the end."""
    url = f"{server}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    made: list[str] = []
    try:
        for file in CRDS:
            body = yaml.safe_load((home / "k8s" / file).read_text())
            body["spec"]["conversion"] = {"strategy": "None"}
            name = body["metadata"]["name"]
            if await admin.request("GET", f"{url}/{name}", "get crd", missing_ok=True):
                raise SystemExit(f"CRD {name} is already installed: not touching it")
            await admin.request("POST", url, f"create crd {name}", body=body)
            made.append(name)

        async def established() -> bool:
            for name in made:
                crd = await admin.request("GET", f"{url}/{name}", "get crd")
                conditions = (crd.get("status") or {}).get("conditions") or []
                if not any(c["type"] == "Established" and c["status"] == "True"
                           for c in conditions):  # fmt: skip
                    return False
            return True

        if not await wait_for("the CRDs to be established", established, 60):
            raise SystemExit("agent-sandbox's CRDs were not established")
        yield
    finally:
        for name in made:
            await admin.request("DELETE", f"{url}/{name}", f"delete crd {name}", missing_ok=True)


@asynccontextmanager
async def controller(
    admin: KubeAPI,
    server: str,
    admin_kubeconfig: Path,
    home: Path,
    run: str,
    ns: str,
    keep_log: Path | None,
) -> AsyncIterator[None]:
    """agent-sandbox's controller as a host process, as ServiceAccount ``ns``/
    ``agent-sandbox-controller`` bound to its own ClusterRoles; stopped at the end."""
    rbac = f"{server}/apis/rbac.authorization.k8s.io/v1"
    account = "agent-sandbox-controller"
    made: list[str] = []
    state = Path(tempfile.mkdtemp(prefix="sandman-agent-sandbox-"))
    process: asyncio.subprocess.Process | None = None
    try:
        await admin.request(
            "POST", f"{server}/api/v1/namespaces/{ns}/serviceaccounts", "create serviceaccount",
            body={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
        )  # fmt: skip
        for file in RBAC:
            role = yaml.safe_load((home / "k8s" / file).read_text())
            name = f"{role['metadata']['name']}-{run}"
            role["metadata"] = {"name": name, "labels": {RUN_LABEL: run}}
            await admin.request("POST", f"{rbac}/clusterroles", f"create {name}", body=role)
            made.append(name)
            binding = {
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": name, "labels": {RUN_LABEL: run}},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
            }  # fmt: skip
            await admin.request("POST", f"{rbac}/clusterrolebindings", name, body=binding)
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": 6 * 3600}}  # fmt: skip
        token = await admin.request(
            "POST", f"{server}/api/v1/namespaces/{ns}/serviceaccounts/{account}/token",
            "request token", body=request,
        )  # fmt: skip
        # The admin's kubeconfig (server, CA) with the ServiceAccount's token instead.
        config = yaml.safe_load(admin_kubeconfig.read_text())
        for user in config["users"]:
            user["user"] = {"token": token["status"]["token"]}
        kubeconfig = state / "kubeconfig"
        kubeconfig.touch(mode=0o600)
        kubeconfig.write_text(yaml.safe_dump(config))
        probe = free_port()
        argv = [str(home / BINARY), "--extensions", "--leader-elect=false",
                "--enable-webhook=false", "--metrics-bind-address=0",
                f"--health-probe-bind-address=127.0.0.1:{probe}", *TUNING]  # fmt: skip
        log(f"starting {' '.join(argv[1:])}")
        with (state / "controller.log").open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *argv, env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

        async def ready() -> bool:
            if process is not None and process.returncode is not None:
                raise SystemExit(f"the controller exited: {tail(state / 'controller.log')}")
            return await asyncio.to_thread(probe_ok, f"http://127.0.0.1:{probe}/readyz")

        if not await wait_for("the controller to be ready", ready, 120):
            raise SystemExit(f"the controller is not ready: {tail(state / 'controller.log')}")
        yield
        if process.returncode is not None:
            raise SystemExit(f"the controller exited: {tail(state / 'controller.log')}")
    finally:
        if process is not None:
            if process.returncode is None:
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()
        for name in made:
            for kind in ("clusterrolebindings", "clusterroles"):
                await admin.request("DELETE", f"{rbac}/{kind}/{name}", name, missing_ok=True)
        if keep_log is not None and (state / "controller.log").exists():
            shutil.copy(state / "controller.log", keep_log)
        shutil.rmtree(state, ignore_errors=True)


def now() -> str:
    return time.strftime("%H:%M:%S")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def probe_ok(url: str) -> bool:
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- the phases --------------------------------------------------------------------


@dataclass
class Measured:
    """One phase: the burst, and the API server's requests until all were ready and
    until everything was deleted."""

    burst: Burst
    to_ready: Requests
    with_deletes: Requests
    waited: float = math.inf
    """How long the burst was waited for (its t100 is more when some were not ready)."""

    def line(self, total: int) -> str:
        return (
            f"{self.burst.line(total)} apiserver_429s={self.with_deletes.throttled} "
            f"writes/sandbox={sum(self.to_ready.writes.values()) / total:.2f} "
            f"(with deletes {sum(self.with_deletes.writes.values()) / total:.2f})"
        )

    def breakdown(self, total: int) -> str:
        return (
            f"  {self.burst.name} writes/sandbox until ready: {self.to_ready.per(total)}\n"
            f"  {self.burst.name} writes/sandbox with deletes: {self.with_deletes.per(total)}"
        )


@dataclass
class Cluster:
    """One run's namespace and identities."""

    namespace: str
    kubeconfig: Path
    admin: KubeAPI
    admin_credentials: Credentials
    user: KubeAPI
    user_credentials: Credentials
    server: str

    def url(self, group_version: tuple[str, str], plural: str) -> str:
        return collection(self.server, group_version, plural, self.namespace)

    async def count(self, url: str, selector: str = "") -> int:
        params: dict[str, str | int] = {"labelSelector": selector} if selector else {}
        listed = await self.admin.request("GET", url, "count", params=params)
        return len(listed.get("items") or [])

    async def agent_sandbox_left(self) -> int:
        """Pods, Sandboxes and SandboxClaims in the namespace (read from etcd)."""
        urls = [f"{self.server}/api/v1/namespaces/{self.namespace}/pods",
                self.url(CORE, "sandboxes"), self.url(EXT, "sandboxclaims")]  # fmt: skip
        return sum([await self.count(u) for u in urls])


async def sandman_phase(cluster: Cluster, requests: int, clients: int, lease: float) -> Measured:
    before = await requests_now(cluster.admin_credentials)
    at_ready: list[Requests] = []

    async def all_ready() -> None:
        at_ready.append(await requests_now(cluster.admin_credentials) - before)

    burst = await paced_burst(
        cluster.kubeconfig, requests, clients, lease, cluster.namespace, all_ready
    )
    burst.name = "sandman"
    after = await requests_now(cluster.admin_credentials)
    return Measured(burst, at_ready[0], after - before)


def pod_template(cluster: Cluster, label: str) -> dict[str, Any]:
    """k8s_burst's pod (spec, labels, KWOK annotations) as an agent-sandbox podTemplate."""
    config = config_for(cluster.kubeconfig, labels={RUN_LABEL: label}, namespace=cluster.namespace)
    pod = pod_specs.pod_manifest(name="template", spec=SPEC, labels={"sandman.io/pool": label},
                                 token="unused", config=config)  # fmt: skip
    meta = pod["metadata"]
    return {"metadata": {"labels": meta["labels"], "annotations": meta.get("annotations") or {}},
            "spec": pod["spec"]}  # fmt: skip


async def report(cluster: Cluster, name: str, ready: dict[str, float], total: int) -> None:
    """Progress: how many are Ready, and how many pods the controller has made."""
    pods = f"{cluster.server}/api/v1/namespaces/{cluster.namespace}/pods"
    started = time.monotonic()
    while True:
        await asyncio.sleep(10 if total <= 1000 else 60)
        # One item and the count of the rest: a full list of 10,000 pods every minute
        # would cost the API server (and so the arm measured) seconds of CPU.
        params: dict[str, str | int] = {"limit": 1}
        listed = await cluster.admin.request("GET", pods, "count pods", params=params)
        made = len(listed.get("items") or []) + int(
            (listed.get("metadata") or {}).get("remainingItemCount") or 0
        )
        log(f"  {name} at {time.monotonic() - started:.0f}s: {len(ready)}/{total} ready; "
            f"pods {made} made")  # fmt: skip


async def object_phase(
    cluster: Cluster,
    burst: Burst,
    url: str,
    bodies: list[dict[str, Any]],
    clients: int,
    timeout: float,
) -> Measured:
    """Create ``bodies`` under ``url`` at once and wait until each is Ready; then delete
    them (by label) and wait until the namespace has none of their pods left."""
    selector = f"{RUN_LABEL}={bodies[0]['metadata']['labels'][RUN_LABEL]}"
    total = len(bodies)
    ready: dict[str, float] = {}
    before = await requests_now(cluster.admin_credentials)
    started = time.monotonic()
    watcher = asyncio.create_task(
        watch_ready(cluster.user, cluster.user_credentials, url, selector, started, ready)
    )
    progress = asyncio.create_task(report(cluster, burst.name, ready, total))
    creates: asyncio.Task[None] | None = None
    try:

        async def all_ready() -> bool:
            if watcher.done():
                watcher.result()  # its error, if it failed
            return len(ready) >= total - burst.failures

        # The timeout covers the creates too (10k of them can take minutes).
        creates = asyncio.create_task(create_all(cluster.user, url, bodies, clients, burst))
        if not await wait_for(f"{burst.name}: all ready", all_ready, timeout):
            log(f"  {burst.name}: {len(ready)}/{total} ready after {timeout:.0f}s")
    finally:
        watcher.cancel()
        progress.cancel()
        if creates is not None:
            creates.cancel()
            await asyncio.gather(creates, return_exceptions=True)
    to_ready = await requests_now(cluster.admin_credentials) - before
    burst.ready_at = sorted(ready.values())
    burst.failures = total - len(ready)  # failed creates, and those never ready
    # One DELETE each, 32 at a time: a collection's DELETE is served one object after
    # the other (--delete-collection-workers=1) and outlasts the client's timeout.
    params: dict[str, str | int] = {"labelSelector": selector}
    listed = await cluster.user.request("GET", url, "list", params=params)
    names = [obj["metadata"]["name"] for obj in listed.get("items") or []]

    async def delete(name: str) -> None:
        await cluster.user.request("DELETE", f"{url}/{name}", f"delete {name}", missing_ok=True)

    await run_workers(names, 32, delete)

    async def gone() -> bool:
        return await cluster.agent_sandbox_left() == 0

    await wait_for(f"{burst.name}: all gone", gone, 600)
    log(f"{now()} {burst.name}: deleted")
    burst.leftover = await cluster.agent_sandbox_left()
    after = await requests_now(cluster.admin_credentials)
    return Measured(burst, to_ready, after - before, timeout)


async def sandboxes_phase(
    cluster: Cluster, requests: int, clients: int, timeout: float
) -> Measured:
    """One Sandbox object per sandbox."""
    label = f"as-{secrets.token_hex(3)}"
    template = pod_template(cluster, label)
    bodies = [{"apiVersion": "/".join(CORE), "kind": "Sandbox",
               "metadata": {"name": f"{label}-{i}", "labels": {RUN_LABEL: label}},
               "spec": {"podTemplate": template}} for i in range(requests)]  # fmt: skip
    url = cluster.url(CORE, "sandboxes")
    return await object_phase(cluster, Burst("agent-sandbox"), url, bodies, clients, timeout)


async def claims_phase(cluster: Cluster, requests: int, clients: int, timeout: float) -> Measured:
    """One SandboxClaim per sandbox, from a warm pool of none (each made cold)."""
    label = f"claim-{secrets.token_hex(3)}"
    meta = {"name": label, "labels": {RUN_LABEL: label}}
    template = {"apiVersion": "/".join(EXT), "kind": "SandboxTemplate", "metadata": meta,
                "spec": {"podTemplate": pod_template(cluster, label)}}  # fmt: skip
    pool = {"apiVersion": "/".join(EXT), "kind": "SandboxWarmPool", "metadata": meta,
            "spec": {"replicas": 0, "sandboxTemplateRef": {"name": label}}}  # fmt: skip
    await cluster.user.request("POST", cluster.url(EXT, "sandboxtemplates"), "template",
                               body=template)  # fmt: skip
    await cluster.user.request("POST", cluster.url(EXT, "sandboxwarmpools"), "pool", body=pool)
    bodies = [{"apiVersion": "/".join(EXT), "kind": "SandboxClaim",
               "metadata": {"name": f"{label}-{i}", "labels": {RUN_LABEL: label}},
               "spec": {"warmPoolRef": {"name": label}}} for i in range(requests)]  # fmt: skip
    url = cluster.url(EXT, "sandboxclaims")
    return await object_phase(cluster, Burst("agent-sandbox claims"), url, bodies, clients, timeout)


# -- main --------------------------------------------------------------------------


async def benchmark(args: argparse.Namespace, home: Path | None) -> str:
    begun = time.monotonic()

    def timeout() -> float:
        """--timeout, or less so that the run (its deletes too) ends within --deadline."""
        if args.deadline is None:
            return float(args.timeout)
        # Deleting the sandboxes and their pods (~0.025 s each), the namespace (~60 s).
        cleanup = 60 + 0.025 * args.requests
        left = args.deadline - (time.monotonic() - begun) - cleanup
        if left < 30:
            raise SystemExit(f"--deadline {args.deadline:.0f}s leaves no time for agent-sandbox")
        return float(min(args.timeout, left))

    admin, admin_credentials = api_for(args.admin_kubeconfig)
    server = admin_credentials.server
    run = secrets.token_hex(3)
    ns = f"peer-{run}"
    user, user_credentials = api_for(args.kubeconfig, ns)
    cluster = Cluster(ns, args.kubeconfig, admin, admin_credentials, user, user_credentials, server)
    results: list[Measured] = []
    async with AsyncExitStack() as stack:
        stack.push_async_callback(user.aclose)
        stack.push_async_callback(admin.aclose)
        capacity = kwok_capacity(args.admin_kubeconfig, args.requests + PODS_PER_KWOK_NODE)
        await stack.enter_async_context(capacity)
        await stack.enter_async_context(namespace(admin, server, ns))
        log(f"{now()} sandman: a paced burst of {args.requests} from {args.clients} clients")
        results.append(await sandman_phase(cluster, args.requests, args.clients, args.lease))
        print(results[-1].line(args.requests), flush=True)
        if home is not None:
            await stack.enter_async_context(crds(admin, server, home))
            await stack.enter_async_context(
                controller(admin, server, args.admin_kubeconfig, home, run, ns, args.controller_log)
            )
            log(f"{now()} agent-sandbox: {args.requests} Sandboxes from {args.clients} clients")
            results.append(await sandboxes_phase(cluster, args.requests, args.clients, timeout()))
            print(results[-1].line(args.requests), flush=True)
            if not (args.quick or args.skip_claims):
                log(f"{now()} agent-sandbox: {args.requests} SandboxClaims from an empty warm pool")
                results.append(await claims_phase(cluster, args.requests, args.clients, timeout()))
                print(results[-1].line(args.requests), flush=True)
    for measured in results:
        print(measured.breakdown(args.requests))
    return compare(results[0].burst, [m.burst for m in results[1:]], args.requests)


def compare(ours: Burst, theirs: list[Burst], total: int) -> str:
    """The last line: both t100s and their ratio. When an arm never had all ready, its
    t100 is inf and the ratio is taken at the highest share both reached (``at=``), so
    that it still says something: e.g. 99.55% of agent-sandbox's were ready."""
    if not theirs:
        return f"sandman_t100={ours.t(1.0, total):.1f} agent_sandbox_t100=skipped ratio=skipped"
    best = max(theirs, key=lambda b: (len(b.ready_at), -b.t(1.0, total)))
    line = f"sandman_t100={ours.t(1.0, total):.1f} agent_sandbox_t100={best.t(1.0, total):.1f}"
    reached = min(len(ours.ready_at), len(best.ready_at))
    if reached == 0:
        return f"{line} ratio=nan"
    fraction = reached / total
    ratio = ours.t(fraction, total) / best.t(fraction, total)
    if reached == total:
        return f"{line} ratio={ratio:.2f}"
    return (
        f"{line} ratio={ratio:.2f} at={100 * fraction:.2f}% "
        f"(t={ours.t(fraction, total):.1f}s vs {best.t(fraction, total):.1f}s)"
    )


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"),
                        help="the ordinary identity (default: $KUBECONFIG)")  # fmt: skip
    parser.add_argument("--admin-kubeconfig", type=Path, required=True,
                        help="installs and removes CRDs, RBAC, the namespace, KWOK nodes")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="where the built controller is kept for this machine")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="never build; agent-sandbox's Sandboxes only, if it is cached")  # fmt: skip
    parser.add_argument("--skip-claims", action="store_true",
                        help="agent-sandbox's Sandboxes only, not its SandboxClaims")  # fmt: skip
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="shorten agent-sandbox's bursts so the run ends within this")  # fmt: skip
    parser.add_argument("--controller-log", type=Path, help="keep the controller's log here")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds an agent-sandbox burst may take to be ready")  # fmt: skip
    args = parser.parse_args()
    if args.requests < 1 or args.clients < 1:
        parser.error("--requests and --clients must be >= 1")
    if args.kubeconfig is None:
        parser.error("--kubeconfig (or KUBECONFIG) is required")
    signal.signal(signal.SIGTERM, interrupted)  # the clean-up runs then too
    home = cached(args.cache) if args.quick else build(args.cache)
    if home is None:
        log(f"agent-sandbox {VERSION} is not built in {args.cache}: its phases are skipped")
    try:
        print(asyncio.run(benchmark(args, home)))
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc or 'SIGINT'}): cleaned up")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
