"""Batched autoregressive sampling with a KV cache over a Hugging Face causal LM.

This is the core of the rollout plane on CPU: the in-process engine calls it today, and the
embedded HTTP engine (SGLang's protocol) wraps it. It returns token ids and per-token
log-probs the way SGLang computes them: ``log_softmax(logits / temperature)`` taken *before*
top-k / top-p / min-p filtering, for every generated token including EOS.

Sampling is seeded per request and batch-invariant: row ``r`` at output position ``t`` draws
one uniform number that is a pure function of ``(seed_r, t)`` (a counter-based splitmix64
hash) and takes the token where it falls in the row's cumulative distribution (inverse-CDF
sampling), so a request samples the same tokens whatever batch it runs in and in whatever
order requests arrive. That is what makes resumed runs reproducible.

Never imports Prefect or MLflow; never touches the trainer's model.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Completion", "SamplingParams", "generate", "sampling_uniforms"]


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            # min_p > 1 masks every token and argmax over all -inf silently yields token 0.
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One generated sequence, in the shape SGLang reports it."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    text: str | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"


# ----------------------------------------------------------------------------- noise

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; mask off the sign extension for a logical shift.
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def sampling_uniforms(seeds: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One Uniform(0, 1) number per row (float64, shape (B,)): a pure function of (seed, position).

    ``u = (top 53 bits of splitmix64(splitmix64(seed) + position) + 0.5) / 2**53``: never 0
    or 1. :func:`_inverse_cdf` turns it into a token, so a row's sample depends on its seed,
    its output position and its own logits only.
    """
    z = _splitmix64(_splitmix64(seeds.long()) + position.long())
    return (_shr(z, 11).to(torch.float64) + 0.5) / float(1 << 53)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row the token where ``u`` falls in the cumulative distribution of ``probs``.

    ``probs`` (B, V) need not be normalised (zeros for filtered tokens); ``u`` (B,) in (0, 1).
    The cumulative sum runs in float64 so rounding cannot move mass between tokens, and a
    zero-probability token is never returned: ``x = u * total`` lands in token ``j``'s
    interval ``[cdf[j-1], cdf[j])`` only if ``cdf[j] > cdf[j-1]``; if rounding puts ``x`` at
    the total itself, the last token with mass is taken.
    """
    cdf = probs.to(torch.float64).cumsum_(-1)
    x = (u * cdf[:, -1])[:, None]
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    empty = probs.gather(-1, token[:, None]).squeeze(-1) <= 0
    if bool(empty.any()):  # x rounded up to the total: the last token with mass
        last = (probs > 0).cumsum(-1).argmax(-1)  # the first index reaching the final count
        token = torch.where(empty, last, token)
    return token


# -------------------------------------------------------------------------- filtering


def _filter_logits(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside top-k / top-p / min-p with -inf (row-wise parameters)."""
    vocab = scaled.shape[-1]
    out = scaled
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
# (32768 elements), so each operation runs inline on the calling thread and stays in cache.
# With two or more threads on a loaded machine an OpenMP fork/join can wait milliseconds
# for a descheduled worker; sampling is a handful of passes over the row, so it must not
# pay that.
_BLOCK_ELEMENTS = 16384


