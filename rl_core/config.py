"""The experiment schema: one typed pydantic model for everything a GRPO run needs.

Loaded from YAML files in ``configs/`` with dotted command-line overrides
(``algorithm.kl_coef=0.001``), in the style of torchtitan's job config and prime-rl's
pydantic configs. A bad key or value fails at load time with the field's dotted path and,
where the field is a choice, the allowed values.

This module must never import Prefect, MLflow or torch: it is read by every layer and by
the CLI before anything heavy starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rl_core.config_files import (
    ConfigError,
    apply_overrides,
    flatten,
    read_config,
    validate_config,
)
from rl_core.teacher import TeacherConfig

__all__ = ["ConfigError", "ExperimentConfig", "apply_overrides", "config_digest", "flatten",
           "load_config", "read_config", "validate_config"]


class _Section(BaseModel):
    # allow_inf_nan=False: every float here is a rate, a weight or a bound on a wait; an
    # infinite timeout or learning rate is a mistake, never a setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """The policy model to start from."""
    path: str = Field("embedded:tiny", min_length=1, description="HF hub id, local HF directory, "
        "or `embedded:tiny` to build the demo model.")
    revision: str | None = Field(
        None, description="Hub branch, tag or commit (default: main); cached by commit sha.")
    name: str = Field("grpoflow-tiny", description="Registered model name for the final export.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    # Knobs of the embedded tiny model (used only when path is `embedded:tiny`).
    tiny_hidden_size: int = Field(192, ge=16)
    tiny_layers: int = Field(4, ge=1)
    tiny_heads: int = Field(4, ge=1)
    tiny_kv_heads: int = Field(2, ge=1)
    tiny_intermediate_size: int = Field(512, ge=16)
    tiny_vocab_size: int = Field(384, ge=64)
    tiny_sft_steps: int = Field(600, ge=0, description="Cap on warm-start supervised steps.")
    tiny_tool_demos: float = Field(0.0, ge=0.0, le=1.0, description="Share of warm-start examples "
        "that are calculator episodes (the agent demo); the warm start then runs tiny_sft_steps "
        "steps (no accuracy target).")
    tiny_target_accuracy: float = Field(
        0.3, gt=0.0, le=1.0, description="Warm start stops at this held-out greedy accuracy.")
    tiny_arch: Literal["dense", "qwen3_moe", "qwen2_moe"] = Field("dense", description="`dense`: "
        "Qwen2; `qwen3_moe` / `qwen2_moe` (shared expert): mixture-of-experts layers of "
        "tiny_experts experts, tiny_experts_per_token per token (docs/moe.md).")
    tiny_experts: int = Field(4, ge=2)
    tiny_experts_per_token: int = Field(2, ge=1)
    tiny_moe_intermediate_size: int = Field(128, ge=8, description="Each expert's MLP width.")
    seed: int = 0


class DataConfig(_Section):
    """Where prompts come from and how they are rendered."""
    source: str = Field("synthetic", min_length=1, description="`synthetic`, an HF dataset name, a "
        "local dataset dir, .jsonl or .parquet.")
    subset: str | None = None
    train_split: str = "train"
    eval_split: str = "test"
    eval_source: str | None = Field(None, description="Defaults to `source` with `eval_split`.")
    question_field: str = Field("question", min_length=1)
    answer_field: str = Field("answer", min_length=1)
    id_field: str | None = Field("id", description="null: ids are content hashes.")
    max_train_examples: int | None = Field(
        None, ge=1, description="Use only the first N training records (any source).")
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0)
    system_prompt: str | None = None
    use_chat_template: bool | None = Field(None, description="null: the tokenizer's chat template "
        "when it has one, else `plain_template`; true: require it; false: always `plain_template`.")
    plain_template: str = Field("Question: {question}\nAnswer:", description="The prompt without a "
        "chat template; `{question}` is replaced by the question (nothing else is formatted, so "
        "other braces are kept).")
    max_prompt_tokens: int = Field(256, ge=1)
    # Synthetic generator knobs.
    synthetic_train_size: int = Field(3000, ge=1)
    synthetic_test_size: int = Field(300, ge=1)
    synthetic_digits: tuple[int, int] = (1, 1)
    synthetic_operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    synthetic_steps: tuple[int, int] = (1, 2)
    synthetic_long_frac: float = Field(0.0, ge=0.0, le=1.0, description="Share of problems "
        "with synthetic_long_steps steps: a long-tailed response length (benchmarks).")
    synthetic_long_steps: int = Field(12, ge=1)
    seed: int = 0

    def synthetic_knobs(self) -> dict[str, Any]:
        """The generator's knobs, as :func:`rl_core.data.generate_splits` takes them."""
        knobs: dict[str, Any] = {"digits": tuple(self.synthetic_digits),
                                 "operations": tuple(self.synthetic_operations),
                                 "steps": tuple(self.synthetic_steps)}
        if self.synthetic_long_frac:  # (absent when off: data and model digests unchanged)
            knobs.update(long_frac=self.synthetic_long_frac, long_steps=self.synthetic_long_steps)
        return knobs

    @model_validator(mode="after")
    def _check_fields(self) -> DataConfig:
        for name in ("synthetic_digits", "synthetic_steps"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {lo, hi}")
        if self.question_field == self.answer_field:
            raise ValueError(
                f"question_field and answer_field are both {self.question_field!r}; they must "
                "name two different columns")
        if self.id_field is not None and self.id_field in (self.question_field, self.answer_field):
            raise ValueError(
                f"id_field {self.id_field!r} is also the question or answer column; name the id "
                "column, or set id_field: null to use content-hash ids")
        if not self.source.strip():
            raise ValueError("source is blank; use synthetic, a file, a directory or a hub name")
        return self

    @field_validator("plain_template")
    @classmethod
    def _check_plain_template(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError(f"must contain '{{question}}' where the question goes (e.g. "
                             f"'Question: {{question}}\\nAnswer:'), got {template!r}")
        return template


class RolloutConfig(_Section):
    """The rollout plane: which engines sample, how many, and with what sampling parameters."""
    engine: Literal["embedded", "sglang", "local"] = Field("embedded", description="`embedded`: "
        "grpoflow's engine processes behind SGLang's HTTP API (CPU); `sglang`: real SGLang servers "
        "(GPU); `local`: the same engine core in the flow's process, no HTTP.")
    n_samples: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    max_staleness: int = Field(0, ge=0, description="Overlap rollout and training: step t+k's "
        "samples are generated while step t trains, from weights at most k versions old (0 = "
        "synchronous). TIS is on by default when > 0 (algorithm.tis_cap 2.0).")
    streaming: bool = Field(False, description="Fully asynchronous rollouts: prompts stream "
        "through the engines in rounds, a step trains on the first train.prompts_per_step "
        "groups that finish, and long samples continue across weight updates (partial "
        "rollouts, per-token versions). Needs max_staleness >= 1 (docs/rollout.md).")
    partial_tokens: int | None = Field(None, ge=1, description="streaming with deterministic "
        "rollouts: new tokens per sample per round (the point where a sample may change "
        "weight version). Default: ceil(max_new_tokens / (max_staleness + 1)).")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(32, ge=1)
    stop: list[str] = []
    stop_token_ids: list[int] = []
    timeout_s: float = Field(600.0, gt=0, description="Bound on one step's generation.")
    # HTTP engines (embedded / sglang)
    num_engines: int = Field(1, ge=1, description="Engine processes (each a full model copy).")
    router: bool | None = Field(
        None, description="Put sglang-router in front; default: on when num_engines > 1.")
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads per embedded engine; default: cores / engines.")
    max_running_requests: int = Field(256, ge=1, description="Per engine (embedded, local).")
    request_batch_size: int = Field(
        16, ge=1, description="Samples per /generate request; 1 = one request per sample.")
    deterministic: bool | None = Field(
        None, description="Timing-free rollouts: a generation goes to each embedded engine as "
        "one request, so the samples that share its batches (and the last bit of every "
        "log-prob) do not depend on when requests arrive; runs repeat bit for bit on CPU, "
        "overlapped (max_staleness > 0) or not. Default: on for the embedded engine, off for "
        "SGLang (whose own batching decides).")
    weight_sync: Literal["auto", "disk", "object_store", "distributed", "shared"] = Field(
        "auto", description="`auto`: `shared` where it can run (engine local, cluster.mode "
        "local, the torch backend, synchronous steps, no LoRA), else `disk`. "
        "`disk`: trainer writes safetensors, engines reload them (one node "
        "or a shared filesystem); `object_store`: through Ray's object store (cluster.mode ray); "
        "`distributed`: the trainer's rank 0 broadcasts to every engine over a "
        "torch.distributed group (SGLang's /update_weights_from_distributed); `shared` "
        "(engine: local): the engine reads the trainer's parameters in place, so a sync is a "
        "version bump, not a copy.")
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend of weight_sync=distributed; auto: nccl (RCCL on "
        "ROCm) when trainer and engines have GPUs on Ray, else gloo.")
    release_memory_while_training: bool | None = Field(None, description="Engines release weights "
        "and KV cache after the rollout and take them back for the weight sync (colocated planes "
        "time-sharing GPUs); None: on when cluster.placement is colocated on Ray with GPUs.")
    weight_sync_bucket_mb: float = Field(
        512.0, gt=0, description="weight_sync=distributed: tensors per "
        "/update_weights_from_distributed call, by size (bounds the engine's receive buffers).")
    weight_sync_timeout_s: float = Field(
        300.0, gt=0, description="Bound on one weight sync (and on each collective in it).")
    startup_timeout_s: float = Field(300.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(
        20.0, gt=0, description="Bound on one health probe of an engine (/health_generate).")
    health_failure_threshold: int = Field(3, ge=1, description="Failed probes in a row that get an "
        "engine restarted and re-synced (a hung engine is replaced after about this many x "
        "health_timeout_s).")
    sglang_tp: int = Field(1, ge=1, description="Tensor parallelism of each SGLang server.")
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    sglang_platform: Literal["cuda", "rocm"] = "cuda"
    sglang_extra_args: list[str] = []

    @property
    def timing_free(self) -> bool:
        """``deterministic`` as resolved: on for grpoflow's engines, off for SGLang."""
        return self.deterministic if self.deterministic is not None else self.engine != "sglang"

    @property
    def segment_tokens(self) -> int | None:
        """Streaming: a round's new tokens per sample (None: until the update aborts it)."""
        if not self.timing_free:
            return None
        return self.partial_tokens or -(-self.max_new_tokens // (self.max_staleness + 1))


class MegatronConfig(_Section):
    """The megatron-core backend's parallel layout (``train.backend: megatron``): ``tp * pp * dp``
    must equal the trainer ranks (``cluster.trainer_ranks`` on Ray, 1 in ``cluster.mode: local``);
    docs/megatron.md."""
    tp: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="Tensor parallelism (divides heads and KV heads); auto: the planner's.")
    pp: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="Pipeline parallelism (divides the layers); auto: the planner's.")
    dp: int | None = Field(
        None, ge=1, description="Data parallelism; default: trainer ranks / (tp * pp).")
    sequence_parallel: bool = Field(
        False, description="Split the sequence over the TP ranks between the tensor-parallel "
        "layers (norms, dropout, the MoE router); needed for MoE models at tp > 1.")
    distributed_optimizer: bool = Field(False, description="ZeRO-1: shard optimizer state over dp.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation (full: every layer, uniform).")
    recompute_num_layers: int = Field(1, ge=1)
    vocab_divisible_by: int = Field(
        128, ge=1, description="Pad the vocabulary to a multiple of this * tp (masked out).")
    ep: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="Expert parallelism (MoE models): shards the experts; divides the "
        "experts and the data-parallel ranks; auto: the planner's.")
    moe_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="MoE token dispatcher across the EP ranks (both run on gloo).")


