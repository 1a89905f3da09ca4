"""What the planner plans for: devices (memory, interconnects) and model shapes (from presets,
an HF ``config.json`` or a directory; a vision-language model's vision tower:
:mod:`rl_core.cluster.vision`), with the byte counts of their weights, KV cache and activations
(the formulas: docs/planner.md). Pure standard-library arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.cluster.vision import VisionShape

__all__ = ["DEVICES", "GB", "GIB", "MODEL_PRESETS", "Device", "ModelShape", "VisionShape",
           "estimate_params", "fsdp_working_bytes", "get_device", "kv_bytes_per_token",
           "load_model", "training_activation_bytes"]

GIB, GB = 2**30, 10**9


@dataclass(frozen=True)
class Device:
    """One accelerator kind and its links. ``memory_gib``: nominal capacity, read as GiB.
    ``link_gbps``: peak intra-node device-to-device bandwidth per direction (NVLink / Infinity
    Fabric), GB/s; ``network_gbps``: the per-device NIC between nodes (400 Gb/s = 50 GB/s);
    ``pcie_gbps``: the host link (x16), which a colocated trainer's offload crosses. ``max_tp``:
    the largest TP (CPU: 1; the embedded engine and gloo trainer never split a layer).
    ``dtype_bytes``: the planes' compute dtype there (CPU runs float32), 0: the model's own."""
    name: str
    label: str
    memory_gib: float
    interconnect: str
    link_gbps: float
    network_gbps: float
    pcie_gbps: float
    devices_per_node: int = 8
    max_tp: int = 8
    dtype_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", "NVIDIA H100 SXM 80GB", 80, "NVLink 4", 450, 50, 64),
    Device("h200", "NVIDIA H200 SXM 141GB", 141, "NVLink 4", 450, 50, 64),
    Device("b200", "NVIDIA B200 192GB", 192, "NVLink 5", 900, 50, 64),
    Device("a100-80gb", "NVIDIA A100 SXM 80GB", 80, "NVLink 3", 300, 25, 32),
    Device("a100-40gb", "NVIDIA A100 SXM 40GB", 40, "NVLink 3", 300, 25, 32),
    Device("mi300x", "AMD Instinct MI300X 192GB", 192, "Infinity Fabric", 448, 50, 64),
    Device("mi325x", "AMD Instinct MI325X 256GB", 256, "Infinity Fabric", 448, 50, 64),
    Device("mi355x", "AMD Instinct MI355X 288GB", 288, "Infinity Fabric", 537.6, 50, 64),
    Device("cpu", "CPU (host memory; gloo)", 16, "shared memory", 10, 1.25, 10,
           devices_per_node=64, max_tp=1, dtype_bytes=4),
)}
_DEVICE_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb"}


def get_device(name: str, *, memory_gib: float | None = None) -> Device:
    """A device from :data:`DEVICES` by name (case-insensitive; ``a100`` = ``a100-80gb``),
    with its memory optionally overridden (a CPU host's RAM, a partitioned GPU)."""
    if (key := _DEVICE_ALIASES.get(k := name.strip().lower(), k)) not in DEVICES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
    if memory_gib is not None and memory_gib <= 0:
        raise ValueError(f"memory_gib must be > 0, got {memory_gib}")
    dev = DEVICES[key]
    return dev if memory_gib is None else dataclasses.replace(dev, memory_gib=memory_gib)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on. ``params``: the parameter
    count, vision tower included (None: :func:`estimate_params`). ``intermediate``: the dense MLP
    width; an MoE model sets ``experts``, ``expert_intermediate`` and ``experts_per_token`` (all
    experts live in memory, the top-k run per token). ``dtype_bytes``: the checkpoint's (bf16 =
    2). ``vision``: a vision-language model's vision tower (None: a text model); the other
    fields describe its language model."""
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0
    dtype_bytes: int = 2
    params: int | None = None
    vision: VisionShape | None = None

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads})")
        if self.params is None:
            object.__setattr__(self, "params", estimate_params(self))

    @property
    def n_params(self) -> int:
        return int(self.params or 0)

    @property
    def vision_params(self) -> int:
        """The vision tower's parameters (from its shape; 0 for a text model)."""
        return self.vision.params if self.vision else 0

    @property
    def mlp_active_width(self) -> int:
        """The MLP width one token passes through (dense width, or top-k experts')."""
        return (self.experts_per_token * self.expert_intermediate if self.experts
                else self.intermediate)

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: attention (with Qwen2's QKV biases), SwiGLU MLP
    or experts + router, RMSNorms, Qwen3's q/k norms."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = (self.experts * 3 * h * self.expert_intermediate + h * self.experts
               if self.experts else 3 * h * self.intermediate)
        return attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def expert_params(self) -> int:
        """Parameters in the routed experts (what expert parallelism shards): ``layers * E * 3 *
        h * i_e``; 0 for a dense model."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], *, name: str = "",
                       params: int | None = None) -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama, Qwen2/2.5/3, Mistral, Qwen3-MoE,
        Mixtral, Qwen2-VL and Qwen2.5-VL with their ``vision_config``; the ``text_config`` when
        the top level has no ``hidden_size``). ``params`` overrides the estimate (which misses
        shared experts and dense layers of an MoE stack)."""
        top = cfg
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            cfg = cfg["text_config"]
        try:
            hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
            heads, vocab = int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json of {name or 'model'} lacks {e.args[0]!r}") from None
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        model_type = str(top.get("model_type") or cfg.get("model_type", ""))
        qwen2 = model_type in ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type or "model"), layers=layers,
            hidden=hidden, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=vocab,
            intermediate=intermediate, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", qwen2)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), experts=experts,
            expert_intermediate=experts and int(cfg.get("moe_intermediate_size") or intermediate),
            experts_per_token=experts and int(cfg.get("num_experts_per_tok") or 0),
            dtype_bytes=4 if dtype in ("float32", "torch.float32") else 2, params=params,
            vision=_vision_from_hf(top.get("vision_config"), hidden))

    @classmethod
    def from_directory(cls, path: str | Path) -> ModelShape:
        """From a model directory (or its ``config.json``), with the exact parameter count from the
        safetensors index or the ``*.safetensors`` headers when present, else estimated."""
        cfg_file = p / "config.json" if (p := Path(path)).is_dir() else p
        if not cfg_file.is_file():
            raise ValueError(f"no config.json at {cfg_file}")
        cfg = json.loads(cfg_file.read_text())
        shape = cls.from_hf_config(cfg, name=cfg_file.parent.name)
        params = _safetensors_params(cfg_file.parent, shape.dtype_bytes)
        return dataclasses.replace(shape, params=params) if params else shape


