"""Session affinity: every turn of an episode to the same engine, so its prefix stays cached.

:class:`StickyRoutes` remembers which engine each routing key (an episode's session) went to.
A key's first request goes where the client's round-robin puts it (so new sessions spread
evenly over the engines), and every later one follows it there while that engine is live;
when it fails (the client marks it down) the key moves to the next live engine and stays there.
The client also sends the key as SGLang's router header (``X-SMG-Routing-Key``, which the
router's ``manual`` policy routes by); docs/rollout.md, "Prefix cache and session affinity".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

__all__ = ["ROUTING_KEY_HEADER", "StickyRoutes"]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class StickyRoutes:
    """Key -> engine URL, least recently used keys forgotten beyond ``capacity``."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[str, str] = OrderedDict()

    def route(self, key: str, usable: Callable[[str], bool], pick: Callable[[], str]) -> str:
        """``key``'s engine if ``usable``, else ``pick()``'s (remembered from now on)."""
        url = self._routes.get(key)
        if url is None or not usable(url):
            url = pick()
        self._routes[key] = url
        self._routes.move_to_end(key)
        if len(self._routes) > self.capacity:
            self._routes.popitem(last=False)
        return url

    def __len__(self) -> int:
        return len(self._routes)
