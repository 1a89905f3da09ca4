"""The megatron-core training backend: the torch backend's interface over a ``GPTModel``.

:class:`MegatronTrainer` offers what :class:`~rl_core.training.torch_trainer.TorchTrainer`
does (``compute_logprobs``, ``train_step``, ``export_weights``, ``save_pretrained``,
``save_state``/``load_state``, distributed weight sync, ``needs_old_logp``,
``has_ref_model``, ``global_step``) and computes the same thing:

- Weights come from the HF checkpoint (:mod:`.convert`), sharded by TP and PP.
- Log-probs and entropy are taken from **vocab-parallel** logits: each TP rank holds
  ``V/tp`` columns; the softmax normaliser, the target logit and ``sum p*z`` are summed
  across the TP group (padded vocabulary columns masked out), so no rank ever holds
  ``(B, L, V)``.
- The loss is :func:`rl_core.algorithms.compute_grpo_loss`, per micro-batch as its share of
  the mini-batch (global token and sequence counts), exactly as the torch backend; micro-
  batches go through megatron's ``get_forward_backward_func`` (1F1B when ``pp > 1``) with
  ``calculate_per_token_loss`` so megatron neither divides by the micro-batch count nor
  averages over DP: gradients are summed, which makes N data-parallel ranks equal one rank
  holding the whole mini-batch.
- The optimizer is megatron's (``get_megatron_optimizer``: Adam with decoupled weight
  decay, gradient clipping, fp32 main weights under bf16, ZeRO-1 with
  ``distributed_optimizer``). Weight decay applies to every parameter and the LR follows the
  torch backend's schedule, so both backends make the same update.
- Checkpoints: ``model/`` in HF format (the rollout plane, the registry, resuming with the
  torch backend) plus ``megatron/`` written by ``dist_checkpointing`` (model and optimizer,
  sharded by TP/PP/DP, reloadable on another layout) and ``megatron_state.json``.

Every method is collective: all ranks call it (the Ray ranks of a
:class:`~rl_core.training.distributed.TrainerGroup`, or just this process in
``cluster.mode: local``). Data-parallel rank ``d`` is given the ``d``-th slice of the batch;
results (log-probs, weights) come from the ranks :attr:`reports` names.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.models import torch_dtype
from rl_core.training.batch import TrainBatch
from rl_core.training.megatron import compat
from rl_core.training.megatron.convert import hf_to_mcore, mcore_to_hf, merge_tp, tp_split
from rl_core.training.megatron.model import (
    arch_from_hf,
    build_gpt_model,
    transformer_config,
)
from rl_core.training.torch_trainer import (
    _TOKENS,
    MiniBatch,
    TorchTrainer,
    _lr_lambda,
    add_micro_metrics,
    grpo_micro_loss,
    read_weights,
    step_metrics,
)
from rl_core.weight_sync.broadcast import BroadcastsWeights

__all__ = ["MegatronTrainer", "vocab_parallel_logprobs"]

log = logging.getLogger(__name__)

# On CPU (and GPUs without them) megatron warns at every import that it falls back from
# Transformer Engine / Apex to its PyTorch implementations: that is the intended path here.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")

_MASKED = -1e30  # padded vocabulary columns: exp() is 0, and 0 * _MASKED is 0 (not nan)
_STATE = "megatron_state.json"


def _mpu() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def init_parallel(tp: int, pp: int, device: torch.device, timeout_s: float = 600.0) -> bool:
    """The default process group (one rank when none exists) and megatron's TP/PP/DP groups;
    True when this call created the default group (its owner destroys it)."""
    ps = _mpu()
    created = not dist.is_initialized()
    if created:
        # cluster.mode=local: this process is the only rank. Its store listens on loopback
        # only (an init_method URL would make torch's TCPStore listen on every interface).
        from rl_core.weight_sync.process_group import host_tcp_store

        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=host_tcp_store("127.0.0.1", 0, 1, timeout=timeout, wait_for_workers=False),
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_pipeline_model_parallel_world_size() == pp
        )
        if same:
            return created
        ps.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"train.megatron.tp * pp = {tp * pp} does not divide the {world} trainer ranks"
        )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return created


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab: int,
    with_entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token log-probs of ``targets`` and entropies from this TP rank's logit columns.

    ``logits``: (B, T, V_local), already divided by the temperature, float32; rank ``r``
    holds global columns ``[r * V_local, (r + 1) * V_local)``; columns ``>= vocab`` are
    padding and are masked out. With ``m`` the global max, ``s = sum_v exp(z_v - m)``:

        logp = z_y - m - log s,    H = m + log s - (sum_v exp(z_v - m) z_v) / s

    The three sums are one all-reduce over the TP group (backward: identity, megatron's
    convention for a loss every TP rank computes alike).
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    ps = _mpu()
    tp = ps.get_tensor_model_parallel_world_size()
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local > vocab:
        pad = torch.arange(start, start + local, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, _MASKED)
    m = logits.detach().amax(-1)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - m.unsqueeze(-1)
    e = shifted.exp()
    idx = targets.long() - start
    inside = (idx >= 0) & (idx < local)
    z_y = shifted.gather(-1, idx.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * inside
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        ez = (e * shifted).sum(-1)
    sums = torch.stack([e.sum(-1), z_y, ez])
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    s, z_y, ez = sums.unbind(0)
    log_s = s.log()
    logp = z_y - log_s
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        entropy = log_s - ez / s
    return logp, entropy


def _finalize_grads(model: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron's grad finalisation (DP reduce, TP/PP ties) without dividing by the token
    count: every micro-batch's loss already is its share of the mini-batch."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


class MegatronTrainer(BroadcastsWeights):
    """GRPO trainer over a megatron-core ``GPTModel`` (one rank of a TP x PP x DP layout)."""

    def __init__(
        self,
        model_path: str | Path,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        max_response_len: int | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        device: str = "cpu",
    ) -> None:
        from megatron.core import tensor_parallel

        self.train_cfg, self.algo = train, algorithm
        self.mcfg = train.megatron
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_response_len = max_response_len
        self.device = torch.device(device)
        self.model_path = Path(model_path)
        self.dtype = torch_dtype(dtype)
        compat.install()  # nothing on GPUs
        tp, pp = self.mcfg.tp, self.mcfg.pp
        self._owns_group = init_parallel(tp, pp, self.device)
        ps = _mpu()
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        # The ranks whose log-probs and metrics are kept: TP rank 0 of each DP replica's last
        # stage (the other TP ranks hold the same values).
        self.reports = self.tp_rank == 0 and self.last_stage
        self._sends_weights = self.rank == 0
        self.arch = arch_from_hf(self.model_path)
        self.arch.check_parallel(tp, pp)
        self.padded_vocab = self.arch.padded_vocab(tp, self.mcfg.vocab_divisible_by)
        torch.manual_seed(train.seed)
        with compat.cuda_free():
            tensor_parallel.model_parallel_cuda_manual_seed(train.seed, force_reset_rng=True)
        self.config = transformer_config(
            self.arch,
            tp=tp,
            pp=pp,
            dtype=self.dtype,
            sequence_parallel=self.mcfg.sequence_parallel,
            recompute=self.mcfg.recompute,
            recompute_num_layers=self.mcfg.recompute_num_layers,
            cpu_init=self.device.type == "cpu",
        )
        hf = read_weights(self.model_path)
        self.core, self.model = self._build(hf)
        self._build_optimizer()
        self.ref_model = None
        if algorithm.kl_coef > 0:
            _, self.ref_model = self._build(hf)
            self.ref_model.eval().requires_grad_(False)
        del hf
        self.global_step = 0

    # ------------------------------------------------------------------ construction

    def _build(self, hf: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """This stage's GPTModel loaded with ``hf``, and the module the schedules call
        (``Float16Module`` around it under bf16/fp16)."""
        ps = _mpu()
        with compat.cuda_free():
            core = build_gpt_model(
                self.arch,
                self.config,
                padded_vocab=self.padded_vocab,
                pre_process=self.first_stage,
                post_process=self.last_stage,
            )
            if self.device.type == "cuda":
                core = core.to(self.device)
            local = hf_to_mcore(
                hf,
                self.arch,
                padded_vocab=self.padded_vocab,
                tp_rank=self.tp_rank,
                tp=ps.get_tensor_model_parallel_world_size(),
                pp_rank=self.pp_rank,
                pp=ps.get_pipeline_model_parallel_world_size(),
            )
            missing, unexpected = core.load_state_dict(local, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(
                f"{self.model_path}: HF -> megatron conversion left missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        if self.dtype == torch.float32:
            return core, core
        from megatron.core.transformer.module import Float16Module

        return core, Float16Module(self.config, core)

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        train = self.train_cfg
        with compat.cuda_free():
            self.ddp = DistributedDataParallel(
                self.config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=self.mcfg.distributed_optimizer,
                ),
                self.model,
            )
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=train.lr,
                    weight_decay=train.weight_decay,
                    adam_beta1=train.betas[0],
                    adam_beta2=train.betas[1],
                    adam_eps=1e-8,
                    clip_grad=train.grad_clip,
                    bf16=self.dtype == torch.bfloat16,
                    fp16=self.dtype == torch.float16,
                    params_dtype=self.dtype,
                    use_distributed_optimizer=self.mcfg.distributed_optimizer,
                ),
                [self.ddp],
                # Decay every parameter, as torch's AdamW does (megatron's default skips
                # biases and norms): both backends make the same update.
                config_overrides={},
            )
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = _finalize_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        total = max(1, train.steps * train.mini_batches * train.ppo_epochs)
        self._lr_factor = _lr_lambda(train, total)

    # The same rules as the torch backend (they read train_cfg, algo and ref_model only).
    has_ref_model = TorchTrainer.has_ref_model
    needs_old_logp = TorchTrainer.needs_old_logp

    # --------------------------------------------------------------------- forward

    def _micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[TrainBatch]:
        """``rows`` cut into micro-batches; under PP (and sequence parallelism) all of one
        shape, as the pipeline's send/receive buffers need (extra rows repeat a real row
        with an empty response mask: they add nothing)."""
        mbs = self.train_cfg.micro_batch_size
        parts = [batch.select(r) for r in rows.split(mbs)]
        if self.mcfg.pp == 1 and not self.mcfg.sequence_parallel:
            return parts
        width = max(p.input_ids.shape[1] for p in parts)
        if self.mcfg.sequence_parallel:
            width = -(-width // self.mcfg.tp) * self.mcfg.tp
        size = min(mbs, len(rows)) if len(parts) == 1 else mbs
        return [_pad_part(p, size, width) for p in parts]

    def _forward(self, model: Any, part: TrainBatch) -> torch.Tensor:
        """This stage's output: vocab-parallel logits (B, L, V/tp) on the last stage."""
        ids = part.input_ids.long().to(self.device)
        attn = part.attention_mask.to(self.device)
        length = ids.shape[1]
        pos = torch.arange(length, device=self.device).unsqueeze(0).expand_as(ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)
        mask = causal[None, None] | ~attn[:, None, None, :]  # True = masked
        return model(ids, pos, mask)

    def _logp(self, out: torch.Tensor, part: TrainBatch, grad_entropy: bool):
        logits = out[:, :-1].float() / self.temperature
        targets = part.input_ids[:, 1:].to(self.device)
        return vocab_parallel_logprobs(
            logits, targets, vocab=self.arch.vocab, with_entropy_grad=grad_entropy
        )

    def _schedule(
        self,
        model: Any,
        parts: list[TrainBatch],
        loss_fn: Callable[[TrainBatch, torch.Tensor], tuple[Any, Any, dict[str, Any]]],
        *,
        forward_only: bool,
    ) -> list[dict[str, Any]]:
        """Run ``parts`` through megatron's schedule; the loss outputs (last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data: Iterator[TrainBatch], chunk: Any) -> tuple[torch.Tensor, Callable]:
            part = next(data)
            return self._forward(chunk, part), functools.partial(loss_fn, part)

        with compat.cuda_free():
            return get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(parts),
                model=[model],
                num_microbatches=len(parts),
                seq_length=parts[0].input_ids.shape[1],
                micro_batch_size=parts[0].size,
                forward_only=forward_only,
            )

    # ------------------------------------------------------------------- log-probs

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs (B, L-1) under the policy or the reference policy (valid on
        the :attr:`reports` ranks; zeros elsewhere)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        was_training = model.training
        model.eval()
        parts = self._micro_batches(batch, torch.arange(batch.size))

        def keep(part: TrainBatch, out: torch.Tensor):  # noqa: ANN202 - megatron's loss_func
            logp, _ = self._logp(out, part, False)
            return out.new_zeros(()), torch.tensor(0), {"logp": logp.float().cpu()}

        outputs = self._schedule(model, parts, keep, forward_only=True)
        model.train(was_training)
        result = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        if self.last_stage:
            start = 0
            for part, got in zip(parts, outputs, strict=True):
                n = min(part.size, batch.size - start)
                rows = slice(start, start + n)
                width = min(got["logp"].shape[1], result.shape[1])
                mask = batch.response_mask[rows, :width]
                result[rows, :width] = torch.where(mask, got["logp"][:n, :width], 0.0)
                start += n
        return result

    # ----------------------------------------------------------------------- train

    def train_step(
        self,
        batch: TrainBatch,
        *,
        minis: Sequence[MiniBatch] | None = None,
        norm_const: float | None = None,
    ) -> dict[str, float]:
        """Apply ``ppo_epochs * mini_batches`` optimizer steps on one GRPO batch (this DP
        rank's slice of it; ``minis`` carry the global counts), as the torch backend does."""
        cfg = self.train_cfg
        started = time.perf_counter()
        self.model.train()
        if minis is None:
            minis = [
                MiniBatch(rows, float(batch.response_mask[rows].sum()), float(len(rows)))
                for rows in torch.arange(batch.size).chunk(cfg.mini_batches)
            ]
        if norm_const is None:
            norm_const = float(self.max_response_len or batch.response_mask.shape[-1])
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        grad_norms: list[float] = []
        tokens = 0.0
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                self.ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
                parts = self._micro_batches(batch, mini.rows)

                def loss_fn(part: TrainBatch, out: torch.Tensor, mini: MiniBatch = mini):  # noqa: ANN202
                    logp, ent = self._logp(out, part, self.algo.entropy_coef > 0)
                    loss, m = grpo_micro_loss(
                        self.algo, part, logp, ent, norm_const, mini, self.device
                    )
                    m["_w"] = float(part.response_mask.sum())
                    return loss, torch.tensor(1), m

                outputs = self._schedule(self.ddp, parts, loss_fn, forward_only=False)
                mini_sums: dict[str, float] = {}
                for m in outputs:
                    w = m.pop("_w")
                    tokens += w
                    add_micro_metrics(m, w, mini_sums, sums, maxes)
                for k, v in mini_sums.items():
                    sums[k] = sums.get(k, 0.0) + v * mini.tokens
                for group in self.optimizer.param_groups:
                    group["lr"] = cfg.lr * self._lr_factor(self.global_step)
                with compat.cuda_free():
                    ok, grad_norm, _ = self.optimizer.step()
                if not ok:
                    raise FloatingPointError(
                        f"optimizer step {self.global_step}: megatron skipped the update "
                        "(inf/nan gradients)"
                    )
                grad_norms.append(float(grad_norm or 0.0))
                self.global_step += 1
        sums[_TOKENS] = tokens
        sums, maxes = self._across_ranks(sums, maxes)
        lr = cfg.lr * self._lr_factor(self.global_step)
        return step_metrics(sums, maxes, grad_norms, lr, time.perf_counter() - started)

    def _across_ranks(
        self, sums: dict[str, float], maxes: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Metric sums and maxima of every DP replica (as the reporting ranks saw them)."""
        if dist.get_world_size() == 1:
            return sums, maxes
        mine = (sums, maxes) if self.reports else ({}, {})
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        total: dict[str, float] = {}
        top: dict[str, float] = {}
        for s, mx in everyone:
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
            for k, v in mx.items():
                top[k] = max(top.get(k, float("-inf")), v)
        return total, top

    # ---------------------------------------------------------------------- weights

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy by HF name on global rank 0 (``{}`` elsewhere): TP shards are
        gathered within each stage, stages gathered to the first one (a collective)."""
        ps = _mpu()
        tp = ps.get_tensor_model_parallel_world_size()
        merged: dict[str, torch.Tensor] = {}
        for name, t in self.core.state_dict().items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            t = t.detach()
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
            stages: list[Any] = [None] * pp if self.first_stage else None  # type: ignore[assignment]
            cpu = {k: v.cpu() for k, v in hf.items()}
            dist.gather_object(
                cpu,
                stages,
                dst=ps.get_pipeline_model_parallel_first_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
            if not self.first_stage:
                return {}
            hf = {}
            for stage in stages:
                hf.update(stage)
            hf = _hf_order(hf)
        return hf if self.rank == 0 else {}

    def save_pretrained(self, path: str | Path) -> Path:
        """Write the policy in HF format (config + safetensors) on rank 0; every rank calls."""
        path = Path(path)
        weights = self.export_weights()
        if self.rank == 0:
            from safetensors.torch import save_file
            from transformers import AutoConfig

            path.mkdir(parents=True, exist_ok=True)
            AutoConfig.from_pretrained(self.model_path).save_pretrained(path)
            generation = self.model_path / "generation_config.json"
            if generation.exists():
                (path / "generation_config.json").write_bytes(generation.read_bytes())
            tensors = {
                k: v.detach().cpu().contiguous()
                for k, v in weights.items()
                if not (self.arch.tied and k == "lm_head.weight")  # HF re-ties it on load
            }
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        if dist.get_world_size() > 1:
            dist.barrier()
        return path

    def shutdown(self) -> None:
        """Leave megatron's groups (and the default group when this trainer created it)."""
        self.close_weight_broadcast()
        ps = _mpu()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------- checkpoints

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
        if dist.get_world_size() > 1:
            dist.barrier()
        _in_process_results_queue()
        with compat.cuda_free():
            dist_checkpointing.save(self._sharded_state(), str(target))
        if self.rank == 0:
            state = {
                "global_step": self.global_step,
                "tp": self.mcfg.tp,
                "pp": self.mcfg.pp,
                "dp": self.dp_size,
                "distributed_optimizer": self.mcfg.distributed_optimizer,
            }
            (path / _STATE).write_text(json.dumps(state, indent=2))
        if dist.get_world_size() > 1:
            dist.barrier()
        return path

    def load_state(self, path: str | Path) -> None:
        """Restore what :meth:`save_state` wrote (any TP/PP layout for the model)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        source = path / "megatron"
        if not (path / _STATE).exists() or not source.is_dir():
            raise FileNotFoundError(
                f"{path}: no megatron checkpoint (megatron/ and {_STATE}); it was written by "
                "another backend: resume it with train.backend=torch, or start from its "
                "model/ as model.path"
            )
        with compat.cuda_free():
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(source))
            self.core.load_state_dict(state["model"])
            with torch.no_grad():  # distopt views of leaf parameters (megatron-cpu.md §6.4)
                self.optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(self.optimizer)
        self.global_step = json.loads((path / _STATE).read_text())["global_step"]


def _in_process_results_queue() -> None:
    """Collect ``dist_checkpointing``'s write results in a plain in-process queue.

    megatron-core 0.16.1 creates that queue with ``multiprocessing.get_context("spawn")
    .Manager()`` on the first save: a spawned server process that re-imports ``__main__``,
    so a user's script without an ``if __name__ == "__main__":`` guard runs twice (measured),
    and the first save pays ~2.5 s for the spawn. The queue only crosses processes for
    megatron's *asynchronous* saves; the trainer saves synchronously (the forked writers
    report through their own queues, and the parent, which runs the save, fills this one),
    so an in-process queue is equivalent here. Private name, pinned version (0.16.1).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is None:
        filesystem_async._results_queue = queue.Queue()


def _restore_adam_steps(optimizer: Any) -> None:
    """Give torch Adam's per-parameter ``step`` the value the checkpoint restored.

    The distributed optimizer's checkpoint (megatron-core 0.16.1, ``dp_reshardable``) keeps
    Adam's step count in the parameter groups, as Apex's FusedAdam reads it; torch's AdamW
    (megatron's fallback without Apex/TE) reads ``state[p]["step"]``, which the load leaves
    as it was. Without this the bias correction after a resume is the wrong step's, and
    training does not continue identically (tests/test_megatron.py catches it).
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state and "step" in state:
                    step = state["step"]
                    state["step"] = (
                        torch.full_like(step, float(group["step"]))
                        if torch.is_tensor(step) else group["step"]
                    )  # fmt: skip


def _pad_part(part: TrainBatch, rows: int, width: int) -> TrainBatch:
    """``part`` grown to ``rows`` x ``width``: right-padding columns, and extra rows that copy
    row 0 with an empty response mask (a real row: no fully masked attention)."""
    extra = rows - part.size
    cols = width - part.input_ids.shape[1]
    out = {}
    for name in ("input_ids", "attention_mask", "response_mask", "rollout_logp", "old_logp",
                 "ref_logp", "advantages"):  # fmt: skip
        t = getattr(part, name)
        if t is None:
            out[name] = None
            continue
        if t.dim() == 2 and cols:
            t = torch.cat([t, t.new_zeros((t.shape[0], cols))], dim=1)
        if extra:
            copy = t[:1].repeat(extra, *([1] * (t.dim() - 1)))
            if name == "response_mask":
                copy = torch.zeros_like(copy)
            t = torch.cat([t, copy])
        out[name] = t
    return TrainBatch(**out)


def _hf_order(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names in model order: embeddings, layers by index, final norm, head."""

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if "embed" in name else 2, 0, name)

    return dict(sorted(weights.items(), key=lambda kv: key(kv[0])))
