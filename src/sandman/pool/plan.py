"""What a reconcile pass decides, apart from doing it: listings in, actions out.

`plan_reconcile` is pure. It reads what the provider listed, which ids the pool already
knows, and who is alive, and says which unknown sandboxes to adopt (leased to their
recorded session), which to delete as orphans, and which sessions another live
process of this pool's name holds. `Reconciler.reconcile` (`sandman.pool.reconcile`)
does the listing before it and the applying after it; `tests/pool/test_plan.py` holds
the decisions as a table.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from sandman.pool import owner as owners
from sandman.pool.records import LABEL_EXPIRES, LABEL_POOL, LABEL_SESSION
from sandman.providers.base import OwnerStatus, SandboxInfo

__all__ = ["Adopt", "Orphan", "ReconcilePlan", "plan_reconcile"]


@dataclass(frozen=True)
class Adopt:
    """Lease ``info`` to ``session`` (a predecessor's hand-over on record), as ours."""

    info: SandboxInfo
    session: str
    expires: float


@dataclass(frozen=True)
class Orphan:
    """Delete ``info``: nobody will ever hold it."""

    info: SandboxInfo
    reason: str
    expires: float = 0.0


@dataclass
class ReconcilePlan:
    adopt: list[Adopt] = field(default_factory=list)
    orphan: list[Orphan] = field(default_factory=list)
    elsewhere: dict[str, dict[str, str]] = field(default_factory=dict)
    """Session -> the labels of one of its sandboxes that another live process of this
    pool's name holds (`Pool.held_elsewhere`)."""


def expires_of(info: SandboxInfo) -> float:
    """The sandbox's recorded expiry (0: none, or unreadable: expired)."""
    try:
        return float(info.labels.get(LABEL_EXPIRES, "0"))
    except ValueError:
        return 0.0


def plan_reconcile(
    infos: Iterable[SandboxInfo],
    *,
    known: Container[str],
    pool: str,
    owner: str,
    liveness: Callable[[str], OwnerStatus],
    now: float,
    adopt: bool,
    judge: bool,
    stray_grace: float,
) -> ReconcilePlan:
    """The actions for the sandboxes in ``infos`` that ``known`` does not hold.

    - Another pool's (or nobody's): deleted only if certainly abandoned, its owner dead,
      or no record at all for longer than ``stray_grace``.
    - This pool's name, owned by another live process: left alone (its sessions noted).
    - Otherwise, with ``adopt``: adopted if it runs, has not expired and its hand-over
      is on record, and (unless ``judge``, the first pass, when every owner was judged)
      its owner is judged dead now. Every other one is an orphan.
    """
    plan = ReconcilePlan()
    for info in infos:
        if info.id in known:
            continue
        holder = info.labels.get(owners.LABEL_OWNER)
        status = liveness(holder) if holder is not None and holder != owner else None
        if info.labels.get(LABEL_POOL) != pool:
            if status == "dead":
                reason = f"owner {owners.describe(holder or '')} is dead"
                plan.orphan.append(Orphan(info, reason))
            elif (
                not info.labels and info.state == "unknown" and now - info.created_at > stray_grace
            ):
                plan.orphan.append(Orphan(info, "no record"))
            continue
        session = info.labels.get(LABEL_SESSION)
        if status == "alive":
            # A pool of the same name in another live process: its own (a predecessor
            # that may leave its sessions to this one).
            if session:
                plan.elsewhere.setdefault(session, info.labels)
            continue
        expires = expires_of(info)
        adoptable = judge or status == "dead"
        if adopt and adoptable and info.state == "running" and expires > now and session:
            plan.adopt.append(Adopt(info, session, expires))
        else:
            reason = "orphan" if session else "orphan, never handed over"
            plan.orphan.append(Orphan(info, reason, expires))
    return plan
