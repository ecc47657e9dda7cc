"""Backends that turn a SandboxSpec into a running sandbox: ``local`` (crun, runc or gVisor) and ``kubernetes`` (pods)."""

from sandman.providers.base import DaemonEndpoint, Provider, SandboxInfo, SandboxState

__all__ = ["DaemonEndpoint", "Provider", "SandboxInfo", "SandboxState"]
