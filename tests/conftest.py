"""Helpers shared by every test package (unit, integration, e2e)."""

from __future__ import annotations

from app.embedded_services import free_port

__all__ = ["free_port"]
