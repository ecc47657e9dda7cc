"""What a failed create says: its kind, for the pacer, and its cause, for a table.

Pure: an exception in, words out.
"""

from __future__ import annotations

from sandman import errors
from sandman.pool.pacing import FailureKind

__all__ = ["cause", "classify"]


def cause(exc: BaseException) -> str:
    """What failed, in a word a table can show: the exception's name in snake case
    (``ImageNotFound`` -> ``image_not_found``)."""
    name = type(exc).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def classify(exc: BaseException) -> tuple[FailureKind, float | None]:
    """The kind of failure (backend strain slows creation down; `Pacer.on_failed`) and
    the seconds the backend asked to wait, if it did."""
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(exc, errors.ThrottledError):
        return "throttled", retry_after
    if isinstance(exc, errors.CapacityError):
        return "capacity", retry_after
    if isinstance(exc, TimeoutError):
        return "timeout", None
    if isinstance(exc, errors.ImageError):
        # The caller's mistake (a typo in an image name), not backend strain:
        # it must not slow creation down for every other tenant.
        return "other", None
    if isinstance(exc, errors.ProviderError | errors.DaemonUnavailable):
        return "server_error", None
    return "other", None
