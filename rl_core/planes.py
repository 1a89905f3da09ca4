"""The two planes of a run (rollout plane + trainer), the transport between them, the prompts.

Prefect tasks never carry models in their results: the flow brings the planes up once and
passes a small :class:`PlanesHandle` around; tasks resolve it with :func:`get_planes`. The
rollout plane is any :class:`~rl_core.interfaces.RolloutPlane` (engines behind SGLang's HTTP
API, or the engine core in this process), the trainer any
:class:`~rl_core.interfaces.Trainer` (in this process, or ranks on Ray), the transport one
:class:`~rl_core.interfaces.WeightSync`: the config picks each once, here, and nothing below
asks which it got.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rl_core.agents.roles import role_adapters
from rl_core.cluster.platform import platform_env
from rl_core.config import (
    ConfigError,
    ExperimentConfig,
    JudgeConfig,
    ModelConfig,
    RolloutConfig,
    StorageConfig,
    TeacherConfig,
    TrainConfig,
    resolve_device,
)
from rl_core.data.prompts import encode_record_prompts
from rl_core.data.records import Record
from rl_core.grpo import AdvantageSource, EpisodeKind, GroupRelative, SingleTurn
from rl_core.interfaces import RolloutPlane, Trainer, WeightSync
from rl_core.models import eos_token_ids
from rl_core.models.vlm import is_vision_checkpoint, vision_processor
from rl_core.rewards import JudgeRunner, RewardSet
from rl_core.rollout.launch import EngineSpec, SGLangLaunchConfig, sglang_launch
from rl_core.rollout.pool import EnginePool
from rl_core.sft import Example, SFTDataConfig
from rl_core.teacher import Distillation, check_tokenizers, teacher_examples
from rl_core.weight_sync import sync_weights
from rl_core.weight_sync.probe import TOLERANCE, ProbeBatch, WeightProbe
from rl_core.weight_sync.roles import RoleAdapterSync

log = logging.getLogger(__name__)

__all__ = ["Planes", "PlanesHandle", "bring_up_planes", "get_planes", "judge_engine_spec",
           "rollout_engine_spec", "sample_teacher_examples", "start_engines", "start_judge",
           "start_rollout", "start_teacher", "tear_down"]


@dataclass(frozen=True)
class PlanesHandle:
    """A small, picklable reference to a run's planes."""

    key: str