class LoraConfig(_Section):
    """LoRA on the torch backend (``rank > 0``; docs/lora.md): only adapters train, the
    reference is the base (adapter disabled), a sync moves the adapter only."""
    rank: int = Field(0, ge=0, description="LoRA rank r; 0 = full-weight training.")
    alpha: float = Field(16.0, gt=0.0, description="Scaling alpha (scale alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="Linear layers (name suffixes) that get adapters.")
    use_rslora: bool = Field(False, description="Scale by alpha / sqrt(r) (rsLoRA).")
    name: str = Field("policy", min_length=1, description="The adapter's name on the engines "
                      "(SGLang's lora_name; requests carry it as lora_path).")
    quantize: Literal["nf4", "fp4"] | None = Field(None, description="QLoRA: the trainer holds "
        "the frozen base in 4 bits (bitsandbytes; `pip install 'grpoflow[qlora]'`); the "
        "engines serve the full-precision base + the adapter. None: full-precision base.")
    double_quant: bool = Field(True, description="QLoRA: quantize the 4-bit scales too.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check_quantize(self) -> LoraConfig:
        if self.quantize and not self.enabled:
            raise ValueError(f"train.lora.quantize={self.quantize!r} quantizes the base under "
                             "an adapter, but train.lora.rank is 0; set train.lora.rank > 0")
        return self


class MoeConfig(_Section):
    """Mixture-of-experts training (docs/moe.md): routing replay and the router's balance."""
    routing_replay: bool = Field(False, description="R3: the rollout engines return every "
        "token's experts (SGLang's return_routed_experts) and the training forwards route by "
        "them instead of their own top-k (the gate weights still come from the training "
        "router); needs an MoE model.")
    aux_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the load-balancing loss "
        "(Switch/Qwen-MoE form, averaged over layers) in the training loss; 0: reported only.")
    per_layer_metrics: bool = Field(False, description="Router metrics per MoE layer too.")


class OptimizerConfig(_Section):
    """AdamW, its LR schedule and LoRA: what every trainer (GRPO, SFT) takes."""
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)],
                 Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, gt=0.0)
    lora: LoraConfig = LoraConfig()


