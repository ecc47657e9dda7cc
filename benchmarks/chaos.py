"""Chaos: random faults at random points, then a full inventory of the host.

Each iteration draws a scenario and a fault from the seed (see
``tests/chaos/engine.py``): two clients on embedded pools, or on one ``sandman
serve``, run a burst of sandboxes; a client, a watchdog, the service or a
sandbox's daemon is killed or stopped, acquires are cancelled, or the state
directory turns read-only or full for a moment. Then the survivors are asked
what they hold, everything closes, and the host must return to what it was.

Prints one line per iteration, the details of each failing one (seed,
iteration, scenario, fault, what leaked or was lost; its logs are kept), a
line per scenario, and last:
``iterations=<n> leaked=<n> lost=<n> untyped_errors=<n>``.

    .venv/bin/python benchmarks/chaos.py --seed 1 --iterations 30
    .venv/bin/python benchmarks/chaos.py --seed 1 --start 7 --iterations 1   # replay one

Needs root, crun, btrfs-progs, iproute2 and nftables (the local provider's needs).

With ``--provider kubernetes`` the runs go to the harness cluster started by
``hack/kube/up`` (its state directory: ``$SANDMAN_KUBE_DIR``, default
``/var/lib/sandman-kube``): pods deleted or evicted behind the pools' backs, a
pool's process SIGKILLed (its pods reaped through its Lease), the API server cut
off for a while (``tests/chaos/kube.py``). With ``--snapshots`` too, a pool's process
on the real node is SIGKILLed in the middle of a snapshot, a fork, a restore or a save
as an image, and ``sandman gc --kubernetes`` or the next pool of its name must leave
no pod, Lease, snapshot, scratch directory or process (``tests/kube/snapshot_kills.py``;
``--fault`` names one step: snapshot, fork, restore, save-image).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chaos import kube
from tests.chaos.engine import FAULTS, Outcome, Plan, plan_for, run_iteration
from tests.kube.conftest import DEFAULT_DIR, KubeCluster

from sandman.images.busybox import busybox_rootfs_tar


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--start", type=int, default=0, help="First iteration (to replay one).")
    parser.add_argument("--provider", choices=["local", "kubernetes"], default="local")
    parser.add_argument(
        "--scenario", choices=[*sorted(FAULTS), "kubernetes"], help="Only this scenario."
    )
    parser.add_argument("--fault", help="Only this fault.")
    parser.add_argument(
        "--snapshots",
        action="store_true",
        help="Workers also snapshot, fork, restore and pause (local provider); on "
        "Kubernetes, pools killed in the middle of those steps.",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="Where failing iterations' logs are kept."
    )
    args = parser.parse_args()
    cluster = None
    if args.provider == "kubernetes":
        env = Path(os.environ.get("SANDMAN_KUBE_DIR", DEFAULT_DIR)) / "env"
        if not env.is_file():
            print(f"no cluster: {env} is missing; start one with hack/kube/up", file=sys.stderr)
            return 2
        cluster = KubeCluster.from_env_file(env)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"sandman-chaos-{args.seed}-"))
    work.mkdir(parents=True, exist_ok=True)
    if cluster is not None and args.snapshots:
        return await kube_snapshot_kills(args, cluster, work)
    busybox = busybox_rootfs_tar(work / "busybox.tar") if cluster is None else None
    outcomes: list[Outcome] = []
    print(f"chaos: seed={args.seed} iterations={args.iterations} logs in {work}", flush=True)
    for iteration in range(args.start, args.start + args.iterations):
        plan: Plan
        if cluster is not None:
            plan = kube.plan_for(args.seed, iteration, fault=args.fault)
            outcome = await kube.run_iteration(plan, cluster, work)
        else:
            assert busybox is not None
            extra = {"snapshots": True} if args.snapshots else {}
            plan = plan_for(args.seed, iteration, scenario=args.scenario, fault=args.fault, **extra)
            outcome = await run_iteration(plan, busybox, work)
        outcomes.append(outcome)
        status = "FAIL" if outcome.failed else "ok"
        did = " ".join(f"{k}={v}" for k, v in sorted(outcome.activity.items()))
        print(
            f"[{len(outcomes)}/{args.iterations}] {status} {plan.describe()} "
            f"{outcome.summary()} ({did}; {outcome.seconds:.1f} s)",
            flush=True,
        )
    by_scenario: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_scenario[f"{outcome.plan.scenario}/{outcome.plan.fault}"].append(outcome)
    print("\nby scenario:")
    for name, group in sorted(by_scenario.items()):
        failed = sum(o.failed for o in group)
        print(
            f"  {name}: runs={len(group)} failed={failed} "
            f"leaked={sum(o.leaked_count for o in group)} lost={sum(len(o.lost) for o in group)} "
            f"untyped_errors={sum(len(o.untyped) for o in group)} "
            f"stuck={sum(len(o.stuck) for o in group)}"
        )
    failing = [o for o in outcomes if o.failed]
    if failing:
        print("\nfailing iterations:")
        for outcome in failing:
            print(outcome.details())
    print(
        f"iterations={len(outcomes)} leaked={sum(o.leaked_count for o in outcomes)} "
        f"lost={sum(len(o.lost) for o in outcomes)} "
        f"untyped_errors={sum(len(o.untyped) for o in outcomes)}"
    )
    return 1 if failing else 0


async def kube_snapshot_kills(args: argparse.Namespace, cluster: KubeCluster, work: Path) -> int:
    """Kubernetes, ``--snapshots``: pools killed mid-step (`tests.kube.snapshot_kills`)."""
    from tests.images import builders
    from tests.images.registry_server import missing_tools, push, start_registry
    from tests.kube import node_images
    from tests.kube.daemon_image import current_daemon_image
    from tests.kube.snapshot_kills import OPS, KillOutcome, plan_for, run_kill
    from tests.kube.support import BUSYBOX, Admin

    if not cluster.real_node:
        print("--snapshots on Kubernetes needs the harness's real node", file=sys.stderr)
        return 2
    registry = None
    base = ""
    ops = [op for op in OPS if op != "save-image"] if missing_tools() else list(OPS)
    if args.fault is not None and args.fault not in ops:
        print(f"--fault: one of {', '.join(ops)} with --snapshots", file=sys.stderr)
        return 2
    if "save-image" in ops:  # an image is made only of one in a registry
        registry = start_registry(work / "registry")
        busybox = builders.busybox_rootfs_tar(work / "busybox.tar").read_bytes()
        oci = builders.OciLayout()
        config = builders.image_config([builders.sha256(busybox)], user="", working_dir="/")
        oci.index.append(oci.image([busybox], config=config, annotations={builders.REF_NAME: "1"}))
        base = push(oci.write_dir(work / "layout"), "1", registry, "sandman-chaos/base")
    admin = Admin(cluster)
    outcomes: list[KillOutcome] = []
    print(f"chaos: seed={args.seed} iterations={args.iterations} logs in {work}", flush=True)
    try:
        with current_daemon_image(cluster) as daemon_image:
            for iteration in range(args.start, args.start + args.iterations):
                plan = plan_for(args.seed, iteration, op=args.fault, ops=ops)
                target = f"{registry.host}/sandman-chaos/saved-{iteration}:1" if registry else ""
                outcome = await run_kill(
                    plan, cluster, admin, daemon_image=daemon_image,
                    image=base if plan.op == "save-image" else BUSYBOX, target=target, work=work,
                )  # fmt: skip
                outcomes.append(outcome)
                status = "FAIL" if outcome.failed else "ok"
                print(
                    f"[{len(outcomes)}/{args.iterations}] {status} {plan.describe()} "
                    f"{outcome.summary()} ({outcome.seconds:.1f} s)",
                    flush=True,
                )
    finally:
        await admin.http.aclose()
        if registry is not None:
            registry.stop()
            node_images.remove(cluster, f"{registry.host}/")
        shutil.rmtree(work / "layout", ignore_errors=True)
        (work / "busybox.tar").unlink(missing_ok=True)
        if args.work is None and not any(work.iterdir()):
            work.rmdir()  # no failing run's log to keep
    by_step: dict[str, list[KillOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_step[f"{outcome.plan.op}/{outcome.plan.reaper}"].append(outcome)
    print("\nby scenario:")
    for name, group in sorted(by_step.items()):
        print(
            f"  kill-during-{name}: runs={len(group)} failed={sum(o.failed for o in group)} "
            f"leaked={sum(len(o.leaked) for o in group)} "
            f"missed={sum(o.missed for o in group)}"
        )
    failing = [o for o in outcomes if o.failed]
    if failing:
        print("\nfailing iterations:")
        for outcome in failing:
            print(outcome.details())
    print(
        f"iterations={len(outcomes)} leaked={sum(len(o.leaked) for o in outcomes)} "
        f"lost=0 untyped_errors=0 missed={sum(o.missed for o in outcomes)}"
    )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
