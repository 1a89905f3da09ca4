"""Routing capture for the embedded engine: SGLang's ``return_routed_experts`` (MoE models).

A request that asks gets the experts each of its tokens was routed to in every MoE layer, as
SGLang returns them: base64 of int32 ``[seq_len - 1, moe_layers, top_k]`` (the last token is
never run through the model; docs/moe.md). Read by :class:`~rl_core.models.moe.RouterTap`
hooks after each forward and kept per request; a retracted request's rows are recomputed with
its next prefill. Used only by the scheduler thread of :mod:`rl_core.engine.core`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_core.models.moe import RouterTap
from rl_core.types import encode_routed_experts

__all__ = ["RoutingCapture"]


class RoutingCapture:
    """Per-request routed experts of a model's forwards (``enabled``: the model is MoE)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tap = RouterTap(model)
        self.enabled = bool(self.tap.routers)
        self._rows: dict[Any, list[torch.Tensor]] = {}  # request -> (tokens, layers, k) parts

    def _take(self, seqs: Sequence[Any]) -> torch.Tensor | None:
        """The last forward's (tokens, layers, top_k), if any of ``seqs`` asks for them."""
        if not self.enabled:
            return None
        if not any(s.req.return_routed_experts for s in seqs):
            self.tap.clear()
            return None
        return self.tap.indices().cpu()

    def prefill(self, seqs: Sequence[Any], rows: Sequence[slice]) -> None:
        """After a prefill forward of ``seqs`` whose tokens sit at ``rows`` of its token order:
        each asking request's rows (replacing any it had: a retracted request starts over)."""
        if (ids := self._take(seqs)) is None:
            return
        for s, r in zip(seqs, rows, strict=True):
            if s.req.return_routed_experts:
                self._rows[s] = [ids[r]]

    def decode(self, seqs: Sequence[Any]) -> None:
        """After a decode forward: row ``j`` is the token ``seqs[j]`` fed."""
        if (ids := self._take(seqs)) is None:
            return
        for j, s in enumerate(seqs):
            if s.req.return_routed_experts and s in self._rows:
                self._rows[s].append(ids[j : j + 1])

    def result(self, s: Any, seq_len: int) -> str | None:
        """The finished request's ``routed_experts`` (None if it did not ask); its rows are
        dropped. An abort before prefill has no rows: an empty array."""
        parts = self._rows.pop(s, None)
        if not s.req.return_routed_experts:
            return None
        ids = torch.cat(parts)[: max(seq_len - 1, 0)] if parts else torch.zeros(0, dtype=torch.int32)
        return encode_routed_experts(ids)
