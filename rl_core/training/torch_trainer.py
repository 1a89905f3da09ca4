"""The torch training backend: a Hugging Face causal LM updated with the GRPO loss.

:class:`TorchTrainer` (:class:`rl_core.interfaces.Trainer`) owns the policy, the frozen
reference (only with the KL term), AdamW and the LR schedule. Each micro-batch's loss is its
share of the mini-batch's *global* counts, so micro-batching and data parallelism are exact;
:mod:`rl_core.training.distributed` runs it on ranks through the hooks ``_train_module``,
``_grad_sync`` and ``_across_ranks`` (no-ops here). MoE forwards: :mod:`.moe`; ``train.lora``:
:mod:`.lora` (docs/lora.md). The step: docs/training.md, "The training step".
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_core.algorithms.losses import (
    compute_grpo_loss,
    entropy_from_logits,
    logprobs_from_logits,
    nll_loss,
)
from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.models import load_policy_model, read_weights, torch_dtype
from rl_core.models.moe import prefer_fast_experts
from rl_core.models.vlm import BANNED_LOGIT, is_vision_model
from rl_core.training import lora as lora_lib
from rl_core.training.moe import MoeForward
from rl_core.training.packing import plan_first_fit, plan_packing
from rl_core.training.vision import TrainerVision, freeze_vision_tower
from rl_core.types import Batch
from rl_core.weight_sync.source import WeightSource

__all__ = ["MiniBatch", "TorchTrainer", "check_loaded"]

# Micro-batch values of these metrics are shares of the mini-batch value (already divided
# by the mini-batch's token/sequence count): they add up, rather than average.
_SUMMED_METRICS = ("loss", "pg_loss")
_MAX_METRICS = ("ratio_max", "tis_max")
_TOKENS = "_tokens"  # response tokens trained on, carried with the metric sums
# What one optimizer step reports: (micro-batch metrics, its response tokens) each, grad norm.
MiniResult = tuple[list[tuple[dict[str, float], float]], float]


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's ``rows`` of the batch given to :meth:`TorchTrainer.train_step`,
    and the response-token and sequence counts of the *whole* mini-batch (on a data-parallel
    rank, including the rows other ranks hold) that its loss is normalised by."""

    rows: torch.Tensor
    tokens: float
    seqs: float


