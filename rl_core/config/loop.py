"""The loop's sections: model, data, rollout, train (optimizer, LoRA, MoE, megatron), algorithm."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rl_core.config.base import Section


class ModelConfig(Section):
    """The policy model to start from."""
    path: str = Field("embedded:tiny", min_length=1, description="HF hub id, local HF directory, "
        "or `embedded:tiny` to build the demo model (`embedded:tiny-vlm`: the vision-language "
        "demo's, docs/vlm.md).")
    revision: str | None = Field(
        None, description="Hub branch, tag or commit (default: main); cached by commit sha.")
    name: str = Field("grpoflow-tiny", description="Registered model name for the final export.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' "
        "dtype in the trainer and grpoflow's engines; SGLang gets `auto` (the checkpoint's) "
        "for `float32`.")
    trust_remote_code: bool = Field(False, description="Let the model's own Python code run "
        "when its config, tokenizer and weights load (Hugging Face `trust_remote_code`).")
    freeze_vision: bool = Field(True, description="Vision-language models: keep the vision "
        "tower and its merger frozen (most recipes do); false trains them too, and weight sync "
        "then carries them (docs/vlm.md).")
    # Knobs of the embedded tiny model (used only when path is `embedded:tiny`).
    tiny_hidden_size: int = Field(192, ge=16, description="Hidden size of the tiny model.")
    tiny_layers: int = Field(4, ge=1, description="Transformer layers of the tiny model.")
    tiny_heads: int = Field(4, ge=1, description="Attention heads of the tiny model.")
    tiny_kv_heads: int = Field(
        2, ge=1, description="Key/value heads of the tiny model (grouped-query attention).")
    tiny_intermediate_size: int = Field(
        512, ge=16, description="MLP width of the `dense` tiny model.")
    tiny_vocab_size: int = Field(384, ge=64, description="Vocabulary size of the tiny model's "
        "BPE tokenizer, trained on the task's text.")
    tiny_sft_steps: int = Field(600, ge=0, description="Cap on warm-start supervised steps.")
    tiny_tool_demos: float = Field(0.0, ge=0.0, le=1.0, description="Share of warm-start examples "
        "that are calculator episodes (the agent demo); the warm start then runs tiny_sft_steps "
        "steps (no accuracy target).")
    tiny_target_accuracy: float = Field(
        0.3, gt=0.0, le=1.0, description="Warm start stops at this held-out greedy accuracy.")
    tiny_arch: Literal["dense", "qwen3_moe", "qwen2_moe"] = Field("dense", description="`dense`: "
        "Qwen2; `qwen3_moe` / `qwen2_moe` (shared expert): mixture-of-experts layers of "
        "tiny_experts experts, tiny_experts_per_token per token (docs/moe.md).")
    tiny_experts: int = Field(4, ge=2, description="Experts per MoE layer of the tiny model.")
    tiny_experts_per_token: int = Field(
        2, ge=1, description="Experts each token is routed to (top-k) in the tiny MoE model.")
    tiny_moe_intermediate_size: int = Field(128, ge=8, description="Each expert's MLP width.")
    seed: int = Field(0, description="Seed of the tiny model's initialisation and warm start.")


class SourceConfig(Section):
    """What GRPO's prompts and SFT's demonstrations share: where rows come from, how a prompt
    is rendered, and the synthetic task (``data`` of both configs builds on it)."""
    source: str = Field("synthetic", min_length=1, description="`synthetic`, an HF dataset name, a "
        "local dataset dir, .jsonl or .parquet.")
    subset: str | None = Field(None, description="A hub dataset's configuration name, or a "
        "subdirectory of a local dataset directory; null: none.")
    train_split: str = Field("train", description="The training split: a hub dataset's split, "
        "or `<split>.jsonl` / `.parquet` in a local directory.")
    eval_split: str = Field("test", description="The held-out split, read like `train_split`.")
    eval_source: str | None = Field(None, description="Defaults to `source` with `eval_split`.")
    id_field: str | None = Field("id", description="null: ids are content hashes.")
    max_train_examples: int | None = Field(
        None, ge=1, description="Use only the first N training records (any source).")
    max_bad_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Share of invalid rows "
        "that are skipped with a warning instead of failing the load; 0: any bad row fails it.")
    image_field: str | None = Field(None, description="Column of each row's image(s): one or a "
        "list, as file paths (relative to the data file), s3:// URIs, bytes, `datasets` Image "
        "cells or base64 data URLs (docs/vlm.md); chat messages' image parts are read too.")
    image_min_pixels: int = Field(56 * 56, ge=1, description="The smallest area (pixels) the "
        "processor resizes an image to (Qwen2-VL's `min_pixels`).")
    image_max_pixels: int = Field(28 * 28 * 1280, ge=1, description="The largest area (pixels) "
        "the processor resizes an image to (Qwen2-VL's `max_pixels`).")
    image_max_input_pixels: int = Field(50_000_000, ge=1, description="A row whose image has "
        "more pixels than this is invalid (downscale it first).")
    system_prompt: str | None = Field(None, description="A system turn before each question with "
        "the chat template, or a paragraph before `plain_template`'s text; null: none.")
    use_chat_template: bool | None = Field(None, description="null: the tokenizer's chat template "
        "when it has one, else `plain_template`; true: require it; false: always `plain_template`.")
    plain_template: str = Field("Question: {question}\nAnswer:", description="The prompt without a "
        "chat template; `{question}` is replaced by the question (nothing else is formatted, so "
        "other braces are kept).")
    # Synthetic generator knobs.
    synthetic_task: Literal["arithmetic", "shapes"] = Field("arithmetic", description="The "
        "synthetic task: `arithmetic` word problems (the text demo) or `shapes`, pictures of "
        "coloured shapes with a question each (the vision-language demo, docs/vlm.md).")
    synthetic_image_size: int = Field(64, ge=32, le=448, description="`shapes`: the pictures' "
        "side in pixels.")
    synthetic_train_size: int = Field(3000, ge=1, description="Synthetic training problems.")
    synthetic_test_size: int = Field(
        300, ge=1, description="Synthetic held-out problems (none of them in the training set).")
    synthetic_digits: tuple[int, int] = Field((1, 1), description="(min, max) digits of an "
        "operand; the right operand of `*` is always one digit (2-9).")
    synthetic_operations: list[Literal["+", "-", "*"]] = Field(
        ["+", "-"], description="Operations a step draws from.")
    synthetic_steps: tuple[int, int] = Field(
        (1, 2), description="(min, max) operations per synthetic problem.")
    seed: int = Field(0, description="Seed of the synthetic problems (and of SFT's choice of "
        "held-out rows).")

    @model_validator(mode="after")
    def _check_source(self) -> SourceConfig:
        for name in ("synthetic_digits", "synthetic_steps"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {lo, hi}")
        if not self.source.strip():
            raise ValueError("source is blank; use synthetic, a file, a directory or a hub name")
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels ({self.image_min_pixels}) is over "
                             f"image_max_pixels ({self.image_max_pixels})")
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
    question_field: str = Field("question", min_length=1, description="Column of the question.")
    answer_field: str = Field("answer", min_length=1, description="Column of the reference "
        "answer the reward function scores against.")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this many tokens "
        "(rendered) are skipped and counted.")
    synthetic_long_frac: float = Field(0.0, ge=0.0, le=1.0, description="Share of problems "
        "with synthetic_long_steps steps: a long-tailed response length (benchmarks).")
    synthetic_long_steps: int = Field(
        12, ge=1, description="Operations of a long problem (`synthetic_long_frac`).")

    def synthetic_knobs(self) -> dict[str, Any]:
        """The generator's knobs, as :func:`rl_core.data.generate_splits` takes them."""
        if self.synthetic_task == "shapes":  # rl_core.data.shapes.shape_splits
            return {"task": "shapes", "size": self.synthetic_image_size}
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
    pause_mode: Literal["abort", "retract", "in_place"] = Field("abort", description="What a "
        "weight update does to a streamed round in flight (streaming, deterministic off): "
        "`abort` ends its requests (their tokens kept; the next round continues them), "
        "`retract` holds them and recomputes their KV under the new weights, `in_place` holds "
        "them with their KV and continues after the update (SGLang's /pause_generation modes; "
        "docs/training.md, \"Fully asynchronous rollouts\").")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the rollouts "
        "(0: greedy); the trainer takes its log-probs at it too.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample from the "
        "most likely tokens that hold this much probability; 1.0: off.")
    top_k: int = Field(-1, ge=-1, description="Sample from the `top_k` most likely tokens; -1: "
        "off.")

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, top_k: int) -> int:
        if top_k == 0:  # what SGLang and the embedded engine refuse at the first request
            raise ValueError("rollout.top_k=0 samples from no token: use -1 (off) or >= 1")
        return top_k
    max_new_tokens: int = Field(32, ge=1, description="Tokens a sample (an agent turn) may "
        "generate at most; also Dr.GRPO's normaliser (`seq-mean-token-sum-norm`).")
    stop: list[str] = Field([], description="Strings that end a sample when generated.")
    stop_token_ids: list[int] = Field(
        [], description="Token ids that end a sample, besides the tokenizer's EOS ids.")
    timeout_s: float = Field(600.0, gt=0, description="Bound on one step's generation.")
    # HTTP engines (embedded / sglang)
    num_engines: int = Field(1, ge=1, description="Engine processes (each a full model copy).")
    router: bool | None = Field(
        None, description="Put sglang-router in front; default: on when num_engines > 1.")
    engine_threads: int | None = Field(
        None, ge=1, description="torch threads per embedded engine; default: cores / engines.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the `local` "
        "engine (when it does not share the trainer's weights) and the `embedded` engine "
        "processes run in local mode: auto, a GPU (CUDA or ROCm) when torch sees one (engine i "
        "on GPU i mod the count), else the CPU. On Ray an engine actor uses the GPU it is given "
        "(`cluster.gpus_per_engine`); `sglang` servers run on GPUs.")
    max_running_requests: int = Field(256, ge=1, description="Per engine (embedded, local).")
    prefix_cache_tokens: int = Field(0, ge=0, description="The embedded/local engine's prefix "
        "cache: finished requests' KV, up to this many tokens per engine, reused by prompts that "
        "extend them (an agent's next turn); 0: off (SGLang keeps its own radix cache).")
    max_loras_per_batch: int = Field(1, ge=1, description="LoRA adapters one running batch of "
        "the local engine, the embedded engine processes and SGLang serve (passed to those as "
        "--max-loras-per-batch): 1 merges the batch's adapter into "
        "the weights (no cost per token); N > 1 runs rows of up to N adapters and the base "
        "model together, each adapter applied unmerged to its rows (docs/lora.md).")
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random", "manual"] = (
        Field("cache_aware", description="sglang-router's policy; `manual`: sticky by the "
              "episode (session affinity, the routing-key header)."))
    request_batch_size: int = Field(
        16, ge=1, description="Samples per /generate request; 1 = one request per sample.")
    deterministic: bool | None = Field(
        None, description="Timing-free rollouts: a generation goes to each embedded engine as "
        "one request, so the samples that share its batches (and the last bit of every "
        "log-prob) do not depend on when requests arrive; runs repeat bit for bit on CPU, "
        "overlapped (max_staleness > 0) or not. Default: on for the embedded engine, off for "
        "SGLang (whose own batching decides).")
    weight_sync: Literal["auto", "disk", "shm", "object_store", "distributed", "shared"] = Field(
        "auto", description="`auto`: `shared` where it can run (engine local, cluster.mode "
        "local, the torch backend, synchronous steps, no LoRA), else `disk`. "
        "`disk`: trainer writes safetensors, engines reload them (one node "
        "or a shared filesystem); `shm` (embedded engines, cluster.mode local): the trainer "
        "writes shared memory that the engine processes serve without a copy; "
        "`object_store`: through Ray's object store (cluster.mode ray); "
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
    weight_sync_delta: bool = Field(
        False, description="weight_sync=disk to embedded engines, trainer in this process: "
        "write only what changed since the version the engines hold (per tensor: skipped, "
        "sparse index/value pairs or the compressed XOR of the bit patterns, whichever is "
        "smallest; exact), with a full sync every weight_sync_delta_full_every versions and "
        "after any failed one (docs/weight-sync.md, \"Delta sync\").")
    weight_sync_delta_full_every: int = Field(
        10, ge=1, description="weight_sync_delta: every this many versions a full sync.")
    weight_sync_probe: bool = Field(
        True, description="After every weight sync each engine scores a fixed probe batch by "
        "prefill and is compared with the trainer's log-probs of it: an engine that loaded the "
        "right bytes into the wrong place fails the sync (docs/weight-sync.md).")
    weight_sync_probe_tolerance: float | None = Field(
        None, gt=0, description="Largest |log p| difference the probe accepts; None: by "
        "model.dtype (float32 1e-3, float16 0.1, bfloat16 0.5; docs/weight-sync.md).")
    startup_timeout_s: float = Field(300.0, gt=0, description="Bound on the engines' start until "
        "all are healthy (and on a restarted engine's).")
    health_interval_s: float = Field(
        5.0, gt=0, description="Seconds between the engine monitor's health probes.")
    health_timeout_s: float = Field(
        20.0, gt=0, description="Bound on one health probe of an engine (/health_generate).")
    health_failure_threshold: int = Field(3, ge=1, description="Failed probes in a row that get an "
        "engine restarted and re-synced (a hung engine is replaced after about this many x "
        "health_timeout_s).")
    sglang_tp: int = Field(1, ge=1, description="Tensor parallelism of each SGLang server.")
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0, description="SGLang's "
        "`--mem-fraction-static` (GPU memory share for weights and KV cache); null: its default.")
    sglang_platform: Literal["cuda", "rocm"] = Field("cuda", description="GPU platform of the "
        "SGLang servers (rollout and judge): their environment presets (docs/platforms.md).")
    sglang_extra_args: list[str] = Field(
        [], description="Arguments appended to each SGLang server's command line.")

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
    recompute_num_layers: int = Field(1, ge=1, description="`recompute: full`: layers per "
        "recomputed chunk (megatron-core's uniform method).")
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
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input "
        "while training (PEFT's `lora_dropout`).")
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
    per_role: bool = Field(False, description="Multi-role episodes (an agent.env that declares "
        "roles): one adapter per role, `<name>-<role>`, each sampling its role's turns and "
        "trained on its role's samples only (docs/lora.md). False: one adapter for every role.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check_quantize(self) -> LoraConfig:
        if self.quantize and not self.enabled:
            raise ValueError(f"train.lora.quantize={self.quantize!r} quantizes the base under "
                             "an adapter, but train.lora.rank is 0; set train.lora.rank > 0")
        if self.per_role and not self.enabled:
            raise ValueError("train.lora.per_role=true trains an adapter per role, but "
                             "train.lora.rank is 0; set train.lora.rank > 0")
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
    lr: float = Field(1e-4, gt=0.0, description="AdamW's peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's (decoupled) weight decay.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)],
                 Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW's (beta1, beta2).")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup up to "
        "`lr`; 0: none.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warmup: "
        "`constant`, or `cosine` decay to `min_lr_ratio` x `lr` over the run's optimizer steps.")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="`cosine`: the final learning rate, as a share of `lr`.")
    grad_clip: float = Field(
        1.0, gt=0.0, description="Gradients are clipped to this global norm before each step.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (`rank > 0`; docs/lora.md).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the trainer in "
        "the flow's process runs (cluster.mode=local): auto, a GPU (CUDA or ROCm) when torch "
        "sees one, else the CPU. On Ray the ranks' devices follow cluster.gpus_per_trainer.")


