"""Token-level policy-gradient losses for GRPO-style RL post-training.

Pure functions on torch tensors: clipped surrogates (DAPO clip-higher, dual clip, GSPO), KL
penalties, loss aggregation, entropy and log-probs from logits, and the rollout/trainer
mismatch corrections (TIS, MIS, IcePop, sequence masking). ``mask`` is bool (B, T), True on
the response tokens that count; log-probs are float (B, T). Whatever masked positions hold
(inf, NaN) reaches no value or gradient (``torch.where``, never a multiply by the mask), and
per-token outputs are exactly 0 there. The math: docs/training.md, "The loss, exactly".
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KL_KINDS", "LOSS_AGG_MODES", "aggregate_loss", "compute_grpo_loss",
           "entropy_from_logits", "gspo_ratio", "kl_penalty", "logprobs_from_logits", "masked_mean",
           "masked_sum", "nll_loss", "policy_loss", "rollout_correction", "tis_weights"]

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RatioType = Literal["token", "sequence"]
TISLevel = Literal["token", "sequence", "geometric"]
TISMode = Literal["truncate", "mask"]
SeqMaskMetric = Literal["max", "mean"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RATIO_TYPES: tuple[str, ...] = ("token", "sequence")
TIS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
TIS_MODES: tuple[str, ...] = ("truncate", "mask")
SEQ_MASK_METRICS: tuple[str, ...] = ("max", "mean")

_LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios before exp so one wild token cannot overflow
_LOW_VAR_KL_CLAMP = 10.0  # verl's low_var_kl clamps the per-token estimate to [-10, 10]


def _as_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_same_shape(mask: Tensor, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but mask has shape {tuple(mask.shape)}")


def _fill(x: Tensor, mask: Tensor, value: float = 0.0) -> Tensor:
    """``x`` where ``mask`` else ``value``: the NaN/inf-safe way to blank padded positions."""
    return torch.where(mask, x, torch.full_like(x, value))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` (all elements, or along ``dim``); inf/NaN elsewhere never
    reach the value or the gradient."""
    filled = torch.where(_as_mask(mask), x, torch.zeros_like(x))
    return filled.sum() if dim is None else filled.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    r"""masked_mean(x, m) = sum_{i : m_i} x_i / |{i : m_i}|, and 0 (not NaN) when the mask
    selects nothing (per slice when ``dim`` is given)."""
    mask = _as_mask(mask)
    total = masked_sum(x, mask, dim)
    full_mask = torch.broadcast_to(mask, torch.broadcast_shapes(mask.shape, x.shape))
    count = full_mask.sum() if dim is None else full_mask.sum(dim=dim)
    mean = total / count.clamp(min=1)  # true division: float even for int/bool x
    return torch.where(count > 0, mean, torch.zeros_like(mean))


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of ``x`` over masked positions, 0 if the mask selects nothing."""
    top = torch.where(mask, x, torch.full_like(x, -math.inf)).amax()
    return torch.where(mask.any(), top, torch.zeros_like(top))


def gspo_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence ratio s_i on every token (GSPO-token form), (B, T):
    value s_i, gradient s_i w.r.t. the token's own logp only (docs/training.md, "The loss,
    exactly"). Masked positions hold s_i (1.0 for a fully-masked row) with zero gradient."""
    mask = _as_mask(mask)
    _check_same_shape(mask, logp=logp, old_logp=old_logp)
    logp, old_logp = _fill(logp, mask), _fill(old_logp, mask)
    log_ratio = logp - old_logp
    count = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1) / count).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1))


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2,
    clip_high: float = 0.2, dual_clip: float | None = None, ratio_type: RatioType = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate (B, T), 0 at masked positions (reduce it with
    :func:`aggregate_loss`), and detached 0-dim metrics: ``clip_frac`` (``_low``, ``_high``),
    ``dual_clip_frac``, ``ratio_mean``, ``ratio_max``, ``ppo_kl``. ``advantages``: (B,) or
    (B, T). Clip-higher, dual clip, GSPO, the metrics: docs/training.md, "The loss, exactly"."""
    mask = _as_mask(mask)
    _check_same_shape(mask, logp=logp, old_logp=old_logp)
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"unknown ratio_type {ratio_type!r}; allowed: {RATIO_TYPES}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0] and mask.dim() == 2:
        advantages = advantages.unsqueeze(-1).expand_as(mask)
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages must have shape (B,) or (B, T) = {tuple(mask.shape)}, "
                         f"got {tuple(advantages.shape)}")
    logp, old_logp = _fill(logp, mask), _fill(old_logp, mask)
    adv = _fill(advantages.to(logp.dtype), mask)
    if ratio_type == "token":
        ratio = torch.exp((logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    else:
        ratio = gspo_ratio(logp, old_logp, mask)
    surr_unclipped = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(surr_unclipped, surr_clipped)
    with torch.no_grad():
        clipped = (surr_clipped < surr_unclipped) & mask
    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        cap, negative = -dual_clip * adv, adv < 0
        with torch.no_grad():
            dual_active = negative & (loss > cap) & mask
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    with torch.no_grad():
        ratio_d = ratio.detach()
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "clip_frac_low": masked_mean((clipped & (ratio < 1.0)).float(), mask),
            "clip_frac_high": masked_mean((clipped & (ratio > 1.0)).float(), mask),
            "dual_clip_frac": masked_mean(dual_active.float(), mask),
            "ratio_mean": masked_mean(ratio_d, mask), "ratio_max": _masked_max(ratio_d, mask),
            "ppo_kl": masked_mean((old_logp - logp).detach(), mask),
        }
    return _fill(loss, mask), metrics


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, kind: KLKind = "low_var_kl", mask: Tensor | None = None
) -> Tensor:
    """Per-token (B, T) estimate of KL(pi || pi_ref) from samples of pi: ``k1``, ``k2``,
    ``k3`` or ``low_var_kl`` (docs/training.md, "The loss, exactly"). Masked positions (when
    ``mask`` is given) are exactly 0 whatever they held."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; allowed: {KL_KINDS}")
    if mask is not None:
        mask = _as_mask(mask)
        _check_same_shape(mask, logp=logp, ref_logp=ref_logp)
        logp, ref_logp = _fill(logp, mask), _fill(ref_logp, mask)
    r = ref_logp - logp
    if kind == "k1":
        kl = -r
    elif kind == "k2":
        kl = 0.5 * r.square()
    elif kind == "k3":
        kl = torch.exp(r) - r - 1.0
    else:
        r = r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kl = (torch.exp(r) - r - 1.0).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    return kl if mask is None else _fill(kl, mask)


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: LossAggMode = "token-mean",
    norm_const: float | None = None, global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> Tensor:
    """Reduce a per-token loss matrix (B, T) to a scalar by ``mode`` (docs/training.md, "The
    loss, exactly"). ``global_tokens``/``global_seqs`` (the full batch's counts) replace the
    local ones so micro-batches sum to the full batch's loss; ``norm_const`` must then be equal
    on all. Empty selection: 0, on the graph. ValueError: unknown mode, non-positive count."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {LOSS_AGG_MODES}")
    for name, value in (("norm_const", norm_const), ("global_tokens", global_tokens),
                        ("global_seqs", global_seqs)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    mask = _as_mask(mask)
    _check_same_shape(mask, loss_mat=loss_mat)
    if mode == "token-mean":
        total = masked_sum(loss_mat, mask)
        if global_tokens is not None:
            return total / global_tokens
        return total / mask.sum().clamp(min=1).to(total.dtype)
    tokens_per_seq = mask.sum(dim=-1)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    num_seqs: Tensor | float = (
        float(global_seqs) if global_seqs is not None
        else (tokens_per_seq > 0).sum().clamp(min=1).to(seq_sums.dtype))
    if mode == "seq-mean-token-mean":
        return (seq_sums / tokens_per_seq.clamp(min=1).to(seq_sums.dtype)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    const = float(norm_const) if norm_const is not None else float(mask.shape[-1])
    return seq_sums.sum() / (num_seqs * const)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) at every position: float32 (B, T) from (B, T, V) logits, in
    verl's stable form; p_v == 0 entries (banned tokens) add exactly 0 with finite gradients."""
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    z_safe = torch.where(p > 0, z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - (p * z_safe).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability (float32, (B, T)) of ``labels`` under softmax(logits / temperature),
    without a (B, T, V) log-softmax. Use the engine's sampling temperature, or the ratios are
    biased; ``labels`` must all be valid ids (padding is masked downstream)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _nan_as_inf(x: Tensor) -> Tensor:
    """NaN -> +inf: a log-ratio nobody can compute counts as an unbounded mismatch."""
    return torch.where(torch.isnan(x), torch.full_like(x, math.inf), x)


def _sample_frac(hit: Tensor, rows: Tensor) -> Tensor:
    """Share of the rows with at least one response token (``rows``) where ``hit`` holds."""
    count = rows.sum()
    frac = (hit & rows).sum() / count.clamp(min=1)
    return torch.where(count > 0, frac, torch.zeros_like(frac))


def rollout_correction(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, tis_cap: float | None = None,
    tis_level: TISLevel = "token", tis_mode: TISMode = "truncate",
    icepop_low: float | None = None, icepop_high: float | None = None,
    seq_mask_threshold: float | None = None, seq_mask_metric: SeqMaskMetric = "max",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token weights and keep-mask correcting the rollout engine / trainer mismatch: TIS/MIS,
    IcePop, sequence masking, each off while None (docs/training.md, "Off-policy corrections").
    Returns ``(w, keep, metrics)``, detached: ``keep`` is ``mask`` minus what any rule dropped;
    ``w`` the finite TIS weight on ``keep`` (1 without ``tis_cap``), exactly 0 elsewhere."""
    if tis_level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {tis_level!r}; allowed: {TIS_LEVELS}")
    if tis_mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {tis_mode!r}; allowed: {TIS_MODES}")
    if seq_mask_metric not in SEQ_MASK_METRICS:
        raise ValueError(
            f"unknown seq_mask_metric {seq_mask_metric!r}; allowed: {SEQ_MASK_METRICS}")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if (icepop_low is None) != (icepop_high is None):
        raise ValueError("icepop_low and icepop_high must be given together")
    if icepop_low is not None and icepop_high is not None and not 0 < icepop_low < 1 < icepop_high:
        raise ValueError(f"need 0 < icepop_low < 1 < icepop_high, got {icepop_low}, {icepop_high}")
    if seq_mask_threshold is not None and seq_mask_threshold <= 0:
        raise ValueError(f"seq_mask_threshold must be > 0, got {seq_mask_threshold}")
    mask = _as_mask(mask)
    _check_same_shape(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    with torch.no_grad():
        d = _fill(_nan_as_inf(old_logp.detach() - rollout_logp.detach()), mask)
        rows = mask.any(dim=-1)
        count = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(d.dtype)
        seq_sum = _nan_as_inf(d.sum(dim=-1, keepdim=True))  # +inf and -inf tokens: NaN -> inf
        keep = mask.clone()
        w = torch.ones_like(d)
        finite = mask & torch.isfinite(d)
        metrics = {"rollout_trainer_logp_diff": masked_mean(d.abs(), finite)}
        if tis_cap is not None:
            log_rho = {"token": d, "sequence": seq_sum, "geometric": seq_sum / count}[tis_level]
            raw = torch.exp(log_rho).expand_as(d)
            over = (raw > tis_cap) & mask
            if tis_mode == "truncate":
                w = _fill(raw.clamp(max=tis_cap), mask)
            else:
                w = torch.where(over | ~mask, torch.zeros_like(raw), raw)
                keep &= ~over
                metrics["mis_masked_token_frac"] = masked_mean(over.float(), mask)
                if tis_level != "token":
                    metrics["mis_masked_sample_frac"] = _sample_frac(over.any(dim=-1), rows)
            metrics.update(tis_mean=masked_mean(w, mask), tis_max=_masked_max(w, mask),
                           tis_clip_frac=masked_mean(over.float(), mask))
        if icepop_low is not None and icepop_high is not None:
            # Compared in log space: the band edges are exact for d = log(edge).
            outside = ~((d >= math.log(icepop_low)) & (d <= math.log(icepop_high))) & mask
            keep &= ~outside
            metrics["icepop_masked_token_frac"] = masked_mean(outside.float(), mask)
        if seq_mask_threshold is not None:
            if seq_mask_metric == "max":
                mismatch = _fill(d.abs(), mask).amax(dim=-1)
            else:
                mismatch = (seq_sum / count).abs().squeeze(-1)
            dropped = (mismatch > seq_mask_threshold) & rows
            keep &= ~dropped.unsqueeze(-1)
            metrics["seq_masked_sample_frac"] = _sample_frac(dropped, rows)
        w = _fill(w, keep)
    return w, keep, metrics


def tis_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0,
    level: TISLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance-sampling weights min(rho, cap) at ``level``: :func:`rollout_correction`
    with TIS alone. ``(w, metrics)``: ``w`` (B, T) detached, 0 at masked positions."""
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; allowed: {TIS_LEVELS}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    w, _, metrics = rollout_correction(old_logp, rollout_logp, mask, tis_cap=cap, tis_level=level)
    return w, metrics


def nll_loss(logits: Tensor, labels: Tensor, mask: Tensor,
             global_tokens: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning's loss: the mean cross-entropy (negative log-likelihood) of the
    ``mask`` tokens, ``logits`` (B, T, V) predicting ``labels`` (B, T); ``global_tokens``: the
    whole mini-batch's count, so micro-batches add up exactly. Its gradient is the policy
    gradient's at ratio 1 with advantage 1 on every token: SFT is the one training step with
    this loss (docs/sft.md). Cross-entropy's own kernel, on the masked rows only."""
    mask = _as_mask(mask)
    tokens = float(mask.sum()) if global_tokens is None else global_tokens
    loss = F.cross_entropy(logits[mask].float(), labels[mask].long(), reduction="sum")
    loss = loss / max(tokens, 1.0)
    return loss, {"loss": loss.item()}


def compute_grpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    ref_logp: Tensor | None = None, kl_coef: float = 0.0, kl_kind: KLKind = "low_var_kl",
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
    ratio_type: RatioType = "token", loss_agg: LossAggMode = "token-mean",
    norm_const: float | None = None, entropy: Tensor | None = None, entropy_coef: float = 0.0,
    rollout_logp: Tensor | None = None, tis_cap: float | None = None,
    tis_level: TISLevel = "token", tis_mode: TISMode = "truncate",
    icepop_low: float | None = None, icepop_high: float | None = None,
    seq_mask_threshold: float | None = None, seq_mask_metric: SeqMaskMetric = "max",
    global_tokens: float | None = None, global_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The full GRPO objective of one (micro-)batch: a 0-dim loss with grad, and float metrics.

        loss = agg(L_pg * w) + kl_coef * agg(KL) - entropy_coef * agg(H)

    w (:func:`rollout_correction`) only with ``rollout_logp`` and a correction on; a token it
    masks out still counts in agg's normaliser (docs/training.md, "The loss, exactly").
    ValueError: ``kl_coef`` without ``ref_logp``, ``entropy_coef`` without ``entropy``.
    """
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef != 0 requires ref_logp")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 requires entropy")
    mask = _as_mask(mask)

    def agg(x: Tensor) -> Tensor:
        return aggregate_loss(x, mask, loss_agg, norm_const=norm_const,
                              global_tokens=global_tokens, global_seqs=global_seqs)

    pg_mat, pg_metrics = policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low,
                                     clip_high=clip_high, dual_clip=dual_clip,
                                     ratio_type=ratio_type)
    metrics: dict[str, float] = {k: v.item() for k, v in pg_metrics.items()}
    correcting = (tis_cap is not None or icepop_low is not None or icepop_high is not None
                  or seq_mask_threshold is not None)
    if rollout_logp is not None and correcting:
        w, keep, corr_metrics = rollout_correction(
            old_logp, rollout_logp, mask, tis_cap=tis_cap, tis_level=tis_level,
            tis_mode=tis_mode, icepop_low=icepop_low, icepop_high=icepop_high,
            seq_mask_threshold=seq_mask_threshold, seq_mask_metric=seq_mask_metric)
        pg_mat = torch.where(keep, pg_mat * w, torch.zeros_like(pg_mat))
        metrics.update({k: v.item() for k, v in corr_metrics.items()})
    loss = pg_loss = agg(pg_mat)
    metrics["pg_loss"] = pg_loss.item()
    if ref_logp is not None:
        kl_mat = kl_penalty(logp, ref_logp, kind=kl_kind, mask=mask)
        metrics["kl"] = masked_mean(kl_mat.detach(), mask).item()
        if kl_coef != 0.0:
            loss = loss + kl_coef * agg(kl_mat)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask).item()
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * agg(entropy)
    metrics["loss"] = loss.item()
    return loss, metrics
