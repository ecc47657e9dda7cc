"""The controlled conditions an evaluation runs under; every field is recorded in its verdict."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandman.models import Bytes, NetworkMode

__all__ = ["DEFAULT_ENV", "Conditions"]

DEFAULT_ENV: dict[str, str] = {
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TZ": "UTC",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
"""The variables every evaluation sets: a fixed locale, time zone and hash seed."""


class Conditions(BaseModel):
    """Limits and environment of the fresh sandbox each evaluation gets.

    ``cpu`` (cores) and ``memory`` (bytes, ``"2Gi"`` works) are hard cgroup
    limits; ``network`` is off (``"none"``: loopback only) unless set;
    ``timeout`` is the wall-clock limit of the test run, after which its
    whole process group is killed; ``env`` replaces `DEFAULT_ENV`.
    ``audit``: what the verdict's ``suspicious`` lists (leads from the
    patch's text, and what the run did) is only recorded with ``"record"``;
    with ``"strict"`` (the default) a run that did what only a forging patch
    does — code the patch changed reaching into the test framework, other
    processes' descriptors or the grader's files; the test process ending
    before its framework finished; output claiming passes the framework did
    not report — is graded unresolved.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: float = Field(default=1.0, gt=0, le=1024)
    memory: Bytes = Field(default=2 * 2**30, ge=64 * 2**20)
    pids: int = Field(default=1024, ge=16)
    network: NetworkMode = "none"
    timeout: float = Field(default=1800.0, gt=0)
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ENV))
    audit: Literal["record", "strict"] = "strict"
