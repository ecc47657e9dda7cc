"""The HTTP service: many client processes share one `Pool` through it.

```python
import uvicorn

from sandman.pool import Pool
from sandman.server import ApiKey, ServerSettings, create_app

settings = ServerSettings(api_keys=[ApiKey(tenant="team-a", key="...")])
uvicorn.run(create_app(Pool(provider), settings), host="0.0.0.0", port=8000)
```

Clients use ``sandman.connect(url, api_key=...)``. Needs the ``server`` extra
(``pip install 'sandman-rl[server]'``).
"""

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "sandman.server needs the server extra: pip install 'sandman-rl[server]'"
    ) from exc

from sandman.server.app import create_app, service_of
from sandman.server.errors import STATUS, ApiError
from sandman.server.metrics import Metrics
from sandman.server.service import LABEL_TENANT, Service
from sandman.server.settings import ApiKey, ServerSettings, TenantLimits, WarmSpares

__all__ = [
    "LABEL_TENANT",
    "STATUS",
    "ApiError",
    "ApiKey",
    "Metrics",
    "ServerSettings",
    "Service",
    "TenantLimits",
    "WarmSpares",
    "create_app",
    "service_of",
]