def _sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    position: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step for a batch of rows: (tokens, their log-probs), both shape (B,).

    ``position`` is each row's output index (the counter of :func:`sampling_uniforms`).
    Temperature 0 is greedy and reports the unscaled ``log_softmax``; otherwise the token is
    drawn from ``softmax(filtered logits / T)`` by inverse CDF and its log-prob is
    ``log_softmax(logits / T)`` before filtering. Shared with the continuous-batching engine
    so both sample identically. Rows are independent: they are processed in blocks of
    ``_BLOCK_ELEMENTS`` values.
    """
    uniforms = sampling_uniforms(seeds, position)
    rows = max(1, _BLOCK_ELEMENTS // logits.shape[-1])
    args = (logits, temperature, top_k, top_p, min_p, uniforms)
    if logits.shape[0] <= rows:
        return _sample_block(*args)
    blocks = [
        _sample_block(*(a[start : start + rows] for a in args))
        for start in range(0, logits.shape[0], rows)
    ]
    return torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])


def _sample_block(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)


# --------------------------------------------------------------------------- generate


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    tokenizer: Any = None,
    micro_batch_size: int = 256,
) -> list[Completion]:
    """Sample one completion per prompt; ``params`` is shared or one per prompt.

    Prompts are left-padded into micro-batches of ``micro_batch_size``; rows that finish
    leave the KV cache so later decode steps only pay for live rows. ``tokenizer`` is needed
    only for stop strings and to fill ``Completion.text``.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
    resolved = [p if p.seed is not None else _with_seed(p, secrets.randbits(62)) for p in params]
    out: list[Completion] = []
    for start in range(0, len(prompts), micro_batch_size):
        out.extend(
            _generate_batch(
                model,
                prompts[start : start + micro_batch_size],
                resolved[start : start + micro_batch_size],
                eos_token_ids=list(eos_token_ids),
                pad_token_id=pad_token_id,
                tokenizer=tokenizer,
            )
        )
    return out


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(**{**p.__dict__, "seed": seed})


def _generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    tokenizer: Any,
) -> list[Completion]:
    device = next(model.parameters()).device
    n = len(prompts)
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError("every prompt needs at least one token")
    width = max(lengths)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    temperature = torch.tensor([p.temperature for p in params])
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    seeds = torch.tensor([p.seed for p in params], dtype=torch.long)
    max_new = [p.max_new_tokens for p in params]

    outputs: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    finish: list[dict[str, Any] | None] = [None] * n
    for i in range(n):
        if max_new[i] == 0:
            finish[i] = {"type": "length", "length": 0}
    stop_ids = [
        set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)) for p in params
    ]

    live = torch.tensor([f is None for f in finish])
    rows = torch.nonzero(live).flatten()  # original indices of live rows, in cache order
    if rows.numel() == 0:
        return _collect(prompts, outputs, logprobs, finish, tokenizer)

    ids, mask, positions = ids[rows], mask[rows], positions[rows]
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        use_cache=True,
    )
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float().cpu()
    last_pos = positions[:, -1]
    step = 0
    while True:
        r = rows
        token, token_logp = _sample_next(
            logits,
            temperature[r],
            top_k[r],
            top_p[r],
            min_p[r],
            seeds[r],
            torch.full_like(r, step),
        )

        keep: list[int] = []
        for j, i in enumerate(r.tolist()):
            t = int(token[j])
            outputs[i].append(t)
            logprobs[i].append(float(token_logp[j]))
            matched = (
                _hit_stop(tokenizer, outputs[i], params[i].stop)
                if params[i].stop and tokenizer is not None
                else None
            )
            if t in stop_ids[i]:
                finish[i] = {"type": "stop", "matched": t}
            elif matched is not None:
                finish[i] = {"type": "stop", "matched": matched}
            elif len(outputs[i]) >= max_new[i]:
                finish[i] = {"type": "length", "length": len(outputs[i])}
            else:
                keep.append(j)
        if not keep:
            break
        step += 1
        if len(keep) < len(r):
            sel = torch.tensor(keep, dtype=torch.long)
            cache.batch_select_indices(sel.to(device))
            mask, last_pos, token, rows = mask[sel], last_pos[sel], token[sel], r[sel]
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=token[:, None].to(device),
            attention_mask=mask.to(device),
            position_ids=last_pos[:, None].to(device),
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()
    return _collect(prompts, outputs, logprobs, finish, tokenizer)


def _hit_stop(tokenizer: Any, output_ids: list[int], stops: list[str]) -> str | None:
    # Decoding only the tail keeps this O(1) per step; a stop string spans few tokens.
    tail = tokenizer.decode(output_ids[-16:], skip_special_tokens=False)
    for s in stops:
        if s and s in tail:
            return s
    return None


def _collect(
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    logprobs: list[list[float]],
    finish: list[dict[str, Any] | None],
    tokenizer: Any,
) -> list[Completion]:
    result = []
    for i, p in enumerate(prompts):
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(outputs[i], skip_special_tokens=True)
        reason = finish[i] or {"type": "length", "length": len(outputs[i])}
        result.append(Completion(list(p), outputs[i], logprobs[i], reason, text))
    return result
