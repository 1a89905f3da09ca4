"""The torch trainer's mixture-of-experts forward: routing replay (R3), router metrics, aux loss.

:class:`MoeForward` wraps every forward of an MoE model (policy, reference, DDP/FSDP2
wrappers). With ``train.moe.routing_replay`` each router takes the batch's recorded experts
(``Batch.routed_experts``, padded or packed layout; -1: its own choice) with the training
router's renormalised gate weights, so it still learns. Forwards with gradients also yield
the balance loss and router metrics over the tokens that predict a real token. docs/moe.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from rl_core.config import ConfigError, MoeConfig
from rl_core.models.moe import RouterTap, moe_dims, router_metrics, routers
from rl_core.training.packing import PackPlan
from rl_core.types import Batch

__all__ = ["MoeForward"]

T = TypeVar("T")


class MoeForward:
    """Routing replay and router metrics around the forwards of one MoE model."""

    def __init__(self, model: torch.nn.Module, cfg: MoeConfig, model_path: str | Path) -> None:
        dims = moe_dims(model)
        if dims is None:
            raise ValueError(f"{model_path} is not a mixture-of-experts model")
        self.layers, self.top_k, self.experts = dims
        self.cfg = cfg
        self._taps: dict[int, RouterTap] = {}  # by the id of the first router module
        # The last forward with gradients: (load-balancing loss, router metrics).
        self.last: tuple[torch.Tensor, dict[str, float]] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, cfg: MoeConfig,
                  model_path: str | Path) -> MoeForward | None:
        """The MoE forward of ``model``; None for a dense model (an error if
        ``train.moe.routing_replay`` asks for replay)."""
        if moe_dims(model) is not None:
            return cls(model, cfg, model_path)
        if cfg.routing_replay:
            raise ConfigError(f"train.moe.routing_replay=true, but {model_path} is a dense model "
                              "(no mixture-of-experts routers): use an MoE model (e.g. "
                              "model.tiny_arch=qwen3_moe) or set train.moe.routing_replay=false")
        return None

    def _tap(self, model: torch.nn.Module) -> RouterTap:
        key = id(routers(model)[0])
        if key not in self._taps:
            self._taps[key] = RouterTap(model)
        return self._taps[key]

    def run(self, model: torch.nn.Module, batch: Batch, plan: PackPlan | None,
            forward: Callable[[], T]) -> T:
        """``forward()`` (the model on ``batch``, packed by ``plan`` or not) with the rollout's
        routing replayed (``routing_replay``) and, with gradients, the router's statistics."""
        tap = self._tap(model)
        tap.clear()
        tap.keep_logits = torch.is_grad_enabled()
        replay = self._layout(batch.routed_experts, plan) if (
            self.cfg.routing_replay and batch.routed_experts is not None) else None
        tap.replay(replay)
        try:
            out = forward()
        finally:
            tap.replay(None)
        if tap.keep_logits:
            tokens = self._tokens(batch, plan)
            self.last = router_metrics(tap.logits, tap.indices(), tokens,
                                       per_layer=self.cfg.per_layer_metrics)
            if self.cfg.routing_replay:  # the share of tokens routed by the rollout's experts
                given = replay is not None and bool(tokens.any())
                share = float((replay[:, 0, 0] >= 0)[tokens].float().mean()) if given else 0.0
                self.last[1]["moe/replayed_tokens"] = share
        tap.clear()
        return out

    def _layout(self, routed: Any, plan: PackPlan | None) -> torch.Tensor:
        """(B, L-1, layers * top_k) per-token experts -> (tokens, layers, top_k) in the
        forward's flattened token order (the last token of a row, never scored: -1)."""
        b, cols, width = routed.shape
        if width != self.layers * self.top_k:
            raise ValueError(f"the samples' routed_experts hold {width} experts per token; this "
                             f"model routes {self.layers} layers x top-{self.top_k}")
        if plan is None:
            out = torch.cat([routed, routed.new_full((b, 1, width), -1)], dim=1)
        else:
            out = routed.new_full((plan.input_ids.numel(), width), -1)
            valid = routed[..., 0] >= 0  # positions a shared prompt fills from any of its rows
            out[plan.src[valid]] = routed[valid]
        return out.reshape(-1, self.layers, self.top_k)

    @staticmethod
    def _tokens(batch: Batch, plan: PackPlan | None) -> torch.Tensor:
        """The forward's tokens that predict a real token (flattened bool)."""
        scored = batch.attention_mask[:, 1:].bool()
        if plan is None:
            return torch.cat([scored, torch.zeros_like(scored[:, :1])], dim=1).reshape(-1)
        mask = torch.zeros(plan.input_ids.numel(), dtype=torch.bool)
        mask[plan.src[scored]] = True
        return mask
