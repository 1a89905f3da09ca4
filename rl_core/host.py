"""This host's processes and ports: is a pid alive, which TCP port is free (a leaf module)."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """True while some process has ``pid`` (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks; another process may race us)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
