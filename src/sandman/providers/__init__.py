"""Backends that turn a SandboxSpec into a running sandbox: ``local`` (crun) and, later, ``kubernetes``."""

from sandman.providers.base import DaemonEndpoint, Provider, SandboxInfo, SandboxState

__all__ = ["DaemonEndpoint", "Provider", "SandboxInfo", "SandboxState"]
