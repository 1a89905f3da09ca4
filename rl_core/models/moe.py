"""Mixture-of-experts models: the tiny MoE demo model, routing capture and replay, router stats.

Qwen3-MoE and Qwen2-MoE as ``transformers`` 5 runs them: top-k router modules and experts fused
into 3-D tensors, which checkpoints store one by one (:func:`fuse_expert_weights` converts).
:class:`RouterTap`'s forward hooks record each router's choice and, given the rollout's expert
indices, replay them (R3) with the training router's gate weights, so the router still learns;
-1 keeps the router's own choice (docs/moe.md). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["MOE_ARCHS", "PER_EXPERT_CHECKPOINTS", "RouterTap", "build_tiny_moe",
           "fuse_expert_weights", "gate_weights", "hub_layout", "is_moe_checkpoint", "moe_dims",
           "names_experts_one_by_one",
           "pin_eager_experts", "prefer_fast_experts", "router_metrics", "routers"]

# The tiny demo's MoE architectures (model.tiny_arch); any model whose routers are
# transformers' TopKRouter modules runs on the engine and the trainer.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
# Model types whose checkpoints (and SGLang's loaders) name the experts one by one,
# ``<p>.mlp.experts.<e>.{gate,up,down}_proj.weight``, while transformers 5 runs them fused
# (E, 2I, H) / (E, H, I). Mixtral's checkpoints say ``block_sparse_moe.experts.<e>.w1`` and
# gpt-oss's are fused (E, H, 2I), interleaved: neither is this layout.
PER_EXPERT_CHECKPOINTS = frozenset({"qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe",
                                    "olmoe"})
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def _hf_config(model_path: str | Path) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def names_experts_one_by_one(model_path: str | Path) -> bool:
    """Whether the checkpoint in ``model_path`` is of a :data:`PER_EXPERT_CHECKPOINTS` type."""
    return _hf_config(model_path).get("model_type") in PER_EXPERT_CHECKPOINTS


def is_moe_checkpoint(model_path: str | Path) -> bool:
    """Whether the HF model in ``model_path`` routes tokens to experts (its config.json)."""
    config = _hf_config(model_path)
    return bool(config.get("num_experts") or config.get("num_local_experts")
                or config.get("n_routed_experts"))


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules in layer order (empty: a dense model):
    ``transformers``' ``*TopKRouter``/``*TopkRouter`` (Qwen-MoE, Mixtral, gpt-oss, OLMoE,
    DeepSeek-V3, GLM-4.5)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")
            and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def gate_weights(router: torch.nn.Module, logits: torch.Tensor,
                 idx: torch.Tensor) -> torch.Tensor:
    """The gate weights ``router`` gives experts ``idx`` (tokens, k) from its ``logits``, as its
    own forward computes them (differentiable, for routing replay): sigmoid routers (DeepSeek-V3,
    GLM-4.5) their scores renormalised and times ``routed_scaling_factor`` (the bias only picks);
    softmax routers the probabilities, renormalised over the k where the router does."""
    if hasattr(router, "e_score_correction_bias"):
        top = logits.float().sigmoid().gather(-1, idx)
        if getattr(router, "norm_topk_prob", False):
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * float(getattr(router, "routed_scaling_factor", 1.0))
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    name = type(router).__name__
    if getattr(router, "norm_topk_prob", False) or name.startswith(("Mixtral", "GptOss")):
        top = top / top.sum(dim=-1, keepdim=True)
    return top


def moe_dims(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts), or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return len(found), int(found[0].top_k), int(found[0].num_experts)


def prefer_fast_experts(model: torch.nn.Module) -> None:
    """On CPU, run an MoE model's experts one by one (``transformers``' "eager" experts):
    its default ``grouped_mm`` is about 10x slower there (a GPU keeps it)."""
    param = next(model.parameters(), None)
    if routers(model) and param is not None and param.device.type == "cpu":
        model.set_experts_implementation("eager")


def pin_eager_experts(model_dir: str | Path) -> None:
    """Make every loader of the MoE model in ``model_dir`` run its experts one by one (its
    ``config.json`` says ``experts_implementation: eager``, which ``from_pretrained`` reads;
    ``save_pretrained`` does not write it back): for a CPU-only model such as the demo's, whose
    loaders (the SFT warm start) do not call :func:`prefer_fast_experts`."""
    path = Path(model_dir) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "experts_implementation": "eager"}, indent=2) + "\n")


def build_tiny_moe(arch: str, *, vocab_size: int, hidden_size: int, layers: int, heads: int,
                   kv_heads: int, experts: int, experts_per_token: int,
                   moe_intermediate_size: int, max_position_embeddings: int,
                   bos_token_id: int | None, eos_token_id: int, pad_token_id: int,
                   seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen3-MoE (or Qwen2-MoE, with a shared expert) causal LM: every
    layer an MoE layer, top-k probabilities renormalised (Qwen3-30B-A3B's ``norm_topk_prob``),
    tied embeddings."""
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  num_experts=experts, num_experts_per_tok=experts_per_token,
                  moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True,
                  intermediate_size=moe_intermediate_size * experts_per_token,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=hidden_size // heads, **common))
    if arch == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            shared_expert_intermediate_size=moe_intermediate_size * experts_per_token, **common))
    raise ValueError(f"model.tiny_arch={arch!r}: an MoE architecture is one of {MOE_ARCHS}")


