"""The losses of Tinker's ``forward_backward`` (docs/tinker-protocol.md §8.4, §17), on flat
tensors: the current policy's log-probs of the target tokens and the datum inputs aligned
with them. Every loss is a plain sum over tokens and datums (no normalisation).

* ``cross_entropy``: ``sum(-logp * weights)``; any real weights (``forward_backward_custom``
  sends ``-dC/dlogp``).
* ``importance_sampling``: ``-sum(r * A)``, ``r = exp(logp - sampler_logp)``.
* ``ppo``: ``-sum(min(r * A, clip(r, lo, hi) * A))``; ``lo``/``hi`` from ``loss_fn_config``
  ``clip_low_threshold`` / ``clip_high_threshold``, defaults 0.8 / 1.2 (Tinker's).
* ``cispo``: ``-sum(stopgrad(clip(r, lo, hi)) * logp * A)``; defaults 0.0 / 4.0, the one-sided
  clip Tinker's public docs give as cispo's default (tinker-docs ``losses/cispo``).
* ``dro``: ``-sum(logp * A - beta / 2 * (logp - sampler_logp) ** 2)`` as Tinker's docs write
  it (every position, no advantage mask); ``loss_fn_config["beta"]`` is required (the docs
  state no default).
* ``gspo``: Tinker's GSPO-token (tinker-docs ``losses/gspo``): per datum, the sequence ratio
  ``s = exp(mean over sequence_ratio_mask != 0 of (logp - sampler_logp))`` (the value of
  :func:`rl_core.algorithms.losses.gspo_ratio`), every token's ratio
  ``s_t = stopgrad(s) * exp(logp - stopgrad(logp))`` (s's value, its own token's gradient), then
  ppo's clipped objective on ``s_t``: ``-sum(min(s_t * A, clip(s_t, lo, hi) * A))``.
  ``sequence_ratio_mask`` is required; ``lo``/``hi`` as ppo's (0.8 / 1.2 by default: an
  assumption, docs/tinker.md). A datum whose mask marks nothing gets ``s = 1``.

``stable_reinforce`` is refused: Tinker has not published its objective, and it reads sampler
records (``record_stability_info``) that this server does not keep (docs/tinker.md).

Positions where the advantage is 0 (prompt padding in the cookbook) contribute exactly 0 to
the importance-sampling losses, with a zero gradient even where the ratio would overflow.
Unknown ``loss_fn_config`` keys are ignored, as a client may send keys another loss uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from rl_core.algorithms.losses import gspo_ratio
from rl_core.tinker import LOSSES, REFUSED_LOSSES, TinkerError

__all__ = ["CLIP_DEFAULTS", "LossStats", "compute_loss", "loss_settings", "required_inputs"]

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_REQUIRED = {"cross_entropy": ("target_tokens", "weights"), "importance_sampling": _RL_INPUTS,
             "ppo": _RL_INPUTS, "cispo": _RL_INPUTS, "dro": _RL_INPUTS,
             "gspo": (*_RL_INPUTS, "sequence_ratio_mask")}
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (0.8, 1.2)}


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` keys ``loss_fn`` needs; TinkerError for an unknown loss."""
    if loss_fn in REFUSED_LOSSES:
        raise TinkerError(f"loss_fn {loss_fn!r} is not served: {REFUSED_LOSSES[loss_fn]}")
    if loss_fn not in _REQUIRED:
        raise TinkerError(f"unknown loss_fn {loss_fn!r}; this server implements "
                          f"{sorted(_REQUIRED)} (Tinker's names: {list(LOSSES)})")
    return _REQUIRED[loss_fn]


