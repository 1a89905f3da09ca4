"""Session affinity: every turn of an episode to the same engine, so its prefix stays cached.

:func:`affinity_order` ranks engines for a routing key by rendezvous (highest-random-weight)
hashing: a key's first choice never changes while its engine lives, and when it dies only that
engine's keys move (to each key's next choice). The client routes a keyed request to the first
live engine of its order and sends the key as SGLang's router header (``X-SMG-Routing-Key``,
read by the router's ``manual`` policy); docs/rollout.md, "Prefix cache and session affinity".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["ROUTING_KEY_HEADER", "affinity_order"]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def affinity_order(key: str, urls: Sequence[str]) -> list[str]:
    """``urls`` in ``key``'s order of preference (the same on every call and process)."""
    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()

    return sorted(urls, key=weight, reverse=True)