def fuse_expert_weights(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by the names ``transformers`` 5 runs the model with: per-expert
    ``<p>.experts.<e>.{gate,up,down}_proj.weight`` become ``<p>.experts.gate_up_proj`` (E, 2I,
    H: gate rows, then up rows) and ``<p>.experts.down_proj`` (E, H, I); other names pass."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in named.items():
        if m := _EXPERT.match(name):
            parts.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
        else:
            out[name] = t
    for prefix, projs in parts.items():
        n = len(projs.get("down", {}))
        if any(sorted(projs.get(p, {})) != list(range(n)) for p in ("gate", "up", "down")):
            raise ValueError(f"{prefix}: the checkpoint lacks some experts' gate/up/down "
                             f"projections (found {({p: len(v) for p, v in projs.items()})})")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate"][e], projs["up"][e]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down"][e] for e in range(n)])
    return out


def hub_layout(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` with fused expert tensors split per expert, as hub checkpoints (and transformers'
    ``save_pretrained``, and SGLang's loader) name them; other tensors pass through. The
    inverse of :func:`fuse_expert_weights`; the split tensors are views (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, fc1 in enumerate(t):
                gate, up = fc1.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, fc2 in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = fc2
        else:
            out[name] = t
    return out


class RouterTap:
    """Forward hooks on every router of ``model`` (a context manager; ``close()`` removes them).
    After a forward :meth:`indices` holds each flattened token's experts per layer and
    :attr:`logits` the routers' logits (``keep_logits``); :meth:`replay` sets the (tokens, layers,
    top_k) indices the next forwards use (-1: the router's own choice)."""

    def __init__(self, model: torch.nn.Module, *, keep_logits: bool = False) -> None:
        self.routers = routers(model)
        self.keep_logits = keep_logits
        self.logits: list[torch.Tensor] = []
        self._indices: list[torch.Tensor | None] = [None] * len(self.routers)
        self._replay: torch.Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook(i))
                         for i, r in enumerate(self.routers)]

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, _: Any, out: tuple[torch.Tensor, ...]) -> Any:
            logits, weights, idx = out
            if self._replay is not None:
                want = self._replay[:, layer].to(idx.device, torch.long)
                if want.shape != idx.shape:
                    raise ValueError(f"routing replay: {tuple(want.shape)} expert indices for a "
                                     f"router that chose {tuple(idx.shape)}")
                idx = torch.where((want < 0).any(-1, keepdim=True), idx, want)
                weights = gate_weights(module, logits, idx).to(weights.dtype)
            if self.keep_logits:
                self.logits.append(logits)
            self._indices[layer] = idx
            return logits, weights, idx

        return hook

    def replay(self, indices: torch.Tensor | None) -> None:
        """Route the next forwards by ``indices`` (tokens, layers, top_k); None: by the router."""
        self._replay = indices

    def indices(self) -> torch.Tensor:
        """(tokens, layers, top_k) int32: the last forward's experts per flattened token."""
        if any(i is None for i in self._indices):
            raise RuntimeError("no forward has run through every router since the last read")
        out = torch.stack([i for i in self._indices if i is not None], dim=1).to(torch.int32)
        self._indices = [None] * len(self.routers)
        return out

    def clear(self) -> None:
        self.logits, self._indices = [], [None] * len(self.routers)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RouterTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def router_metrics(logits: list[torch.Tensor], indices: torch.Tensor, mask: torch.Tensor,
                   *, per_layer: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The load-balancing loss (with gradient) and the ``moe/*`` router metrics over the tokens
    ``mask`` of one forward, ``indices`` (tokens, layers, top_k) the experts it used: ``aux_loss``
    (``E * sum_e f_e * P_e``), ``load_max_over_mean``, ``load_cv``, ``router_entropy``, the names
    the megatron backend reports too (docs/moe.md, 'Router metrics'). ``per_layer`` adds
    ``<name>_l<i>`` (not for the loss)."""
    mask = mask.to(indices.device)
    counts, probs_sum, metrics, per = [], [], {}, {}
    for layer, z in enumerate(logits):
        probs = torch.softmax(z.float(), dim=-1)[mask.to(z.device)]
        experts = probs.shape[-1]
        load = torch.bincount(indices[mask, layer].reshape(-1).long(), minlength=experts).float()
        counts.append(load.to(probs.device))
        probs_sum.append(probs.sum(0))
        with torch.no_grad():
            mean = load.mean().clamp(min=1e-9)
            vals = {"moe/load_max_over_mean": float(load.max() / mean),
                    "moe/load_cv": float(load.std(unbiased=False) / mean),
                    "moe/router_entropy": float(-(probs * probs.clamp(min=1e-30).log())
                                                .sum(-1).mean()) if len(probs) else 0.0}
        for k, v in vals.items():
            metrics[k] = metrics.get(k, 0.0) + v / len(logits)
            if per_layer:
                per[f"{k}_l{layer}"] = v
    total = mask.sum().clamp(min=1) * len(logits)
    share, prob = torch.stack(counts).sum(0) / total, torch.stack(probs_sum).sum(0) / total
    aux = share.shape[0] * (share * prob).sum()
    return aux, {**metrics, "moe/aux_loss": float(aux.detach()), **per}