class TrainConfig(OptimizerConfig):
    """The training plane and the loop around it."""
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="`torch` (HF model, DDP/FSDP2) or `megatron` (megatron-core).")
    megatron: MegatronConfig = MegatronConfig()
    moe: MoeConfig = MoeConfig()
    steps: int = Field(60, ge=0)
    prompts_per_step: int = Field(32, ge=1)
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per GRPO step.")
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward.")
    pack_groups: bool = Field(True, description="torch backend: run each group's shared prompt "
        "through the forward once (one packed row per group, block attention mask) wherever "
        "that costs fewer FLOPs than the padded batch; the same logits, fewer tokens.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    max_plane_restarts: int = Field(
        1, ge=0, description="Rebuilds from the latest checkpoint after a step fails.")
    seed: int = 0


class AlgorithmConfig(_Section):
    """The GRPO objective and its variants (Dr.GRPO, DAPO, GSPO), and the corrections for
    the rollout engine sampling from another policy than the trainer's (TIS/MIS, IcePop,
    sequence masking: docs/training.md)."""
    advantage: Literal["grpo", "drgrpo"] = "grpo"
    kl_coef: float = Field(0.0, ge=0.0)
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.2, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    ratio_type: Literal["token", "sequence"] = "token"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = Field(0.0, ge=0.0)
    tis_cap: float | None = Field(None, gt=0.0, description="Importance-sampling cap C on the "
        "trainer/rollout ratio pi_old / pi_rollout; None = off (on by default at 2.0 when "
        "rollout.max_staleness > 0).")
    tis_level: Literal["token", "sequence", "geometric"] = Field("token", description="The "
        "ratio `tis_cap` bounds: per token, per sequence (product of the token ratios) or "
        "their geometric mean per sequence.")
    tis_mode: Literal["truncate", "mask"] = Field("truncate", description="`truncate` (TIS): "
        "weight min(ratio, C); `mask` (MIS): weight ratio, and 0 (token or whole sequence "
        "masked out of the policy gradient) where the ratio exceeds C. Needs `tis_cap`.")
    icepop_low: float | None = Field(None, gt=0.0, lt=1.0, description="IcePop: tokens whose "
        "ratio pi_old / pi_rollout is below this are masked out of the policy gradient; set "
        "with `icepop_high` (e.g. 0.5 and 2.0). None = off.")
    icepop_high: float | None = Field(None, gt=1.0, description="IcePop: tokens whose ratio "
        "is above this are masked out of the policy gradient. None = off.")
    seq_mask_threshold: float | None = Field(None, gt=0.0, description="Sequence masking: a "
        "sample whose log-ratio mismatch (`seq_mask_metric`) exceeds this is dropped from the "
        "policy gradient entirely. None = off.")
    seq_mask_metric: Literal["max", "mean"] = Field("max", description="`max`: the largest "
        "|log ratio| over the sample's tokens; `mean`: |mean log ratio| (the log of the "
        "geometric-mean ratio).")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal (no gradient) and "
        "sample more prompts until the step has train.prompts_per_step informative groups.")
    dynamic_sampling_max_rounds: int = Field(
        4, ge=1, description="Rollout rounds per step at most (then train on what was kept).")

    @model_validator(mode="after")
    def _check_corrections(self) -> AlgorithmConfig:
        if (self.icepop_low is None) != (self.icepop_high is None):
            raise ValueError(
                "algorithm.icepop_low and algorithm.icepop_high bound one band: set both "
                f"(e.g. 0.5 and 2.0) or neither (got {self.icepop_low} and {self.icepop_high})")
        if self.tis_mode == "mask" and self.tis_cap is None:
            raise ValueError(
                "algorithm.tis_mode=mask masks the tokens whose ratio exceeds algorithm.tis_cap, "
                "which is not set: set algorithm.tis_cap (e.g. 2.0) or tis_mode=truncate")
        return self