class TorchTrainer(WeightSource):
    """GRPO trainer over a Hugging Face causal LM (single rank)."""

    def __init__(
        self, model_path: str | Path, train: TrainConfig, algorithm: AlgorithmConfig, *,
        temperature: float = 1.0, max_response_len: int | None = None, dtype: str = "float32",
        trust_remote_code: bool = False, device: str = "cpu", pack_length: int | None = None,
        freeze_vision: bool = True, roles: Sequence[str] = (),
    ) -> None:
        self.train_cfg, self.algo = train, algorithm
        # Rows without a shared prompt packed first-fit into rows of this many tokens (SFT's
        # train.packing); None: groups sharing a prompt pack (train.pack_groups), nothing else.
        self.pack_length = pack_length
        self.forward_slots = 0  # token slots the forwards ran (padding included)
        # Log-probs are taken at the rollout temperature, as the engine reports them.
        self.temperature = temperature if temperature > 0 else 1.0
        # Dr.GRPO's constant normaliser: the generation budget, the same every step.
        self.max_response_len = max_response_len
        self.device = torch.device(device)
        torch.manual_seed(train.seed)
        self.model_path, self._trust_remote_code = str(model_path), trust_remote_code
        self._dtype = torch_dtype(dtype)
        self.lora = train.lora if train.lora.enabled else None
        # train.lora.per_role: role -> its adapter's name (one adapter each; docs/lora.md)
        self.role_adapters = _role_adapters(self.lora, roles)
        self._export_role: str | None = None  # whose adapter export_weights gives (per role)
        quant = lora_lib.quantization(train.lora, torch_dtype(dtype))  # QLoRA: a 4-bit base
        self.model = load_policy_model(
            model_path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
            **({"quantization_config": quant, "device_map": str(self.device)} if quant else {}))
        if quant is None:
            self.model = self.model.to(self.device)
        else:
            lora_lib.unpacked_4bit(self.model)
        prefer_fast_experts(self.model)
        self.moe = MoeForward.for_model(self.model, train.moe, model_path)  # None: dense
        # A vision-language policy: its images' pixels and M-RoPE positions (.vision)
        self.vision = TrainerVision(model_path, self.model) if is_vision_model(self.model) \
            else None
        if self.vision is not None and freeze_vision:
            freeze_vision_tower(self.model)
        if self.lora is not None:
            self.model = lora_lib.apply_lora(self.model, self.lora,
                                             *([list(self.role_adapters.values())]
                                               if self.role_adapters else []))
        self.model.train()
        self.ref_model = (copy.deepcopy(self.model).eval().requires_grad_(False)
                          if algorithm.kl_coef > 0 and self.lora is None else None)
        self._build_optimizer()
        self._n_params = sum(p.numel() for p in self.model.parameters())
        self.global_step = 0  # optimizer steps applied

    def _build_optimizer(self) -> None:
        """AdamW and the LR schedule over the current parameters (FSDP2 rebuilds them)."""
        train = self.train_cfg
        self.optimizer = torch.optim.AdamW(self._trained(), lr=train.lr,
                                           betas=tuple(train.betas),
                                           weight_decay=train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(train))

    def _trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA: the adapters only; per role: every
        role's, though peft marks only the active adapter's ``requires_grad``)."""
        if self.role_adapters:
            return [p for n, p in self.model.named_parameters() if ".lora_" in n]
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------ per-role adapters (train.lora)

    def _by_role(self, batch: Batch, rows: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
        """``rows`` split by the role whose adapter scores and trains them, in the roles'
        order (``batch.roles``; a batch without them: the first role's); one part, role None,
        without per-role adapters."""
        if not self.role_adapters:
            return [(None, rows)]
        first = next(iter(self.role_adapters))
        if batch.roles is None:
            return [(first, rows)]
        groups: dict[str, list[int]] = {}
        for i in rows.tolist():
            role = batch.roles[i]
            if role not in self.role_adapters:
                raise ValueError(f"row {i} is role {role!r}, which has no adapter "
                                 f"(train.lora.per_role: {sorted(self.role_adapters)})")
            groups.setdefault(role, []).append(i)
        return [(r, torch.tensor(groups[r], dtype=torch.long)) for r in self.role_adapters
                if r in groups]

    def _use_role(self, role: str | None) -> None:
        """Make ``role``'s adapter the active one (None: nothing to switch)."""
        if role is not None:
            self.model.set_adapter(self.role_adapters[role])

    @contextlib.contextmanager
    def exporting(self, role: str) -> Any:
        """Within it, :meth:`export_weights`, :meth:`adapter_config` and :meth:`write_weights`
        give ``role``'s adapter (``train.lora.per_role``: the per-role weight sync)."""
        if role not in self.role_adapters:
            raise ValueError(f"no adapter for role {role!r} (train.lora.per_role: "
                             f"{sorted(self.role_adapters)})")
        before, self._export_role = self._export_role, role
        try:
            yield
        finally:
            self._export_role = before

    def _export_adapter(self) -> str:
        """The peft name of the adapter a sync or write gives now."""
        if not self.role_adapters:
            return lora_lib._ADAPTER
        return self.role_adapters[self._export_role or next(iter(self.role_adapters))]

    # ------------------------------------------------- data-parallel hooks (one rank: no-ops)

    @property
    def _train_module(self) -> torch.nn.Module:
        """The module the training forward goes through (a DDP wrapper on ranks)."""
        return self.model

    def _grad_sync(self, sync: bool) -> AbstractContextManager:
        """Around one micro-batch's forward/backward; ``sync``: the mini-batch's last."""
        return contextlib.nullcontext()

    def _across_ranks(self, sums: dict[str, float],
                      maxes: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Metric sums and maxima of every rank (one rank: its own)."""
        return sums, maxes

    # ------------------------------------------------------------------ log-probs

    def _forward(self, model: torch.nn.Module, batch: Batch,
                 logp: bool = True) -> tuple[torch.Tensor, Any]:
        """Logits (B, L-1, V) at the rollout temperature and the tokens' log-probs (B, L-1;
        None without ``logp``); groups sharing a prompt run packed
        (:mod:`rl_core.training.packing`) where cheaper."""
        ids = batch.input_ids.long()
        plan = None
        images = self.vision is not None and batch.images is not None
        if self.pack_length is not None and not images:
            plan = plan_first_fit(ids, batch.attention_mask, self.pack_length, self.model.dtype)
        elif self.train_cfg.pack_groups and batch.prompt_lens is not None and (
                not images or self.vision.packable(batch)):
            cfg = self.model.config.get_text_config()
            plan = plan_packing(ids, batch.attention_mask, batch.prompt_lens,
                                params=self._n_params, layers=cfg.num_hidden_layers,
                                hidden=cfg.hidden_size, dtype=self.model.dtype,
                                images=batch.images if images else None)
        self.forward_slots += (ids if plan is None else plan.input_ids).numel()
        # pixels and 3-row M-RoPE positions (a vision-language policy's rows with images)
        extra = {k: v.to(self.device) for k, v in self.vision.inputs(batch, plan).items()} \
            if images else {}
        if plan is None:
            def forward() -> Any:
                return model(input_ids=ids.to(self.device),
                             attention_mask=batch.attention_mask.to(self.device).long(), **extra)
        else:
            extra.setdefault("position_ids", plan.position_ids.to(self.device))

            def forward() -> Any:
                return model(input_ids=plan.input_ids.to(self.device),
                             attention_mask=plan.attention_mask.to(self.device), **extra)
        out = forward() if self.moe is None else self.moe.run(model, batch, plan, forward)
        logits = out.logits[:, :-1] if plan is None else plan.gather(out.logits)
        if self.vision is not None:  # as the engine: placeholders are never sampled
            logits = logits.index_fill(-1, self.vision.banned.to(logits.device), BANNED_LOGIT)
        logits = logits.float() / self.temperature
        return logits, logprobs_from_logits(logits, ids[:, 1:].to(self.device)) if logp else None

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs (B, L-1) under the policy or the reference policy."""
        if reference and self.lora is not None:
            with self.model.disable_adapter():  # the base model is the reference
                return self._logprobs(self.model, batch, per_role=False)
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("no reference model: algorithm.kl_coef is 0")
        return self._logprobs(model, batch)

    def _logprobs(self, model: torch.nn.Module, batch: Batch,
                  per_role: bool = True) -> torch.Tensor:
        """Per-role adapters: each row under its role's adapter (``per_role``)."""
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        mb = self.train_cfg.micro_batch_size
        rows = torch.arange(batch.size)
        for role, own in self._by_role(batch, rows) if per_role else [(None, rows)]:
            self._use_role(role)
            for index in own.split(mb):
                part = batch.select(index)
                _, logp = self._forward(model, part)
                out[index, : logp.shape[1]] = torch.where(part.response_mask, logp.cpu(), 0.0)
        model.train(was_training)
        return out

    @property
    def has_ref_model(self) -> bool:
        """Whether reference log-probs exist (``algorithm.kl_coef > 0``)."""
        # getattr: the megatron backend borrows this property without TorchTrainer's __init__
        lora = getattr(self, "lora", None)
        return self.ref_model is not None or (lora is not None and self.algo.kl_coef > 0)

    @property
    def needs_old_logp(self) -> bool:
        """Whether old log-probs need their own pass (several mini-batches or epochs); else
        the ratio is exactly 1 and the corrections use the training forward's own, detached
        (``grpo_micro_loss``; docs/training.md, "The training step")."""
        cfg = self.train_cfg
        return cfg.mini_batches > 1 or cfg.ppo_epochs > 1

    # ---------------------------------------------------------------------- train

    def train_step(self, batch: Batch, *, minis: Sequence[MiniBatch] | None = None,
                   norm_const: float | None = None) -> dict[str, float]:
        """Apply ``ppo_epochs * mini_batches`` optimizer steps on one GRPO batch. ``minis``
        (data-parallel ranks): the rows of each optimizer step and the global counts to
        normalise by; ``norm_const``: Dr.GRPO's constant (defaults: :func:`run_train_step`)."""
        return run_train_step(self, batch, minis, norm_const, self._update,
                              lambda: self.scheduler.get_last_lr()[0])

    def _update(self, batch: Batch, mini: MiniBatch, norm_const: float) -> MiniResult:
        """One optimizer step on ``mini``, micro-batch by micro-batch."""
        self.optimizer.zero_grad(set_to_none=True)
        # per-role adapters: each micro-batch's rows of each role under that role's adapter
        # (an adapter gets gradients from its own role's rows only; one step over all)
        micros = [part for micro in mini.rows.split(self.train_cfg.micro_batch_size)
                  for part in self._by_role(batch, micro)]
        metrics = []
        for i, (role, micro) in enumerate(micros):
            self._use_role(role)
            part = batch.select(micro)
            with self._grad_sync(i == len(micros) - 1):
                loss, m = self._micro_loss(part, norm_const, mini)
                loss.backward()
            metrics.append((m, float(part.response_mask.sum())))
        norm = torch.nn.utils.clip_grad_norm_(self._trained(), self.train_cfg.grad_clip)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        grad_norm = float(norm)
        self.optimizer.step()
        self.scheduler.step()
        return metrics, grad_norm

    def _micro_loss(self, part: Batch, norm_const: float,
                    mini: MiniBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's share of its mini-batch's GRPO loss, and its metrics."""
        nll = self.algo.loss == "nll"
        logits, logp = self._forward(self._train_module, part, logp=not nll)
        if nll:  # SFT (docs/sft.md): no ratio, KL or entropy terms
            labels = part.input_ids[:, 1:].to(self.device)
            loss, metrics = nll_loss(logits, labels, part.response_mask.to(self.device),
                                     mini.tokens)
        else:  # entropy is reported; it carries gradient only when it is a bonus
            with torch.set_grad_enabled(self.algo.entropy_coef > 0):
                ent = entropy_from_logits(logits)
            loss, metrics = grpo_micro_loss(self.algo, part, logp, ent, norm_const, mini,
                                            self.device)
        if self.moe is not None and self.moe.last is not None:  # router metrics, balance loss
            aux, router = self.moe.last
            metrics.update(router)
            if (coef := self.train_cfg.moe.aux_loss_coef) > 0:  # this micro-batch's share
                loss = loss + coef * aux * float(part.response_mask.sum()) / max(mini.tokens, 1.0)
        return loss, metrics

    # -------------------------------------------------------------------- weights

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state_dict on the sending rank (a gather on sharded ranks)."""
        return self.model.state_dict()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights by HF parameter name (what the rollout plane loads); with
        LoRA, the adapter's tensors by peft's names."""
        full = self._full_state_dict()
        if self.lora is not None:
            return lora_lib.adapter_tensors(full, self._export_adapter())
        return {k: v.detach() for k, v in full.items()}

    def adapter_config(self) -> dict[str, Any]:
        """LoRA: the adapter's ``adapter_config.json`` (the in-process sync sends it along)."""
        return lora_lib.adapter_config(self.model, self._export_adapter())

    def _write_hf(self, path: Path, weights: dict[str, torch.Tensor]) -> None:
        """HF format (config + safetensors; LoRA: a PEFT adapter directory) from the sending
        rank; the others wait for it."""
        if self._sends_weights:
            path.mkdir(parents=True, exist_ok=True)
            if self.lora is not None:
                lora_lib.write_adapter(self.model, path, weights, self._export_adapter())
            else:
                self.model.save_pretrained(path, state_dict=weights, safe_serialization=True)
        self._barrier()

    def save_pretrained(self, path: str | Path) -> Path:
        """The policy in HF format; with LoRA, the base with the adapter merged in, and the
        adapter itself in ``path/adapter`` (a PEFT directory: SGLang's ``--lora-paths``)."""
        if self.lora is None:
            return super().save_pretrained(path)
        path = Path(path)
        full = self._full_state_dict()
        if self._sends_weights:
            path.mkdir(parents=True, exist_ok=True)
            base = self.model.get_base_model()
            own = None
            if self.lora.quantize:  # merge into the full-precision base, not the 4-bit one
                base = load_policy_model(
                    self.model_path, dtype=self._dtype,
                    trust_remote_code=self._trust_remote_code)
                own = base.state_dict()
            if self.role_adapters:  # per role: the base itself, each role's adapter beside it
                base.save_pretrained(path, safe_serialization=True, state_dict=(
                    own if own is not None else lora_lib.base_tensors(full)))
                for role, name in self.role_adapters.items():
                    lora_lib.write_adapter(self.model, path / lora_lib.ROLE_ADAPTERS_DIR / role,
                                           lora_lib.adapter_tensors(full, name), name)
            else:
                base.save_pretrained(path, safe_serialization=True,
                                     state_dict=lora_lib.merged_tensors(full, self.lora, own))
                lora_lib.write_adapter(self.model, path / lora_lib.ADAPTER_DIR,
                                       lora_lib.adapter_tensors(full))
        self._barrier()
        return path

    def _loadable(self, path: Path) -> dict[str, torch.Tensor]:
        """What :meth:`save_state` wrote in ``path/model``, by the model's state_dict names."""
        if self.role_adapters:  # model/adapters/<role>/, one PEFT directory each
            out: dict[str, torch.Tensor] = {}
            for role, name in self.role_adapters.items():
                own = read_weights(path / "model" / lora_lib.ROLE_ADAPTERS_DIR / role)
                out.update(lora_lib.model_keys(own, name))
            return out
        named = read_weights(path / "model")
        return lora_lib.model_keys(named) if self.lora is not None else named

    def _check_restore(self, path: Path, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        if self.lora is not None:  # a LoRA checkpoint holds the adapter, not the base weights
            missing = [k for k in missing if ".lora_" in k]
        check_loaded(path, missing, unexpected)

    def _barrier(self) -> None:
        """Wait for every rank (one rank: nothing to wait for)."""

    def save_state(self, path: str | Path) -> Path:
        """Model (``path/model``, HF format), optimizer and scheduler (``trainer_state.pt``)."""
        path = Path(path)
        for role in self.role_adapters:  # per role: model/adapters/<role>/
            with self.exporting(role):
                self.write_weights(path / "model" / lora_lib.ROLE_ADAPTERS_DIR / role)
        if not self.role_adapters:
            self.write_weights(path / "model")  # LoRA: the adapter only
        state = {"optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "global_step": self.global_step}
        torch.save(state, path / "trainer_state.pt")
        return path

    def load_state(self, path: str | Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        path = Path(path)
        missing, unexpected = self.model.load_state_dict(self._loadable(path), strict=False)
        self._check_restore(path, missing, unexpected)
        # Our own file, written by save_state: it holds optimizer tensors and plain numbers.
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = state["global_step"]


def run_train_step(trainer: Any, batch: Batch, minis: Sequence[MiniBatch] | None,
                   norm_const: float | None,
                   update: Callable[[Batch, MiniBatch, float], MiniResult],
                   lr: Callable[[], float]) -> dict[str, float]:
    """``ppo_epochs * mini_batches`` optimizer steps on ``batch``: both backends' ``train_step``.
    ``update(batch, mini, norm_const)`` makes one step and returns (each micro-batch's metrics,
    its response tokens) and the grad norm; ``lr()`` is the LR after it. Defaults and the metric
    reduction over every rank: docs/training.md, "The training step"."""
    started = time.perf_counter()
    trainer.model.train()
    if minis is None:
        chunks = torch.arange(batch.size).chunk(trainer.train_cfg.mini_batches)
        minis = [MiniBatch(r, float(batch.response_mask[r].sum()), float(len(r))) for r in chunks]
    if norm_const is None:
        norm_const = float(trainer.max_response_len or batch.response_mask.shape[-1])
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    grad_norms: list[float] = []
    tokens = 0.0
    for _ in range(trainer.train_cfg.ppo_epochs):
        for mini in minis:
            micro_metrics, grad_norm = update(batch, mini, norm_const)
            mini_sums: dict[str, float] = {}  # loss terms: shares of the mini-batch's value
            for m, w in micro_metrics:
                tokens += w
                for k, v in m.items():
                    if k in _SUMMED_METRICS:
                        mini_sums[k] = mini_sums.get(k, 0.0) + float(v)
                    elif k in _MAX_METRICS:
                        maxes[k] = max(maxes.get(k, float("-inf")), float(v))
                    else:
                        sums[k] = sums.get(k, 0.0) + float(v) * w
            for k, v in mini_sums.items():
                sums[k] = sums.get(k, 0.0) + v * mini.tokens
            grad_norms.append(grad_norm)
            trainer.global_step += 1
    sums[_TOKENS] = tokens
    sums, maxes = trainer._across_ranks(sums, maxes)
    tokens = sums.pop(_TOKENS)
    metrics = {k: v / max(tokens, 1.0) for k, v in sums.items()}
    metrics.update(maxes)
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=lr(),
                   train_tokens_per_s=tokens / max(time.perf_counter() - started, 1e-9))
    return metrics


def grpo_micro_loss(
    algo: AlgorithmConfig, part: Batch, logp: torch.Tensor, entropy: torch.Tensor,
    norm_const: float, mini: MiniBatch, device: torch.device,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch ``part`` as its share of mini-batch ``mini``.
    ``logp``/``entropy``: (B, L-1) under the policy being trained, from whichever backend."""
    old = part.old_logp if part.old_logp is not None else logp.detach()
    return compute_grpo_loss(
        logp, old.to(device), part.advantages.to(device), part.response_mask.to(device),
        ref_logp=None if part.ref_logp is None else part.ref_logp.to(device),
        kl_coef=algo.kl_coef, kl_kind=algo.kl_kind, clip_low=algo.clip_low,
        clip_high=algo.clip_high, dual_clip=algo.dual_clip, ratio_type=algo.ratio_type,
        loss_agg=algo.loss_agg, norm_const=norm_const, entropy=entropy,
        entropy_coef=algo.entropy_coef, rollout_logp=part.rollout_logp.to(device),
        tis_cap=algo.tis_cap, tis_level=algo.tis_level, tis_mode=algo.tis_mode,
        icepop_low=algo.icepop_low, icepop_high=algo.icepop_high,
        seq_mask_threshold=algo.seq_mask_threshold, seq_mask_metric=algo.seq_mask_metric,
        global_tokens=mini.tokens, global_seqs=mini.seqs,
    )


def _role_adapters(lora: Any, roles: Sequence[str]) -> dict[str, str]:  # noqa: ANN401
    """``train.lora.per_role``: each role's adapter name, the roles checked; else {}."""
    if lora is None or not lora.per_role:
        return {}
    if len(roles) < 2:
        raise ValueError(f"train.lora.per_role=true trains an adapter per role, but the trainer "
                         f"was given roles {tuple(roles)}: set agent.env to an environment whose "
                         "class declares two roles or more (docs/agents.md)")
    if bad := [r for r in roles if not re.fullmatch(r"[A-Za-z0-9_-]+", r)]:
        raise ValueError(f"train.lora.per_role: roles {bad} cannot name adapters (letters, "
                         "digits, _ and - only)")
    return lora_lib.role_adapter_names(lora, roles)


def check_loaded(path: Path, missing: Sequence[str], unexpected: Sequence[str]) -> None:
    """Fail on keys a restore missed or did not expect (a tied ``lm_head`` may be absent)."""
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _lr_lambda(cfg: TrainConfig):  # noqa: ANN202 - a closure for LambdaLR
    """Warmup, then constant or cosine to ``min_lr_ratio`` over the run's optimizer steps."""
    total = max(1, cfg.steps * cfg.mini_batches * cfg.ppo_epochs)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor
