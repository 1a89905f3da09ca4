"""The sampling side of :class:`~rl_core.tinker.backend.LoraBackend`: one
:class:`~rl_core.engine.core.EmbeddedEngine` per base model and the adapters it holds.

:class:`SamplingEngine` is safe to call from several threads at once: each call submits its
requests to the one engine and waits for them (``background=False``: the waiting threads take
turns driving the engine's scheduler, and the one driving runs every thread's requests), so
requests of several tenants meet in the engine's batches (up to ``max_loras_per_batch``
adapters in one). Engine creation and adapter loads happen under one lock; an adapter is held
(:meth:`SamplingEngine.using`) while a request uses it and never unloaded under it: the least
recently used adapters past ``max_loaded_adapters`` are unloaded only when no request uses
them, and an adapter replaced by a newer version of its files once its last user is done.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rl_core.tinker import TinkerError

__all__ = ["SamplingEngine"]


class SamplingEngine:
    """``path``'s engine (created on first use with ``kwargs()``) and its adapters, by
    directory; ``max_loaded()``: adapters kept loaded; ``new_name()``: a fresh engine name;
    ``threads()``: set torch's thread count before the work."""

    def __init__(self, path: Path, kwargs: Callable[[], Mapping[str, Any]],
                 max_loaded: Callable[[], int], new_name: Callable[[], str],
                 threads: Callable[[], None]) -> None:
        self.path, self._kwargs, self._max_loaded = path, kwargs, max_loaded
        self._new_name, self._threads = new_name, threads
        self.engine: Any = None  # EmbeddedEngine
        # adapter directory -> (engine name, the files' stamp), least recently used first
        self.loras: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._lock = threading.RLock()
        self._pins: dict[str, int] = {}  # engine name -> requests in flight using it
        self._retired: set[str] = set()  # replaced: unloaded when its last request ends

    def get(self) -> Any:  # noqa: ANN401 - EmbeddedEngine, imported lazily
        """The engine, created on first use."""
        with self._lock:
            if self.engine is None:
                from rl_core.engine.core import EmbeddedEngine

                self._threads()
                self.engine = EmbeddedEngine(self.path, **self._kwargs())
            return self.engine

    @contextlib.contextmanager
    def using(self, adapter_dir: Path | None) -> Iterator[str | None]:
        """The engine's name for the adapter in ``adapter_dir`` (None: the base model), held
        until the block ends."""
        name = self._acquire(adapter_dir)
        try:
            yield name
        finally:
            if name is not None:
                with self._lock:
                    self._pins[name] -= 1
                    if not self._pins[name]:
                        del self._pins[name]
                        if name in self._retired:
                            self._retired.discard(name)
                            self._unload(name)

    def generate(self, reqs: Sequence[Any]) -> list[Any]:
        """Run ``reqs`` (all or none) with whatever else the engine has; their outputs."""
        self._threads()
        try:
            outs = self.get().generate_sync(reqs)
        except ValueError as e:  # EngineRequestError, AdapterError: the request's fault
            raise TinkerError(str(e)) from None
        for o in outs:
            if o.finish_reason.get("type") == "abort":
                raise TinkerError(f"generation aborted: {o.finish_reason.get('message')}")
        return outs

    def close(self) -> None:
        """Stop the engine (a later call starts a new one)."""
        with self._lock:
            if self.engine is not None:
                self.engine.close()
            self.engine = None
            self.loras.clear()
            self._pins.clear()
            self._retired.clear()

    def _unload(self, name: str) -> None:
        """Unload ``name`` now, or once no request uses it."""
        if self._pins.get(name):
            self._retired.add(name)
        elif self.engine is not None:
            self.engine.unload_lora_adapter(name)

    def _acquire(self, adapter_dir: Path | None) -> str | None:
        """Load (once per version of its files: path, mtime, size, inode) and hold the
        adapter in ``adapter_dir``; unload the least recently used ones not in use past
        ``max_loaded()``."""
        if adapter_dir is None:
            return None
        from rl_core.engine.lora import AdapterError

        path = Path(adapter_dir).resolve()
        weights, config = path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG
        if not weights.is_file() or not config.is_file():
            raise TinkerError(f"{adapter_dir}: no adapter there (expected {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS})")
        stats = [weights.stat(), config.stat()]
        stamp = tuple(x for st in stats for x in (st.st_mtime_ns, st.st_size, st.st_ino))
        key = str(path)
        with self._lock:
            engine = self.get()
            if key in self.loras:
                name, old = self.loras[key]
                if old == stamp:
                    self.loras.move_to_end(key)
                    self._pins[name] = self._pins.get(name, 0) + 1
                    return name
                del self.loras[key]
                self._unload(name)
            name = self._new_name()
            try:
                engine.load_lora_adapter(name, path)
            except (AdapterError, ValueError) as e:
                raise TinkerError(str(e)) from None
            self.loras[key] = (name, stamp)
            self._pins[name] = self._pins.get(name, 0) + 1
            excess = len(self.loras) - self._max_loaded()
            for old_key, (old_name, _) in list(self.loras.items()):
                if excess <= 0:
                    break
                if not self._pins.get(old_name):  # one in use stays until a later load
                    del self.loras[old_key]
                    engine.unload_lora_adapter(old_name)
                    excess -= 1
            return name