class JudgeConfig(_Section):
    """An LLM judge or reward model on engines of its own (`reward.fn: judge`, docs/judges.md)."""
    model: str | None = Field(None, description="The judge: a local Hugging Face directory or hub "
        "id of a chat model (its tokenizer's chat template renders the prompt).")
    mode: Literal["score", "verdict"] = Field("score", description="`score`: a number read from "
        "the output (\"Score: 7\") divided by `max_score`; `verdict`: yes / no scores 1 / 0.")
    template: str | None = Field(None, description="The user turn; fields `{question}`, "
        "`{response}`, `{answer}`, `{max_score}` (literal braces doubled). null: the mode's "
        "default.")
    system_prompt: str | None = Field(None, description="A system turn before the template.")
    max_score: float = Field(10.0, gt=0.0, description="`score` mode: the top of the scale.")
    max_new_tokens: int = Field(64, ge=1, description="Greedy tokens per judgement at most.")
    batch_size: int = Field(8, ge=1, description="Samples per request to a judge engine.")
    timeout_s: float = Field(60.0, gt=0.0, description="Bound on one request (a batch), queueing "
        "at the engine included; its samples then count as timeouts (scored 0) after `retries`.")
    retries: int = Field(2, ge=0, description="Further attempts of a request after a timeout or "
        "an engine error, with exponential backoff (a dead engine is restarted meanwhile).")
    retry_backoff_s: float = Field(1.0, gt=0.0, description="Wait before the first retry; doubled "
        "for each further one.")
    num_engines: int = Field(1, ge=1, description="Judge engine processes (each a model copy).")
    engine: Literal["embedded", "sglang"] = Field("embedded", description="`embedded`: grpoflow's "
        "engine processes (CPU); `sglang`: SGLang servers (GPU).")
    engine_threads: int | None = Field(None, ge=1, description="torch threads per embedded "
        "judge engine; default: cores / engines.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: "
        "`model.dtype` on embedded engines, the checkpoint's own on SGLang.")
    sglang_tp: int = Field(1, ge=1, description="Tensor parallelism of each judge SGLang server.")
    sglang_base_gpu_id: int = Field(0, ge=0, description="First GPU of judge engine 0 (engine i "
        "starts at base + i * tp): keep the judge off the rollout engines' GPUs, or share them "
        "with a small `sglang_mem_fraction_static`.")
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    sglang_extra_args: list[str] = []

    @field_validator("template")
    @classmethod
    def _check_template(cls, template: str | None) -> str | None:
        if template is None:
            return None
        import string

        allowed = {"question", "response", "answer", "max_score"}
        try:
            names = {n for _, n, _, _ in string.Formatter().parse(template) if n is not None}
        except ValueError as e:
            raise ValueError(f"not a format string ({e}); write literal braces as "
                             "{{ }}") from None
        if bad := names - allowed:
            raise ValueError(f"unknown fields {sorted(bad)}; the fields are {sorted(allowed)} "
                             "(write literal braces as {{ }})")
        if "response" not in names:
            raise ValueError("the template must contain {response}: what the judge is to judge")
        return template


