"""The SDK: one async implementation (`AsyncClient`, `AsyncSandbox`) and its blocking facade,
over an in-process pool (`local`, `kubernetes`) or the HTTP service (`connect`)."""

from sandman.client._async import AsyncClient, AsyncSandbox
from sandman.client._sync import Client, Sandbox
from sandman.client.backends import Backend, InProcessBackend, Lease
from sandman.client.local import kubernetes, kubernetes_sync, local, local_sync
from sandman.client.remote import RemoteBackend, connect, connect_sync

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "Backend",
    "Client",
    "InProcessBackend",
    "Lease",
    "RemoteBackend",
    "Sandbox",
    "connect",
    "connect_sync",
    "kubernetes",
    "kubernetes_sync",
    "local",
    "local_sync",
]
