"""Whether a pid belongs to a running process (a leaf: no rl_core imports)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while some process has ``pid`` (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True
