"""Choosing rendezvous ports for attempts."""

from __future__ import annotations

import socket
from typing import Protocol


class PortAllocator(Protocol):
    def __call__(self, host: str) -> int:
        """A TCP port that is free on ``host`` right now."""
        ...


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a free port on ``host``.

    Each attempt gets a new port, so a restart never collides with a rendezvous store that
    a dying rank still holds open.
    """
    bind_host = host if host in ("127.0.0.1", "localhost", "0.0.0.0") else "0.0.0.0"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_host, 0))
        return int(s.getsockname()[1])
