"""Configuration objects. Library code takes these as arguments; only the CLI and
the server read them from the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LocalConfig"]


class LocalConfig(BaseModel):
    """The local provider: containers run by an OCI runtime on this machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["local"] = "local"
    state_dir: Path = Path("/var/lib/sandman")
    """Images, sandboxes and the runtime's state live under here."""
    runtime: Literal["crun", "runc"] = "crun"
    """Which OCI runtime runs the containers."""
    runtime_path: str | None = None
    """The runtime binary; default: ``runtime`` looked up on PATH."""
    cgroup_parent: str = Field(default="/sandman", pattern=r"^/[A-Za-z0-9_./-]*$")
    """Every sandbox's cgroup is ``<cgroup_parent>/<sandbox id>`` in each hierarchy."""
    daemon_path: Path | None = None
    """The sandmand binary mounted into sandboxes; default: the one built with this package."""
    stop_timeout: float = Field(default=10.0, gt=0)
    """How long a runtime command may take before it counts as failed."""
    subnet: str = "10.200.0.0/16"
    """Sandboxes with network ``isolated`` or ``egress`` each get a /30 from here."""
    uplink: str | None = None
    """The interface ``egress`` sandboxes are NATed out of; default: the default route's."""
