"""Megatron-core on a machine without CUDA: the few hard-coded CUDA calls, redirected.

megatron-core's pure-PyTorch layer spec computes correctly on CPU over gloo, but about ten
call sites assume a CUDA device (measured on 0.16.1; ``../shared/reference/megatron-cpu.md``
lists each one). This module redirects exactly those, and only when CUDA is absent: on a
GPU machine :func:`install` and :func:`cuda_free` do nothing.

- :func:`install` (process-wide, idempotent): the RNG tracker's CUDA generator becomes the
  CPU default generator, ``torch.cuda.current_device`` answers ``"cpu"`` (RoPE's
  ``inv_freq``, DDP's and TP's buffers), and ``torch.cuda.synchronize`` / ``current_stream``
  become no-ops (pipeline p2p, checkpoint writes, the grad-sync stream), as do
  ``torch.cuda.Stream`` / ``torch.cuda.stream`` (the MoE all-to-all token dispatcher's
  device-to-host side stream), and that dispatcher's split sizes become numpy arrays, as its
  device-to-host copy makes them on GPUs. These would raise on this machine anyway, so nothing
  else that worked changes.
- :func:`fix_moe_without_te` (every platform, idempotent): megatron-core 0.16.1's MoE router
  gating (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm is not None``, a
  name bound only when Transformer Engine imports; without TE it raises ``NameError``. It binds
  the name to ``None`` (the plain ``torch.mm`` path), on GPUs too: the local spec has no TE.
- :func:`cuda_free` (a context manager around megatron's optimizer and DDP calls): a
  ``TorchFunctionMode`` making ``device='cuda'`` tensors CPU tensors (optimizer scale and
  overflow buffers, ``clip_grads``' norm buffers), ``Tensor.cuda()`` a no-op, and
  ``Tensor.type()`` answer ``torch.cuda.FloatTensor`` for CPU tensors (``clip_grads`` and the
  mixed-precision optimizer compare type strings). It lies about types, so it is scoped: torch
  function modes are per thread, and only the trainer's own calls run inside it.

It depends on private names of ``megatron.core.tensor_parallel.random``; the version is
pinned (``megatron-core==0.16.1``, the newest that installs on Python 3.11), and
:func:`install` fails loudly if those names move.
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