class RewardConfig(_Section):
    """How completions are scored."""
    fn: str = Field("gsm8k", description="`gsm8k`, `format`, `judge` (an LLM judge: "
        "`reward.judge`), or `package.module:function`.")
    format_weight: float = Field(0.0, ge=0.0)
    timeout_s: float = Field(
        5.0, gt=0.0, description="Bound on one sample's reward call; a timeout scores 0.")
    memory_limit_mb: int | None = Field(
        4096, ge=64, description="Address-space limit (RLIMIT_AS) of each worker process running "
        "a custom reward function; an allocation past it scores that sample 0. null: no limit.")
    pass_threshold: float = Field(1.0, description="A completion counts as correct (accuracy, eval "
        "pass@k) when the reward function scores it at least this (format bonus excluded).")
    max_failed_steps: int = Field(
        3, ge=0, description="Fail the run when the reward function fails every sample of this "
        "many consecutive steps (0: never; such steps score 0 and the run goes on).")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The judge of "
        "`fn: judge`.")

    @field_validator("fn")
    @classmethod
    def _check_fn(cls, fn: str) -> str:
        spec = fn.strip()
        if spec in ("gsm8k", "format", "judge"):
            return fn
        module, sep, attr = spec.partition(":")
        names = [*module.split("."), *attr.split(".")]
        if not sep or ":" in attr or not all(n.isidentifier() for n in names):
            raise ValueError(f"{fn!r} is neither a builtin ('gsm8k', 'format', 'judge') nor a "
                             "dotted path 'package.module:function' (e.g. my_rewards.math:score)")
        return fn

    @model_validator(mode="after")
    def _judge_has_model(self) -> RewardConfig:
        if self.fn.strip() == "judge" and not self.judge.model:
            raise ValueError("reward.fn is 'judge' but reward.judge.model is not set: name the "
                             "judge model (a local Hugging Face directory or hub id)")
        return self