@dataclass
class Planes:
    """The rollout plane, its weight transport, the trainer and the tokenized prompt sets."""

    config: ExperimentConfig
    rollout: RolloutPlane
    weights: WeightSync
    trainer: Trainer | None  # None: evaluation only
    tokenizer: Any
    pad_token_id: int
    train_records: list[Record]
    train_prompts: list[list[int]]
    eval_records: list[Record]
    eval_prompts: list[list[int]]
    reward_runner: RewardSet | JudgeRunner  # a JudgeRunner with reward.fn: judge alone
    skipped_long_prompts: int = 0
    cluster: Any = None  # a RayCluster in cluster.mode ray
    placement: Any = None  # its PlanePlacement
    time_share: bool = False  # engines release their memory while the trainer works
    # what a rollout plays: SingleTurn, or AgentEpisodes when agent.env/program is set
    kind: EpisodeKind | None = None
    # where the advantages come from: GroupRelative, or Distillation (teacher.path) with the
    # teacher's rollout plane
    advantage: AdvantageSource | None = None
    # the sync's behavioural check (rollout.weight_sync_probe); None: off
    probe: WeightProbe | None = None

    @property
    def weight_version(self) -> int:
        return self.rollout.weight_version

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to the rollout plane as ``version``, verified."""
        if self.trainer is None:
            raise RuntimeError("these planes were brought up without a trainer")
        if not self.rollout.memory_released:
            return sync_weights(self.trainer, self.rollout, self.weights, version, self.probe)
        # Time-shared devices: weights back first (the update writes into them), KV cache after;
        # the probe needs the KV cache, so it runs last (a failure: the task's retry reloads).
        t0 = time.perf_counter()
        self.rollout.resume_memory(["weights"])
        metrics = sync_weights(self.trainer, self.rollout, self.weights, version)
        self.rollout.resume_memory(["kv_cache"])
        resumed = time.perf_counter() - t0 - metrics["sync_seconds"]
        if self.probe is not None:
            metrics.update(self.probe.check(self.trainer, self.rollout, version))
        return {**metrics, "resume_memory_seconds": resumed}

    def release_rollout_memory(self) -> dict[str, float]:
        """Colocated planes: the engines free weights and KV cache for the trainer (until
        :meth:`sync_weights`). A no-op unless ``time_share``."""
        if not self.time_share:
            return {}
        t0 = time.perf_counter()
        self.rollout.release_memory()
        return {"release_memory_seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.reward_runner.close()
        _close_all(self.kind, self.advantage, self.weights, self.rollout, self.trainer,
                   self.placement, self.cluster)


_REGISTRY: dict[str, Planes] = {}


def _encode_within_limit(
    tokenizer: Any, records: list[Record], cfg: ExperimentConfig, vision: Any = None,  # noqa: ANN401
) -> tuple[list[Record], list[list[int]], int]:
    """Records' prompt ids (images placed and their pads expanded by ``vision``, the model's
    :class:`~rl_core.models.vlm.VisionProcessor`), those over ``data.max_prompt_tokens`` left
    out (counted)."""
    d = cfg.data
    ids = encode_record_prompts(tokenizer, records, vision, system_prompt=d.system_prompt,
                                use_chat_template=d.use_chat_template,
                                plain_template=d.plain_template)
    keep = [i for i, p in enumerate(ids) if len(p) <= d.max_prompt_tokens]
    return [records[i] for i in keep], [ids[i] for i in keep], len(records) - len(keep)


def start_rollout(
    cfg: ExperimentConfig, model_path: str | Path, work_dir: str | Path, placement: Any = None,
    trainer: Trainer | None = None,
) -> tuple[RolloutPlane, WeightSync]:
    """The rollout plane ``rollout.engine`` asks for, serving ``model_path``, and the transport
    ``rollout.weight_sync`` names. With a Ray ``placement`` every engine is a Ray actor; with
    ``weight_sync: shared`` and a ``trainer`` the in-process engine reads its parameters."""
    r = cfg.rollout
    if r.engine == "local":
        from rl_core.rollout.inprocess import InProcessPlane
        from rl_core.weight_sync.transports import SharedSync, TensorSync

        share = getattr(trainer, "model", None) if r.weight_sync == "shared" else None
        plane = InProcessPlane(model_path, dtype=cfg.model.dtype, timeout_s=r.timeout_s,
                               device=(str(next(share.parameters()).device) if share is not None
                                       else resolve_device(r.device, "rollout.device")),
                               max_running_requests=r.max_running_requests,
                               prefix_cache_tokens=r.prefix_cache_tokens,
                               max_loras_per_batch=r.max_loras_per_batch,
                               trust_remote_code=cfg.model.trust_remote_code, share=share,
                               routed_experts=cfg.train.moe.routing_replay)
        plane.pause_mode = r.pause_mode
        lora = cfg.train.lora.name if cfg.train.lora.enabled else None
        if adapters := role_adapters(cfg):  # train.lora.per_role: an adapter per role
            return plane, RoleAdapterSync(plane, {role: TensorSync(plane, name)
                                                  for role, name in adapters.items()})
        return plane, (SharedSync(trainer) if share is not None else TensorSync(plane, lora))
    from rl_core.rollout.http import HttpPlane

    work_dir = Path(work_dir)
    if r.weight_sync == "distributed" and r.engine == "sglang":
        from rl_core.models.moe import is_moe_checkpoint, names_experts_one_by_one

        if is_moe_checkpoint(model_path) and not names_experts_one_by_one(model_path):
            raise ConfigError(
                f"rollout.weight_sync=distributed with rollout.engine=sglang: {model_path} is "
                "a mixture of experts whose checkpoint layout (Mixtral's w1/w2/w3, gpt-oss's "
                "fused experts) the broadcast does not produce, so SGLang's loader would not "
                "take the experts it sends; use rollout.weight_sync=disk (docs/moe.md)")
    spec = rollout_engine_spec(cfg, model_path)
    pool = start_engines(spec, cfg, work_dir / "engines",
                         router=r.num_engines > 1 if r.router is None else r.router,
                         client_kwargs={"read_timeout_s": r.timeout_s,
                                        "total_timeout_s": r.timeout_s},
                         placement=placement)
    deterministic = r.timing_free
    plane = HttpPlane(pool, request_batch_size=r.request_batch_size, timeout_s=r.timeout_s,
                      weight_sync_timeout_s=r.weight_sync_timeout_s, deterministic=deterministic,
                      routed_experts=cfg.train.moe.routing_replay)
    plane.pause_mode = r.pause_mode
    if r.weight_sync == "distributed":
        from rl_core.weight_sync.broadcast import BroadcastSync


        transport: Any = BroadcastSync(plane, _weight_sync_backend(cfg), r.weight_sync_timeout_s,
                                       int(r.weight_sync_bucket_mb * 2**20))
        plane.before_generate = transport.rejoin  # restarted engines rejoin before sampling
    else:
        from rl_core.weight_sync.transports import DiskSync, ObjectStoreSync

        if r.weight_sync == "object_store":
            transport = ObjectStoreSync(plane, work_dir / "weight_sync", r.weight_sync_timeout_s)
        elif r.weight_sync == "shm":
            from rl_core.weight_sync.transports import ShmSync

            transport = ShmSync(plane, r.weight_sync_timeout_s)
        else:  # LoRA: the adapter, swapped by name (train.lora)
            from rl_core.weight_sync.delta import DeltaEncoder

            transport = DiskSync(plane, work_dir / "weight_sync", r.weight_sync_timeout_s,
                                 cfg.train.lora.name if cfg.train.lora.enabled else None,
                                 DeltaEncoder(r.weight_sync_delta_full_every)
                                 if r.weight_sync_delta else None)
            if adapters := role_adapters(cfg):  # train.lora.per_role: an adapter per role
                transport = RoleAdapterSync(plane, {role: DiskSync(
                    plane, work_dir / "weight_sync" / role, r.weight_sync_timeout_s, name)
                    for role, name in adapters.items()})
    pool.resync = transport.resync  # a restarted engine serves the current weights first
    return plane.start(), transport


def rollout_engine_spec(cfg: ExperimentConfig, model_path: str | Path) -> EngineSpec:
    """The rollout plane's engines (``rollout.*``, ``model.*``, ``cluster.env``)."""
    r = cfg.rollout
    if r.engine == "sglang":
        return EngineSpec("sglang", str(model_path), r.num_engines,
                          sglang=sglang_launch(cfg, model_path), env=cfg.cluster.env)
    if cfg.cluster.mode == "ray":  # an engine actor sees the GPU Ray gave it, if any
        device, gpus = ("cuda" if cfg.cluster.gpus_per_engine > 0 else "cpu"), 0
    else:  # rollout.device (auto: the GPUs torch sees, one engine each in turn)
        device = resolve_device(r.device, "rollout.device")
        gpus = _gpu_count() if device == "cuda" else 0
    return EngineSpec("embedded", str(model_path), r.num_engines, threads=cfg.thread_budget()[0],
                      dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                      max_running_requests=r.max_running_requests, env=cfg.cluster.env,
                      device=device, gpus=gpus, prefix_cache_tokens=r.prefix_cache_tokens,
                      max_loras_per_batch=r.max_loras_per_batch)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def judge_engine_spec(j: JudgeConfig, env: Mapping[str, str | None] | None, platform: str,
                      dtype: str) -> EngineSpec:
    """The judge's engines (``reward.judge.*``; ``dtype``: the run's, for ``dtype: auto``)."""
    if j.engine == "sglang":
        launch = SGLangLaunchConfig(
            model_path=str(j.model), tp=j.sglang_tp, base_gpu_id=j.sglang_base_gpu_id,
            mem_fraction_static=j.sglang_mem_fraction_static, dtype=j.dtype,
            extra_args=list(j.sglang_extra_args), platform=platform)  # type: ignore[arg-type]
        return EngineSpec("sglang", str(j.model), j.num_engines, sglang=launch, env=env)
    threads = j.engine_threads or max(1, (os.cpu_count() or 1) // j.num_engines)
    return EngineSpec("embedded", str(j.model), j.num_engines, threads=threads,
                      dtype=dtype if j.dtype == "auto" else j.dtype, env=env)


def start_engines(spec: EngineSpec, cfg: ExperimentConfig, log_dir: str | Path, *,
                  router: bool, client_kwargs: dict[str, float], placement: Any = None,
                  ) -> EnginePool:
    """The one engine bring-up: a pool of ``spec``'s engines (not started), watched with the
    rollout plane's health settings (``rollout.health_*``, ``startup_timeout_s``); each engine
    a Ray actor when a Ray ``placement`` is given."""
    r = cfg.rollout
    command, env = spec.command()
    launcher = None
    if placement is not None:
        from rl_core.rollout.ray_engines import RayActorLauncher

        launcher = RayActorLauncher(command, [s.actor_options() for s in placement.engines],
                                    env=env, start_timeout_s=r.startup_timeout_s)
    return EnginePool(
        None if launcher else command, spec.num_engines, launcher=launcher, log_dir=log_dir,
        env=env, router=router, health_interval_s=r.health_interval_s,
        health_timeout_s=r.health_timeout_s, failure_threshold=r.health_failure_threshold,
        startup_timeout_s=r.startup_timeout_s, client_kwargs=client_kwargs,
        router_policy=r.router_policy)


def start_judge(cfg: ExperimentConfig, work_dir: str | Path,
                questions: Mapping[str, str | None] | None = None) -> JudgeRunner:
    """``reward.fn: judge``'s runner on its own engines (:func:`start_engines`, logs in
    ``work_dir``/judge). Requests fail fast on the client and are retried by the judge
    (``reward.judge.retries``), whose bounds sit above ``timeout_s`` so that its own fire."""
    j, log_dir = cfg.reward.judge, Path(work_dir) / "judge"
    spec = judge_engine_spec(j, cfg.cluster.env, cfg.rollout.sglang_platform, cfg.model.dtype)

    def engines() -> EnginePool:
        pool = start_engines(spec, cfg, log_dir, router=False, client_kwargs={
            "read_timeout_s": j.timeout_s + 5.0, "total_timeout_s": j.timeout_s + 5.0,
            "connect_timeout_s": min(5.0, j.timeout_s), "max_retries": 0})
        pool.start()  # stops what it started when it fails
        return pool

    return JudgeRunner(cfg.reward, engines, log_dir=log_dir, questions=questions)


def _time_share(cfg: ExperimentConfig) -> bool:
    """``rollout.release_memory_while_training``, with ``None`` resolved: colocated GPUs,
    unless rollout overlaps training (``max_staleness > 0``: the engines are busy then)."""
    flag = cfg.rollout.release_memory_while_training
    if flag is not None:
        return flag
    c = cfg.cluster
    overlap = cfg.rollout.max_staleness > 0
    return c.mode == "ray" and c.placement == "colocated" and c.gpus_per_engine > 0 and not overlap


def _weight_sync_backend(cfg: ExperimentConfig) -> str:
    """``rollout.weight_sync_backend``, with ``auto`` resolved for the planes' devices."""
    backend, c = cfg.rollout.weight_sync_backend, cfg.cluster
    if backend != "auto":
        return backend
    gpus = c.mode == "ray" and c.gpus_per_trainer > 0 and c.gpus_per_engine > 0
    return "nccl" if gpus else "gloo"


def bring_up_planes(cfg: ExperimentConfig, model_path: str | Path, train_records: list[Record],
                    eval_records: list[Record], work_dir: str | Path, *,
                    with_trainer: bool = True) -> PlanesHandle:
    """Start the rollout plane and the trainer on ``model_path``; tokenize the prompt sets.

    ``cluster.mode: local``: the trainer in this process, engines as local processes (or the
    engine core in this process). ``cluster.mode: ray``: a Ray cluster (started here, or
    joined at ``cluster.address``), the planes placed by ``cluster.placement``,
    ``cluster.trainer_ranks`` trainer actors in one process group and one actor per engine.
    ``work_dir`` (the run directory) holds the engines' logs, the weight-sync staging and a
    local Ray's temp dir. ``with_trainer=False`` brings up the rollout plane alone.
    """
    if trainer_threads := cfg.thread_budget()[1]:
        torch.set_num_threads(trainer_threads)
    cluster = placement = trainer = rollout = transport = kind = rewards = teacher = None
    vision = None
    advantage: AdvantageSource = GroupRelative(cfg.rollout.n_samples, cfg.algorithm.advantage)
    try:
        if cfg.cluster.mode == "ray":
            cluster, placement = _ray_cluster(cfg, work_dir, with_trainer)
        if with_trainer:
            trainer = _start_trainer(cfg, model_path, placement)
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        pad_token_id = tokenizer.pad_token_id
        if pad_token_id is None:  # padding is masked out; any end-of-sequence id will do
            pad_token_id = eos_token_ids(tokenizer, getattr(trainer, "model", None), model_path)[0]
        # a vision-language model's processor (None: a text model), read once for the run
        vision = vision_processor(model_path, cfg.model.trust_remote_code) \
            if is_vision_checkpoint(model_path) else None
        train_records, train_prompts, skipped = _encode_within_limit(tokenizer, train_records, cfg,
                                                                    vision)
        if not train_records:
            raise ValueError(
                f"every training prompt is longer than data.max_prompt_tokens="
                f"{cfg.data.max_prompt_tokens}; raise it or shorten the prompts"
            )
        eval_records, eval_prompts, skip_eval = _encode_within_limit(tokenizer, eval_records, cfg,
                                                                     vision)
        rollout, transport = start_rollout(cfg, model_path, work_dir, placement, trainer)
        if trainer is None and isinstance(transport, RoleAdapterSync):  # a per-role export
            transport.serve_exported(model_path)
        if cfg.teacher.enabled and with_trainer:
            teacher = start_teacher(cfg, tokenizer, str(model_path), work_dir)
            advantage = Distillation(teacher, cfg.teacher, advantage)
        if cfg.agent.enabled:
            from rl_core.agents.kind import AgentEpisodes

            kind = AgentEpisodes(cfg.agent, rollout, tokenizer, vision)
        rewards = _reward_runner(cfg, work_dir, [*train_records, *eval_records])
    except BaseException:
        _close_all(rewards, kind, teacher, transport, rollout, trainer, placement, cluster)
        raise
    # the probe scores text: a vision model's prompts go without their image pads
    probe_prompts = train_prompts if vision is None else [
        [t for t in p if t != vision.pad] for p in train_prompts]
    key, probe = uuid.uuid4().hex, (_probe(cfg, probe_prompts, pad_token_id)
                                    if trainer is not None else None)
    if probe is not None and (pool := getattr(rollout, "pool", None)) is not None:
        pool.admit_check = lambda url: probe.admit(rollout, url, rollout.weight_version)
    _REGISTRY[key] = Planes(
        cfg, rollout, transport, trainer, tokenizer, pad_token_id, train_records, train_prompts,
        eval_records, eval_prompts, rewards,
        skipped_long_prompts=skipped + skip_eval, cluster=cluster, placement=placement,
        time_share=_time_share(cfg), kind=kind or SingleTurn(rollout), advantage=advantage,
        probe=probe,
    )
    return PlanesHandle(key)


def _probe(cfg: ExperimentConfig, prompts: list[list[int]], pad_token_id: int,
           ) -> WeightProbe | None:
    """``rollout.weight_sync_probe``: the sync's probe on the first training prompts."""
    r, why = cfg.rollout, None
    if cfg.train.lora.enabled and cfg.train.lora.quantize:
        why = "the trainer scores with a 4-bit base (QLoRA) that the engines do not serve"
    elif r.temperature not in (0.0, 1.0) and (cfg.cluster.mode == "ray"
                                              or cfg.train.backend == "megatron"):
        why = "this trainer scores at the rollout temperature, the engines' prefill without it"
    if not r.weight_sync_probe or why:
        if why and r.weight_sync_probe:
            log.info("rollout.weight_sync_probe: off (%s); syncs are checked by checksum", why)
        return None
    tolerance = r.weight_sync_probe_tolerance or TOLERANCE[cfg.model.dtype]
    return WeightProbe(ProbeBatch.from_prompts(prompts), tolerance, pad_token_id)


def start_teacher(cfg: ExperimentConfig, tokenizer: Any, student: str,
                   work_dir: str | Path) -> RolloutPlane:
    """The teacher's rollout plane (``teacher.*``), after checking it shares the student's
    tokenizer; it serves fixed weights (never synced)."""
    from rl_core.base_model import snapshot_model

    t = cfg.teacher
    path = snapshot_model(ModelConfig(path=t.path), cfg.data, cfg.storage.cache_dir).path
    check_tokenizers(tokenizer, AutoTokenizer.from_pretrained(path), student, str(t.path))
    sub = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"engine": t.engine, "num_engines": t.num_engines,
                                                  "weight_sync": "disk"}),
        "train": cfg.train.model_copy(update={"lora": cfg.train.lora.model_copy(
            update={"rank": 0})})})  # fmt: skip
    plane, _ = start_rollout(sub, path, Path(work_dir) / "teacher")
    log.info("teacher plane: %s serving %s", t.engine, t.path)
    return plane