def _vision_from_hf(vc: object, lm_hidden: int) -> VisionShape | None:
    """The vision tower of a Qwen2.5-VL ``vision_config`` (``hidden_size``, ``intermediate_size``,
    ``out_hidden_size``: a SwiGLU tower) or a Qwen2-VL one (``embed_dim``, ``mlp_ratio``, its
    ``hidden_size`` the output width: a GELU tower); None without one (or without ``depth``:
    another family's tower, left to the safetensors count)."""
    if not isinstance(vc, Mapping) or "depth" not in vc:
        return None
    gated = "embed_dim" not in vc
    hidden = int(vc["hidden_size"] if gated else vc["embed_dim"])
    return VisionShape(
        depth=int(vc["depth"]), hidden=hidden,
        intermediate=int(vc.get("intermediate_size") if gated
                         else hidden * float(vc.get("mlp_ratio", 4))),
        heads=int(vc.get("num_heads", 16)),
        out_hidden=int(vc.get("out_hidden_size") or (lm_hidden if gated else vc["hidden_size"])),
        patch=int(vc.get("patch_size", 14)), spatial_merge=int(vc.get("spatial_merge_size", 2)),
        temporal_patch=int(vc.get("temporal_patch_size", 2)),
        in_channels=int(vc.get("in_chans") or vc.get("in_channels") or 3), gated=gated)


def estimate_params(m: ModelShape) -> int:
    """Parameters from the shape, exact for Llama/Qwen2-style dense models and Qwen2.5-VL (the
    formula: docs/planner.md): ``layers`` x :attr:`ModelShape.layer_params`, the embedding and
    lm_head (one matrix when tied), the final norm, and the vision tower
    (:attr:`VisionShape.params`)."""
    embeddings = m.vocab * m.hidden * (1 if m.tied_embeddings else 2)
    return m.layers * m.layer_params + embeddings + m.hidden + m.vision_params


def _safetensors_params(directory: Path, dtype_bytes: int) -> int | None:
    if (index := directory / "model.safetensors.index.json").is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        return int(total) // dtype_bytes if total else None
    count = 0
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        count += sum(math.prod(meta["shape"]) for k, meta in header.items() if k != "__metadata__")
    return count or None


