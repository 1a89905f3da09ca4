"""A megatron-core ``GPTModel`` built from a Hugging Face config, and its parallel layout.

The local (pure-PyTorch) layer spec for ``qwen2``, ``llama``, ``qwen3``, ``qwen3_moe`` and
``qwen2_moe``; experts are ``SequentialMLP``s sharded by EP, never by TP.
:class:`SequenceParallelRMSNorm` makes sequence parallelism work without Transformer Engine.
The vocabulary is padded to a multiple of ``vocab_divisible_by * tp`` (masked out of every
softmax). docs/megatron.md: "Supported architectures", "Configuration", "Mixture of experts".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Arch", "SequenceParallelRMSNorm", "arch_from_hf", "build_gpt_model",
           "transformer_config"]

_SUPPORTED = ("qwen2", "llama", "qwen3", "qwen2_moe", "qwen3_moe")
_MOE_UNSUPPORTED = ("mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe")
DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class Arch:
    """What the conversion and the model need from an HF config."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling_factor: float | None = None
    # Mixture of experts (0 experts: dense). moe_layers[n]: whether layer n routes.
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    norm_topk: bool = True
    moe_layers: tuple[bool, ...] = ()
    shared_ffn: int = 0  # qwen2_moe's gated shared expert

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layer_ids(self) -> list[int]:
        """The global indices of the MoE layers (SGLang's ``routed_experts`` layer axis)."""
        return [n for n, moe in enumerate(self.moe_layers) if moe]

    def padded_vocab(self, tp: int, divisible_by: int) -> int:
        """The vocabulary rounded up to a multiple of ``divisible_by * tp``."""
        multiple = max(1, divisible_by) * tp
        return int(math.ceil(self.vocab / multiple) * multiple)

    def check_parallel(self, tp: int, pp: int, ep: int = 1,
                       sequence_parallel: bool = False) -> None:
        """Fail, naming the config field, when TP/PP/EP cannot split this model."""
        if ep > 1 and not self.is_moe:
            raise ValueError(f"train.megatron.ep={ep}: expert parallelism needs a mixture-of-"
                             f"experts model, and this {self.model_type} model is dense")
        if self.is_moe and self.experts % ep:
            raise ValueError(f"train.megatron.ep={ep} must divide the number of experts "
                             f"({self.experts})")
        if self.is_moe and tp > 1 and not sequence_parallel:
            raise ValueError(
                f"train.megatron.tp={tp} with a mixture-of-experts model: megatron-core trains "
                "MoE layers under TP only with sequence parallelism; set "
                "train.megatron.sequence_parallel=true (or tp=1 and shard the experts with "
                "train.megatron.ep; docs/megatron.md, MoE)")
        if self.heads % tp or self.kv_heads % tp:
            raise ValueError(
                f"train.megatron.tp={tp} must divide the attention heads ({self.heads}) and the "
                f"key/value heads ({self.kv_heads}) of this {self.model_type} model")
        if self.ffn % tp:
            raise ValueError(
                f"train.megatron.tp={tp} must divide the MLP width (intermediate_size={self.ffn})")
        if self.layers % pp:
            raise ValueError(
                f"train.megatron.pp={pp} must divide the number of layers ({self.layers})")


def _rope_theta(cfg: Any) -> float:
    # transformers 5 keeps it in rope_parameters; 4.x in rope_theta.
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(cfg, "rope_theta", None) or 10000.0)


def _rope_scaling(cfg: Any) -> float | None:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "llama3":
        for key, value in {"low_freq_factor": 1.0, "high_freq_factor": 4.0}.items():
            if float(params.get(key, value)) != value:
                raise ValueError(
                    f"rope scaling {key}={params[key]}: megatron-core's llama3 scaling fixes it "
                    f"at {value}; this model cannot be trained with train.backend=megatron")
        return float(params.get("factor", 8.0))
    raise ValueError(
        f"rope_type {kind!r} is not supported by the megatron backend (default and llama3 are); "
        "use train.backend=torch for this model")


def arch_from_hf(config: Any) -> Arch:
    """The :class:`Arch` of an HF config object (or a model directory's ``config.json``)."""
    if isinstance(config, str | Path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config)
    kind = config.model_type
    if kind in _MOE_UNSUPPORTED:
        raise ValueError(
            f"{kind} is a mixture-of-experts model the megatron backend does not map yet "
            "(qwen3_moe and qwen2_moe are supported); use train.backend=torch")
    if kind not in _SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not supported by the megatron backend "
                         f"(supported: {', '.join(_SUPPORTED)}); use train.backend=torch")
    heads = config.num_attention_heads
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{kind} with mlp_bias=True is not supported by the megatron backend")
    return Arch(
        model_type=kind, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn=config.intermediate_size, vocab=config.vocab_size, eps=float(config.rms_norm_eps),
        rope_theta=_rope_theta(config),
        max_positions=int(getattr(config, "max_position_embeddings", 4096)),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in attention_bias.
        qkv_bias=(kind == "qwen2" or bool(getattr(config, "attention_bias", False))
                  or (kind == "qwen2_moe" and bool(getattr(config, "qkv_bias", True)))),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        rope_scaling_factor=_rope_scaling(config) if kind == "llama" else None,
        **(_moe_fields(config) if kind.endswith("_moe") else {}))


