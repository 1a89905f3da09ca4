"""Connectors: environments of the hubs people already use, as grpoflow environments.

What ``verifiers:<id>`` (:mod:`~rl_core.agents.verifiers_env`) and ``openenv:<spec>``
(:mod:`~rl_core.agents.openenv_env`) share: the optional-import check, the one background event
loop async hub code runs on, and bounded waits. A hub error, malformed answer or timeout is an
:class:`~rl_core.agents.env.EnvironmentFailure`: it costs the episode, never the step
(docs/agents.md, 'Environment hubs'). Never imports Prefect or MLflow; the hub packages are
imported only when a factory is made (the optional ``agents`` extra).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rl_core.agents.env import EnvironmentFailure

__all__ = ["ROLES", "hub_loop", "message_text", "require_hub", "wait_on_hub"]

T = TypeVar("T")
ROLES = ("system", "user", "assistant", "tool")


def require_hub(module: str, spec: str) -> Any:  # noqa: ANN401 (a module)
    """Import ``module`` or say how to install it (the optional ``agents`` extra)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"agent.env={spec!r} needs the `{module.split('.')[0]}` package ({e}); install "
            "grpoflow's environment-hub extra: pip install -e \".[agents]\"") from e


# ---------------------------------------------------------------------------- the event loop

class _Loop:
    """One daemon thread running the event loop every hub coroutine runs on (verifiers'
    episodes, the bridge, OpenEnv clients and servers), so async hub code keeps one loop."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = 0

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            # A forked child inherits the loop object but not its thread: start its own.
            if cls._loop is None or cls._loop.is_closed() or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="grpoflow-hub-loop",
                                 daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop


def hub_loop() -> asyncio.AbstractEventLoop:
    """The event loop hub coroutines run on (started on first use, per process)."""
    return _Loop.get()


def wait_on_hub(coro: Coroutine[Any, Any, T], timeout: float, what: str,
                knob: str = "call_timeout_s") -> T:
    """Run ``coro`` on the hub loop and wait at most ``timeout`` seconds for it; a late
    answer is cancelled and becomes a ``timeout`` failure naming ``what`` and ``knob``."""
    future = asyncio.run_coroutine_threadsafe(coro, hub_loop())
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise EnvironmentFailure("timeout", f"{what}: no answer within {timeout:g}s "
                                 f"(agent.env_args.{knob})") from None


def message_text(content: Any) -> str:  # noqa: ANN401
    """The text of an OpenAI message's content (a string or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)

