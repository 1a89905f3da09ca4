"""The running batch's KV cache for the engine's scheduler: two layouts behind one interface.

``prefill`` computes new rows into staging, ``admit`` moves the kept ones into the batch,
``step`` decodes one token per row, ``select`` keeps some rows (returns their new order),
``clear``/``free`` empty it (``free`` drops the buffers), ``weights_changed`` drops anything
derived from the weights, ``token_rows`` locates each prefilled sequence's tokens (for MoE
routing capture). :class:`SlotBatch` (Llama/Qwen families) copies nothing per step, and keeps
finished rows' KV in its :class:`~rl_core.engine.prefix_cache.PrefixCache` for later prompts
that start with them (``remember``; ``prefill`` computes only what follows a hit);
:class:`PaddedBatch` runs any full-attention model (docs/rollout.md, "KV cache layouts").
Both compute identical prompts of one prefill (a GRPO group's samples: the same ids and
pictures) once and give each of them its own copy of the result (:func:`shared_rows`). Each row
carries its LoRA adapter's name: with ``lora`` set (several adapters per batch,
engine/lora.py) every forward binds them, so each row's tokens get its own adapter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rl_core.engine.prefix_cache import PrefixCache, PrefixHit
from rl_core.models.vlm import ImageInputs, concat_images, is_vision_model, mrope_positions

if TYPE_CHECKING:
    from rl_core.engine.lora import RowAdapters

__all__ = ["KV_LAYOUTS", "PaddedBatch", "SlotBatch", "make_kv_batch"]

log = logging.getLogger(__name__)

KV_LAYOUTS = ("auto", "slots", "padded")
# Llama-family decoders SlotBatch runs on the model's own modules (checked in ``unsupported``).
_SLOT_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def make_kv_batch(layout: str, model: torch.nn.Module, device: torch.device, pad_token_id: int,
                  max_rows: int, model_path: str, prefix_cache_tokens: int = 0,
                  ) -> SlotBatch | PaddedBatch:
    """The KV cache for ``layout``: "slots" (fast, Llama-family models), "padded" (any
    full-attention model, through its own forward) or "auto" (slots when supported).
    ``prefix_cache_tokens`` > 0: a prefix cache of that many tokens (slots only)."""
    if not all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers):
        raise ValueError(f"{model_path}: sliding-window or hybrid KV caches are not supported by "
                         "the embedded engine (it pads and merges full-attention caches only)")
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {layout!r}")
    why_not = SlotBatch.unsupported(model)
    if layout == "slots" and why_not:
        raise ValueError(f"{model_path}: kv_layout='slots' is not possible: {why_not}")
    if layout == "padded" or why_not:
        if layout == "auto":
            log.info("%s: padded KV cache (%s)", model_path, why_not)
        if prefix_cache_tokens:
            log.warning("%s: the prefix cache needs the slots KV layout (%s); it is off",
                        model_path, why_not or "kv_layout='padded'")
        return PaddedBatch(model, device, pad_token_id)
    return SlotBatch(model, device, pad_token_id, max_rows, prefix_cache_tokens)


def shared_rows(seqs: list[list[int]], images: list[ImageInputs | None] | None,
                loras: Sequence[str | None] | None = None) -> tuple[list[int], list[int]]:
    """(the first row of each distinct sequence, each row's index into those): rows with the
    same ids, the same pictures (pixels and grids equal) and the same LoRA adapter are one
    prefill row."""
    firsts: list[int] = []
    where: list[int] = []
    seen: dict[tuple[Any, ...], list[int]] = {}
    for i, q in enumerate(seqs):
        im = images[i] if images else None
        same = seen.setdefault((loras[i] if loras else None, *q), [])
        for u in same:
            other = images[firsts[u]] if images else None
            if _same_images(im, other):
                where.append(u)
                break
        else:
            same.append(len(firsts))
            where.append(len(firsts))
            firsts.append(i)
    return firsts, where


def _same_images(a: ImageInputs | None, b: ImageInputs | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.tokens == b.tokens and torch.equal(a.grid_thw, b.grid_thw)
                      and torch.equal(a.pixel_values, b.pixel_values))


def _bind(lora: RowAdapters | None, names: list[str | None] | None,
          counts: list[int] | None = None) -> contextlib.AbstractContextManager[None]:
    """The rows' adapters bound for the forwards inside (nothing without ``lora``)."""
    if lora is None or names is None:
        return contextlib.nullcontext()
    return lora.bind(names, counts)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotBatch:
    """Preallocated per-row KV slots, written in place; the decoder runs on the model's modules.
    Per layer, K and V of (slots, kv_heads, columns, head_dim): row ``r`` in slot ``r``, its
    position ``p`` in column ``p``, so a decode step writes one column per row. Layout, growth
    and attention: docs/rollout.md, "KV cache layouts"."""

    layout = "slots"

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_token_id: int,
                 max_rows: int, prefix_cache_tokens: int = 0) -> None:
        self.model, self.inner = model, model.model
        self.prefix = PrefixCache(prefix_cache_tokens)
        attn = self.inner.layers[0].self_attn
        self.head_dim, self.scaling = int(attn.head_dim), float(attn.scaling)
        self.q_size, self.kv_size = int(attn.q_proj.out_features), int(attn.k_proj.out_features)
        self.kv_heads, self.qk_norm = self.kv_size // self.head_dim, hasattr(attn, "q_norm")
        self._packed: list[Any] | None = None
        self.device, self.pad, self.max_rows = device, pad_token_id, max_rows
        self.k, self.v = [], []  # per layer: (slots, kv_heads, columns, head_dim) tensors
        self.lora: RowAdapters | None = None
        self.clear()

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why this class cannot run ``model`` (None: it can)."""
        cfg = model.config
        if (kind := getattr(cfg, "model_type", None)) not in _SLOT_MODEL_TYPES:
            return f"model_type {kind!r} is not one of {sorted(_SLOT_MODEL_TYPES)}"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act!r} (expected silu)"
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, p) for p in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return "not a Llama-style decoder (model.model.{embed_tokens,layers,norm,rotary_emb})"
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
            return "no linear lm_head"
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            projs = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if not (all(isinstance(p, torch.nn.Linear) for p in projs)
                    and hasattr(attn, "head_dim") and hasattr(attn, "scaling")):
                return "a decoder layer without Llama attention (q/k/v/o_proj, head_dim, scaling)"
            if getattr(attn, "sliding_window", None):
                return "sliding-window attention"
            projs = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            dense = all(isinstance(p, torch.nn.Linear) for p in projs) and hasattr(mlp, "act_fn")
            if not (dense or (hasattr(mlp, "gate") and hasattr(mlp, "experts"))):
                return "a decoder layer without a gated MLP (gate/up/down_proj, act_fn) or MoE block"
            if not all(hasattr(layer, p) for p in ("input_layernorm", "post_attention_layernorm")):
                return "a decoder layer without Llama-style norms"
        return None

    def prefill(self, seqs: list[list[int]], reserves: list[int], keep_logits: int,
                images: list[ImageInputs | None] | None = None,
                prefixes: list[PrefixHit | None] | None = None,
                loras: list[str | None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute ``seqs`` into the slots after the batch; (last logits, prompt logits):
        ``keep_logits`` > 0 (one sequence only, no prefix) also returns its last positions'
        logits. ``prefixes``: each sequence's cached prefix (its K/V copied into the slot; only
        the tokens after it are computed); ``loras``: each sequence's adapter. Text only:
        ``images`` must be None or all None (vision models run padded)."""
        assert not any(images or []), "SlotBatch runs text models only"
        loras = loras or [None] * len(seqs)
        firsts, where = shared_rows(seqs, None, loras)  # identical prompts computed once
        names = [loras[u] for u in firsts]
        self.shared = len(seqs) - len(firsts)
        hits = [prefixes[u] if prefixes else None for u in firsts]
        starts = [h.length if h is not None else 0 for h in hits]
        assert not (keep_logits and any(starts)), "prompt logits need the whole prompt"
        lengths = [len(seqs[u]) for u in firsts]
        n, b, width = len(firsts), self.rows, max(lengths)
        self._reserve(b + len(seqs), width, max([*self.limits, *reserves]))
        for i, hit in enumerate(hits):  # the cached prefix's K/V into the row's slot
            if hit is not None:
                for layer in range(len(self.k)):
                    self.k[layer][b + i, :, : hit.length] = hit.keys[layer]
                    self.v[layer][b + i, :, : hit.length] = hit.values[layer]
        # Packed: the rows' tokens (after any prefix) back to back, no padding, through every
        # matrix product; ``index`` places each in the right-padded (n, width) layout.
        ids = torch.tensor([t for u, p in zip(firsts, starts, strict=True) for t in seqs[u][p:]],
                           dtype=torch.long)
        positions = torch.cat([torch.arange(p, k) for p, k in zip(starts, lengths, strict=True)])
        index = torch.cat([torch.arange(p, k) + i * width
                           for i, (p, k) in enumerate(zip(starts, lengths, strict=True))])
        computed = [k - p for p, k in zip(starts, lengths, strict=True)]
        with _bind(self.lora, names, computed):
            h = self._forward(ids[None].to(self.device), positions[None].to(self.device),
                              prefill_at=b, packing=(index.to(self.device), n, width),
                              prefixed=any(starts))
        with _bind(self.lora, names):  # logits: each distinct row's positions
            if keep_logits:  # one sequence: the packed row is the sequence
                prompt_logits = self.logits(h[0, width - keep_logits :])
                last = prompt_logits[-1:]
            else:
                ends = torch.tensor(computed, device=self.device).cumsum(0) - 1
                prompt_logits, last = None, self.logits(h[0, ends])[where]
        self._staged = ([len(q) for q in seqs], list(reserves), where, loras)
        return last, prompt_logits

    def token_rows(self, lengths: list[int]) -> list[slice]:
        """Each prefilled sequence's tokens in the forward's token order (the distinct
        sequences packed back to back; a shared one's are its first's)."""
        assert self._staged is not None
        where = self._staged[2]
        firsts = [where.index(u) for u in range(max(where) + 1)]
        ends = torch.tensor([lengths[i] for i in firsts]).cumsum(0).tolist()
        return [slice(ends[u] - n, ends[u]) for n, u in zip(lengths, where, strict=True)]

    def admit(self, keep: list[int]) -> None:
        """Append staged rows ``keep`` (indices into the last prefill) to the batch: each
        row's slot gets its prefill row's keys and values (a shared one's, copied)."""
        assert self._staged is not None
        (lengths, reserves, where, loras), self._staged = self._staged, None
        if not keep:
            return
        self.row_loras += [loras[i] for i in keep]
        b, src = self.rows, [where[i] for i in keep]
        if src != list(range(len(keep))):  # compact (and copy shared rows) towards slot b
            cols = max(lengths[i] for i in keep)
            idx = torch.tensor([b + u for u in src], dtype=torch.long, device=self.device)
            for buf in (*self.k, *self.v):
                buf[b : b + len(keep), :, :cols] = buf[idx, :, :cols]  # gathered first: a copy
        new_pos = torch.tensor([lengths[i] for i in keep], dtype=torch.long, device=self.device)
        self.pos = torch.cat([self.pos, new_pos])
        self.limits += [reserves[i] for i in keep]
        self.rows += len(keep)
        self.max_len = max(self.max_len, *(lengths[i] for i in keep))
        self._rows_index = torch.arange(self.rows, device=self.device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's pending token (at its position ``pos``); the next logits (B, V)."""
        self._reserve(self.rows, self.max_len + 1, max(self.limits))
        width = self.max_len + 1
        cols = torch.arange(width, device=self.device)
        mask = cols[None, :] <= self.pos[:, None]  # (B, width): columns each row may see
        with _bind(self.lora, self.row_loras):
            h = self._forward(tokens[:, None].to(self.device), self.pos[:, None],
                              decode_mask=mask)
            self.pos, self.max_len = self.pos + 1, self.max_len + 1
            return self.logits(h[:, 0])

    def remember(self, rows: list[tuple[int, list[int]]]) -> None:
        """Keep each finished row's K/V in the prefix cache: ``(row, ids)``, ``ids`` the row's
        computed tokens (its prompt and every output token but the pending one). Several
        adapters per batch: only the base model's rows (the cache holds no adapter's KV)."""
        for r, ids in rows:
            n = len(ids)
            if n != int(self.pos[r]) or (self.lora and self.row_loras[r]):  # never a guess
                continue
            self.prefix.insert(ids, [k[r, :, :n].clone() for k in self.k],
                               [v[r, :, :n].clone() for v in self.v])

    def select(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep``; rows past the new end fill the freed slots. The new order."""
        if not keep:
            self.clear()
            return []
        size, kept = len(keep), set(keep)
        holes = [r for r in range(size) if r not in kept]
        movers = [r for r in keep if r >= size]
        order = list(range(size))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if holes:
            dst = torch.tensor(holes, dtype=torch.long, device=self.device)
            src = torch.tensor(movers, dtype=torch.long, device=self.device)
            for buf in (*self.k, *self.v):
                buf[dst, :, : self.max_len] = buf[src, :, : self.max_len]
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self.pos = self.pos[idx]
        self.limits = [self.limits[o] for o in order]
        self.row_loras = [self.row_loras[o] for o in order]
        self.rows, self.max_len = size, int(self.pos.max())
        self._rows_index = torch.arange(size, device=self.device)
        return order

    def clear(self) -> None:
        """Empty the batch; the buffers stay allocated for the next one."""
        self.rows, self.max_len = 0, 0
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.limits: list[int] = []
        self.row_loras: list[str | None] = []  # each row's adapter (None: the base model)
        self._staged: tuple[list[int], list[int], list[int], list[str | None]] | None = None
        self._rows_index = self.pos
        self.shared = 0  # rows of the last prefill that were another row's copy

    def free(self) -> None:
        """Empty the batch and drop the KV buffers and the prefix cache."""
        self.clear()
        self.k, self.v = [], []
        self.prefix.clear()

    def weights_changed(self) -> None:
        """Drop the packed weights (rebuilt from the model at the next forward) and the
        prefix cache (its K/V came from the old weights)."""
        self._packed = None
        self.prefix.clear()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states (..., hidden)."""
        return self._mm(h, self._weights()[-1], self.model.lm_head)

    def _mm(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None],
            *linears: torch.nn.Module) -> torch.Tensor:
        """:func:`_matmul`, plus the bound rows' adapters on ``linears`` (packed side by side)."""
        out = _matmul(x, packed)
        return out if self.lora is None else self.lora.apply(linears, x, out)

    def _reserve(self, rows: int, columns: int, column_cap: int) -> None:
        """Grow the buffers to hold ``rows`` slots of ``columns`` (geometrically, capped)."""
        have_rows, _, have_cols, _ = self.k[0].shape if self.k else (0, 0, 0, 0)
        if rows <= have_rows and columns <= have_cols:
            return
        new_rows = max(rows, min(self.max_rows, 2 * have_rows)) if rows > have_rows else have_rows
        new_cols = have_cols
        if columns > have_cols:
            new_cols = max(columns, min(column_cap, max(2 * have_cols, 2 * columns)))
        weight = self.inner.embed_tokens.weight
        shape = (new_rows, self.kv_heads, new_cols, self.head_dim)
        live, used = self.rows, self.max_len
        for bufs in (self.k, self.v):
            for i in range(len(self.inner.layers)):
                # Zeros, not empty: masked columns still meet V in a matmul (0 * NaN = NaN).
                grown = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                if i < len(bufs):
                    grown[:live, :, :used] = bufs[i][:live, :, :used]
                bufs[i : i + 1] = [grown]  # replaces layer i, or appends it the first time

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, *, prefill_at: int | None = None,
                 packing: tuple[torch.Tensor, int, int] | None = None,
                 decode_mask: torch.Tensor | None = None, prefixed: bool = False) -> torch.Tensor:
        """Final hidden states for ``ids`` (n, T). Prefill (``prefill_at=b``, ``packing=(index,
        rows, width)``): ``ids`` (1, T) packed, attention on the right-padded (rows, width) layout
        (token ``j`` at ``index[j]``), keys to slots ``b..`` (``prefixed``: the slots already
        hold cached prefixes, attended to as they are). Decode (``decode_mask`` (B, width),
        T = 1): keys to column ``pos`` of each slot, attention over ``[0, width)``."""
        (n, t), hd, packed = ids.shape, self.head_dim, self._weights()
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (n, 1, T, hd)
        if decode_mask is not None:
            width = decode_mask.shape[1]
            # Additive mask (0 / -inf) for every (row, KV head, query head of the group).
            bias = torch.zeros(decode_mask.shape, dtype=h.dtype, device=h.device)
            bias = bias.masked_fill_(~decode_mask, float("-inf"))[:, None, None, :]
            groups = self.q_size // self.kv_size
            bias = bias.expand(n, self.kv_heads, groups, width).reshape(-1, groups, width)
            rows = self._rows_index
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            qkv_w, o_w, gate_up_w, down_w = packed[i]
            qkv = self._mm(layer.input_layernorm(h), qkv_w, attn.q_proj, attn.k_proj, attn.v_proj)
            q = qkv[..., : self.q_size].view(n, t, -1, hd)
            k = qkv[..., self.q_size : self.q_size + self.kv_size].view(n, t, -1, hd)
            v = qkv[..., self.q_size + self.kv_size :].view(n, t, -1, hd)
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if decode_mask is None:
                assert prefill_at is not None and packing is not None
                index, rows_n, width = packing
                at = slice(prefill_at, prefill_at + rows_n)
                q = _unpack(q, index, rows_n, width)
                k = _unpack(k, index, rows_n, width, self.k[i][at, :, :width] if prefixed else None)
                v = _unpack(v, index, rows_n, width, self.v[i][at, :, :width] if prefixed else None)
                self.k[i][prefill_at : prefill_at + rows_n, :, :width] = k
                self.v[i][prefill_at : prefill_at + rows_n, :, :width] = v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                   enable_gqa=True)
                o = o.transpose(1, 2).reshape(rows_n * width, -1)[index].view(n, t, -1)
            else:
                self.k[i][rows, :, self.pos] = k[:, :, 0]
                self.v[i][rows, :, self.pos] = v[:, :, 0]
                # (row, KV head) pairs as one batch, without repeat_kv: the query heads of a
                # KV head form the rows of one small matrix. Slot views, no copies.
                keys = self.k[i][:n, :, :width].reshape(-1, width, hd)
                values = self.v[i][:n, :, :width].reshape(-1, width, hd)
                qg = q.reshape(-1, groups, hd)
                scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scaling)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                o = torch.bmm(probs, values).view(n, -1, 1, hd).transpose(1, 2).reshape(n, t, -1)
            h = h.add_(self._mm(o, o_w, attn.o_proj))
            if gate_up_w is None:  # an MoE block: the model's router and experts
                h = h.add_(layer.mlp(layer.post_attention_layernorm(h)))
                continue
            mlp = layer.mlp
            gate_up = self._mm(layer.post_attention_layernorm(h), gate_up_w, mlp.gate_proj,
                               mlp.up_proj)
            half = gate_up.shape[-1] // 2
            act = mlp.act_fn(gate_up[..., :half]).mul_(gate_up[..., half:])
            h = h.add_(self._mm(act, down_w, mlp.down_proj))
        return self.inner.norm(h)

    def _weights(self) -> list[Any]:
        """Per layer (qkv, o, gate_up, down), then the LM head, as ``_pack``ed matrices
        (gate_up and down None for an MoE layer: it runs as the model's module)."""
        if self._packed is None:
            def mlp(x: torch.nn.Module) -> tuple[Any, Any]:
                if not hasattr(x.mlp, "gate_proj"):
                    return None, None
                return _pack(x.mlp.gate_proj, x.mlp.up_proj), _pack(x.mlp.down_proj)

            self._packed = [*[(_pack(x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj),
                               _pack(x.self_attn.o_proj), *mlp(x)) for x in self.inner.layers],
                            _pack(self.model.lm_head)]
        return self._packed