def loss_settings(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """``loss_fn``'s numeric settings from ``config`` with their defaults, checked."""
    required_inputs(loss_fn)
    config = dict(config or {})
    out: dict[str, float] = {}
    if loss_fn in CLIP_DEFAULTS:
        lo, hi = CLIP_DEFAULTS[loss_fn]
        out["lo"] = _number(config, "clip_low_threshold", lo)
        out["hi"] = _number(config, "clip_high_threshold", hi)
        if not 0.0 <= out["lo"] <= out["hi"]:
            raise TinkerError(f"{loss_fn}: need 0 <= clip_low_threshold <= clip_high_threshold, "
                              f"got {out['lo']} and {out['hi']}")
    if loss_fn == "dro":
        if "beta" not in config:
            raise TinkerError("dro needs loss_fn_config['beta'] (the coefficient of its "
                              "quadratic penalty; it has no documented default)")
        out["beta"] = _number(config, "beta", 0.0)
    return out


def _number(config: Mapping[str, object], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TinkerError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise TinkerError(f"loss_fn_config[{key!r}] must be finite, got {value}")
    return float(value)


@dataclass
class LossStats:
    """Sums behind the metrics, accumulated over the micro-batches of one request."""

    loss: float = 0.0
    tokens: int = 0  # positions with a nonzero weight (CE) or advantage (RL losses)
    ratio_sum: float = 0.0  # of the importance ratio over those positions (RL losses)
    clipped: int = 0  # of those, where the ratio lies outside [lo, hi] (ppo, cispo)

    def add(self, other: LossStats) -> None:
        self.loss += other.loss
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.clipped += other.clipped

    def metrics(self, loss_fn: str) -> dict[str, float]:
        """The ``name:reduction`` metrics of ``loss_fn`` (the same keys on every request, so
        the SDK's chunk merge keeps them); a ratio mean of no position is 1."""
        out = {"loss:sum": float(self.loss), "tokens:sum": float(self.tokens)}
        if loss_fn != "cross_entropy":
            out["ratio:mean"] = self.ratio_sum / self.tokens if self.tokens else 1.0
        if loss_fn in CLIP_DEFAULTS:
            out["clipped_frac:mean"] = self.clipped / self.tokens if self.tokens else 0.0
        return out


def sequence_ratios(logp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor,
                    lengths: Sequence[int]) -> torch.Tensor:
    """GSPO-token's per-token ratio on flattened datums of ``lengths``: each datum's sequence
    ratio (geometric mean of ``exp(logp - q)`` over its ``mask != 0`` positions, 1 where none)
    as the value, each token's own ``logp`` as the gradient, at every position."""
    if sum(lengths) != logp.numel():
        raise ValueError(f"lengths {list(lengths)} do not add up to {logp.numel()} positions")
    rows = [pad_sequence(list(torch.split(x, list(lengths))), batch_first=True)
            for x in (logp.detach(), q, mask)]
    seq = gspo_ratio(rows[0], rows[1], rows[2]).detach()  # (B, T): s_i on every position
    valid = pad_sequence([torch.ones(n, dtype=torch.bool, device=logp.device) for n in lengths],
                         batch_first=True)
    return seq[valid] * torch.exp(logp - logp.detach())


def compute_loss(loss_fn: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                 settings: Mapping[str, float], lengths: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, LossStats]:
    """The summed loss of ``loss_fn`` (a scalar that back-propagates into ``logp``) and its
    stats; ``logp`` and every input are float32 tensors of one shape (flattened datums, of
    ``lengths`` positions each: gspo's sequence ratio is per datum; None: one datum)."""
    if loss_fn == "cross_entropy":
        w = inputs["weights"]
        loss = -(logp * w).sum()
        return loss, LossStats(float(loss.detach()), int((w != 0).sum()))
    adv, q = inputs["advantages"], inputs["logprobs"]
    active = adv != 0
    tokens = int(active.sum())
    if loss_fn == "dro":
        beta = settings["beta"]
        loss = -(logp * adv - 0.5 * beta * (logp - q) ** 2).sum()
        ratio = torch.exp((logp.detach() - q)[active])
        return loss, LossStats(float(loss.detach()), tokens, float(ratio.sum()))
    if loss_fn == "gspo":
        ratio = sequence_ratios(logp, q, inputs["sequence_ratio_mask"],
                                [logp.numel()] if lengths is None else lengths)
    else:  # exp of 0 where inactive: no overflow, so no inf * 0 = nan in value or gradient
        ratio = torch.exp(torch.where(active, logp - q, torch.zeros_like(logp)))
    clipped = 0
    if loss_fn == "importance_sampling":
        loss = -(ratio * adv).sum()
    else:
        lo, hi = settings["lo"], settings["hi"]
        clipped_ratio = ratio.clamp(lo, hi)
        clipped = int(((ratio.detach() < lo) | (ratio.detach() > hi))[active].sum())
        if loss_fn in ("ppo", "gspo"):
            loss = -torch.minimum(ratio * adv, clipped_ratio * adv).sum()
        else:  # cispo
            loss = -(clipped_ratio.detach() * logp * adv).sum()
    stats = LossStats(float(loss.detach()), tokens, float(ratio.detach()[active].sum()), clipped)
    return loss, stats
