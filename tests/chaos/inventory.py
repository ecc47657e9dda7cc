"""What one chaos run holds on this host, found from the host's side, not the pool's.

A run (`Scope`) has a state directory, a cgroup parent and a pool-name prefix
nobody else uses, so everything found under them is the run's:

- ``container``: the runtime's containers (``crun --root <state>/runtime/crun list``);
- ``process``: processes in a cgroup under the run's parent (``sandmand`` is PID 1
  of each sandbox; anything else there is the workload), in any v1 hierarchy;
- ``watchdog``: a watchdog process of one of the run's pools;
- ``uid range``: a host uid range (`sandman.providers.local.userns`) held for one of
  the run's sandboxes;
- ``mount``: a mount, in any mount namespace, that names the state directory (a
  sandbox's overlay, a disk layer); ``disk mount`` / ``loop``: the state
  directory's btrfs filesystem and its loop device (`providers.local.disk`);
- ``cgroup``: a directory under the run's cgroup parent, in every hierarchy;
- ``netns`` / ``veth`` / ``nft``: a sandbox's network namespace, its host-side
  interface and its elements in the ``sandman`` nftables sets (names from
  `providers.local.network.names`, for every sandbox id the run has seen), and
  ``net alloc``: its allocation in ``<state>/network/alloc.json``;
- ``dir``: a sandbox directory under ``<state>/sandboxes``; ``disk layer``: a btrfs
  subvolume under ``<state>/disk``; ``runtime state``: the runtime's own record.

`take` lists them (blocking: run it in a thread from async code); `settle` waits,
with a deadline, until what is left is what the baseline had; `scrub` removes
whatever a run left so the next one starts clean.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sandman.providers.local import userns
from sandman.providers.local.network import NETNS_DIR, SYS_NET, TABLE, names

__all__ = ["Item", "Scope", "Tracker", "count", "describe", "scrub", "settle", "take"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_SANDBOX_ID = re.compile(r"\bsb-[0-9a-f]{12}\b")
_NFT_SETS = ("egress_ifs", "egress_deny", "egress_allow")


@dataclass(frozen=True)
class Scope:
    """The resources of one run: nobody else uses its state dir, cgroup parent or pool names."""

    state_dir: Path
    cgroup_parent: str
    pool_prefix: str
    runtime: str = "crun"

    @property
    def sandboxes(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def disk(self) -> Path:
        return self.state_dir / "disk"


@dataclass(frozen=True, order=True)
class Item:
    """One thing found on the host; ``sandbox`` is the id it belongs to ("" if none)."""

    kind: str
    name: str
    sandbox: str = ""

    def __str__(self) -> str:
        owner = f" [{self.sandbox}]" if self.sandbox and self.sandbox not in self.name else ""
        return f"{self.kind} {self.name}{owner}"


@dataclass
class Tracker:
    """Every sandbox id a run has seen (a netns is named by a hash of its id, so only
    known ids lead to it); fed by each `take` and by what clients report."""

    ids: set[str] = field(default_factory=set)

    def see(self, ids: Iterable[str]) -> None:
        self.ids.update(i for i in ids if i)


_GROUPS = {"disk mount": "the disk filesystem", "loop": "the disk filesystem"}


def _owner(item: Item) -> str:
    return item.sandbox or _GROUPS.get(item.kind, str(item))


def count(items: Iterable[Item]) -> int:
    """How many things leaked: each sandbox once, whatever it left (the disk
    filesystem and its loop device count as one), plus each other item."""
    return len({_owner(i) for i in items})


def describe(items: Iterable[Item]) -> list[str]:
    """One line per sandbox (or other owner): what it left."""
    by_owner: dict[str, list[Item]] = {}
    for item in sorted(items):
        by_owner.setdefault(_owner(item), []).append(item)
    lines = []
    for owner, found in sorted(by_owner.items()):
        kinds: dict[str, list[str]] = {}
        for item in found:
            kinds.setdefault(item.kind, []).append(item.name)
        parts = []
        for kind, named in kinds.items():
            if kind == "cgroup":
                parts.append(f"{len(named)} cgroups")
            elif kind == "dir":
                parts.append(f"dir [{named[0].rpartition(' [')[2]}")
            elif kind in ("disk layer", "runtime state"):
                parts.append(kind)
            else:
                parts.append(f"{kind} {', '.join(named)}")
        if len(found) == 1 and owner == str(found[0]):
            lines.append(owner)
        else:
            lines.append(f"{owner}: {'; '.join(parts)}")
    return lines


def take(scope: Scope, tracker: Tracker | None = None) -> list[Item]:
    """Everything of ``scope`` on the host now, sorted; feeds ``tracker`` the ids seen."""
    tracker = tracker if tracker is not None else Tracker()
    found: list[Item] = []
    found += _dirs(scope)
    found += _containers(scope)
    found += _cgroups(scope)
    found += _processes_and_mounts(scope)
    found += _disk(scope)
    allocated = _allocations(scope)
    found += allocated
    found += _id_ranges(scope)
    tracker.see(i.sandbox for i in found)
    found += _networks(tracker.ids)
    found += _nft(tracker.ids)
    return sorted(set(found))


def _dirs(scope: Scope) -> list[Item]:
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        found += [
            Item("dir", f"{e.path} [{_listing(e.path)}]", e.name)
            for e in os.scandir(scope.sandboxes)
        ]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        found += [
            Item("snapshot", f"{e.path} [{_listing(e.path)}]", e.name)
            for e in os.scandir(scope.state_dir / "snapshots")
        ]
    runtime = scope.state_dir / "runtime" / scope.runtime
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        found += [Item("runtime state", e.path, e.name) for e in os.scandir(runtime)]
    return found


def _listing(path: str) -> str:
    """What a sandbox directory holds (a stray one's content tells how it came to stay)."""
    try:
        return " ".join(sorted(os.listdir(path))) or "empty"
    except OSError as exc:
        return exc.strerror or "unreadable"


def _containers(scope: Scope) -> list[Item]:
    root = scope.state_dir / "runtime" / scope.runtime
    binary = shutil.which(scope.runtime)
    if binary is None or not root.is_dir():
        return []
    done = subprocess.run(
        [binary, "--root", str(root), "list", "--format", "json"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return [Item("container", f"(list failed: {done.stderr.strip()[:200]})")]
    entries = json.loads(done.stdout or "[]") or []
    return [Item("container", f"{e['id']} {e['status']}", e["id"]) for e in entries]


def cgroup_dirs(parent: str) -> list[Path]:
    """The directories of cgroup parent ``parent`` in each hierarchy that has it."""
    return [d for h in CGROUP_ROOT.iterdir() if (d := h / parent.strip("/")).is_dir()]


def _cgroups(scope: Scope) -> list[Item]:
    found = []
    for parent in cgroup_dirs(scope.cgroup_parent):
        with contextlib.suppress(FileNotFoundError):
            found += [Item("cgroup", e.path, e.name) for e in os.scandir(parent) if e.is_dir()]
    return found


def _processes_and_mounts(scope: Scope) -> list[Item]:
    """Processes in the run's cgroups or watching its pools, and mounts (per mount
    namespace) that name its state directory."""
    found: list[Item] = []
    parent = ":" + scope.cgroup_parent.rstrip("/") + "/"
    state = str(scope.state_dir)
    disk = str(scope.disk)
    prefix = scope.pool_prefix.encode()
    namespaces: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cgroups = (proc / "cgroup").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        sid = ""  # the sandbox whose cgroup holds the process, if any
        if parent in cgroups:
            for line in cgroups.splitlines():
                _, _, path = line.partition(":" + scope.cgroup_parent.rstrip("/") + "/")
                if path:
                    sid = path.split("/")[0]
                    break
            found.append(Item("process", f"pid {proc.name} {_comm(proc)}", sid))
        if b"sandman.client.watchdog" in cmdline and prefix in cmdline:
            pool = next((a for a in cmdline.split(b"\0") if a.startswith(prefix)), b"")
            found.append(Item("watchdog", f"pid {proc.name} of {pool.decode()}"))
        try:
            namespace = os.readlink(proc / "ns" / "mnt")
        except OSError:
            continue
        if namespace in namespaces:
            continue
        try:
            mountinfo = (proc / "mountinfo").read_text()
        except OSError:
            continue
        namespaces.add(namespace)
        if state not in mountinfo:
            continue
        host = namespace == _own_namespace()
        for line in mountinfo.splitlines():
            if state not in line:
                continue
            fields = line.split()
            point = fields[4]
            if host and point == disk:
                found.append(Item("disk mount", point))
                continue
            match = _SANDBOX_ID.search(line)
            fstype = fields[fields.index("-") + 1] if "-" in fields else "?"
            where = "" if host else f" in {namespace} (pid {proc.name})"
            # A mount in a sandbox's namespace that names no sandbox (the masked
            # directories' bind of <state>/empty) is that sandbox's.
            owner = match.group(0) if match else "" if host else sid
            found.append(Item("mount", f"{point} ({fstype}){where}", owner))
    return found


_OWN: list[str] = []


def _own_namespace() -> str:
    if not _OWN:
        _OWN.append(os.readlink("/proc/self/ns/mnt"))
    return _OWN[0]


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return "?"


def _disk(scope: Scope) -> list[Item]:
    found = []
    image = scope.state_dir / "disk.img"
    if _is_mount(scope.disk):
        with contextlib.suppress(OSError):
            found += [
                Item("disk layer", e.path, e.name)
                for e in os.scandir(scope.disk)
                if _SANDBOX_ID.fullmatch(e.name)
            ]
        with contextlib.suppress(OSError):
            found += [
                Item("snapshot layer", e.path, e.name)
                for e in os.scandir(scope.disk / ".snapshots")
            ]
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip().removesuffix(" (deleted)") == str(image):
                found.append(Item("loop", f"{backing.parent.parent.name} of {image}"))
    return found


def _is_mount(path: Path) -> bool:
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:
        return False


def _allocations(scope: Scope) -> list[Item]:
    path = scope.state_dir / "network" / "alloc.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [Item("net alloc", sid, sid) for sid in state.get("attachments", {})]


def _id_ranges(scope: Scope) -> list[Item]:
    """Host uid ranges (`userns.REGISTRY`) still held for a sandbox of the run."""
    found = []
    prefix = f"{scope.sandboxes.resolve()}/"
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(userns.REGISTRY):
            # A slot no longer held (`userns.held`) is free: the provider takes it again.
            if not entry.name.isdigit() or not userns.held(int(entry.name)):
                continue
            holder = userns.holder(int(entry.name))
            if holder is not None and holder.startswith(prefix):
                sid = holder.removeprefix(prefix)
                found.append(Item("uid range", f"slot {entry.name}", sid))
    return found


def _networks(ids: Iterable[str]) -> list[Item]:
    found = []
    for sid in ids:
        netns, host_if = names(sid)
        if (NETNS_DIR / netns).exists():
            found.append(Item("netns", netns, sid))
        if (SYS_NET / host_if).exists():
            found.append(Item("veth", host_if, sid))
    return found


def _nft(ids: Iterable[str]) -> list[Item]:
    by_if = {names(sid)[1]: sid for sid in ids}
    if not by_if or shutil.which("nft") is None:
        return []
    found = []
    for which in _NFT_SETS:
        done = subprocess.run(
            ["nft", "list", "set", "inet", TABLE, which],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            continue  # no table (nothing of anyone's): no elements either
        for host_if, sid in by_if.items():
            hits = done.stdout.count(f'"{host_if}"')
            if hits:
                found.append(Item("nft", f"{which} {host_if} x{hits}", sid))
    return found


def settle(
    scope: Scope,
    tracker: Tracker,
    *,
    baseline: Iterable[Item] = (),
    timeout: float = 20.0,
    interval: float = 0.2,
) -> list[Item]:
    """Wait until what ``scope`` holds is (within) ``baseline``, at most ``timeout``
    seconds; returns what is left beyond it (empty: settled)."""
    base = set(baseline)
    deadline = time.monotonic() + timeout
    while True:
        left = [item for item in take(scope, tracker) if item not in base]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(interval)


def scrub(scope: Scope, tracker: Tracker, baseline: Iterable[Item] = ()) -> list[Item]:
    """Remove whatever the run left (blocking): every known sandbox through the provider,
    stray processes, the disk filesystem, the cgroup parent. Returns what is still left
    beyond ``baseline``."""
    baseline = list(baseline)
    import asyncio

    from sandman.providers.local import LocalProvider
    from sandman.providers.local.host import remove_cgroup_parent
    from sandman.settings import LocalConfig

    for item in take(scope, tracker):
        if item.kind in ("process", "watchdog"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(item.name.split()[1]), signal.SIGKILL)

    async def delete_all() -> None:
        provider = LocalProvider(
            LocalConfig(state_dir=scope.state_dir, cgroup_parent=scope.cgroup_parent)
        )
        ids = set(tracker.ids)
        with contextlib.suppress(Exception):
            ids |= {info.id for info in await provider.list()}
        for sid in sorted(ids):
            with contextlib.suppress(Exception):
                await provider.delete(sid)
        with contextlib.suppress(Exception):
            for snapshot in await provider.snapshots():
                await provider.delete_snapshot(snapshot.id)
        with contextlib.suppress(Exception):
            await provider.network.reset()
        with contextlib.suppress(Exception):
            await provider.aclose()

    if scope.state_dir.exists():
        asyncio.run(delete_all())
    # Elements of a sandbox whose network record is gone: teardown no longer knows them.
    _drop_elements({names(sid)[1] for sid in tracker.ids})
    left = settle(scope, tracker, baseline=baseline, timeout=5)
    if left:
        # What the provider could not delete (a disk filesystem gone read-only...): by force.
        subprocess.run(["umount", "-l", str(scope.disk)], capture_output=True, check=False)
        for directory in (
            scope.sandboxes,
            scope.state_dir / "snapshots",
            scope.state_dir / "runtime",
            scope.disk,
        ):
            shutil.rmtree(directory, ignore_errors=True)
        left = settle(scope, tracker, baseline=baseline, timeout=10)
    remove_cgroup_parent(scope.cgroup_parent)
    return left


def _drop_elements(interfaces: set[str]) -> None:
    """Delete the elements of ``interfaces`` from the ``sandman`` nftables sets."""
    for which in _NFT_SETS:
        done = subprocess.run(
            ["nft", "-j", "list", "set", "inet", TABLE, which],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            continue
        for entry in json.loads(done.stdout)["nftables"]:
            for element in entry.get("set", {}).get("elem", []):
                text = _element(element)
                if text is not None and text.split(" . ")[0].strip('"') in interfaces:
                    subprocess.run(
                        ["nft", "delete", "element", "inet", TABLE, which, f"{{ {text} }}"],
                        capture_output=True, timeout=30, check=False,
                    )  # fmt: skip


def _element(element: object) -> str | None:
    """An element of ``nft -j`` output in nft's own syntax (the forms our sets hold)."""
    if isinstance(element, str):
        return json.dumps(element)
    if isinstance(element, dict) and "concat" in element:
        parts = [_element(part) for part in element["concat"]]
        return None if None in parts else " . ".join(str(p) for p in parts)
    if isinstance(element, dict) and "prefix" in element:
        return f"{element['prefix']['addr']}/{element['prefix']['len']}"
    if isinstance(element, dict) and "range" in element:
        low, high = element["range"]
        return f"{low}-{high}"
    return None
