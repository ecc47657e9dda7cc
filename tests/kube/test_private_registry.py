"""A private registry: Debian's ``docker-registry`` on 127.0.0.1 behind htpasswd basic auth,
and an image pull secret (``kubernetes.io/dockerconfigjson``) the harness's admin makes.

Without the secret, the kubelet's pull is refused: create fails at once with an
ImageError that names the image and says the pull was unauthorized, and ``prepare``
reports the runtime's refusal. With it (the pool's `KubernetesConfig.image_pull_secrets`, a spec's
`KubernetesOptions.image_pull_secrets`, ``prepare``'s ``pull_secrets``) the pod
starts. Each case has an image of its own (a layer only this run has): once pulled,
an image is on the node and no later pod would be asked for credentials. The
registry, the Secret, the pods and the images on the node are all gone afterwards.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandman import errors
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.prepare import prepare_images
from tests.images import builders
from tests.images.registry_server import Registry, missing_tools, push, start_registry
from tests.kube import node_images
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 240)]

START_TIMEOUT = 120.0
# A refused pull is reported at the kubelet's first ErrImagePull (its next sync of the pod).
FAILURE_WITHIN = 45.0


@dataclass(frozen=True)
class Private:
    registry: Registry
    repository: str  # every image of this run is a tag of it
    tags: dict[str, str]  # case -> image reference

    def image(self, case: str) -> str:
        return self.tags[case]


@pytest.fixture
def private(tmp_path: Path, kube_cluster: KubeCluster, real_node: str) -> Iterator[Private]:
    """A registry wanting a password, with one image per case; stopped, and the images
    removed from the node, afterwards."""
    if (why := missing_tools()) is not None:
        pytest.skip(why)
    nonce = secrets.token_hex(6)
    registry = start_registry(
        tmp_path / "registry", username="puller", password=secrets.token_urlsafe(12)
    )
    repository = f"{registry.host}/sandman-test/private-{nonce}"
    try:
        tags = {}
        for case in ("refused", "spec", "pool", "prepare-refused", "prepare"):
            layer = builders.layer_tar([
                # The image's USER is "user" (builders.image_config): containerd looks it up.
                builders.directory("etc"),
                builders.file("etc/passwd", b"user:x:1000:1000::/home/user:/none\n"),
                builders.file("etc/group", b"user:x:1000:\n"),
                builders.directory("home"),
                builders.directory("home/user", uid=1000, gid=1000),
                builders.file("sandman-private", f"{nonce} {case}".encode()),
            ])  # fmt: skip
            layout = builders.sample_oci([layer], ref_name=case).write_dir(tmp_path / case)
            tags[case] = push(layout, case, registry, f"sandman-test/private-{nonce}")
        yield Private(registry, repository, tags)
    finally:
        registry.stop()
        assert registry.process.poll() is not None
        node_images.remove(kube_cluster, repository)
        assert not [r for r in node_images.image_refs(kube_cluster) if r.startswith(repository)]


# The kubelet may pull a pod's image before it can read the pod's pull secret: the Node
# authorizer lets it read a Secret only once it has seen a pod on that node name it, and
# the kubelet gives its secret cache a moment only, then pulls without (logging "Unable to
# retrieve pull secret"), and the registry says 401. Seen now and then with a Secret made
# just before; the kubelet's own next attempt has it. A create waits that out itself
# (SECRET_SYNC_GRACE); a `prepare` that got one 401 with a secret is tried again here.
RETRIES_ON_401 = 1
# How the runtime relays the registry's refusal of a pull without (valid) credentials:
# containerd 1.6 quotes its "401 Unauthorized", containerd 2 says "authorization failed:
# no basic auth credentials".
REFUSED = re.compile(r"401 Unauthorized|no basic auth credentials")


@pytest.fixture
async def pull_secret(private: Private, admin: Admin) -> AsyncIterator[str]:
    """A dockerconfigjson Secret with the registry's credentials, made by the admin (the
    provider's identity cannot read Secrets, and needs not)."""
    registry = private.registry
    assert registry.username is not None and registry.password is not None
    login = f"{registry.username}:{registry.password}".encode()
    config = {"auths": {registry.host: {
        "username": registry.username, "password": registry.password,
        "auth": base64.b64encode(login).decode(),
    }}}  # fmt: skip
    name = f"sandman-test-regcred-{secrets.token_hex(4)}"
    secrets_url = admin.pods.replace("/pods", "/secrets")
    response = await admin.http.post(secrets_url, json={
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
        "metadata": {"name": name},
        "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()},
    })  # fmt: skip
    response.raise_for_status()
    try:
        yield name
    finally:
        response = await admin.http.delete(f"{secrets_url}/{name}")
        assert response.status_code in (200, 404), response.text


async def test_a_private_image_starts_with_its_pull_secret_and_is_refused_without(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, private: Private, pull_secret: str
) -> None:
    plain = KubernetesProvider(config_for(kube_cluster, start_timeout=START_TIMEOUT))
    pooled = KubernetesProvider(
        config_for(kube_cluster, start_timeout=START_TIMEOUT, image_pull_secrets=[pull_secret])
    )
    labels = {POOL: pool_name}
    try:
        spec = real_node_spec(kube_cluster)
        refused = spec.model_copy(update={"image": private.image("refused")})
        started = time.monotonic()
        with pytest.raises(errors.ImageError) as caught:
            await plain.create(refused, labels=labels)
        elapsed = time.monotonic() - started
        message = str(caught.value)
        assert f"image {private.image('refused')}" in message, message
        assert "the pull was unauthorized" in message, message
        assert REFUSED.search(message), message
        assert elapsed < FAILURE_WITHIN, f"took {elapsed:.1f} s"

        # The spec's own secret.
        k8s = spec.kubernetes.model_copy(update={"image_pull_secrets": [pull_secret]})
        own = spec.model_copy(update={"image": private.image("spec"), "kubernetes": k8s})
        info = await plain.create(own, labels=labels)
        assert info.state == "running" and info.endpoint is not None
        await plain.delete(info.id)

        # The pool's.
        info = await pooled.create(
            spec.model_copy(update={"image": private.image("pool")}), labels=labels
        )
        assert info.state == "running" and info.endpoint is not None
        await pooled.delete(info.id)
    finally:
        await plain.aclose()
        await pooled.aclose()
        await admin.sweep(pool_name)


async def test_prepare_pulls_a_private_image_with_the_pull_secret(
    kube_cluster: KubeCluster, private: Private, pull_secret: str, real_node: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster))
    try:
        [refused] = await prepare_images(
            provider.api, [private.image("prepare-refused")], [real_node], timeout=60
        )
        assert not refused.ok
        assert REFUSED.search(refused.detail), refused.detail
        for _ in range(RETRIES_ON_401 + 1):
            [pulled] = await prepare_images(
                provider.api, [private.image("prepare")], [real_node], timeout=60,
                pull_secrets=[pull_secret],
            )  # fmt: skip
            if pulled.ok or not REFUSED.search(pulled.detail):
                break
        assert pulled.ok, pulled.detail
    finally:
        await provider.aclose()
    refs = node_images.image_refs(kube_cluster)
    assert private.image("prepare") in refs
    assert private.image("prepare-refused") not in refs
