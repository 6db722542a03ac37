"""Helpers shared by every test package (unit, integration, e2e)."""

from __future__ import annotations

from app.embedded_services import free_port

__all__ = ["admin_env", "free_port"]


def admin_env() -> dict[str, str]:
    """The admin API of a test broker on a free port: the default (18083) would be
    taken by the first of several brokers a test runs."""
    return {"DEVICEMQ_ADMIN_PORT": str(free_port("127.0.0.1"))}
