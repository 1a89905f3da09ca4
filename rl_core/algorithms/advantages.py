"""Group-relative advantage estimators for GRPO-style training (pure torch math, no I/O).

Each sample's reward is compared with the others drawn for the same prompt (its *group*).
``rewards`` is (B,); groups are *contiguous* runs of ``group_size`` samples.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_MODES", "group_advantages"]

AdvantageMode = Literal["grpo", "drgrpo"]
ADVANTAGE_MODES: tuple[str, ...] = ("grpo", "drgrpo")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate ``rewards`` and reshape it to ``(num_groups, group_size)`` as floats."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {rewards.shape[0]} is not divisible by group_size {group_size}: groups "
            "must be contiguous runs of group_size samples of the same prompt")
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r.reshape(-1, group_size)


def group_advantages(
    rewards: Tensor, group_size: int, mode: AdvantageMode = "grpo", eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """Per-sample advantages: ``grpo`` (r - mean) / (unbiased std + eps), ``drgrpo`` r - mean
    (docs/training.md, "The loss, exactly"); a constant group gets exactly 0, never NaN.
    ``valid`` (B,) bool: samples False (an infrastructure failure: docs/agents.md, 'Failures
    are not rewards') take no part in their group's mean and std and get 0; a group with fewer
    than two valid samples (``grpo``) or none gets 0 everywhere. (B,) in ``rewards``' float
    dtype (float32 for int/bool). ValueError on a bad shape, B % group_size != 0,
    group_size < 2 for ``grpo`` or an unknown mode."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; allowed: {ADVANTAGE_MODES}")
    if mode == "grpo" and group_size < 2:
        raise ValueError(
            f"grpo advantages need group_size >= 2 (the unbiased std of one sample is "
            f"undefined), got {group_size}")
    r = _grouped(rewards, group_size)
    if valid is not None and not bool(valid.all()):
        if valid.shape != rewards.shape:
            raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
        return _masked(r, valid.reshape(r.shape).to(torch.bool), mode, eps).reshape(-1)
    adv = r - r.mean(dim=1, keepdim=True)
    if mode == "grpo":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)  # unbiased (Bessel-corrected), like verl
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)).expand_as(adv)
    return torch.where(constant, torch.zeros_like(adv), adv).reshape(-1)


def _masked(r: Tensor, valid: Tensor, mode: AdvantageMode, eps: float) -> Tensor:
    """:func:`group_advantages` over the valid samples of each (G, n) group only."""
    v = valid.to(r.dtype)
    count = v.sum(dim=1, keepdim=True)
    mean = (r * v).sum(dim=1, keepdim=True) / count.clamp(min=1)
    adv = (r - mean) * v
    if mode == "grpo":
        var = ((r - mean) ** 2 * v).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    big, small = torch.finfo(r.dtype).max, torch.finfo(r.dtype).min
    constant = (torch.where(valid, r, small).amax(dim=1, keepdim=True)
                == torch.where(valid, r, big).amin(dim=1, keepdim=True))
    few = count < (2 if mode == "grpo" else 1)
    return torch.where(constant | few | ~valid, torch.zeros_like(adv), adv)
