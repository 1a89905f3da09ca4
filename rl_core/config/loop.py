"""The loop's sections: model, data, rollout, train (optimizer, LoRA, MoE, megatron), algorithm."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rl_core.config.base import Section


class ModelConfig(Section):
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


class SourceConfig(Section):
    """What GRPO's prompts and SFT's demonstrations share: where rows come from, how a prompt
    is rendered, and the synthetic task (``data`` of both configs builds on it)."""
    source: str = Field("synthetic", min_length=1, description="`synthetic`, an HF dataset name, a "
        "local dataset dir, .jsonl or .parquet.")
    subset: str | None = None
    train_split: str = "train"
    eval_split: str = "test"
    eval_source: str | None = Field(None, description="Defaults to `source` with `eval_split`.")
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
    # Synthetic generator knobs.
    synthetic_train_size: int = Field(3000, ge=1)
    synthetic_test_size: int = Field(300, ge=1)
    synthetic_digits: tuple[int, int] = (1, 1)
    synthetic_operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    synthetic_steps: tuple[int, int] = (1, 2)
    seed: int = 0

    @model_validator(mode="after")
    def _check_source(self) -> SourceConfig:
        for name in ("synthetic_digits", "synthetic_steps"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {lo, hi}")
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


class DataConfig(SourceConfig):
    """Where prompts come from and how they are rendered."""
    question_field: str = Field("question", min_length=1)
    answer_field: str = Field("answer", min_length=1)
    max_prompt_tokens: int = Field(256, ge=1)
    synthetic_long_frac: float = Field(0.0, ge=0.0, le=1.0, description="Share of problems "
        "with synthetic_long_steps steps: a long-tailed response length (benchmarks).")
    synthetic_long_steps: int = Field(12, ge=1)

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
        if self.question_field == self.answer_field:
            raise ValueError(
                f"question_field and answer_field are both {self.question_field!r}; they must "
                "name two different columns")
        if self.id_field is not None and self.id_field in (self.question_field, self.answer_field):
            raise ValueError(
                f"id_field {self.id_field!r} is also the question or answer column; name the id "
                "column, or set id_field: null to use content-hash ids")
        return self


class RolloutConfig(Section):
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


class MegatronConfig(Section):
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


class LoraConfig(Section):
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


class MoeConfig(Section):
    """Mixture-of-experts training (docs/moe.md): routing replay and the router's balance."""
    routing_replay: bool = Field(False, description="R3: the rollout engines return every "
        "token's experts (SGLang's return_routed_experts) and the training forwards route by "
        "them instead of their own top-k (the gate weights still come from the training "
        "router); needs an MoE model.")
    aux_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the load-balancing loss "
        "(Switch/Qwen-MoE form, averaged over layers) in the training loss; 0: reported only.")
    per_layer_metrics: bool = Field(False, description="Router metrics per MoE layer too.")


class OptimizerConfig(Section):
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


class AlgorithmConfig(Section):
    """The GRPO objective and its variants (Dr.GRPO, DAPO, GSPO), and the corrections for
    the rollout engine sampling from another policy than the trainer's (TIS/MIS, IcePop,
    sequence masking: docs/training.md)."""
    advantage: Literal["grpo", "drgrpo"] = "grpo"
    loss: Literal["policy_gradient", "nll"] = Field("policy_gradient", description="`nll`: "
        "supervised fine-tuning's mean negative log-likelihood of the response tokens, "
        "advantages ignored (the SFT flow's and the tiny model's warm start; docs/sft.md).")
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
