"""Hugging Face <-> megatron-core weights for the decoders of :mod:`.model`, dense and MoE.

megatron-core ships no converter (the bridges need CUDA and Transformer Engine): this maps the
local layer spec, reading both HF expert layouts (fused and per-expert). Pipeline stages number
their layers locally. Exact both ways (slicing and concatenation: round trips are bit for
bit). The name tables: docs/megatron.md, "Weight mapping" and "Mixture of experts".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from rl_core.training.megatron.model import Arch

__all__ = ["expert_name", "hf_to_mcore", "local_expert", "mcore_to_hf",
           "merge_tp", "stage_layers", "tp_split"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")

# Per-layer names: megatron suffix -> HF suffix (replicated tensors).
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}


def local_expert(name: str) -> tuple[str, int, str] | None:
    """``(prefix, index, suffix)`` of a megatron expert tensor's name, else None."""
    m = _LOCAL_EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def expert_name(name: str, index: int) -> str:
    """``name`` (an expert tensor's) with the expert index replaced by ``index``."""
    prefix, _, suffix = local_expert(name) or (None, 0, None)
    if prefix is None:
        raise KeyError(f"{name!r} is not an expert tensor")
    return f"{prefix}{index}{suffix}"


def _expert_fc(hf: Mapping[str, torch.Tensor], src: str,
               e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e`` of layer ``src`` as megatron's (linear_fc1 = [gate; up], linear_fc2)."""
    fused = hf.get(src + "mlp.experts.gate_up_proj")
    if fused is not None:
        return fused[e].clone(), hf[src + "mlp.experts.down_proj"][e].clone()
    one = f"{src}mlp.experts.{e}."
    if one + "gate_proj.weight" not in hf:
        raise KeyError(f"HF weights lack the experts of {src.rstrip('.')} (neither "
                       f"{src}mlp.experts.gate_up_proj nor {one}gate_proj.weight)")
    return (torch.cat([hf[one + "gate_proj.weight"], hf[one + "up_proj.weight"]]),
            hf[one + "down_proj.weight"].clone())


def stage_layers(arch: Arch, pp_rank: int, pp: int) -> range:
    """The global layer indices pipeline stage ``pp_rank`` holds."""
    per = arch.layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _qkv(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Fuse q/k/v (weights or biases) into megatron's per-group layout."""
    g, hd = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, per * hd, *rest), k.reshape(g, hd, *rest),
                      v.reshape(g, hd, *rest)], dim=1).reshape(-1, *rest)


