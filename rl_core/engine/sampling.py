"""The engine's sampler: SGLang's sampling parameters and one batched sampling step.

:func:`sample_next` returns tokens and log-probs as SGLang computes them:
``log_softmax(logits / temperature)`` *before* top-k / top-p / min-p filtering, EOS included.
Seeded and batch-invariant: one uniform per row and output position, a pure function of
``(seed, position)``, placed in the row's cumulative distribution (docs/rollout.md, "The
embedded engine"). Never touches the trainer's model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SamplingParams", "hit_stop", "prompt_logprobs", "sample_next", "sample_seed",
           "sampling_uniforms"]


def sample_seed(seed: int, step: int, record_id: str, index: int) -> int:
    """A 62-bit sampling seed that depends only on what the sample *is*."""
    blob = f"{seed}:{step}:{record_id}:{index}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2


@dataclass
class SamplingParams:
    """SGLang's sampling parameters (the subset RL frameworks send)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        """Refuse values SGLang refuses, and integers the sampler cannot pack into int64 (on
        the engine's scheduler thread, where the error would fail the whole running batch)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a non-negative finite number, got "
                             f"{self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            # min_p > 1 masks every token and argmax over all -inf silently yields token 0.
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k == 0 or not -1 <= self.top_k < 1 << 63:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            raise ValueError(f"sampling_seed must fit in a signed 64-bit integer, got {self.seed}.")


# splitmix64's unsigned constants as the signed int64 torch stores (all have the top bit set).
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                  0x94D049BB133111EB))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask off the sign extension for a logical shift.
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def sampling_uniforms(seeds: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One Uniform(0, 1) number per row (float64, shape (B,)), a pure function of (seed,
    position): ``u = (top 53 bits of splitmix64(splitmix64(seed) + position) + 0.5) / 2**53``,
    never 0 or 1. A row's sample depends on its seed, position and own logits only."""
    z = _splitmix64(_splitmix64(seeds.long()) + position.long())
    return (_shr(z, 11).to(torch.float64) + 0.5) / float(1 << 53)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where ``u`` (B,) falls in the cumulative distribution of ``probs``
    (B, V; unnormalised, zeros for filtered tokens). Summed in float64; a zero-probability
    token is never returned (``u * total`` rounded up to the total: the last with mass)."""
    cdf = probs.to(torch.float64).cumsum_(-1)
    x = (u * cdf[:, -1])[:, None]
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    empty = probs.gather(-1, token[:, None]).squeeze(-1) <= 0
    if bool(empty.any()):  # x rounded up to the total: the last token with mass
        last = (probs > 0).cumsum(-1).argmax(-1)  # the first index reaching the final count
        token = torch.where(empty, last, token)
    return token


def _filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside top-k / top-p / min-p with -inf (row-wise parameters)."""
    vocab, out = scaled.shape[-1], scaled
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        drop = ranks >= k[:, None]
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        # Rows with top_p = 1 keep everything even where the float32 cumsum reaches 1.0
        # early, so a row samples the same whatever other rows share its batch.
        mass_before = probs.cumsum(-1) - probs
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        drop[:, 0] = False
        drop_orig = torch.zeros_like(drop).scatter(-1, order, drop)
        out = out.masked_fill(drop_orig, float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        thresh = probs.max(-1, keepdim=True).values * min_p[:, None]
        out = out.masked_fill(probs < thresh, float("-inf"))
    return out


# Rows per sampling block keep every (rows, vocab) tensor under torch's parallel grain
# (32768 elements): each operation runs inline on the calling thread, in cache, and never
# waits milliseconds in an OpenMP fork/join for a descheduled worker on a loaded machine.
_BLOCK_ELEMENTS = 16384


def sample_next(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                position: torch.Tensor, top_n: int = 0) -> tuple[torch.Tensor, ...]:
    """One sampling step: (tokens, log-probs), both (B,); ``position``: each row's output
    index. T = 0 is greedy with the unscaled ``log_softmax``; else an inverse-CDF draw from
    ``softmax(filtered logits / T)``, log-prob ``log_softmax(logits / T)`` before filtering.
    ``top_n > 0`` adds the ``top_n`` largest of those same log-probs and their token ids,
    both (B, top_n): the alternatives OpenAI's ``top_logprobs`` reports. Rows are
    independent, processed in blocks of ``_BLOCK_ELEMENTS`` values."""
    uniforms = sampling_uniforms(seeds, position)
    rows = max(1, _BLOCK_ELEMENTS // logits.shape[-1])
    args = (logits, temperature, top_k, top_p, min_p, uniforms)
    if logits.shape[0] <= rows:
        return _sample_block(*args, top_n=top_n)
    blocks = [_sample_block(*(a[start : start + rows] for a in args), top_n=top_n)
              for start in range(0, logits.shape[0], rows)]
    return tuple(torch.cat(parts) for parts in zip(*blocks, strict=True))


def _sample_block(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor,
                  uniforms: torch.Tensor, top_n: int = 0) -> tuple[torch.Tensor, ...]:
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_t[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        token = torch.argmax(scaled, dim=-1)
    else:
        filtered = _filter_logits(scaled, top_k, top_p, min_p)
        # Unfiltered rows sample from the log-probs already computed; filtered logits are
        # -inf outside the kept set, so their softmax is exactly 0 there.
        probs = logp_all.exp() if filtered is scaled else torch.softmax(filtered, dim=-1)
        token = _inverse_cdf(probs, uniforms)
        if bool(greedy.any()):
            token = torch.where(greedy, torch.argmax(scaled, dim=-1), token)
    logp = logp_all.gather(-1, token[:, None]).squeeze(-1)
    if top_n <= 0:
        return token, logp
    top = logp_all.topk(min(top_n, logp_all.shape[-1]), dim=-1)
    return token, logp, top.values, top.indices


def prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, n: int,
                    k: int) -> list[float | None]:
    """SGLang's ``input_token_logprobs`` for prompt positions k..n-1 (first one None) of an
    ``n``-token prompt: ``ids`` is the prefilled row, ``logits`` its last positions, from
    position k on (unscaled ``log_softmax``: no temperature)."""
    if n - k <= 1:  # k == n (validate refuses k > n): none; k == n - 1: the first only
        return [None] * (n - k)
    first = ids.shape[0] - logits.shape[0]  # the position logits[0] belongs to (k)
    # Logits at position p score token p + 1.
    logp = torch.log_softmax(logits[k - first : n - 1 - first].float(), dim=-1).cpu()
    return [None, *logp.gather(-1, ids[k + 1 : n][:, None]).squeeze(-1).tolist()]


def hit_stop(tokenizer: Any, output_ids: list[int], stops: list[str]) -> str | None:
    """The first of ``stops`` in the text of the last 16 tokens (O(1) per step: a stop string
    spans few tokens), or None."""
    tail = tokenizer.decode(output_ids[-16:], skip_special_tokens=False)
    return next((s for s in stops if s and s in tail), None)
