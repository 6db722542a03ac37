"""Helpers shared by every test package (unit, integration, e2e)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; a race is possible
    but unlikely, since the OS hands out ephemeral ports round-robin)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
