"""Megatron-core on a machine without CUDA: the few hard-coded CUDA calls, redirected.

Only when CUDA is absent (on GPUs :func:`install` and :func:`cuda_free` do nothing):
:func:`install` redirects the process-wide calls (RNG, current device, streams, the
all-to-all dispatcher's split sizes); :func:`cuda_free` is a scoped ``TorchFunctionMode`` for
``device='cuda'``, ``.cuda()`` and ``Tensor.type()``. :func:`fix_moe_without_te` applies
everywhere. Private names of the pinned megatron-core 0.16.1: :func:`install` fails loudly if
they move. docs/megatron.md, "The CPU compatibility layer".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["active", "cuda_free", "fix_moe_without_te", "install"]

_lock = threading.Lock()
_installed = False

# Tensor.type() strings megatron compares against, by dtype.
_CUDA_TYPES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def active() -> bool:
    """Whether the redirection applies (no CUDA/ROCm device in this process)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Redirect megatron's process-wide CUDA calls to the CPU; True if it applied."""
    global _installed
    if not active():
        return False
    with _lock:
        if _installed:
            return True
        from megatron.core.tensor_parallel import random as mrandom

        for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
            if not hasattr(mrandom, name):
                raise RuntimeError(
                    f"megatron.core.tensor_parallel.random.{name} is gone: this megatron-core "
                    "is not the pinned one (0.16.1); rl_core/training/megatron/compat.py "
                    "needs updating for it")

        def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            state = torch.get_rng_state()
            return state.clone() if kwargs.get("clone") else state

        def set_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            torch.set_rng_state(new_state)

        mrandom._get_cuda_rng_state = torch.cuda.get_rng_state = get_state
        torch.cuda.random.get_rng_state = get_state
        mrandom._set_cuda_rng_state = torch.cuda.set_rng_state = set_state
        torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed) and None
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_stream = lambda *args, **kwargs: _NO_STREAM
        torch.cuda.Stream = lambda *args, **kwargs: _NO_STREAM  # type: ignore[misc]
        torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
        _split_sizes_as_numpy()
        _installed = True
        return True


class _NoStream:
    """What ``torch.cuda.current_stream()`` gives on CPU: waits that have nothing to wait for."""

    def wait_event(self, *args: Any) -> None: ...

    def wait_stream(self, *args: Any) -> None: ...

    def synchronize(self) -> None: ...

    def record_event(self, *args: Any) -> _NoStream:
        return self  # an "event" whose synchronize() has nothing to wait for


_NO_STREAM = _NoStream()  # one instance: megatron compares streams (``!=``)


def _split_sizes_as_numpy() -> None:
    """The all-to-all dispatcher moves its split sizes "to the CPU as numpy"
    (``maybe_move_tensor_to_cpu(..., as_numpy=True)``), which converts only CUDA tensors: on
    CPU they stay tensors, and ``all_to_all_single`` refuses tensor split sizes."""
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def fix_moe_without_te() -> None:
    """Bind ``moe_utils.te_general_gemm`` to None where Transformer Engine is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _is_cuda(device: Any) -> bool:
    return (device.type == "cuda" if isinstance(device, torch.device)
            else isinstance(device, str) and device.startswith("cuda"))


class _CudaFree(TorchFunctionMode):
    """``device='cuda'`` -> CPU, ``.cuda()`` -> self, ``.type()`` -> the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPES:
                return _CUDA_TYPES[tensor.dtype]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], *args[2:])
            if not args[1:] and not kwargs:
                return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_free() -> Iterator[None]:
    """Run megatron calls that hard-code CUDA on the CPU (nothing happens on GPUs)."""
    if not active():
        yield
        return
    install()
    with _CudaFree():
        yield