def _reward_runner(cfg: ExperimentConfig, work_dir: str | Path,
                   records: list[Record]) -> RewardSet | JudgeRunner:
    """``reward.fn``'s runner. ``judge`` starts the judge's engines (with ``reward.extra``,
    the judge is the task reward of a `RewardSet`); the judge finds a sample's question by its
    record id (an id two splits give different questions is left out: such a sample's caller
    must pass the question)."""
    if cfg.reward.fn.strip() != "judge":
        return RewardSet.from_config(cfg.reward)
    questions: dict[str, str | None] = {}
    for r in records:
        questions[r.id] = r.text if questions.get(r.id, r.text) == r.text else None
    judge = start_judge(cfg, work_dir, questions)
    return RewardSet.from_config(cfg.reward, judge) if cfg.reward.extra else judge


def _start_trainer(cfg: ExperimentConfig, model_path: str | Path, placement: Any) -> Trainer:
    """One trainer in this process, or ``cluster.trainer_ranks`` rank actors on Ray."""
    kw = dict(temperature=cfg.rollout.temperature, max_response_len=cfg.rollout.max_new_tokens,
              dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    if placement is None:  # this process: train.device (auto: a GPU when torch sees one)
        kw["device"] = resolve_device(cfg.train.device, "train.device")
    train = cfg.train
    if train.backend == "megatron":
        from rl_core.training.megatron.layout import resolve_layout

        layout, how = resolve_layout(cfg, model_path)
        if how:
            log.info("train.megatron tp/pp auto: %s", how)
        train = train.model_copy(update={"megatron": layout})
    if placement is None:
        if train.backend == "megatron":
            from rl_core.training.megatron import MegatronTrainer

            return MegatronTrainer(model_path, train, cfg.algorithm, **kw)
        from rl_core.training.torch_trainer import TorchTrainer

        return TorchTrainer(model_path, train, cfg.algorithm, **kw,
                            freeze_vision=cfg.model.freeze_vision, roles=tuple(role_adapters(cfg)))
    from rl_core.cluster.platform import detect_platform
    from rl_core.training.distributed import TrainerGroup

    gpu = cfg.cluster.gpus_per_trainer > 0
    kind = detect_platform().kind if gpu else "cpu"
    return TrainerGroup.start(
        model_path, train, cfg.algorithm, num_ranks=cfg.cluster.trainer_ranks,
        num_threads_per_rank=cfg.train.num_threads or 1,
        scheduling_strategies=[slot.scheduling_strategy for slot in placement.trainer],
        num_cpus_per_rank=placement.trainer[0].num_cpus,
        num_gpus_per_rank=placement.trainer[0].num_gpus, device="cuda" if gpu else "cpu",
        env=platform_env(kind, cfg.cluster.env), timeout_s=cfg.cluster.timeout_s, **kw,
        freeze_vision=cfg.model.freeze_vision)


def _ray_cluster(cfg: ExperimentConfig, work_dir: str | Path, with_trainer: bool) -> tuple:
    """Start or join Ray, check it has what the config asks for, reserve the planes."""
    from rl_core.cluster.ray_cluster import PlaneResources, RayCluster, need_for, place_planes

    c = cfg.cluster
    resources = PlaneResources(
        trainer_ranks=c.trainer_ranks,
        cpus_per_trainer=c.cpus_per_trainer if with_trainer else 0.001,
        gpus_per_trainer=c.gpus_per_trainer if with_trainer else 0.0,
        engines=cfg.rollout.num_engines, cpus_per_engine=c.cpus_per_engine,
        gpus_per_engine=c.gpus_per_engine,
    )
    need = need_for(resources, c.placement)
    cluster = RayCluster.start(c, work_dir, need=need,
                               num_cpus=c.num_cpus if not c.address else None)
    try:
        placement = place_planes(resources, c.placement, timeout_s=c.timeout_s)
    except BaseException:
        cluster.shutdown()
        raise
    for line in placement.describe():
        log.info("placement (%s): %s", c.placement, line)
    return cluster, placement


def _close_all(*things: Any) -> None:
    """Stop whatever was started, newest first; never raises (logs instead)."""
    for thing in things:
        fn = next((getattr(thing, m) for m in ("close", "shutdown", "remove")
                   if thing is not None and hasattr(thing, m)), None)
        if fn is None:
            continue
        try:
            fn()
        except Exception:
            log.exception("tear-down of %s failed", type(thing).__name__)


def get_planes(handle: PlanesHandle) -> Planes:
    try:
        return _REGISTRY[handle.key]
    except KeyError:
        raise LookupError(
            f"planes {handle.key} are not up in this process (torn down, or the flow "
            "restarted); bring them up again"
        ) from None


def tear_down(handle: PlanesHandle) -> None:
    planes = _REGISTRY.pop(handle.key, None)
    if planes is not None:
        planes.close()


def sample_teacher_examples(examples: Sequence[Example], d: SFTDataConfig,
                            student: str | Path, cache_dir: str | Path, work_dir: str | Path,
                            *, model: ModelConfig | None = None,
                            num_threads: int | None = None) -> tuple[list[Example], dict[str, float]]:
    """:func:`teacher_examples` on a teacher plane brought up for the purpose: the GRPO
    teacher's start-up (``data.teacher.path`` resolved like ``model.path`` and cached in
    ``cache_dir``, its vocabulary checked against ``student``'s by :func:`check_tokenizers`,
    ``data.teacher.engine`` engines logging under ``work_dir/teacher``), closed afterwards.
    ``model`` supplies the dtype and ``trust_remote_code``; ``num_threads`` bounds an
    embedded engine's torch threads."""
    t = d.teacher
    if not t.enabled:
        raise ValueError("data.teacher.path is not set")
    model = (model or ModelConfig()).model_copy(update={"path": str(student)})
    cfg = ExperimentConfig(
        model=model, data=d.grpo_data(), storage=StorageConfig(cache_dir=str(cache_dir)),
        rollout=RolloutConfig(engine=t.engine, num_engines=t.num_engines,
                              engine_threads=num_threads, max_new_tokens=t.max_new_tokens),
        train=TrainConfig(num_threads=num_threads),
        teacher=TeacherConfig(path=t.path, engine=t.engine, num_engines=t.num_engines))
    tokenizer = AutoTokenizer.from_pretrained(student, trust_remote_code=model.trust_remote_code)
    plane = start_teacher(cfg, tokenizer, str(student), work_dir)
    try:
        return teacher_examples(plane, tokenizer, examples, d)
    finally:
        plane.close()
