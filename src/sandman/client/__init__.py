"""The SDK: one async implementation (`AsyncClient`, `AsyncSandbox`) and its blocking facade."""

from sandman.client._async import AsyncClient, AsyncSandbox
from sandman.client._sync import Client, Sandbox
from sandman.client.backends import Backend, InProcessBackend, Lease
from sandman.client.local import local, local_sync

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "Backend",
    "Client",
    "InProcessBackend",
    "Lease",
    "Sandbox",
    "local",
    "local_sync",
]
