"""The one line ``devicemq run`` prints when a start fails for a reason the user can
fix (a backend that does not answer, a port in use), for one broker (app/cli.py)
and for a worker telling its supervisor (app/workers.py)."""

from __future__ import annotations

import errno

from broker.config import ConfigError, Settings


def startup_error(settings: Settings, error: BaseException) -> str | None:
    """The one line ``devicemq run`` prints for an error that stops a start (a backend
    that does not answer, a port in use), or None for one that is a bug."""
    from app.admin import AdminUnavailable
    from app.embedded_services import ServiceError
    from app.metrics import MetricsUnavailable
    from persistence.device_persistence import PersistenceUnavailable
    from persistence.integration_sink import IntegrationUnavailable

    known = (
        PersistenceUnavailable
        | IntegrationUnavailable
        | ServiceError
        | MetricsUnavailable
        | AdminUnavailable
    )
    if isinstance(error, known | ConfigError):
        return str(error)
    if isinstance(error, OSError) and error.errno in (
        errno.EADDRINUSE,
        errno.EADDRNOTAVAIL,
        errno.EACCES,
    ):
        from edge.listeners import effective_host

        where = f"{effective_host(settings, settings.listener.host)}:{settings.listener.port}"
        return f"cannot listen on {where}: {error.strerror}"
    return None
