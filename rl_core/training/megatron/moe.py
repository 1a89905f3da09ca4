"""The routers of a megatron MoE model: routing replay (R3) in, routing statistics out.

:func:`attach` puts a :class:`_Tap` in megatron-core 0.16.1's ``TopKRouter.router_replay`` slot
of every router. A tap replays the batch's given experts (gate weights from this forward's
logits, so the router learns; a FIFO serves recompute's backward re-runs), counts what
:func:`routing_metrics` needs, and adds the balance loss through ``MoEAuxLossAutoScaler``
(``f`` filled in by :meth:`Routing.end`). Under SP each TP rank sees its slice of the
sequence. docs/megatron.md, "Mixture of experts".
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from rl_core.training.megatron.model import Arch

__all__ = ["Routing", "attach", "routing_metrics", "routing_targets"]


def routing_targets(routed: torch.Tensor, seq_len: int, topk: int) -> torch.Tensor:
    """A batch's given experts, ``Batch.routed_experts`` (B, W, layers * k) or (B, W, layers,
    k) with W <= ``seq_len`` (SGLang's ``routed_experts`` per row: ``seq_len - 1`` tokens), as
    megatron's router sees tokens: (seq_len * B, layers, k), sequence-major (megatron's hidden
    states are [S, B, H]); -1 where nothing is given."""
    if routed.dim() == 3:
        routed = routed.reshape(*routed.shape[:2], -1, topk)
    b, width = routed.shape[:2]
    width = min(width, seq_len)
    full = torch.full((b, seq_len, *routed.shape[2:]), -1, dtype=torch.long)
    full[:, :width] = routed[:, :width].long()
    return full.transpose(0, 1).reshape(seq_len * b, *routed.shape[2:])


class Routing:
    """The taps of one model's routers and what they share: the current micro-batch's replay
    targets and valid-token mask, the forward counter, the statistics (``stats``: float64,
    one row per MoE layer of the whole model: ``E`` expert loads, ``E`` probability sums,
    entropy sum, token count; this rank fills only its own stage's rows)."""

    def __init__(self, arch: Arch, *, recompute: bool, sp_group: Any = None) -> None:
        self.arch, self.recompute = arch, recompute
        self.sp_group = sp_group  # the TP group under sequence parallelism, else None
        self.valid_total = 0  # the micro-batch's counted tokens (over the whole sequence)
        self.taps: list[_Tap] = []
        self.tick = 0
        self.targets: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.aux_weight = 0.0
        self.share: torch.Tensor | None = None  # this micro-batch's f (filled by end())
        self.load = torch.zeros(arch.experts)
        self.collect = False
        self.stats = torch.zeros(len(arch.moe_layer_ids), 2 * arch.experts + 2,
                                 dtype=torch.float64)
        self.replayed = torch.zeros(2, dtype=torch.float64)  # given, counted tokens

    def begin(self, attention_mask: torch.Tensor, routed: torch.Tensor | None,
              rows: torch.Tensor | None = None, aux_weight: float = 0.0) -> None:
        """Before each micro-batch's forward: its (B, S) attention mask, its given experts
        (``Batch.routed_experts``: B, W, layers * k) or None (route freely), which rows count
        (B,) (None: all; padding rows, which copy a real row with an empty response mask, do
        not), and the weight of its load-balancing loss in the gradient (0: none)."""
        self.tick += 1
        seq_len = attention_mask.shape[1]
        # the tokens that predict a real token: not the last of a row, not padding
        scored = torch.cat([attention_mask[:, 1:].bool(),
                            attention_mask.new_zeros((attention_mask.shape[0], 1)).bool()], 1)
        valid = scored & (True if rows is None else rows.bool().unsqueeze(-1))
        self.valid = valid.transpose(0, 1).reshape(-1)
        self.valid_total = int(self.valid.sum())
        self.aux_weight = aux_weight
        self.share = torch.zeros(self.arch.experts) if aux_weight else None
        self.load.zero_()
        self.targets = (None if routed is None
                        else routing_targets(routed, seq_len, self.arch.topk))
        if self.sp_group is not None:  # this TP rank's slice of the sequence ([S, B] order)
            import torch.distributed as dist

            size, rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
            width = seq_len // size * attention_mask.shape[0]
            mine = slice(rank * width, (rank + 1) * width)
            self.valid = self.valid[mine]
            self.targets = None if self.targets is None else self.targets[mine]
        if self.targets is not None and self.targets.shape[1] != len(self.stats):
            raise ValueError(f"routed_experts gives {self.targets.shape[1]} MoE layers; the "
                             f"model has {len(self.stats)}")
        if self.collect:  # tokens counted, and how many of them were given experts
            given = (0.0 if self.targets is None
                     else float((self.targets[:, 0, 0] >= 0)[self.valid].sum()))
            self.replayed += torch.tensor([given, float(self.valid.sum())], dtype=torch.float64)

    def end(self) -> None:
        """After the micro-batch's forward on this stage: the pooled expert shares ``f`` its
        load-balancing terms multiply (written through ``.data``: the autograd graph saved
        the buffer, and backward must read these values)."""
        if self.share is not None:
            if self.sp_group is not None:  # every TP rank's tokens
                import torch.distributed as dist

                dist.all_reduce(self.load, group=self.sp_group)
            stage_layers = max(len(self.taps), 1)
            n = max(self.valid_total, 1) * stage_layers
            self.share.data.copy_(self.load / n)

    def used(self) -> list[torch.Tensor]:
        """The experts each of this stage's routers chose in the latest forward,
        (S * B, k) each, in layer order."""
        return [tap.last for tap in self.taps]


class _Tap:
    """One router's ``router_replay`` (the interface ``topk_routing_with_score_function``
    calls: ``get_replay_topk``)."""

    def __init__(self, routing: Routing, router: Any, index: int) -> None:
        self.routing, self.router, self.index = routing, router, index
        self.seen = 0
        self.queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self.last: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                        | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.routing
        values, idx = default_compute_topk(scores, topk, num_groups=num_groups,
                                           group_topk=group_topk)
        fresh = self.seen < state.tick
        self.seen = state.tick
        given = None if state.targets is None else state.targets[:, self.index]
        valid, weight, share, total = state.valid, state.aux_weight, state.share, state.valid_total
        if fresh and state.recompute and self.router.training:  # for the backward's re-run
            self.queue.append((given, valid, weight, share, total))
        elif not fresh and self.queue:
            given, valid, weight, share, total = self.queue.popleft()
        if given is not None:
            given = given.to(idx.device)
            replay = (given >= 0).all(-1, keepdim=True)
            idx = torch.where(replay, given.to(idx.dtype), idx)
            values = scores.gather(1, idx)
        self.last = idx.detach()
        if fresh and state.collect:
            self._count(scores.detach(), idx.detach())
        if fresh and share is not None:
            state.load += self._load(idx[valid.to(idx.device)]).float().cpu()
        if share is not None and self.router.training and torch.is_grad_enabled():
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            probs = self._probs(scores)[valid.to(scores.device)]
            n = max(total, 1) * len(state.stats)  # tokens x every MoE layer
            term = state.arch.experts * (share.to(probs.device) * probs.sum(0)).sum() / n
            values = MoEAuxLossAutoScaler.apply(values, term * weight)
        return values, idx

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The router's probabilities over all experts (norm_topk_prob: megatron's top-k
        runs on the logits; otherwise on the probabilities)."""
        return scores.float().softmax(-1) if self.routing.arch.norm_topk else scores.float()

    def _load(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.bincount(idx.reshape(-1).long(), minlength=self.routing.arch.experts)

    def _count(self, scores: torch.Tensor, idx: torch.Tensor) -> None:
        state, experts = self.routing, self.routing.arch.experts
        valid = state.valid.to(scores.device)
        probs, idx = self._probs(scores)[valid], idx[valid]
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        row = state.stats[self.index]
        row[:experts] += self._load(idx).double().cpu()
        row[experts:2 * experts] += probs.sum(0).double().cpu()
        row[-2] += float(entropy.sum())
        row[-1] += float(valid.sum())


def attach(core: Any, arch: Arch, *, recompute: bool, sp_group: Any = None) -> Routing | None:
    """A :class:`Routing` over the routers of ``core`` (this stage's ``GPTModel``; under
    sequence parallelism ``sp_group`` is its TP group); None for a dense model."""
    if not arch.is_moe:
        return None
    routing = Routing(arch, recompute=recompute, sp_group=sp_group)
    moe_index = {layer: i for i, layer in enumerate(arch.moe_layer_ids)}
    for layer in core.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        global_layer = layer.layer_number - 1  # megatron numbers layers from 1, globally
        if global_layer not in moe_index:
            raise RuntimeError(f"megatron built a router in layer {global_layer}, which the HF "
                               f"config makes dense (MoE layers: {arch.moe_layer_ids})")
        tap = _Tap(routing, router, moe_index[global_layer])
        router.router_replay = tap
        routing.taps.append(tap)
    return routing


def routing_metrics(stats: torch.Tensor, experts: int, *,
                    per_layer: bool = False) -> dict[str, float]:
    """The step's ``moe/*`` metrics from summed :class:`Routing` statistics (one row per MoE
    layer) over all its counted tokens at once; the torch backend's names and formulas
    (docs/moe.md, "Router metrics"). ``per_layer`` adds ``<name>_l<i>`` (not for the loss)."""
    load, probs = stats[:, :experts], stats[:, experts:2 * experts]
    entropy, tokens = stats[:, -2], stats[:, -1]
    if float(tokens.sum()) == 0:
        return {}
    mean = (load.sum(-1) / experts).clamp_min(1e-9)
    layers = {"moe/load_max_over_mean": load.amax(-1) / mean,
              "moe/load_cv": load.std(-1, unbiased=False) / mean,
              "moe/router_entropy": entropy / tokens.clamp_min(1)}
    out = {k: float(v.mean()) for k, v in layers.items()}
    total = tokens.sum()
    out["moe/aux_loss"] = float(experts * (load.sum(0) / total * probs.sum(0) / total).sum())
    if per_layer:
        out.update({f"{k}_l{i}": float(x) for k, v in layers.items() for i, x in enumerate(v)})
    return out
