"""megatron-core's parallel state for the trainer: the TP x PP x DP (x EP) groups on the
rank's ``torch.distributed`` world, vocab-parallel log-probs (docs/megatron.md,
'Vocab-parallel log-probs') and the gradient finalisation the schedules call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["finalize_grads", "init_parallel", "mpu", "vocab_parallel_logprobs"]

_MASKED = -1e30  # padded vocabulary columns: exp() is 0, and 0 * _MASKED is 0 (not nan)


def mpu() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def init_parallel(tp: int, pp: int, device: torch.device, timeout_s: float = 600.0,
                  ep: int = 1) -> bool:
    """The default process group (one rank when none exists) and megatron's TP/PP/DP (and
    expert-parallel) groups; True when this call created the default group (its owner
    destroys it)."""
    ps = mpu()
    created = not dist.is_initialized()
    if created:
        # cluster.mode=local: this process is the only rank. Its store listens on loopback
        # only (an init_method URL would make torch's TCPStore listen on every interface).
        from rl_core.weight_sync.process_group import host_tcp_store

        timeout = timedelta(seconds=timeout_s)
        store = host_tcp_store("127.0.0.1", 0, 1, timeout=timeout, wait_for_workers=False)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                                world_size=1, timeout=timeout)
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size()) == (tp, pp, ep):
            return created
        ps.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp) or (world // pp) % ep:
        raise ValueError(f"train.megatron.tp * pp = {tp * pp} and ep = {ep} do not divide the "
                         f"{world} trainer ranks (ep must divide world / pp)")
    # Experts are never split by TP (expert_tensor_parallel_size 1): EP x expert-DP = world / pp,
    # so the expert-parallel groups may span TP ranks (megatron's "parallel folding").
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    return created


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab: int,
                            with_entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropies (B, T) from this TP rank's columns of
    float32, temperature-scaled logits (B, T, V_local); columns ``>= vocab`` are masked. One
    all-reduce over the TP group (docs/megatron.md, "Vocab-parallel log-probs")."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    ps = mpu()
    tp, local = ps.get_tensor_model_parallel_world_size(), logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local > vocab:
        pad = torch.arange(start, start + local, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, _MASKED)
    m = logits.detach().amax(-1)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - m.unsqueeze(-1)
    e = shifted.exp()
    idx = targets.long() - start
    inside = (idx >= 0) & (idx < local)
    z_y = shifted.gather(-1, idx.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * inside
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        ez = (e * shifted).sum(-1)
    sums = torch.stack([e.sum(-1), z_y, ez])
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    s, z_y, ez = sums.unbind(0)
    log_s = s.log()
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        entropy = log_s - ez / s
    return z_y - log_s, entropy


def finalize_grads(model: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron's grad finalisation (DP reduce, TP/PP ties) without dividing by the token
    count: every micro-batch's loss already is its share of the mini-batch."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)