def _unpack(x: torch.Tensor, index: torch.Tensor, rows: int, width: int,
            base: torch.Tensor | None = None) -> torch.Tensor:
    """Packed (1, heads, T, hd) to right-padded (rows, heads, width, hd); padding is zeros, or
    ``base``'s (rows, heads, width, hd) values (cached prefixes) where no token goes."""
    heads, hd = x.shape[1], x.shape[3]
    out = (x.new_zeros(rows * width, heads, hd) if base is None
           else base.transpose(1, 2).reshape(rows * width, heads, hd).clone())
    out[index] = x[0].transpose(0, 1)
    return out.view(rows, width, heads, hd).transpose(1, 2)


def _pack(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linears`` side by side as one (in, sum of out) matrix, and their joint bias: ``x @ W``
    with W stored (in, out) runs ~1.5x faster on CPU than ``F.linear``'s ``x @ W.T`` for
    decode-sized batches, and one wide product replaces two or three."""
    weight = torch.cat([m.weight for m in linears]).t().contiguous()
    if all(m.bias is None for m in linears):
        return weight, None
    bias = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
    return weight, torch.cat(bias)


def _matmul(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """``x @ weight + bias`` for a :func:`_pack`ed linear (any leading dims)."""
    weight, bias = packed
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return out.view(*x.shape[:-1], weight.shape[1])


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad a (B, H, T, D) KV tensor with ``n`` zero columns at the front of T."""
    return F.pad(t, (0, 0, n, 0)) if n else t


class PaddedBatch:
    """The running batch through the model's own forward: any full-attention HF causal LM.
    Rows left-padded in a ``DynamicCache`` (per-row masks, positions); leading columns no row
    needs are trimmed when rows leave; every decode step copies the whole cache. A Qwen2-VL-
    family model gets its rows' images in prefill and M-RoPE positions (models/vlm.py)."""

    layout = "padded"

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_token_id: int) -> None:
        self.model, self.device, self.pad = model, device, pad_token_id
        self.vision = is_vision_model(model)  # M-RoPE: 3-row positions, images in prefill
        self.prefix = PrefixCache(0)  # no prefix cache in this layout (make_kv_batch says so)
        self.lora: RowAdapters | None = None
        self.clear()

    def prefill(self, seqs: list[list[int]], reserves: list[int], keep_logits: int,
                images: list[ImageInputs | None] | None = None,
                prefixes: list[PrefixHit | None] | None = None,
                loras: list[str | None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert not any(prefixes or []), "the padded layout has no prefix cache"
        loras = loras or [None] * len(seqs)
        firsts, where = shared_rows(seqs, images, loras)  # identical prompts and pictures: once
        self._where, self.shared, self._loras = where, len(seqs) - len(firsts), loras
        images = [images[u] for u in firsts] if images else None
        seqs = [seqs[u] for u in firsts]
        width = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, width - len(q) :] = torch.tensor(q, dtype=torch.long)
            mask[i, width - len(q) :] = 1
        extra: dict[str, Any] = {}
        if self.vision:  # per-row M-RoPE positions; the rows' images in row order
            pixels = concat_images(images or [])
            positions, next_pos = mrope_positions(self.model, ids, mask, pixels)
            if pixels is not None:
                extra = {"pixel_values": pixels.pixel_values.to(self.device),
                         "image_grid_thw": pixels.grid_thw.to(self.device)}
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            next_pos = positions[:, -1] + 1
        with _bind(self.lora, [loras[u] for u in firsts]):
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=True,
                             logits_to_keep=max(1, keep_logits), **extra)
        self._staged = (out.past_key_values, mask, next_pos)
        return out.logits[where, -1, :], (out.logits[0] if keep_logits else None)

    def token_rows(self, lengths: list[int]) -> list[slice]:
        """Each prefilled sequence's tokens in the forward's token order (left-padded rows; a
        shared sequence's are its first's)."""
        width = max(lengths)
        return [slice((u + 1) * width - n, (u + 1) * width)
                for n, u in zip(lengths, self._where, strict=True)]

    def admit(self, keep: list[int]) -> None:
        assert self._staged is not None
        (cache, mask, next_pos), self._staged = self._staged, None
        if not keep:
            return
        self.row_loras += [self._loras[i] for i in keep]
        src = [self._where[i] for i in keep]
        idx = torch.tensor(src, dtype=torch.long)
        if src != list(range(mask.shape[0])):  # some rows left, or shared rows copied
            cache.batch_select_indices(idx.to(self.device))
        mask, next_pos = mask[idx], next_pos[idx]
        if self.cache is None:
            self.cache, self.mask, self.next_pos = cache, mask, next_pos
        else:
            assert self.mask is not None and self.next_pos is not None
            old, new = self.mask.shape[1], mask.shape[1]
            width = max(old, new)
            for a, b in zip(self.cache.layers, cache.layers, strict=True):
                a.keys = torch.cat([_left_pad(a.keys, width - old), _left_pad(b.keys, width - new)])
                a.values = torch.cat([_left_pad(a.values, width - old),
                                      _left_pad(b.values, width - new)])
            self.mask = torch.cat([F.pad(self.mask, (width - old, 0)),
                                   F.pad(mask, (width - new, 0))])
            self.next_pos = torch.cat([self.next_pos, next_pos])
        self.rows += len(keep)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None and self.next_pos is not None
        ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype)
        self.mask = torch.cat([self.mask, ones], dim=1)
        positions = self.next_pos[:, None]
        if self.vision:  # the same next position on all three M-RoPE rows
            positions = positions[None].expand(3, -1, -1)
        # transformers 5 names the cache `cache` (`past_key_values` warns on every call of
        # the VLM classes); text models keep the name every version takes
        kv = {"cache": self.cache} if self.vision else {"past_key_values": self.cache}
        with _bind(self.lora, self.row_loras):
            out = self.model(input_ids=tokens[:, None].to(self.device),
                             attention_mask=self.mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=True, **kv)
        self.cache = out.past_key_values
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def select(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` in order; trim columns no row needs any more."""
        if not keep:
            self.clear()
            return []
        assert self.cache is not None and self.mask is not None and self.next_pos is not None
        idx = torch.tensor(keep, dtype=torch.long)
        self.cache.batch_select_indices(idx.to(self.device))
        self.mask, self.next_pos, self.rows = self.mask[idx], self.next_pos[idx], len(keep)
        self.row_loras = [self.row_loras[j] for j in keep]
        lead = int((self.mask.cumsum(-1) == 0).sum(-1).min())
        if lead:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
            self.mask = self.mask[:, lead:]
        return keep

    def clear(self) -> None:
        self.rows = 0
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, L) long: 1 where the cache holds a token
        self.next_pos: torch.Tensor | None = None  # (B,) position of the pending token
        self._staged: tuple[DynamicCache, torch.Tensor, torch.Tensor] | None = None
        self._where: list[int] = []  # each row of the last prefill -> its computed row
        self._loras: list[str | None] = []  # each row of the last prefill: its adapter
        self.row_loras: list[str | None] = []  # each row's adapter (None: the base model)
        self.shared = 0  # rows of the last prefill that were another row's copy

    free = clear  # nothing is kept between batches

    def remember(self, rows: list[tuple[int, list[int]]]) -> None:  # no prefix cache here
        pass

    def weights_changed(self) -> None:  # the model's forward reads its weights directly
        pass
