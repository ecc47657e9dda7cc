"""The pool: pacing, readiness, leases, ownership, reconciliation and warm spares."""

from sandman.pool.events import EventHook, EventLog, PoolEvent
from sandman.pool.pacing import Pacer, PacingConfig
from sandman.pool.pool import Pool, PoolConfig, PoolHealth
from sandman.pool.records import Record
from sandman.pool.tally import Tally

__all__ = [
    "EventHook",
    "EventLog",
    "Pacer",
    "PacingConfig",
    "Pool",
    "PoolConfig",
    "PoolEvent",
    "PoolHealth",
    "Record",
    "Tally",
]
