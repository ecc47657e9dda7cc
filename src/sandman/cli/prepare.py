"""``sandman prepare IMAGES...``: pull task images onto Kubernetes nodes ahead of a run."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from pydantic import ValidationError

from sandman import errors
from sandman.cli._common import run_async


async def _prepare(
    images: tuple[str, ...],
    *,
    selector: str,
    kubeconfig: Path | None,
    context: str | None,
    namespace: str | None,
    timeout: float,
    per_node: int,
    pull_secrets: tuple[str, ...],
) -> bool:
    from sandman.providers.kubernetes.api import KubeAPI
    from sandman.providers.kubernetes.credentials import load_credentials
    from sandman.providers.kubernetes.prepare import (
        PullResult,
        check_images,
        check_pull_secrets,
        list_nodes,
        prepare_images,
    )
    from sandman.settings import KubernetesConfig

    check_images(images)  # before any request
    check_pull_secrets(pull_secrets)

    try:
        config = KubernetesConfig(kubeconfig=kubeconfig, context=context, namespace=namespace)
    except ValidationError as exc:
        raise errors.ConfigError(
            f"bad --namespace {namespace!r}: {exc.errors()[0]['msg']}"
        ) from None
    credentials = load_credentials(config)
    api = KubeAPI(credentials)
    try:
        nodes = sorted(node["metadata"]["name"] for node in await list_nodes(api, selector))
        if not nodes:
            raise errors.ConfigError(f"no Ready, schedulable node matches {selector!r}")
        click.echo(
            f"pulling {len(images)} image(s) onto {len(nodes)} node(s) "
            f"in namespace {credentials.namespace}",
            err=True,
        )
        with click.progressbar(
            length=len(images) * len(nodes), label="pulls", file=sys.stderr
        ) as bar:

            def progress(result: PullResult) -> None:
                bar.update(1)

            results = await prepare_images(
                api,
                images,
                nodes,
                timeout=timeout,
                per_node=per_node,
                pull_secrets=pull_secrets,
                on_result=progress,
            )
    finally:
        await api.aclose()
    failed = [r for r in results if not r.ok]
    for result in failed:
        click.echo(f"FAILED  {result.image}  on {result.node}: {result.detail}", err=True)
    slowest = max(r.seconds for r in results)
    click.echo(
        f"{len(results) - len(failed)}/{len(results)} pulled, {len(failed)} failed "
        f"(slowest {slowest:.1f} s)"
    )
    return not failed


@click.command()
@click.argument("images", nargs=-1, required=True)
@click.option(
    "--nodes",
    "selector",
    default="",
    metavar="SELECTOR",
    help="Label selector of the nodes to pull onto (default: every Ready, schedulable node).",
)
@click.option(
    "--kubeconfig",
    envvar="KUBECONFIG",
    type=click.Path(path_type=Path),
    help="Default: $KUBECONFIG, else the pod's service account.",
)
@click.option("--context", help="The kubeconfig context (default: its current one).")
@click.option("--namespace", help="Where the pull pods go (default: the context's).")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    show_default=True,
    help="Seconds for the whole run; pulls still open then count as failed.",
)
@click.option(
    "--per-node",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Pulls at once on one node.",
)
@click.option(
    "--pull-secret",
    "pull_secrets",
    multiple=True,
    metavar="NAME",
    help="An image pull secret in the namespace (repeatable).",
)
@click.pass_context
def prepare(
    ctx: click.Context,
    images: tuple[str, ...],
    selector: str,
    kubeconfig: Path | None,
    context: str | None,
    namespace: str | None,
    timeout: float,
    per_node: int,
    pull_secrets: tuple[str, ...],
) -> None:
    """Pull IMAGES onto Kubernetes nodes ahead of a run, so sandboxes start without pulling.

    One pod per image and node pulls the image and runs nothing; each is
    deleted when its pull is settled. Exits 1 when any pull failed, listing
    each failure with the kubelet's reason (e.g. ErrImagePull) and node.
    """
    ok = run_async(
        ctx,
        _prepare(
            images,
            selector=selector,
            kubeconfig=kubeconfig,
            context=context,
            namespace=namespace,
            timeout=timeout,
            per_node=per_node,
            pull_secrets=pull_secrets,
        ),
    )
    if not ok:
        ctx.exit(1)


COMMANDS: list[click.Command] = [prepare]