class TrainConfig(OptimizerConfig):
    """The training plane and the loop around it."""
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="`torch` (HF model, DDP/FSDP2) or `megatron` (megatron-core).")
    megatron: MegatronConfig = Field(
        MegatronConfig(), description="The megatron backend's parallel layout.")
    moe: MoeConfig = Field(MoeConfig(), description="Mixture-of-experts training (docs/moe.md).")
    steps: int = Field(60, ge=0, description="GRPO steps (rollout, then update) of the run.")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per GRPO step, each sampled "
        "`rollout.n_samples` times.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per GRPO step.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch (each of "
        "`mini_batches` optimizer steps).")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward.")
    pack_groups: bool = Field(True, description="torch backend: run each group's shared prompt "
        "through the forward once (one packed row per group, block attention mask) wherever "
        "that costs fewer FLOPs than the padded batch; the same logits, fewer tokens.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    max_plane_restarts: int = Field(
        1, ge=0, description="Rebuilds from the latest checkpoint after a step fails.")
    seed: int = Field(0, description="The trainer's torch seed.")


class AlgorithmConfig(Section):
    """The GRPO objective and its variants (Dr.GRPO, DAPO, GSPO), and the corrections for
    the rollout engine sampling from another policy than the trainer's (TIS/MIS, IcePop,
    sequence masking: docs/training.md)."""
    advantage: Literal["grpo", "drgrpo"] = Field("grpo", description="`grpo`: (reward - group "
        "mean) / group std; `drgrpo` (Dr.GRPO): reward - group mean.")
    loss: Literal["policy_gradient", "nll"] = Field("policy_gradient", description="`nll`: "
        "supervised fine-tuning's mean negative log-likelihood of the response tokens, "
        "advantages ignored (the SFT flow's and the tiny model's warm start; docs/sft.md).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL penalty to the reference "
        "(the starting policy) in the loss; 0: no penalty and no reference model.")
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="The "
        "per-token KL estimator; `low_var_kl`: `k3` clamped to [-10, 10], as verl.")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clipping below: the ratio is "
        "clipped at `1 - clip_low`.")
    clip_high: float = Field(0.2, ge=0.0, description="PPO clipping above: the ratio is clipped "
        "at `1 + clip_high` (DAPO's clip-higher raises it).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip PPO: a token with a "
        "negative advantage loses at most `dual_clip` x |advantage|. None = off.")
    ratio_type: Literal["token", "sequence"] = Field("token", description="`token`: per-token "
        "ratios; `sequence`: GSPO's length-normalised sequence ratio on every token.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = Field("token-mean", description="`token-mean`: "
        "the mean over all tokens; `seq-mean-token-mean` / `-sum`: the mean over samples of "
        "their token means / sums; `-sum-norm`: sums / `rollout.max_new_tokens` (Dr.GRPO).")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of the entropy bonus subtracted from the loss; 0: none.")
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
