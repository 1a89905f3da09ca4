"""Group-relative advantage estimators for GRPO-style training.

This module turns per-sample scalar rewards into per-sample advantages by comparing each
sample with the other samples drawn for the same prompt (its *group*). It is pure math on
torch tensors: it must never import prefect or mlflow, never touch models, tokenizers or
devices, and never do I/O. Orchestration and logging live elsewhere.

Layout convention: ``rewards`` has shape ``(B,)`` and groups are *contiguous* runs of
``group_size`` samples, i.e. samples ``[g * G, (g + 1) * G)`` answer the same prompt.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_MODES", "group_advantages", "group_reward_stats"]

AdvantageMode = Literal["grpo", "drgrpo"]
ADVANTAGE_MODES: tuple[str, ...] = ("grpo", "drgrpo")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate ``rewards`` and reshape it to ``(num_groups, group_size)`` as floats."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    batch = rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(
            f"batch size {batch} is not divisible by group_size {group_size}: groups must be "
            "contiguous runs of group_size samples of the same prompt"
        )
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r.reshape(-1, group_size)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    r"""Group-relative (outcome) advantages, one scalar per sample.

    For a group g of G samples with rewards r_1..r_G (contiguous in ``rewards``)::

        grpo   (GRPO, Shao et al. 2024 "DeepSeekMath", eq. for outcome supervision):
               A_i = (r_i - mean_g(r)) / (std_g(r) + eps)
               std_g is the *unbiased* sample std, sqrt(sum_j (r_j - mean_g)^2 / (G - 1)),
               i.e. ``torch.std``'s default, as verl's ``compute_grpo_outcome_advantage`` uses.
        drgrpo (Dr.GRPO, Liu et al. 2025 "Understanding R1-Zero-Like Training"):
               A_i = r_i - mean_g(r)          (no std normalisation: avoids the
                                               question-difficulty bias)

    A group whose rewards are all identical (max == min) gets exactly 0 advantage in both
    modes, never NaN and never float round-off noise amplified by ``1 / eps``.

    Args:
        rewards: float (or int/bool) tensor of shape (B,), B divisible by ``group_size``.
        group_size: G, the number of samples per prompt (>= 2 for ``grpo``).
        mode: ``"grpo"`` or ``"drgrpo"``.
        eps: added to the std in ``grpo`` mode.

    Returns:
        Tensor of shape (B,) (same float dtype as ``rewards``; float32 for int/bool input).

    Raises:
        ValueError: on a bad shape, B % group_size != 0, group_size < 2 for ``grpo``, or an
            unknown mode.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; allowed: {ADVANTAGE_MODES}")
    if mode == "grpo" and group_size < 2:
        raise ValueError(
            f"grpo advantages need group_size >= 2 (the unbiased std of one sample is "
            f"undefined), got {group_size}"
        )
    r = _grouped(rewards, group_size)
    mean = r.mean(dim=1, keepdim=True)
    centred = r - mean
    if mode == "grpo":
        std = r.std(dim=1, keepdim=True)  # unbiased (Bessel-corrected), like verl
        adv = centred / (std + eps)
    else:
        adv = centred
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)).expand_as(adv)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def group_reward_stats(rewards: Tensor, group_size: int) -> dict[str, float]:
    r"""Summary statistics of a batch of grouped rewards, for logging.

    Returns python floats::

        mean          = (1/B) sum_i r_i
        std           = unbiased std over the whole batch (0.0 when B == 1)
        zero_std_frac = (1/num_groups) sum_g 1[max_g(r) == min_g(r)]

    ``zero_std_frac`` is the fraction of groups whose GRPO advantage is identically zero and
    therefore carry no policy-gradient signal (the quantity DAPO's dynamic sampling, Yu et
    al. 2025, filters on).

    Raises:
        ValueError: on a bad shape or B % group_size != 0.
    """
    r = _grouped(rewards, group_size)
    flat = r.reshape(-1)
    std = flat.std().item() if flat.numel() > 1 else 0.0
    zero_std = (r.amax(dim=1) == r.amin(dim=1)).float().mean().item()
    return {"mean": flat.mean().item(), "std": std, "zero_std_frac": zero_std}
