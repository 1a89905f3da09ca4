"""Errors that cross layers (a leaf module): what an engine request raises, so that callers
below the rollout package (the judge) can tell a refused request from a failed one."""

from __future__ import annotations

__all__ = ["RolloutError", "RolloutRequestError"]


class RolloutError(RuntimeError):
    """A rollout-plane request that did not produce an answer."""


class RolloutRequestError(RolloutError):
    """The server rejected the request (HTTP 4xx, or ``success: false``); not retried."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message