# Qwen2.5-VL's vision tower (vision_config of Qwen2.5-VL-3B/7B/72B-Instruct): 32 blocks of 1280,
# SwiGLU 3420, 16 heads, 14-pixel patches merged 2 x 2 into a token of the LM's width.
def _qwen25_vl_vision(out_hidden: int) -> VisionShape:
    return VisionShape(depth=32, hidden=1280, intermediate=3420, heads=16, out_hidden=out_hidden)


# The published shapes (config.json of each model on the Hugging Face hub), positionally: name,
# layers, hidden, heads, kv_heads, head_dim, vocab, intermediate, tied_embeddings, qkv_bias.
MODEL_PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 151936, 4864, True, True),
    ModelShape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 151936, 8960, True, True),
    ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 152064, 18944, qkv_bias=True),
    ModelShape("qwen2.5-32b", 64, 5120, 40, 8, 128, 152064, 27648, qkv_bias=True),
    ModelShape("qwen2.5-72b", 80, 8192, 64, 8, 128, 152064, 29568, qkv_bias=True),
    ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 151936, 6144, qk_norm=True, experts=128,
               expert_intermediate=768, experts_per_token=8),
    ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 128256, 14336),
    ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 128256, 28672),
    ModelShape("qwen2.5-vl-3b", 36, 2048, 16, 2, 128, 151936, 11008, True, True,
               vision=_qwen25_vl_vision(2048)),
    ModelShape("qwen2.5-vl-7b", 28, 3584, 28, 4, 128, 152064, 18944, qkv_bias=True,
               vision=_qwen25_vl_vision(3584)),
)}


def load_model(spec: str | Path) -> ModelShape:
    """A model directory or ``config.json`` path, else a preset name (case-insensitive;
    ``Qwen/Qwen2.5-7B-Instruct`` works too)."""
    if (path := Path(spec)).exists():
        return ModelShape.from_directory(path)
    key = str(spec).strip().lower().rsplit("/", 1)[-1].removesuffix("-instruct")
    if (key := key.removeprefix("meta-")) in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    raise ValueError(f"unknown model {str(spec)!r}: not a directory or config.json, and not a "
                     f"preset ({', '.join(MODEL_PRESETS)})")


def kv_bytes_per_token(m: ModelShape, *, tp: int = 1, pp: int = 1, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token takes on one device of a TP x PP engine: ``2 (K and V) * ceil(L /
    pp) * ceil(K / tp) * d * bytes``. KV heads split across TP ranks; with more ranks than KV heads
    each rank keeps a copy."""
    return 2 * math.ceil(m.layers / pp) * math.ceil(m.kv_heads / tp) * m.head_dim * dtype_bytes


def training_activation_bytes(m: ModelShape, *, micro_batch: int, seq_len: int, tp: int = 1,
                              dtype_bytes: int = 2, dispatch_imbalance: float = 1.0) -> int:
    """Activations of one micro-batch per device with full activation recompute and flash
    attention (no s^2 term; the formula: docs/planner.md): every layer's input, the layer being
    recomputed twice for its gradients, and the logits with an fp32 log-softmax and its
    gradient; tensor + sequence parallelism divide by ``tp``. An MoE layer runs each token
    through its top-k experts' width and dispatches k permuted copies of it (and their outputs)
    plus the router's probabilities; under EP a rank may receive ``dispatch_imbalance`` times
    its share of the routed tokens (the planner assumes :data:`MOE_DISPATCH_IMBALANCE`)."""
    tokens, h, d = micro_batch * seq_len, m.hidden, m.head_dim
    checkpoints = m.layers * tokens * h * dtype_bytes
    per_token = 4 * h + 2 * m.heads * d + 2 * m.kv_heads * d
    if m.experts:
        routed = 4 * m.mlp_active_width + 2 * m.experts_per_token * h
        per_token += int(dispatch_imbalance * routed) + 2 * m.experts
    else:
        per_token += 4 * m.intermediate
    one_layer = 2 * tokens * per_token * dtype_bytes
    logits = tokens * m.vocab * (dtype_bytes + 8)
    return (checkpoints + one_layer + logits) // tp


def fsdp_working_bytes(m: ModelShape, dtype_bytes: int = 2) -> int:
    """FSDP's unsharded working set, ``3 * max(layer, V*h) * bytes``: the largest wrapped unit
    gathered for the current and the prefetched unit, plus its gradients before reduce-scatter."""
    return 3 * max(m.layer_params, m.embedding_params) * dtype_bytes
