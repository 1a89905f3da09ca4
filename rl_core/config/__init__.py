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

from pydantic import Field, model_validator

from rl_core.config.base import (
    ConfigError,
    Section,
    apply_overrides,
    flatten,
    read_config,
    validate_config,
)
from rl_core.config.infra import (
    CheckpointConfig,
    ClusterConfig,
    EvalConfig,
    StorageConfig,
    TrackingConfig,
)
from rl_core.config.loop import (
    AlgorithmConfig,
    DataConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    RolloutConfig,
    SourceConfig,
    TrainConfig,
)
from rl_core.config.signals import (
    AgentConfig,
    EnginesConfig,
    JudgeConfig,
    RewardConfig,
    TeacherConfig,
)

__all__ = ["AgentConfig", "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "ConfigError",
           "DataConfig", "EnginesConfig", "EvalConfig", "ExperimentConfig", "JudgeConfig", "LoraConfig",
           "MegatronConfig", "ModelConfig", "MoeConfig", "OptimizerConfig", "RewardConfig",
           "RolloutConfig", "Section", "SourceConfig", "StorageConfig", "TeacherConfig", "TrackingConfig",
           "TrainConfig", "apply_overrides", "config_digest", "flatten", "load_config",
           "read_config", "resolve_device", "validate_config"]


def resolve_device(name: str, field: str) -> str:
    """``auto`` / ``cpu`` / ``cuda`` (the config field ``field``) as the torch device to use:
    auto is a GPU when torch sees one (ROCm builds report theirs as cuda), else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}=cuda, but torch sees no GPU here (torch "
                          f"{torch.__version__}); use {field}=auto or cpu, or a GPU build of torch")
    return name


class ExperimentConfig(Section):
    """A whole GRPO experiment."""
    name: str = Field("grpoflow", description="The experiment's name: run names start with it, "
        "and it is the MLflow experiment unless `tracking.experiment` is set.")
    run_name: str | None = Field(None, description="Defaults to `<name>-<timestamp>`.")
    seed: int = Field(0, description="Seed of the prompt order and of the rollout and "
        "evaluation sampling.")
    model: ModelConfig = Field(ModelConfig(), description="The policy model to start from.")
    data: DataConfig = Field(DataConfig(), description="The prompts and how they are rendered.")
    rollout: RolloutConfig = Field(
        RolloutConfig(), description="The rollout plane: engines and sampling parameters.")
    train: TrainConfig = Field(
        TrainConfig(), description="The training plane: backend, optimizer and batches.")
    algorithm: AlgorithmConfig = Field(
        AlgorithmConfig(), description="The GRPO objective, its variants and corrections.")
    reward: RewardConfig = Field(RewardConfig(), description="How completions are scored.")
    agent: AgentConfig = Field(AgentConfig(), description="Multi-turn episodes (docs/agents.md).")
    teacher: TeacherConfig = Field(
        TeacherConfig(), description="On-policy distillation (docs/distillation.md).")
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="Where checkpoints go and how often.")
    cluster: ClusterConfig = Field(
        ClusterConfig(), description="Where the planes run: this process or Ray actors.")
    storage: StorageConfig = Field(
        StorageConfig(), description="Where runs and cached data and models go.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow tracking and registry.")

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
        if self.algorithm.loss == "nll":
            raise ValueError(
                "algorithm.loss=nll is supervised fine-tuning's loss: on GRPO's rollouts it "
                "would imitate the policy's own samples. Fine-tune on demonstrations with "
                "`grpoflow sft` (docs/sft.md), or set algorithm.loss=policy_gradient")
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
        if r.weight_sync == "shm" and (r.engine != "embedded" or c.mode != "local"
                                       or self.train.lora.enabled or r.weight_sync_delta):
            raise ValueError(
                "rollout.weight_sync=shm hands grpoflow's engine processes their weights in "
                "shared memory on this host: it needs rollout.engine=embedded, cluster.mode=local, "
                "no LoRA (train.lora) and no rollout.weight_sync_delta; got "
                f"rollout.engine={r.engine}, cluster.mode={c.mode}; use rollout.weight_sync=disk")
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
        if r.weight_sync_delta:
            self._check_delta()
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
        elif self.rollout.pause_mode != "abort":
            raise ValueError(f"rollout.pause_mode={self.rollout.pause_mode} decides what a weight "
                             "update does to a streamed round in flight: it needs "
                             "rollout.streaming=true (and rollout.deterministic=false)")
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
        if r.pause_mode != "abort" and r.timing_free:
            why.append(f"rollout.pause_mode={r.pause_mode} needs rollout.deterministic=false "
                       "(deterministic rounds never run across a weight update)")
        if why:
            raise ValueError("rollout.streaming=true: " + "; ".join(why))

    def _check_lora(self) -> None:
        if self.train.backend != "torch":
            raise ValueError("train.lora.rank > 0 needs train.backend=torch (megatron-core 0.16 "
                             "has no LoRA layers of its own; docs/lora.md)")
        if (sync := self.rollout.weight_sync) != "disk":
            raise ValueError(f"train.lora.rank > 0 with rollout.weight_sync={sync!r}: adapters "
                             "travel as PEFT files (SGLang's /load_lora_adapter); use disk")
        if self.train.lora.per_role:
            why = [w for bad, w in (
                (self.agent.env is None, "agent.env is not set (the roles are the environment's: "
                 "an agent.env whose class declares `roles`)"),
                (self.cluster.mode != "local", f"cluster.mode={self.cluster.mode!r} (trainer "
                 "ranks train one adapter; use cluster.mode=local)"),
                (self.rollout.engine == "sglang", "rollout.engine=sglang (several adapters on "
                 "SGLang engines are not wired or tested yet; use local or embedded)")) if bad]
            if why:
                raise ValueError("train.lora.per_role=true: " + "; ".join(why))

    def _check_delta(self) -> None:
        r, why = self.rollout, []
        if r.weight_sync != "disk":
            why.append(f"rollout.weight_sync is {r.weight_sync!r} (deltas travel as files: disk)")
        if r.engine != "embedded":
            why.append(f"rollout.engine is {r.engine!r} (only the embedded engine reads deltas)")
        if self.cluster.mode != "local":
            why.append("cluster.mode is ray (the encoder needs the weights in this process)")
        if self.train.lora.enabled:
            why.append("train.lora is on (an adapter is small already)")
        if why:
            raise ValueError("rollout.weight_sync_delta=true: " + "; ".join(why))

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
