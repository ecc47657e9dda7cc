"""The Python side of the in-sandbox daemon: its binary, protocol and client."""

from sandman.daemon.binary import daemon_path
from sandman.daemon.client import DaemonClient
from sandman.daemon.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "DaemonClient", "daemon_path"]
