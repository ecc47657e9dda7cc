"""The service's routes, one router per resource (FastAPI's larger-application layout).

Each handler reaches the `Service` and its companions through the app's state
(`_deps`), never through a closure: `create_app` builds them once and stores
them on ``app.state``.
"""

from sandman.server.routes import (
    daemon,
    dashboard,
    operations,
    sandboxes,
    sessions,
    snapshots,
    warm,
)

ROUTERS = [
    sessions.router,
    sandboxes.router,
    snapshots.router,
    warm.router,
    daemon.router,
    operations.router,
    dashboard.router,
]
"""Every router, in the order the OpenAPI document lists them."""

__all__ = ["ROUTERS"]