def _moe_fields(config: Any) -> dict[str, Any]:
    """The MoE part of an HF ``qwen3_moe`` / ``qwen2_moe`` config (HF's rule for which layers
    route: not in ``mlp_only_layers``, and ``(n + 1) % decoder_sparse_step == 0``)."""
    experts, layers = int(config.num_experts), config.num_hidden_layers
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    moe = tuple(n not in dense and (n + 1) % step == 0 for n in range(layers))
    shared = (int(config.shared_expert_intermediate_size)
              if config.model_type == "qwen2_moe" else 0)
    return {"experts": experts, "topk": int(config.num_experts_per_tok),
            "moe_ffn": int(config.moe_intermediate_size),
            "norm_topk": bool(getattr(config, "norm_topk_prob", False)), "moe_layers": moe,
            "shared_ffn": shared}


def transformer_config(
    arch: Arch, *, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False, recompute: str = "none", recompute_num_layers: int = 1,
    cpu_init: bool = True, ep: int = 1, dispatcher: str = "alltoall",
) -> Any:
    """megatron's ``TransformerConfig`` for ``arch`` (per-token loss: see the trainer). MoE:
    HF's routing exactly, fp32 router, no token dropping, megatron's own aux loss off (the
    balance loss is :mod:`.moe`'s; docs/megatron.md, "Mixture of experts")."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kw: dict[str, Any] = {}
    if recompute != "none":
        kw["recompute_granularity"] = recompute
        if recompute == "full":
            kw.update(recompute_method="uniform", recompute_num_layers=recompute_num_layers)
    if arch.is_moe:
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"train.megatron.moe_dispatcher={dispatcher!r}: choose one of "
                             f"{', '.join(DISPATCHERS)}")
        kw.update(
            num_moe_experts=arch.experts, moe_router_topk=arch.topk,
            moe_ffn_hidden_size=arch.moe_ffn, moe_router_pre_softmax=not arch.norm_topk,
            moe_router_score_function="softmax", moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
            moe_layer_freq=[int(x) for x in arch.moe_layers],
            expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        if arch.shared_ffn:
            kw.update(moe_shared_expert_intermediate_size=arch.shared_ffn,
                      moe_shared_expert_gate=True)
    return TransformerConfig(
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel, params_dtype=dtype,
        pipeline_dtype=dtype,  # what the stages send each other
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        # Each micro-batch's loss is already its share of the mini-batch (global token
        # counts): no division by the micro-batch count, gradients summed over DP.
        calculate_per_token_loss=True, **kw)


def build_gpt_model(
    arch: Arch, config: Any, *, padded_vocab: int, pre_process: bool = True,
    post_process: bool = True,
) -> Any:
    """This pipeline stage's ``GPTModel`` (local spec; parallel, un-gathered logits)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if arch.is_moe:  # per-layer specs: dense and MoE layers as moe_layer_freq says
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from rl_core.training.megatron.compat import fix_moe_without_te

        fix_moe_without_te()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        if config.sequence_parallel:  # the block's final norm too (this stage's layers)
            from megatron.core.transformer.transformer_block import (
                TransformerBlockSubmodules,
                get_num_layers_to_build,
            )

            spec = TransformerBlockSubmodules(
                layer_specs=[spec] * get_num_layers_to_build(config, None),
                layer_norm=_torch_norm())
    if config.sequence_parallel:
        spec = _replace_module(spec, _torch_norm(), SequenceParallelRMSNorm)
    theta = arch.rope_theta
    return GPTModel(
        config, spec, vocab_size=padded_vocab, max_sequence_length=arch.max_positions,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=arch.tied, position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0)


class SequenceParallelRMSNorm:
    """torch's ``RMSNorm`` in a megatron spec under sequence parallelism: its weight is
    marked ``sequence_parallel`` (each TP rank saw its own slice of the sequence; megatron
    sums the weight's gradient over them). A factory, as ``WrappedTorchNorm`` is."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,  # noqa: ANN401
                **_: Any) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: only RMSNorm here")
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _torch_norm() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _replace_module(spec: Any, old: type, new: type) -> Any:  # noqa: ANN401
    """``spec`` (a megatron ``ModuleSpec`` tree, its submodule dataclasses and lists) with
    every reference to module class ``old`` replaced by ``new`` (copies; ``spec`` is left)."""
    import dataclasses

    if spec is old:
        return new
    if isinstance(spec, list | tuple):
        return type(spec)(_replace_module(s, old, new) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{
            f.name: _replace_module(getattr(spec, f.name), old, new)
            for f in dataclasses.fields(spec) if f.init})
    return spec
