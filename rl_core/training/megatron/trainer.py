"""The megatron-core training backend: the torch backend's interface over a ``GPTModel``.

:class:`MegatronTrainer` computes what ``TorchTrainer`` does on a TP x PP x DP (x EP) layout:
HF weights converted (:mod:`.convert`), vocab-parallel log-probs, the same GRPO loss per
micro-batch through megatron's schedules, megatron's optimizer, ``dist_checkpointing``
checkpoints, MoE replay and metrics (:mod:`.moe`). Every method is collective (all ranks call
it; alone in ``cluster.mode: local``); DP rank ``d`` gets the ``d``-th slice of the batch;
results come from the :attr:`reports` ranks. docs/megatron.md.
"""


from __future__ import annotations

import dataclasses
import functools
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import rl_core.training.megatron.compat as compat
import rl_core.training.megatron.moe as moe
from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.models import read_weights, torch_dtype
from rl_core.models.moe import hub_layout
from rl_core.training import torch_trainer
from rl_core.training.megatron.convert import (
    expert_name,
    hf_to_mcore,
    local_expert,
    mcore_to_hf,
    merge_tp,
    tp_split,
)
from rl_core.training.megatron.model import arch_from_hf, build_gpt_model, transformer_config
from rl_core.training.megatron.parallel import (
    finalize_grads,
    init_parallel,
    mpu,
    vocab_parallel_logprobs,
)
from rl_core.training.torch_trainer import MiniBatch, MiniResult, TorchTrainer
from rl_core.types import Batch
from rl_core.weight_sync.source import WeightSource

__all__ = ["MegatronTrainer"]

log = logging.getLogger(__name__)

# On CPU (and GPUs without them) megatron warns at every import that it falls back from
# Transformer Engine / Apex to its PyTorch implementations: that is the intended path here.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")

_STATE = "megatron_state.json"