def _unqkv(arch: Arch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = arch.kv_heads, arch.head_dim
    per = arch.heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * hd, *rest).split([per * hd, hd, hd], dim=1)
    return q.reshape(g * per * hd, *rest), k.reshape(g * hd, *rest), v.reshape(g * hd, *rest)


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor], arch: Arch, *, padded_vocab: int, tp_rank: int = 0,
    tp: int = 1, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0, ep: int = 1,
) -> dict[str, torch.Tensor]:
    """The local state dict of rank (``tp_rank``, ``pp_rank``, ``ep_rank``) from full HF
    weights (either expert layout)."""
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].clone()

    def need(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF weights lack {name!r} (a {arch.model_type} checkpoint?)")
        return hf[name]

    embed = need("model.embed_tokens.weight")
    if first:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(embed, padded_vocab), 0)
    for local, n in enumerate(stage_layers(arch, pp_rank, pp)):
        src, dst = f"model.layers.{n}.", f"decoder.layers.{local}."
        for m_name, h_name in _REPLICATED.items():
            if src + h_name in hf:
                out[dst + m_name] = hf[src + h_name].clone()
        a = src + "self_attn."
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            qkv = _qkv(arch, *(need(f"{a}{x}_proj.{kind}") for x in "qkv"))
            out[f"{dst}self_attention.linear_qkv.{kind}"] = shard(qkv, 0)
        out[dst + "self_attention.linear_proj.weight"] = shard(need(a + "o_proj.weight"), 1)
        if arch.is_moe and arch.moe_layers[n]:
            per = arch.experts // ep
            for i in range(per):
                fc1, fc2 = _expert_fc(hf, src, ep_rank * per + i)
                out[f"{dst}mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1
                out[f"{dst}mlp.experts.local_experts.{i}.linear_fc2.weight"] = fc2
            mlp_src, mlp_dst = src + "mlp.shared_expert.", dst + "mlp.shared_experts."
            if not arch.shared_ffn:
                continue
        else:
            mlp_src, mlp_dst = src + "mlp.", dst + "mlp."
        gate, up = need(mlp_src + "gate_proj.weight"), need(mlp_src + "up_proj.weight")
        out[mlp_dst + "linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])
        out[mlp_dst + "linear_fc2.weight"] = shard(need(mlp_src + "down_proj.weight"), 1)
    if last:
        out["decoder.final_layernorm.weight"] = need("model.norm.weight").clone()
        head = embed if arch.tied else need("lm_head.weight")
        if not arch.tied or pp > 1:
            out["output_layer.weight"] = shard(_pad_rows(head, padded_vocab), 0)
    return out


def tp_split(name: str) -> bool:
    """Whether megatron tensor ``name`` is split across TP ranks (norms, the router and the
    experts (expert TP 1) are replicated)."""
    return ".local_experts." not in name and name.endswith(("linear_proj.weight", "linear_fc2.weight", "linear_fc1.weight",
                          "linear_qkv.weight", "linear_qkv.bias")
                         ) or name in ("embedding.word_embeddings.weight", "output_layer.weight")


def merge_tp(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """One megatron tensor whole again from its TP shards (in TP-rank order)."""
    if len(shards) == 1 or not tp_split(name):
        return shards[0]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(list(shards), dim=1)
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards))


def mcore_to_hf(
    merged: Mapping[str, torch.Tensor], arch: Arch, *, pp_rank: int = 0, pp: int = 1
) -> dict[str, torch.Tensor]:
    """HF weights of one pipeline stage from its TP-merged (:func:`merge_tp`) tensors. A tied
    model also lists the embedding as ``lm_head.weight``, as HF's ``state_dict()`` does (the
    checksums cover both). Experts must carry global indices (renamed after the EP gather);
    they come out fused, as transformers 5 holds them (per expert: ``hub_layout``)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
    offset = stage_layers(arch, pp_rank, pp).start
    for name, t in merged.items():
        if t is None or name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if m is None:
            if name == "embedding.word_embeddings.weight":
                out["model.embed_tokens.weight"] = t[: arch.vocab]
                if arch.tied:  # named twice, one tensor, as HF's state_dict() does
                    out["lm_head.weight"] = out["model.embed_tokens.weight"]
            elif name == "decoder.final_layernorm.weight":
                out["model.norm.weight"] = t
            elif name == "output_layer.weight":
                if not arch.tied:
                    out["lm_head.weight"] = t[: arch.vocab]
            else:
                raise KeyError(f"no HF name for megatron tensor {name!r}")
            continue
        layer, rest = int(m.group(1)) + offset, m.group(2)
        dst = f"model.layers.{layer}."
        if rest.startswith("mlp.shared_experts.linear_fc"):
            rest, dst = rest.replace("shared_experts.", ""), dst + "mlp.shared_expert."
            dst_mlp = dst
        else:
            dst_mlp = dst + "mlp."
        if (expert := local_expert(name)) is not None:
            fc1, fc2 = experts.setdefault(layer, {}).get(expert[1], (None, None))
            pair = (t, fc2) if expert[2] == ".linear_fc1.weight" else (fc1, t)
            experts[layer][expert[1]] = pair
        elif rest in _REPLICATED:
            out[dst + _REPLICATED[rest]] = t
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = _unqkv(arch, t)
            for proj, part in (("q", q), ("k", k), ("v", v)):
                out[f"{dst}self_attn.{proj}_proj.{kind}"] = part.contiguous()
        elif rest == "self_attention.linear_proj.weight":
            out[dst + "self_attn.o_proj.weight"] = t
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2)
            out[dst_mlp + "gate_proj.weight"], out[dst_mlp + "up_proj.weight"] = (
                gate.contiguous(), up.contiguous())
        elif rest == "mlp.linear_fc2.weight":
            out[dst_mlp + "down_proj.weight"] = t
        else:
            raise KeyError(f"no HF name for megatron tensor {name!r}")
    for layer, pairs in experts.items():
        if sorted(pairs) != list(range(arch.experts)) or any(
                None in pair for pair in pairs.values()):
            raise KeyError(f"layer {layer}: experts {sorted(pairs)} of {arch.experts} (gather "
                           "every EP rank's experts and give them global indices first)")
        dst = f"model.layers.{layer}.mlp.experts."
        out[dst + "gate_up_proj"] = torch.stack([pairs[e][0] for e in range(arch.experts)])
        out[dst + "down_proj"] = torch.stack([pairs[e][1] for e in range(arch.experts)])
    return out