class AgentConfig(_Section):
    """Multi-turn episodes (`rl_core.agents`, docs/agents.md). With neither `env` nor `program`
    set, rollouts are single completions."""
    env: str | None = Field(None, description="`tools` (the builtin tool-use environment), "
        "`verifiers:<environment id>`, `openenv:<package.module:EnvClass>`, or "
        "`package.module:factory` (called with `env_args`, returns an Environment per episode).")
    program: str | None = Field(None, description="A black-box agent, `package.module:function`"
        "(client, task) -> reward, run against the rollout plane's OpenAI-compatible endpoint.")
    env_args: dict[str, Any] = Field({}, description="Keyword arguments for the factory.")
    tools: list[str] = Field(["calculator"], description="Tools of `env: tools`: builtins "
        "(`calculator`, `python`) or `package.module:attribute` naming an rl_core.agents.Tool.")
    system_prompt: str | None = Field(None, description="`env: tools`: the system message; "
        "null: the Hermes tool instructions, unless the chat template renders tools itself.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most.")
    max_tokens: int = Field(256, ge=1, description="Tokens after the prompt per episode at most "
        "(model turns and observations); each turn also stops at rollout.max_new_tokens.")
    timeout_s: float = Field(120.0, gt=0, description="Wall time of one episode at most.")
    env_timeout_s: float = Field(30.0, gt=0, description="Bound on one environment call.")
    episode_retries: int = Field(1, ge=0, description="An episode whose environment fails is "
        "started over this many times, then recorded as failed (trains nothing).")
    max_failed_frac: float = Field(0.5, ge=0.0, le=1.0, description="A step in which more than "
        "this share of episodes failed counts towards `max_failed_steps`.")
    max_failed_steps: int = Field(3, ge=0, description="Fail the run after this many such steps "
        "in a row (0: never).")
    score_final_answer: bool = Field(True, description="Add `reward.fn`'s score of the last model "
        "turn to the environment's reward (off for environments that score themselves).")

    @model_validator(mode="after")
    def _one_kind(self) -> AgentConfig:
        if self.env is not None and self.program is not None:
            raise ValueError("set agent.env (an environment grpoflow drives) or agent.program (a "
                             "black-box agent on the OpenAI endpoint), not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.env is not None or self.program is not None


class EvalConfig(_Section):
    """Held-out evaluation: greedy pass@1 and sampled pass@k."""
    every: int = Field(10, ge=0, description="Evaluate every N steps; 0 = only before/after.")
    num_examples: int = Field(200, ge=1)
    pass_k: int = Field(4, ge=1)
    pass_k_examples: int = Field(64, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    max_new_tokens: int | None = Field(None, ge=1)
    promotion_metric: Literal["pass_at_1", "pass_at_k"] = Field(
        "pass_at_1", description="What the scheduled evaluation compares (candidate vs champion).")
    promotion_margin: float = Field(
        0.01, ge=0.0, description="The candidate must beat the champion by more than this.")
    champion_alias: str = Field("champion", min_length=1)


class CheckpointConfig(_Section):
    """Where checkpoints go and how often."""
    every: int = Field(0, ge=0, description="Save every N steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1)
    uri: str | None = Field(None, description="Defaults to <run_dir>/checkpoints.")


class ClusterConfig(_Section):
    """Where the planes run: this process and local engines, or Ray actors."""
    mode: Literal["local", "ray"] = Field(
        "local", description="`local`: trainer in the flow process, engines as local processes; "
        "`ray`: both planes as Ray actors (docs/architecture.md).")
    address: str | None = Field(None, description="Ray to join (`auto`, `host:port`, "
        "`ray://host:port`); None starts a local Ray bound to 127.0.0.1 for the run.")
    placement: Literal["colocated", "disaggregated"] = Field("colocated", description="Planes "
        "share devices (time-sliced) or get separate device pools.")
    trainer_ranks: int = Field(1, ge=1, description="Data-parallel trainer actors (Ray).")
    cpus_per_trainer: float = Field(1.0, ge=0)
    gpus_per_trainer: float = Field(0.0, ge=0)
    cpus_per_engine: float = Field(1.0, ge=0)
    gpus_per_engine: float = Field(0.0, ge=0)
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray (default: all).")
    timeout_s: float = Field(300.0, gt=0, description="Bound on Ray start, placement, calls.")
    env: dict[str, str | None] = Field(
        default_factory=dict, description="Environment for every engine and trainer process, "
        "over the platform presets (docs/platforms.md); a null value removes a preset.")


class StorageConfig(_Section):
    """Durable storage root for data, models and checkpoints."""
    root: str = Field("runs", description="Local directory (or s3:// once storage lands).")
    cache_dir: str = Field(".cache/grpoflow", description="Prepared data and built models.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph, "
                                        "R2); default: AWS_ENDPOINT_URL or AWS.")


class TrackingConfig(_Section):
    """MLflow, the system of record: params, per-step metrics, checkpoints, the registry."""
    backend: Literal["none", "mlflow"] = Field(
        "mlflow", description="`mlflow`: a SQLite store in the run directory unless `uri` is set.")
    uri: str | None = Field(None, description="Tracking URI; default: MLFLOW_TRACKING_URI.")
    experiment: str | None = Field(None, description="Default: the config's `name`.")
    samples_every: int = Field(10, ge=0, description="Sample-generation table every K steps.")
    samples_rows: int = Field(16, ge=1)
    traces_per_step: int = Field(4, ge=0, description="Multi-turn episodes logged as MLflow "
        "traces each step (turns, tool calls, rewards, timings); 0: none.")
    system_metrics: bool = True
    system_metrics_interval_s: float = Field(10.0, gt=0)
    register_model: bool = Field(True, description="Register the final model as `model.name`.")
    alias: str = Field("candidate", description="Alias given to each new registered version.")
    checkpoint_artifacts: bool = Field(
        True, description="Log local checkpoints as artifacts (s3:// ones by reference only).")
    flush_timeout_s: float = Field(120.0, ge=0, description="At the end, wait this long for unsent "
        "metrics to reach MLflow; what is left goes to <run_dir>/mlflow-unsent-metrics.jsonl "
        "(replayable).")


class ExperimentConfig(_Section):
    """A whole GRPO experiment."""
    name: str = "grpoflow"
    run_name: str | None = Field(None, description="Defaults to `<name>-<timestamp>`.")
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    agent: AgentConfig = AgentConfig()
    teacher: TeacherConfig = TeacherConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()

    def thread_budget(self) -> tuple[int, int | None]:
        """(torch threads per embedded engine, trainer threads; None: torch's default).

        ``cluster.mode: local`` with ``placement: colocated`` (the default): each plane may use
        every core, and they take turns. ``placement: disaggregated``: the cores are split,
        half for the engines and the rest for the trainer, so the planes can run at once (as
        separate GPUs would). ``rollout.engine_threads`` / ``train.num_threads`` override."""
        cores = os.cpu_count() or 1
        split = self.cluster.mode == "local" and self.cluster.placement == "disaggregated"
        engine_cores = max(1, cores // 2) if split else cores
        engine = self.rollout.engine_threads or max(1, engine_cores // self.rollout.num_engines)
        trainer = self.train.num_threads or (max(1, cores - engine_cores) if split else None)
        return engine, trainer

    @property
    def overlaps_training(self) -> bool:
        """Whether generation for later steps runs *while* the trainer trains
        (``rollout.max_staleness > 0``). On this machine's CPU cores only when the planes'
        thread pools fit side by side; otherwise (colocated, or the in-process engine, whose
        threads are the trainer's) the same rollouts run before the step trains, in turn:
        the same samples and weights, without two OpenMP teams fighting over the cores
        (docs/benchmarks.md measured 3x slower steps that way)."""
        r = self.rollout
        if r.max_staleness == 0:
            return False
        if r.engine == "sglang" or self.cluster.mode == "ray":
            return True  # the engines' own devices (GPUs) or Ray's resource placement
        if r.engine == "local":
            return False
        engine, trainer = self.thread_budget()
        cores = os.cpu_count() or 1
        return engine * r.num_engines + (trainer or cores) <= cores

    @model_validator(mode="after")
    def _check_cross_fields(self) -> ExperimentConfig:
        if self.algorithm.advantage == "grpo" and self.rollout.n_samples < 2:
            raise ValueError(
                "rollout.n_samples must be >= 2 for GRPO advantages (a group of one has no "
                "baseline); set rollout.n_samples=2 or more")
        if self.algorithm.clip_low > self.algorithm.clip_high and self.algorithm.clip_high > 0:
            # DAPO's clip-higher raises clip_high; a lower high bound is almost always a typo.
            raise ValueError(f"algorithm.clip_low ({self.algorithm.clip_low}) must not exceed "
                             f"algorithm.clip_high ({self.algorithm.clip_high})")
        c, r = self.cluster, self.rollout
        nccl = r.weight_sync_backend == "nccl" or (
            r.weight_sync_backend == "auto" and c.gpus_per_trainer > 0 and c.gpus_per_engine > 0)
        if (r.weight_sync == "distributed" and c.mode == "ray" and c.placement == "colocated"
                and nccl):
            raise ValueError(
                "rollout.weight_sync=distributed with cluster.placement=colocated on GPUs puts "
                "trainer rank 0 and an engine on one device, which NCCL/RCCL refuse "
                "('Duplicate GPU detected'); use rollout.weight_sync=disk (or object_store), "
                "or cluster.placement=disaggregated")
        if r.weight_sync == "object_store" and c.mode != "ray":
            raise ValueError(
                "rollout.weight_sync=object_store moves weights through Ray's object store, "
                f"but cluster.mode={c.mode!r} runs no Ray; use rollout.weight_sync=disk, or "
                "cluster.mode=ray")
        if r.engine == "local" and r.num_engines > 1:
            raise ValueError(
                f"rollout.engine=local runs one engine in the flow's process, but "
                f"rollout.num_engines={r.num_engines}: set rollout.engine=embedded for engine "
                "processes behind sglang-router (or num_engines=1)")
        if r.weight_sync == "auto":
            shareable = not self._shared_blockers() and not self.train.lora.enabled
            r.weight_sync = "shared" if shareable else "disk"
        if r.weight_sync == "shared":
            self._check_shared()
        if self.train.backend == "megatron":
            self._check_megatron()
        if self.train.lora.enabled:
            self._check_lora()
        if self.train.moe.routing_replay and self.model.path == "embedded:tiny" and (
                self.model.tiny_arch == "dense"):
            raise ValueError("train.moe.routing_replay=true replays mixture-of-experts routing, "
                             "but model.path is the dense embedded:tiny: set "
                             "model.tiny_arch=qwen3_moe (or an MoE model.path), or "
                             "train.moe.routing_replay=false")
        if self.teacher.enabled and (self.rollout.temperature != 1.0 or self.agent.enabled):
            raise ValueError("teacher.path (on-policy distillation) scores the student's tokens "
                             "at temperature 1 and single-turn samples: set rollout.temperature"
                             "=1.0 and leave agent.env/agent.program unset")
        if self.rollout.max_staleness > 0:
            if self.rollout.release_memory_while_training:
                raise ValueError(
                    "rollout.max_staleness > 0 generates while the trainer trains, so the "
                    "engines cannot release their memory meanwhile: set "
                    "rollout.release_memory_while_training=false (or max_staleness=0)")
            if "tis_cap" not in self.algorithm.model_fields_set:
                # Off-policy samples: correct them by truncated importance sampling unless the
                # config says otherwise (tis_cap: null turns it off explicitly).
                self.algorithm.tis_cap = 2.0
        if self.rollout.streaming:
            self._check_streaming()
        rollouts = self.train.prompts_per_step * self.rollout.n_samples
        if rollouts % self.train.mini_batches:
            raise ValueError(
                f"train.prompts_per_step * rollout.n_samples ({rollouts}) must be divisible by "
                f"train.mini_batches ({self.train.mini_batches})")
        return self

    def _check_streaming(self) -> None:
        r, why = self.rollout, []
        if r.max_staleness < 1:
            why.append("rollout.max_staleness is 0 (a stream trains on samples generated while "
                       "earlier steps trained: set it to 1 or more)")
        if self.agent.enabled:
            why.append("agent.env/agent.program is set (multi-turn episodes are not streamed "
                       "yet: use rollout.max_staleness alone)")
        if self.algorithm.dynamic_sampling:
            why.append("algorithm.dynamic_sampling is on (not combined with streaming yet)")
        if why:
            raise ValueError("rollout.streaming=true: " + "; ".join(why))

    def _check_lora(self) -> None:
        if self.train.backend != "torch":
            raise ValueError("train.lora.rank > 0 needs train.backend=torch (megatron-core 0.16 "
                             "has no LoRA layers of its own; docs/lora.md)")
        if (sync := self.rollout.weight_sync) != "disk":
            raise ValueError(f"train.lora.rank > 0 with rollout.weight_sync={sync!r}: adapters "
                             "travel as PEFT files (SGLang's /load_lora_adapter); use disk")

    def _check_shared(self) -> None:
        if why := self._shared_blockers():
            raise ValueError("rollout.weight_sync=shared lets the in-process engine read the "
                             "trainer's parameters in place, which needs one process and "
                             "synchronous steps: " + "; ".join(why) +
                             ". Otherwise use rollout.weight_sync=disk")

    def _shared_blockers(self) -> list[str]:
        """Why ``rollout.weight_sync: shared`` cannot run with this config (empty: it can)."""
        r, why = self.rollout, []
        if r.engine != "local":
            why.append(f"rollout.engine is {r.engine!r} (set it to local)")
        if self.cluster.mode != "local":
            why.append(f"cluster.mode is {self.cluster.mode!r} (set it to local)")
        if self.train.backend != "torch":
            why.append(f"train.backend is {self.train.backend!r} (the torch backend only)")
        if r.max_staleness > 0:
            why.append("rollout.max_staleness > 0 (the engine would sample from weights "
                       "the trainer is changing; set it to 0)")
        return why

    def _check_megatron(self) -> None:
        m, c = self.train.megatron, self.cluster
        ranks = c.trainer_ranks if c.mode == "ray" else 1
        if m.sequence_parallel and m.tp == 1:
            raise ValueError(
                "train.megatron.sequence_parallel=true needs train.megatron.tp > 1: it splits "
                "the sequence over the tensor-parallel ranks (set tp, or sequence_parallel=false)")
        if "auto" in (m.tp, m.pp, m.ep):
            return  # the planner's layout, checked when the trainer starts
        where = (f"cluster.trainer_ranks ({ranks})" if c.mode == "ray"
                 else "the one trainer of cluster.mode=local")
        if ranks % (m.tp * m.pp):
            raise ValueError(
                f"train.megatron.tp * train.megatron.pp ({m.tp} * {m.pp}) must divide {where}; "
                + ("use cluster.mode=ray with cluster.trainer_ranks = tp * pp * dp"
                   if c.mode == "local" else "change cluster.trainer_ranks or tp/pp"))
        dp = ranks // (m.tp * m.pp)
        if (m.tp * dp) % m.ep:
            raise ValueError(
                f"train.megatron.ep={m.ep} must divide the ranks of a pipeline stage ({m.tp * dp}"
                f" = tp * dp = {where} / pp): megatron-core carves the expert-parallel groups "
                "out of them (across the data-parallel and, experts not being TP-split, the "
                "tensor-parallel ranks)")
        if m.dp is not None and m.dp != dp:
            raise ValueError(
                f"train.megatron.tp * pp * dp = {m.tp} * {m.pp} * {m.dp} = {m.tp * m.pp * m.dp}, "
                f"but there are {ranks} trainer ranks ({where}); leave train.megatron.dp unset "
                "to derive it")


def load_config(path: str | Path | None = None,
                overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    data, origin = read_config(path, overrides, "configs/tiny-cpu.yaml")
    return validate_config(ExperimentConfig, data, origin)


def config_digest(cfg: ExperimentConfig) -> str:
    """A stable short digest of the whole config (names outputs and caches)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