class MegatronTrainer(WeightSource):
    """GRPO trainer over a megatron-core ``GPTModel`` (one rank of a TP x PP x DP layout)."""

    def __init__(
        self, model_path: str | Path, train: TrainConfig, algorithm: AlgorithmConfig, *,
        temperature: float = 1.0, max_response_len: int | None = None, dtype: str = "float32",
        trust_remote_code: bool = False, device: str = "cpu") -> None:
        from megatron.core import tensor_parallel

        self.train_cfg, self.algo, self.mcfg = train, algorithm, train.megatron
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_response_len, self.device = max_response_len, torch.device(device)
        self.model_path, self.dtype = Path(model_path), torch_dtype(dtype)
        compat.install()  # nothing on GPUs
        tp, pp, ep = self.mcfg.tp, self.mcfg.pp, self.mcfg.ep
        self._owns_group = init_parallel(tp, pp, self.device, ep=ep)
        ps = mpu()
        self.rank = dist.get_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        # The ranks whose log-probs and metrics are kept: TP rank 0 of each DP replica's last
        # stage (the other TP ranks hold the same values).
        self.reports = self.tp_rank == 0 and self.last_stage
        self._sends_weights = self.rank == 0
        self.arch = arch_from_hf(self.model_path)
        self.sp = self.mcfg.sequence_parallel and tp > 1  # (tp: auto may resolve to 1)
        self.arch.check_parallel(tp, pp, ep, self.sp)
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.padded_vocab = self.arch.padded_vocab(tp, self.mcfg.vocab_divisible_by)
        torch.manual_seed(train.seed)
        with compat.cuda_free():
            tensor_parallel.model_parallel_cuda_manual_seed(train.seed, force_reset_rng=True)
        self.config = transformer_config(
            self.arch, tp=tp, pp=pp, dtype=self.dtype, cpu_init=self.device.type == "cpu",
            sequence_parallel=self.sp, recompute=self.mcfg.recompute,
            recompute_num_layers=self.mcfg.recompute_num_layers, ep=ep,
            dispatcher=self.mcfg.moe_dispatcher)
        hf = read_weights(self.model_path)
        self.core, self.model = self._build(hf)
        full = self.mcfg.recompute == "full"
        sp_group = ps.get_tensor_model_parallel_group() if self.sp else None
        self.routing = moe.attach(self.core, self.arch, recompute=full, sp_group=sp_group)
        self.ref_model = self.ref_routing = None
        if algorithm.kl_coef > 0:  # before the optimizer: megatron's SequentialMLP deep-copies
            ref_core, self.ref_model = self._build(hf)  # the config, which then holds DDP hooks
            self.ref_model.eval().requires_grad_(False)
            self.ref_routing = moe.attach(ref_core, self.arch, recompute=full,
                                          sp_group=sp_group)
        self._build_optimizer()
        del hf
        self.global_step, self._mini_tokens = 0, 0.0

    def _build(self, hf: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """This stage's GPTModel loaded with ``hf``, and the module the schedules call
        (``Float16Module`` around it under bf16/fp16)."""
        ps = mpu()
        with compat.cuda_free():
            core = build_gpt_model(self.arch, self.config, padded_vocab=self.padded_vocab,
                                   pre_process=self.first_stage, post_process=self.last_stage)
            if self.device.type == "cuda":
                core = core.to(self.device)
            local = hf_to_mcore(
                hf, self.arch, padded_vocab=self.padded_vocab, tp_rank=self.tp_rank,
                tp=ps.get_tensor_model_parallel_world_size(), pp_rank=self.pp_rank,
                pp=ps.get_pipeline_model_parallel_world_size(), ep_rank=self.ep_rank,
                ep=self.mcfg.ep)
            missing, unexpected = core.load_state_dict(local, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{self.model_path}: HF -> megatron conversion left missing "
                               f"{missing[:5]}, unexpected {unexpected[:5]}")
        for name, param in core.named_parameters():
            # Experts' gradients go over the expert-DP group (TP ranks included); megatron
            # marks them so only at ep > 1: mark them always (docs/megatron.md, MoE).
            if ".mlp.experts." in name:
                param.allreduce = False
        if self.dtype == torch.float32:
            return core, core
        from megatron.core.transformer.module import Float16Module

        return core, Float16Module(self.config, core)

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        train, distopt = self.train_cfg, self.mcfg.distributed_optimizer
        with compat.cuda_free():
            self.ddp = DistributedDataParallel(self.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=distopt), self.model)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=train.lr, weight_decay=train.weight_decay,
                    adam_beta1=train.betas[0], adam_beta2=train.betas[1], adam_eps=1e-8,
                    clip_grad=train.grad_clip, bf16=self.dtype == torch.bfloat16,
                    fp16=self.dtype == torch.float16, params_dtype=self.dtype,
                    use_distributed_optimizer=distopt), [self.ddp],
                # Decay every parameter, as torch's AdamW does (megatron's default skips
                # biases and norms): both backends make the same update.
                config_overrides={})
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = finalize_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self._lr_factor = torch_trainer._lr_lambda(train)

    # The same rules as the torch backend (they read train_cfg, algo and ref_model only).
    has_ref_model = TorchTrainer.has_ref_model
    needs_old_logp = TorchTrainer.needs_old_logp

    def _micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[Batch]:
        """``rows`` cut into micro-batches; under PP or SP all of one shape, and under EP as
        many of one shape on every rank of an expert group, made up with rows that repeat a
        real row with an empty response mask (they add nothing; docs/megatron.md)."""
        mbs, ep = self.train_cfg.micro_batch_size, self.mcfg.ep
        parts = [batch.select(r) for r in rows.split(mbs)]
        if self.mcfg.pp == 1 and not self.sp and ep == 1:
            return parts
        width = max(p.input_ids.shape[1] for p in parts)
        if self.sp:
            width = -(-width // self.mcfg.tp) * self.mcfg.tp
        size, count = min(mbs, len(rows)) if len(parts) == 1 else mbs, len(parts)
        if ep > 1:
            shape = torch.tensor([size, width, count])
            dist.all_reduce(shape, op=dist.ReduceOp.MAX,
                            group=mpu().get_expert_model_parallel_group())
            size, width, count = shape.tolist()
        empty = dataclasses.replace(parts[0], response_mask=torch.zeros_like(parts[0].response_mask))
        return [_pad_part(p, size, width) for p in parts + [empty] * (count - len(parts))]

    def _forward(self, model: Any, part: Batch) -> torch.Tensor:
        """This stage's output: vocab-parallel logits (B, L, V/tp) on the last stage. An MoE
        model replays ``part.routed_experts`` with ``train.moe.routing_replay`` and adds its
        load-balancing loss with ``train.moe.aux_loss_coef`` (:mod:`.moe`)."""
        if (routing := self.ref_routing if model is self.ref_model else self.routing):
            cfg = self.train_cfg.moe
            share = float(part.response_mask.sum()) / max(self._mini_tokens, 1.0)
            routing.begin(part.attention_mask,
                          part.routed_experts if cfg.routing_replay else None,
                          part.response_mask.any(-1), aux_weight=cfg.aux_loss_coef * share)
        ids = part.input_ids.long().to(self.device)
        length = ids.shape[1]
        pos = torch.arange(length, device=self.device).unsqueeze(0).expand_as(ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)
        mask = ~part.attention_mask.to(self.device)[:, None, None, :] | causal  # True = masked
        out = model(ids, pos, mask)
        if routing:
            routing.end()
        return out

    def _logp(self, out: torch.Tensor, part: Batch, grad_entropy: bool):
        logits = out[:, :-1].float() / self.temperature
        return vocab_parallel_logprobs(logits, part.input_ids[:, 1:].to(self.device),
                                       vocab=self.arch.vocab, with_entropy_grad=grad_entropy)

    def _schedule(self, model: Any, parts: list[Batch],
                  loss_fn: Callable[[Batch, torch.Tensor], tuple[Any, Any, dict[str, Any]]], *,
                  forward_only: bool) -> list[dict[str, Any]]:
        """Run ``parts`` through megatron's schedule; the loss outputs (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data: Iterator[Batch], chunk: Any) -> tuple[torch.Tensor, Callable]:
            part = next(data)
            return self._forward(chunk, part), functools.partial(loss_fn, part)

        with compat.cuda_free():
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(parts), model=[model],
                num_microbatches=len(parts), seq_length=parts[0].input_ids.shape[1],
                micro_batch_size=parts[0].size, forward_only=forward_only)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs (B, L-1) under the policy or the reference policy (valid on
        the :attr:`reports` ranks; zeros elsewhere)."""
        if (model := self.ref_model if reference else self.model) is None:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        was_training = model.training
        model.eval()
        parts = self._micro_batches(batch, torch.arange(batch.size))

        def keep(part: Batch, out: torch.Tensor):  # noqa: ANN202 - megatron's loss_func
            logp, _ = self._logp(out, part, False)
            return out.new_zeros(()), torch.tensor(0), {"logp": logp.float().cpu()}

        outputs = self._schedule(model, parts, keep, forward_only=True)
        model.train(was_training)
        result = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        if self.last_stage:
            start = 0
            for part, got in zip(parts, outputs, strict=True):
                if (n := min(part.size, batch.size - start)) <= 0:
                    break  # EP's extra micro-batches
                rows = slice(start, start + n)
                width = min(got["logp"].shape[1], result.shape[1])
                mask = batch.response_mask[rows, :width]
                result[rows, :width] = torch.where(mask, got["logp"][:n, :width], 0.0)
                start += n
        return result

    def train_step(self, batch: Batch, *, minis: Sequence[MiniBatch] | None = None,
                   norm_const: float | None = None) -> dict[str, float]:
        """Apply ``ppo_epochs * mini_batches`` optimizer steps on one GRPO batch (this DP
        rank's slice of it; ``minis`` carry the global counts), as the torch backend does."""
        if self.routing is None:
            return torch_trainer.run_train_step(
                self, batch, minis, norm_const, self._update,
                lambda: self.train_cfg.lr * self._lr_factor(self.global_step))
        self.routing.stats.zero_()
        self.routing.replayed.zero_()
        self.routing.collect = True
        try:
            metrics = torch_trainer.run_train_step(
                self, batch, minis, norm_const, self._update,
                lambda: self.train_cfg.lr * self._lr_factor(self.global_step))
        finally:
            self.routing.collect = False
        stats = torch.cat([self.routing.stats.flatten(), self.routing.replayed])
        copy = self.tp_rank != 0 and not self.sp  # TP ranks saw the same tokens (not under SP)
        if copy or not self.first_stage:  # replay counted once per token
            stats[-2:] = 0
        if copy:
            stats.zero_()
        if dist.get_world_size() > 1:  # every DP replica's tokens, every stage's layers
            dist.all_reduce(stats)
        metrics.update(moe.routing_metrics(stats[:-2].view_as(self.routing.stats),
                                           self.arch.experts,
                                           per_layer=self.train_cfg.moe.per_layer_metrics))
        if self.train_cfg.moe.routing_replay:  # the share of tokens routed by the rollout's
            metrics["moe/replayed_tokens"] = float(stats[-2] / stats[-1].clamp_min(1))
        return metrics

    def _update(self, batch: Batch, mini: MiniBatch, norm_const: float) -> MiniResult:
        """One optimizer step on ``mini`` through megatron's schedule (metrics: last stage)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._mini_tokens = mini.tokens  # the share of each micro-batch's balance loss

        def loss_fn(part: Batch, out: torch.Tensor):  # noqa: ANN202 - megatron's loss_func
            logp, ent = self._logp(out, part, self.algo.entropy_coef > 0)
            loss, m = torch_trainer.grpo_micro_loss(self.algo, part, logp, ent, norm_const, mini,
                                                    self.device)
            m["_w"] = float(part.response_mask.sum())
            return loss, torch.tensor(1), m

        parts = self._micro_batches(batch, mini.rows)
        outputs = self._schedule(self.ddp, parts, loss_fn, forward_only=False)
        metrics = [(m, m.pop("_w")) for m in outputs]
        for group in self.optimizer.param_groups:
            group["lr"] = self.train_cfg.lr * self._lr_factor(self.global_step)
        with compat.cuda_free():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError(f"optimizer step {self.global_step}: megatron skipped the "
                                     "update (inf/nan gradients)")
        return metrics, float(grad_norm or 0.0)

    def _across_ranks(self, sums: dict[str, float],
                      maxes: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Metric sums and maxima of every DP replica (as the reporting ranks saw them)."""
        if dist.get_world_size() == 1:
            return sums, maxes
        mine = (sums, maxes) if self.reports else ({}, {})
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        total, top = {}, {}
        for s, mx in everyone:
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
            for k, v in mx.items():
                top[k] = max(top.get(k, float("-inf")), v)
        return total, top

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy by HF name on global rank 0 (``{}`` elsewhere): TP shards are
        gathered within each stage, stages gathered to the first one (a collective)."""
        ps, merged = mpu(), {}
        tp, ep = ps.get_tensor_model_parallel_world_size(), self.mcfg.ep
        per = self.arch.experts // ep
        for name, t in self.core.state_dict().items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            t = t.detach()
            if (expert := local_expert(name)) is not None:  # global index, every EP rank's
                shards = [t] if ep == 1 else [torch.empty_like(t) for _ in range(ep)]
                if ep > 1:
                    dist.all_gather(shards, t.contiguous(),
                                    group=ps.get_expert_model_parallel_group())
                for r, shard in enumerate(shards):
                    merged[expert_name(name, r * per + expert[1])] = shard
                continue
            if tp > 1 and tp_split(name):
                shards = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
                t = merge_tp(name, shards)
            merged[name] = t
        pp = ps.get_pipeline_model_parallel_world_size()
        hf = mcore_to_hf(merged, self.arch, pp_rank=self.pp_rank, pp=pp)
        if pp > 1:
            if self.tp_rank != 0 or self.dp_rank != 0:
                return {}
            stages: list[Any] | None = [None] * pp if self.first_stage else None
            dist.gather_object({k: v.cpu() for k, v in hf.items()}, stages,
                               dst=ps.get_pipeline_model_parallel_first_rank(),
                               group=ps.get_pipeline_model_parallel_group())
            if not self.first_stage:
                return {}
            hf = _hf_order({k: v for stage in stages for k, v in stage.items()})
        return hf if self.rank == 0 else {}

    def _write_hf(self, path: Path, weights: dict[str, torch.Tensor]) -> None:
        """The policy in HF format (config + safetensors) from rank 0; every rank calls."""
        if self.rank == 0:
            from safetensors.torch import save_file
            from transformers import AutoConfig

            path.mkdir(parents=True, exist_ok=True)
            AutoConfig.from_pretrained(self.model_path).save_pretrained(path)
            if (generation := self.model_path / "generation_config.json").exists():
                (path / "generation_config.json").write_bytes(generation.read_bytes())
            # Experts one tensor each, as hub checkpoints (and save_pretrained) have them
            tensors = {k: v.detach().cpu().contiguous() for k, v in hub_layout(weights).items()
                       if not (self.arch.tied and k == "lm_head.weight")}  # HF re-ties it on load
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        self._barrier()

    def _barrier(self) -> None:
        if dist.get_world_size() > 1:
            dist.barrier()

    def shutdown(self) -> None:
        """Leave megatron's groups (and the default group when this trainer created it)."""
        self.close_weight_broadcast()
        ps = mpu()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _sharded_state(self, *, loading: bool = False) -> dict[str, Any]:
        model = self.core.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
        return {"model": model, "optimizer": optimizer}

    def save_state(self, path: str | Path) -> Path:
        """``model/`` (HF), ``megatron/`` (dist_checkpointing: model + optimizer) and
        ``megatron_state.json`` (step counter, layout)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        self.save_pretrained(path / "model")
        target = path / "megatron"
        if self.rank == 0:
            target.mkdir(parents=True, exist_ok=True)
        self._barrier()
        _in_process_results_queue()
        with compat.cuda_free():
            dist_checkpointing.save(self._sharded_state(), str(target))
        if self.rank == 0:
            state = {"global_step": self.global_step, "tp": self.mcfg.tp, "pp": self.mcfg.pp,
                     "ep": self.mcfg.ep, "dp": self.dp_size,
                     "distributed_optimizer": self.mcfg.distributed_optimizer}
            (path / _STATE).write_text(json.dumps(state, indent=2))
        self._barrier()
        return path

    def load_state(self, path: str | Path) -> None:
        """Restore what :meth:`save_state` wrote, at any TP/PP/EP/DP layout (resharded by
        ``dist_checkpointing``), with the ``distributed_optimizer`` setting it was written
        with (the optimizer state's format; distributed: the same TP/PP/EP, any DP)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        source = path / "megatron"
        if not (path / _STATE).exists() or not source.is_dir():
            raise FileNotFoundError(f"{path}: no megatron checkpoint (megatron/ and {_STATE}); "
                                    "it was written by another backend: resume it with "
                                    "train.backend=torch, or start from its model/ as model.path")
        saved = json.loads((path / _STATE).read_text())
        if saved.get("distributed_optimizer", False) != self.mcfg.distributed_optimizer:
            raise ValueError(
                f"{path}: written with train.megatron.distributed_optimizer="
                f"{str(saved.get('distributed_optimizer', False)).lower()}, and the optimizer "
                "state is stored in that format; resume with the same setting")
        here = {"tp": self.mcfg.tp, "pp": self.mcfg.pp, "ep": self.mcfg.ep}
        if self.mcfg.distributed_optimizer and {k: saved.get(k, 1) for k in here} != here:
            raise ValueError(
                f"{path}: a distributed-optimizer checkpoint resumes at the tp/pp/ep it was "
                f"written at ({ {k: saved.get(k, 1) for k in here} }; here {here}; dp may "
                "differ): megatron-core 0.16.1's fully reshardable optimizer format fails "
                "(docs/megatron.md). Resume at that layout, or start from its model/")
        if self.mcfg.distributed_optimizer:
            _init_empty_adam_state(self.optimizer)
        with compat.cuda_free():
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(source))
            self.core.load_state_dict(state["model"])
            with torch.no_grad():  # distopt views of leaf parameters (megatron-cpu.md §6.4)
                self.optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(self.optimizer)
        self.global_step = saved["global_step"]


def _in_process_results_queue() -> None:
    """Give ``dist_checkpointing`` an in-process write-results queue instead of megatron-core
    0.16.1's spawned ``Manager`` (which re-imports ``__main__`` and costs ~2.5 s): equivalent
    for synchronous saves (docs/megatron.md, compat layer). Private name, pinned version."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is None:
        filesystem_async._results_queue = queue.Queue()


def _init_empty_adam_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped (a fresh trainer resuming) Adam state
    to load into, as megatron does (one step on zero gradients; the load overwrites it all):
    without it 0.16.1's ``state_dict`` fails on the missing ``step`` (no Apex/TE)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is not None and not inner.state and hasattr(
                chained, "_init_optimizer_states_with_dummy_values"):
            with compat.cuda_free():
                chained._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer: Any) -> None:
    """Copy Adam's step count, which the distributed optimizer's checkpoint restores into the
    parameter groups (where Apex's FusedAdam reads it), into torch AdamW's per-parameter
    ``state[p]["step"]``: else a resume's bias correction is the wrong step's (0.16.1)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        if (inner := getattr(chained, "optimizer", None)) is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state and torch.is_tensor(step := state.get("step")):
                    state["step"] = torch.full_like(step, float(group["step"]))
                elif state and "step" in state:
                    state["step"] = group["step"]


def _pad_part(part: Batch, rows: int, width: int) -> Batch:
    """``part`` grown to ``rows`` x ``width``: right-padding columns, and extra rows that copy
    row 0 with an empty response mask (a real row: no fully masked attention)."""
    extra, cols, out = rows - part.size, width - part.input_ids.shape[1], {}
    for name in (f.name for f in dataclasses.fields(part)):
        t = getattr(part, name)
        if name == "routed_experts" and t is not None and cols:  # -1: route freely
            t = torch.cat([t, t.new_full((t.shape[0], cols, *t.shape[2:]), -1)], dim=1)
        elif t is not None and t.dim() == 2 and cols:
            t = torch.cat([t, t.new_zeros((t.shape[0], cols))], dim=1)
        if t is not None and extra:
            copy = t[:1].repeat(extra, *([1] * (t.dim() - 1)))
            if name == "response_mask":
                copy = torch.zeros_like(copy)
            t = torch.cat([t, copy])
        out[name] = t
    return Batch(**out)


def _hf_order(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names in model order: embeddings, layers by index, final norm, head."""
    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if "embed" in name else 2, 0, name)

    return dict(sorted(weights.items(), key=lambda kv: key(kv[0])))
