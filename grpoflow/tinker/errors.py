"""The service's refusal of a request, as its HTTP answer."""

from __future__ import annotations

__all__ = ["ApiError"]


class ApiError(Exception):
    """A refused submission: answered ``status`` with ``{"detail": message}`` (never 402 or
    409, which the SDK retries for minutes; docs/tinker-protocol.md, section 2)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message
