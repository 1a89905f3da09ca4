"""Packed forwards: fewer, fuller rows, with logits equal to the padded rows'.

:func:`plan_packing` (GRPO): one row per group, ``[prompt, completion_1, ..., completion_n]``,
with a block attention mask and position ids that restart after the prompt, so each prompt
runs once and gets the summed gradient of its completions; only where a FLOP estimate says it
is cheaper (docs/training.md). :func:`plan_first_fit` (SFT's ``train.packing``): whole rows,
first-fit into rows of a fixed length, positions restarting per row. Either way
:meth:`PackPlan.gather` maps the logits back to the padded layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PackPlan", "plan_first_fit", "plan_packing"]

# Pack only when the estimate is at least this much cheaper (the mask and the gather cost a
# little, and the estimate is rough).
MIN_SAVING = 0.85


@dataclass
class PackPlan:
    """A micro-batch as packed rows."""

    input_ids: torch.Tensor  # (G, T) long
    position_ids: torch.Tensor  # (G, T) long
    attention_mask: torch.Tensor  # (G, 1, T, T) additive float mask
    src: torch.Tensor  # (B, L-1) long: the packed row (flattened G*T) predicting token t+1

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Packed logits (G, T, V) -> the padded layout's (B, L-1, V)."""
        return logits.reshape(-1, logits.shape[-1])[self.src]


def _groups(ids: torch.Tensor, prompt_lens: list[int],
            images: Sequence[object] | None = None) -> list[list[int]]:
    """Runs of consecutive rows that share one prompt (token for token, and ``images``)."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompt_lens):
        if groups:
            j = groups[-1][0]
            if prompt_lens[j] == p and torch.equal(ids[j, :p], ids[i, :p]) and (
                    images is None or images[i] == images[j]):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _cost(rows: int, width: int, params: int, layers: int, hidden: int) -> float:
    """Forward FLOPs, roughly: linear layers 2 * params per token, attention 4 * hidden * T^2
    per layer and row (scores and weighted sum over the dense mask)."""
    return 2.0 * params * rows * width + 4.0 * layers * hidden * rows * width * width


def plan_packing(ids: torch.Tensor, attention: torch.Tensor, prompt_lens: torch.Tensor, *,
                 params: int, layers: int, hidden: int, dtype: torch.dtype = torch.float32,
                 images: Sequence[object] | None = None) -> PackPlan | None:
    """The packed layout of a right-padded micro-batch, or None where it would not be cheaper
    (no two rows share a prompt, or long completions make the dense mask cost more). Rows
    share a prompt when its tokens and their ``images`` (per row, when given) are equal."""
    lengths = attention.sum(-1).tolist()
    plens = prompt_lens.tolist()
    groups = _groups(ids, plens, images)
    if len(groups) == len(plens):
        return None
    widths = [plens[g[0]] + sum(lengths[i] - plens[i] for i in g) for g in groups]
    width = max(widths)
    b, seq = ids.shape
    padded = _cost(b, seq, params, layers, hidden)
    if _cost(len(groups), width, params, layers, hidden) > MIN_SAVING * padded:
        return None
    packed = torch.zeros((len(groups), width), dtype=torch.long)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    seg = torch.full((len(groups), width), -1, dtype=torch.long)  # -1 pad, 0 prompt, k sample
    src = torch.zeros((b, max(seq - 1, 1)), dtype=torch.long)
    for g, rows in enumerate(groups):
        p = plens[rows[0]]
        packed[g, :p] = ids[rows[0], :p]
        pos[g, :p] = torch.arange(p)
        seg[g, :p] = 0
        at = p
        for k, i in enumerate(rows, start=1):
            n = lengths[i] - p
            packed[g, at : at + n] = ids[i, p : lengths[i]]
            pos[g, at : at + n] = torch.arange(p, p + n)
            seg[g, at : at + n] = k
            # token t+1 of row i is predicted at position t: the prompt's rows for t < p,
            # then this completion's own rows
            where = torch.cat([torch.arange(p), torch.arange(at, at + n)])[: lengths[i] - 1]
            src[i, : where.numel()] = g * width + where
            at += n
    return PackPlan(packed, pos, _block_mask(seg, shared=0, dtype=dtype), src)


def _block_mask(seg: torch.Tensor, shared: int | None, dtype: torch.dtype) -> torch.Tensor:
    """(G, 1, T, T) additive causal mask: a token sees earlier tokens of its own segment
    (``seg``: -1 padding) and of the ``shared`` one (a group's prompt)."""
    width = seg.shape[1]
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # (T, T): key k visible from query q
    same = seg[:, None, :] == seg[:, :, None]
    if shared is not None:
        same |= seg[:, None, :] == shared
    allowed = causal & same & (seg[:, None, :] >= 0)
    allowed |= torch.eye(width, dtype=torch.bool)  # padding sees itself: no empty softmax row
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def plan_first_fit(ids: torch.Tensor, attention: torch.Tensor, length: int,
                   dtype: torch.dtype = torch.float32) -> PackPlan:
    """Each right-padded row of ``ids`` into the first packed row of ``length`` tokens it fits
    in, in order (deterministic); ValueError for a row longer than ``length``."""
    lengths = attention.sum(-1).tolist()
    rows: list[list[int]] = []
    used: list[int] = []
    for i, n in enumerate(lengths):
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than a packed row's {length} "
                             "(train.pack_length)")
        g = next((g for g, u in enumerate(used) if u + n <= length), len(rows))
        if g == len(rows):
            rows.append([])
            used.append(0)
        rows[g].append(i)
        used[g] += n
    width = max(used)
    packed = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros_like(packed)
    seg = torch.full_like(packed, -1)
    src = torch.zeros((ids.shape[0], max(ids.shape[1] - 1, 1)), dtype=torch.long)
    for g, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            packed[g, at : at + n], pos[g, at : at + n], seg[g, at : at + n] = (
                ids[i, :n], torch.arange(n), i)
            src[i, : n - 1] = g * width + at + torch.arange(n - 1)
            at += n
    return PackPlan(packed, pos, _block_mask(seg, shared=None, dtype=dtype), src)
