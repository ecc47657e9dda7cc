"""HTTP for the daemon client and the service client: one seam, two implementations.

- `base`: the seam (`AsyncTransport`, `ResponseStream`, `Response`), its
  errors (`ConnectionLost`, `UntrustedPeer`) and the unix-socket peer check;
- `lean`: the hand-written HTTP/1.1 of the hot path (`HTTPTransport`);
- `bridge`: any httpx transport behind the seam (`HttpxTransport`), imported
  on its own so that the daemon client never loads httpx.

Private: users reach it through ``DaemonClient(transport=...)`` and
``sandman.connect(..., transport=...)``.
"""

from sandman._transport.base import (
    AsyncTransport,
    ConnectionLost,
    Response,
    ResponseStream,
    UntrustedPeer,
    check_peer,
    iter_lines,
)
from sandman._transport.lean import HTTPTransport

__all__ = [
    "AsyncTransport",
    "ConnectionLost",
    "HTTPTransport",
    "Response",
    "ResponseStream",
    "UntrustedPeer",
    "check_peer",
    "iter_lines",
]
