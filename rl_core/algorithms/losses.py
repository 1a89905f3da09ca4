"""Token-level policy-gradient losses for GRPO-style RL post-training.

Pure functions on torch tensors: PPO/GRPO clipped surrogates (with DAPO clip-higher, dual clip
and GSPO sequence ratios), KL penalties against a reference policy, loss aggregation
(token-mean, seq-mean-*, Dr.GRPO), entropy and log-probs from logits, and the corrections for
the rollout engine sampling from another policy than the trainer's (truncated or masked
importance sampling, IcePop token masking, sequence masking). Never imports prefect or mlflow, never
touches models, optimizers or devices, never does I/O: the trainer computes log-probs and
calls these functions.

Conventions:

* ``mask`` is a bool (B, T) tensor, True on response tokens that count (non-bool masks are
  converted with ``mask != 0``).
* ``logp``, ``old_logp``, ``ref_logp``, ``rollout_logp`` are float (B, T) tensors of
  log pi(y_t | y_<t) under the current policy (with grad), the policy that started this
  training step (no grad), the frozen reference, and the rollout engine.
* Masked-out positions contribute nothing, and whatever they hold (inf, NaN) never leaks into
  a value or a gradient: inputs are sanitised with ``torch.where`` before any arithmetic,
  never by multiplying with the mask. Per-token outputs hold exact zeros there.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = ["KL_KINDS", "LOSS_AGG_MODES", "aggregate_loss", "compute_grpo_loss",
           "entropy_from_logits", "gspo_ratio", "kl_penalty", "logprobs_from_logits", "masked_mean",
           "masked_sum", "policy_loss", "rollout_correction", "tis_weights"]

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
    r"""masked_sum(x, m) = sum_{i : m_i} x_i   (over all elements, or along ``dim``).

    Masked-out entries are replaced by 0 with ``torch.where`` first, so inf/NaN there leak
    into neither the value nor the gradient.
    """
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
    r"""GSPO sequence-level importance ratio, broadcast to tokens (GSPO-token form), (B, T).

    GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization") replaces the per-token
    ratio by the length-normalised sequence likelihood ratio::

        s_i     = exp( (1/|y_i|) sum_{t in mask_i} (logp_{i,t} - old_logp_{i,t}) )
        r_{i,t} = sg(s_i) * exp(logp_{i,t} - sg(logp_{i,t}))          (sg = stop-gradient)

    r_{i,t} equals s_i everywhere and d r_{i,t} / d logp_{i,t} = s_i (0 w.r.t. other tokens):
    the GSPO-token estimator, which with a sequence-level advantage reproduces GSPO's gradient.
    As in verl, the mean log-ratio is clamped to [-20, 20] before exp. Masked positions hold
    s_i (1.0 for a fully-masked row) with zero gradient. Typical clip ranges: 3e-4 / 4e-4.
    """
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
    r"""Per-token PPO clipped surrogate loss (GRPO / DAPO / dual-clip / GSPO).

    PPO (Schulman et al. 2017) as used by GRPO (Shao et al. 2024, DeepSeekMath)::

        ratio_{i,t} = exp(logp_{i,t} - old_logp_{i,t})        (ratio_type="token")
        L_{i,t}     = -min( ratio * A,  clip(ratio, 1 - clip_low, 1 + clip_high) * A )

    * DAPO clip-higher (Yu et al. 2025): clip_high > clip_low (e.g. 0.2 / 0.28) keeps
      exploration alive for low-probability tokens.
    * Dual clip (Ye et al. 2020): for A < 0, L = min(L, -dual_clip * A) = min(L, dual_clip*|A|),
      so a huge ratio on a negative-advantage token cannot make the loss unbounded (dual_clip > 1).
    * ratio_type="sequence" uses :func:`gspo_ratio` (GSPO); pair it with sequence-level
      advantages, clip ranges around 3e-4 / 4e-4 and usually ``seq-mean-token-mean``.

    As in verl, the token log-ratio is clamped to [-20, 20] before exp. ``advantages`` is (B,)
    (broadcast over T) or (B, T).

    Returns ``(loss, metrics)``: ``loss`` (B, T) with zeros at masked positions (reduce it with
    :func:`aggregate_loss`); ``metrics`` detached 0-dim tensors over masked tokens:
    ``clip_frac`` (clipped branch strictly chosen: clip(ratio) * A < ratio * A), split into
    ``clip_frac_low`` (ratio < 1) and ``clip_frac_high`` (ratio > 1); ``dual_clip_frac``
    (dual-clip cap strictly active); ``ratio_mean``, ``ratio_max``; ``ppo_kl`` = masked mean of
    (old_logp - logp), the k1 estimate of KL(old || new).
    """
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
    r"""Per-token (B, T) estimate of KL(pi || pi_ref) from samples y ~ pi.

    With r = ref_logp - logp = log(pi_ref / pi) (Schulman 2020, "Approximating KL
    Divergence", http://joschu.net/blog/kl-approx.html)::

        k1         = -r = logp - ref_logp             (unbiased, high variance, can be < 0)
        k2         = 0.5 * r^2 = 0.5 * (logp - ref_logp)^2      (biased, low variance)
        k3         = exp(r) - r - 1                   (unbiased, >= 0; GRPO's estimator,
                                                       DeepSeekMath eq. 4)
        low_var_kl = clamp( exp(r') - r' - 1, -10, 10 ),  r' = clamp(r, -20, 20)
                     (verl's ``low_var_kl``: k3 made overflow-safe)

    Masked positions (when ``mask`` is given) are exactly 0 whatever they held.
    """
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
    r"""Reduce a per-token loss matrix (B, T) to a scalar.

    With m the mask, n_i = sum_t m_{i,t} and S = {i : n_i > 0} (fully-masked rows are
    excluded from every sequence count)::

        token-mean              = sum_{i,t} m L / N_tok,        N_tok = sum_i n_i
                                  (DAPO's token-level loss, Yu et al. 2025)
        seq-mean-token-mean     = (1/N_seq) sum_{i in S} (1/n_i) sum_t m L
                                  (original GRPO, DeepSeekMath; GSPO)
        seq-mean-token-sum      = (1/N_seq) sum_{i in S} sum_t m L
        seq-mean-token-sum-norm = sum_{i,t} m L / (N_seq * C)    (Dr.GRPO, Liu et al. 2025)
                                  C = norm_const, default T = mask.shape[-1] (a constant, so
                                  long responses are not down-weighted), N_seq = |S|

    Gradient accumulation / data parallel: summed micro-batch losses equal the full-batch loss
    only if every micro-batch divides by the *full batch's* N_tok / N_seq. Pass those as
    ``global_tokens`` (replaces N_tok in ``token-mean``) and ``global_seqs`` (replaces N_seq in
    the ``seq-*`` modes; the one ``mode`` does not use is ignored); ``norm_const`` must then
    be the same on every micro-batch. An empty selection gives 0 (not NaN), still on the graph.

    Raises ValueError on an unknown mode (listing the allowed ones) or a non-positive
    ``norm_const`` / ``global_tokens`` / ``global_seqs``.
    """
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
    r"""Entropy of softmax(z) at every position: float32 (B, T) from (B, T, V) logits.

        H(z) = -sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v * z_v

    (verl's form: no log of a probability, so stable for very peaked distributions). Entries
    with p_v == 0 (e.g. z_v = -inf for a banned token) contribute exactly 0 with finite
    gradients.
    """
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    z_safe = torch.where(p > 0, z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - (p * z_safe).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    r"""Log-probability (float32, (B, T)) of ``labels`` under softmax(logits / temperature).

        logp_{b,t} = z_{b,t,y} / tau - logsumexp_v(z_{b,t,v} / tau),   y = labels_{b,t}

    Equals ``log_softmax(logits / tau).gather(-1, labels)`` without keeping a (B, T, V)
    log-softmax. The rollout engine samples with the same temperature, so the trainer must
    divide by it too or the ratios are biased. ``labels`` must all be valid ids (padded
    positions hold e.g. the pad id and are masked downstream).
    """
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
    r"""Per-token weights and keep-mask correcting the rollout engine / trainer mismatch.

    The rollout engine (vLLM/SGLang, or older weights when rollout overlaps training) samples
    from pi_rollout, not from the trainer's pi_old, so the policy gradient is off-policy
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"). With the per-token log-ratio (NaN counts as +inf)::

        d_{i,t} = old_logp_{i,t} - rollout_logp_{i,t}  = log( pi_old / pi_rollout )

    three corrections compose; each is off while its parameter is None:

    * ``tis_cap`` = C, an importance weight rho at ``tis_level``::

          token:     rho_{i,t} = exp(d_{i,t})
          sequence:  rho_i     = exp( sum_{t in mask_i} d_{i,t} )        (product of ratios)
          geometric: rho_i     = exp( (1/|y_i|) sum_{t in mask_i} d_{i,t} )

      ``tis_mode="truncate"`` (TIS): w = min(rho, C). ``tis_mode="mask"`` (MIS, verl's
      ``rollout_is_mode: mask``): w = rho where rho <= C, else the token (sequence, at the
      sequence levels) is masked out.
    * IcePop band ``icepop_low`` < 1 < ``icepop_high``: a token whose exp(d_{i,t}) lies
      outside [low, high] is masked out (the edges are kept); the others are not reweighted.
      With TIS truncate and C >= high this is IcePop's M(k) = k on [low, high], 0 outside.
    * Sequence masking (rejection): sample i is masked out entirely when its mismatch
      m_i = max_t |d_{i,t}| (``seq_mask_metric="max"``) or |(1/|y_i|) sum_t d_{i,t}|
      (``"mean"``) exceeds ``seq_mask_threshold``.

    Returns ``(w, keep, metrics)``, all detached. ``keep`` (bool (B, T)) is ``mask`` minus the
    tokens any rule masked out; ``w`` (B, T) is the TIS weight (1 without ``tis_cap``) on
    ``keep`` and exactly 0 elsewhere, finite everywhere: the caller multiplies the per-token
    policy-gradient loss by it. Masked-out tokens still count in the loss normaliser (see
    :func:`compute_grpo_loss`). ``metrics`` (0-dim, over ``mask``): ``rollout_trainer_logp_diff``
    (mean |d| over tokens where d is finite); with ``tis_cap``, ``tis_mean`` and ``tis_max`` of
    the TIS weight (0 where MIS masked) and ``tis_clip_frac`` (share of tokens with rho > C);
    ``mis_masked_token_frac`` (mask mode) and ``mis_masked_sample_frac`` (mask mode, sequence
    levels); ``icepop_masked_token_frac``; ``seq_masked_sample_frac``. Each rule's fraction is
    its own (the rules may overlap); sample fractions are over rows with a response token.
    """
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
    r"""Truncated importance-sampling weights: :func:`rollout_correction` with TIS alone.

        token:    w_{i,t} = min( exp(old_logp_{i,t} - rollout_logp_{i,t}), cap )
        sequence: w_{i,t} = min( exp( sum_{t in mask_i} (old_logp - rollout_logp) ), cap )
                  (one weight per sequence, broadcast to its tokens; ``geometric``: the mean)

    ``w`` (B, T) is detached and 0 at masked positions, so the caller multiplies the per-token
    loss by it directly. Metrics (detached, 0-dim, over masked tokens): ``tis_mean``,
    ``tis_max``, ``tis_clip_frac`` (raw weight > ``cap``) and ``rollout_trainer_logp_diff``
    (mean |old_logp - rollout_logp|).
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; allowed: {TIS_LEVELS}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    w, _, metrics = rollout_correction(old_logp, rollout_logp, mask, tis_cap=cap, tis_level=level)
    return w, metrics


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
    r"""Full GRPO objective for one (micro-)batch.

        loss = agg(L_pg * w) + kl_coef * agg(KL) - entropy_coef * agg(H)

    L_pg from :func:`policy_loss`; w from :func:`rollout_correction` (TIS/MIS, IcePop,
    sequence masking; only when ``rollout_logp`` and one of ``tis_cap``, ``icepop_low``/
    ``icepop_high``, ``seq_mask_threshold`` are given, else 1); KL from :func:`kl_penalty`
    against ``ref_logp``, a loss term as in GRPO (DeepSeekMath eq. 3), not folded into the
    reward; H the per-token entropy; agg :func:`aggregate_loss` with ``loss_agg``/
    ``norm_const``/``global_tokens``/``global_seqs`` for all three terms. A term is only
    added when its coefficient is non-zero; ``kl`` / ``entropy`` are still reported when given.

    A token the correction masks out gets w = 0 in the policy-gradient term only (KL and
    entropy keep every token) and still counts in agg's normaliser: masking is an importance
    weight of 0 in sum w L / N, as in IcePop and MIS, not a smaller batch. So micro-batches
    and data-parallel ranks keep the normalisers counted from ``mask`` before any loss
    (gradient accumulation stays exact), and a step where many tokens are masked moves the
    policy less instead of scaling the survivors up (verl drops them from the denominator).

    Returns ``(loss, metrics)``: a 0-dim loss with grad and python floats ``loss``, ``pg_loss``
    (with the global normalisers when given), ``kl`` (masked mean, if ``ref_logp``),
    ``entropy`` (masked mean, if ``entropy``), every :func:`policy_loss` metric (over all of
    ``mask``) and, with a correction, every :func:`rollout_correction` metric; all but
    ``loss``/``pg_loss`` are local to the micro-batch. Raises ValueError for ``kl_coef != 0``
    without ``ref_logp`` or ``entropy_coef != 0`` without ``entropy``.
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
