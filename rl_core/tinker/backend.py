"""The compute of grpoflow's Tinker-compatible service: many LoRA adapters on one base model,
trained with Tinker's losses and sampled through the embedded engine.

:class:`LoraBackend` loads each base model (``transformers``, float32) once, on first use, and
wraps it in one ``peft`` model holding every adapter created on it (``add_adapter``; the one a
call addresses is made active first, so only its parameters take gradients). Gradients
accumulate in the adapter's own parameters until its :meth:`~LoraBackend.optim_step` (AdamW,
one optimizer per adapter), so adapters never see each other's gradients.

Sampling and prompt scoring run on an :class:`~rl_core.engine.core.EmbeddedEngine` per base
model (its own copy of the weights; up to ``MAX_LORAS_PER_BATCH`` adapters per batch, each
applied unmerged to its rows, docs/lora.md), from an adapter
directory in PEFT's format as :meth:`~LoraBackend.save_sampler_weights` writes it. A
:meth:`~LoraBackend.save_state` directory is one too (plus ``tinker_state.json`` and the
optimizer state), so both kinds of checkpoint can be sampled (docs/tinker-protocol.md §11.1).

LoRA: ``lora_alpha`` is 32 whatever the rank (scaling ``32 / rank``), dropout 0, B = 0 at
creation (a new adapter is the base model), A drawn from ``seed``. Targets: attention
q/k/v/o_proj, MLP gate/up/down_proj, ``lm_head`` (unembed) except on a model whose output
embedding is tied to its input embedding (the engine's merge would change both), where it is
left untrained and ``create_model``'s info says so. The caller serialises the training and
model calls that concern one base model (calls for different base models may run on different
threads); :meth:`~LoraBackend.sample` and :meth:`~LoraBackend.compute_logprobs` may run on
several threads at once, beside them: their requests meet in the engine's batches (the threads
take turns driving its scheduler), an adapter a request uses is never unloaded under it.
Losses: :mod:`rl_core.tinker.losses`.
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rl_core.engine.lora import ADAPTER_WEIGHTS
from rl_core.tinker import AdamParams, Datum, SampledSequence, SamplingParams, TinkerError
from rl_core.tinker.engines import SamplingEngine
from rl_core.tinker.losses import LossStats, compute_loss, loss_settings, required_inputs

__all__ = ["LORA_ALPHA", "LoraBackend"]

LORA_ALPHA = 32
# The engine's max_loras_per_batch (engine_kwargs may override it). The service runs several
# tenants' sample requests at once (grpoflow/tinker/futures.py, its sampling threads), so their
# adapters meet in the engine's batches: with 4, four tenants share decode steps instead of
# taking turns (docs/benchmarks.md: 4 interleaved adapters 7.7x faster in process), at ~10%
# more per token for one adapter alone (applied unmerged).
MAX_LORAS_PER_BATCH = 4
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
STATE_FILE = "tinker_state.json"  # save_state's config beside the PEFT adapter files
OPTIMIZER_FILE = "optimizer.pt"  # the AdamW state_dict (torch.save; loaded weights_only)
_CREATE_KEYS = ("base_model", "rank", "seed", "train_mlp", "train_attn", "train_unembed")


@dataclass
class _Base:
    name: str
    path: Path
    model: Any = None  # the HF model; the PeftModel once it holds an adapter
    tied: bool = False  # output embedding tied to the input embedding
    linear: set[str] = field(default_factory=set)  # the last name part of each linear layer
    vocab: int = 0
    context: int = 0
    sampler: SamplingEngine = field(init=False)  # its engine and adapters (engines.py)


@dataclass
class _Adapter:
    model_id: str
    base: _Base
    name: str  # the peft adapter name (model ids may hold characters module names cannot)
    info: dict[str, Any]
    params: dict[str, torch.nn.Parameter]  # by PEFT's saved name, sorted
    created: dict[str, Any]  # create_model's arguments (what save_state records)
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0


@dataclass
class _Prepared:
    tokens: list[int]
    targets: torch.Tensor  # int64, [N] or [N, K]
    inputs: dict[str, torch.Tensor]  # float32, the targets' shape


class LoraBackend:
    """LoRA training and sampling on local base models (see the module docstring).
    ``base_models``: name -> local Hugging Face model directory. ``num_threads`` > 0: torch's
    intra-op threads for every call; ``max_batch_tokens``: padded tokens per training
    forward (more datums are split into micro-batches, their gradients summed);
    ``max_loaded_adapters``: adapters each engine holds (least recently used unloaded);
    ``engine_kwargs``: passed to each :class:`~rl_core.engine.core.EmbeddedEngine`."""

    def __init__(self, base_models: Mapping[str, str | Path], *, num_threads: int = 2,
                 device: str = "cpu", max_batch_tokens: int = 16384,
                 max_loaded_adapters: int = 8,
                 engine_kwargs: Mapping[str, Any] | None = None) -> None:
        self._bases = {str(k): _Base(str(k), Path(v)) for k, v in base_models.items()}
        self._adapters: dict[str, _Adapter] = {}
        self.num_threads, self.device = int(num_threads), torch.device(device)
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.max_loaded_adapters = max(1, int(max_loaded_adapters))
        self.engine_kwargs = dict(engine_kwargs or {})
        self._names = itertools.count()
        self._rng = threading.Lock()  # seeded inits of two base models' threads
        for base in self._bases.values():
            base.sampler = SamplingEngine(
                base.path, self._engine_kwargs, lambda: self.max_loaded_adapters,
                lambda: f"tinker-{next(self._names)}", self._threads)

    # ------------------------------------------------------------------ models and adapters

    def base_model_names(self) -> list[str]:
        """The base models this backend serves, in the order given."""
        return list(self._bases)

    def tokenizer_dir(self, base_model: str) -> str:
        """The local directory ``AutoTokenizer.from_pretrained`` loads ``base_model``'s
        tokenizer from."""
        return str(self._base(base_model).path)

    def model_ids(self) -> list[str]:
        """Every adapter's model id."""
        return list(self._adapters)

    def create_model(self, model_id: str, base_model: str, rank: int, *, seed: int | None = None,
                     train_mlp: bool = True, train_attn: bool = True,
                     train_unembed: bool = True) -> dict[str, Any]:
        """A new LoRA adapter ``model_id`` on ``base_model``; its info (base model, arch,
        rank, targets, trainable parameter count, seed, notes)."""
        if model_id in self._adapters:
            raise TinkerError(f"model id {model_id!r} already exists")
        base = self._base(base_model)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise TinkerError(f"rank must be a positive integer, got {rank!r}")
        if not (train_mlp or train_attn or train_unembed):
            raise TinkerError("at least one of train_mlp, train_attn, train_unembed must be true")
        model = self._load(base)
        linear = base.linear
        notes = []
        wanted = [*(ATTN_MODULES if train_attn else ()), *(MLP_MODULES if train_mlp else ())]
        if train_unembed and base.tied:
            notes.append("train_unembed: lm_head is tied to the input embedding in this model; "
                         "it is not trained")
        elif train_unembed:
            wanted.extend(UNEMBED_MODULES)
        targets = sorted(t for t in wanted if t in linear)
        if missing := sorted(set(wanted) - set(targets)):
            notes.append(f"{base_model} has no linear layers named {missing}; not trained")
        if not targets:
            raise TinkerError(f"{base_model}: none of the requested modules {wanted} exist "
                              f"(its linear layers: {sorted(linear)})")
        seed = secrets.randbits(31) if seed is None else int(seed)
        name = f"tinker_{next(self._names)}"
        self._new_adapter(base, name, rank, targets, seed)
        params = {self._saved_name(n, name): p for n, p in base.model.named_parameters()
                  if f".{name}." in n and (".lora_A." in n or ".lora_B." in n)}
        params = dict(sorted(params.items()))
        info = {"model_id": model_id, "base_model": base_model, "model_name": base_model,
                "arch": str(getattr(model.config, "model_type", "unknown")), "is_lora": True,
                "rank": rank, "lora_rank": rank, "lora_alpha": LORA_ALPHA, "seed": seed,
                "train_mlp": bool(train_mlp), "train_attn": bool(train_attn),
                "train_unembed": bool(train_unembed) and "lm_head" in targets,
                "target_modules": targets,
                "trainable_params": sum(p.numel() for p in params.values()), "notes": notes}
        created = {"base_model": base_model, "rank": rank, "seed": seed,
                   "train_mlp": bool(train_mlp), "train_attn": bool(train_attn),
                   "train_unembed": bool(train_unembed)}
        self._adapters[model_id] = _Adapter(model_id, base, name, info, params, created)
        return dict(info)

    def delete_model(self, model_id: str) -> None:
        """Drop adapter ``model_id``, its gradients and optimizer state."""
        ad = self._adapter(model_id)
        ad.base.model.delete_adapter(ad.name)
        del self._adapters[model_id]

    def adapter_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of ``model_id``'s LoRA tensors, by PEFT's saved names."""
        return {k: p.detach().clone() for k, p in self._adapter(model_id).params.items()}

    def adapter_grads(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of ``model_id``'s accumulated gradients (zeros where none), by saved name."""
        return {k: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
                for k, p in self._adapter(model_id).params.items()}

    # ------------------------------------------------------------------ training

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str,
                         config: Mapping[str, float] | None = None, forward_only: bool = False
                         ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Each datum's log-probs of its ``target_tokens`` under ``model_id`` (float32, the
        targets' shape) and the metrics (``loss:sum``, ``tokens:sum``; RL losses also
        ``ratio:mean``, ppo/cispo/gspo ``clipped_frac:mean``). Unless ``forward_only``, the summed
        loss's gradient is added to the adapter's (kept until :meth:`optim_step`). Every
        datum is checked before any computation, so a refused request changes nothing."""
        ad = self._adapter(model_id)
        required = required_inputs(loss_fn)
        settings = loss_settings(loss_fn, config)
        if not data:
            raise TinkerError("forward_backward needs at least one datum")
        items = [self._prepare(i, d, loss_fn, required, ad.base) for i, d in enumerate(data)]
        self._threads()
        self._activate(ad)
        outputs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(items)
        stats = LossStats()
        for chunk in self._chunks(items):
            with torch.set_grad_enabled(not forward_only):
                logps = self._logprobs(ad.base.model, [items[i] for i in chunk])
                flat = torch.cat([lp.reshape(-1) for lp in logps])
                inputs = {k: torch.cat([items[i].inputs[k].reshape(-1) for i in chunk])
                          for k in items[chunk[0]].inputs}
                loss, part = compute_loss(loss_fn, flat, inputs, settings,
                                          [lp.numel() for lp in logps])
                if not forward_only:
                    loss.backward()
            stats.add(part)
            for i, lp in zip(chunk, logps, strict=True):
                outputs[i] = lp.detach().to("cpu", torch.float32).numpy()
        return outputs, stats.metrics(loss_fn)

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step (decoupled weight decay) on ``model_id``'s accumulated gradients,
        clipped to ``grad_clip_norm`` if > 0, then zeroed; ``grad_norm`` is before clipping."""
        ad = self._adapter(model_id)
        p = params
        if not (p.learning_rate >= 0 and 0 <= p.beta1 < 1 and 0 <= p.beta2 < 1 and p.eps >= 0
                and p.weight_decay >= 0 and p.grad_clip_norm >= 0):
            raise TinkerError(f"invalid AdamParams {p}: need learning_rate, eps, weight_decay, "
                              "grad_clip_norm >= 0 and beta1, beta2 in [0, 1)")
        self._threads()
        weights = list(ad.params.values())
        grads = [w.grad for w in weights if w.grad is not None]
        if not grads:
            norm = 0.0
        elif p.grad_clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(weights, p.grad_clip_norm))
        else:
            norm = float(torch.nn.utils.get_total_norm(grads))
        hyper = {"lr": p.learning_rate, "betas": (p.beta1, p.beta2), "eps": p.eps,
                 "weight_decay": p.weight_decay}
        if ad.optimizer is None:
            ad.optimizer = torch.optim.AdamW(weights, **hyper)
        for group in ad.optimizer.param_groups:
            group.update(hyper)
        ad.optimizer.step()
        ad.optimizer.zero_grad(set_to_none=True)
        ad.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": float(p.learning_rate),
                "step:max": float(ad.steps)}

    # ------------------------------------------------------------------ checkpoints

    def save_sampler_weights(self, model_id: str, out_dir: Path) -> None:
        """``model_id``'s adapter in PEFT's format (``adapter_config.json`` +
        ``adapter_model.safetensors``), which the embedded engine serves."""
        ad = self._adapter(model_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        ad.base.model.peft_config[ad.name].save_pretrained(str(out))
        save_file({k: w.detach().to("cpu").contiguous() for k, w in ad.params.items()},
                  str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    def save_state(self, model_id: str, out_dir: Path, with_optimizer: bool = True) -> None:
        """The adapter (as :meth:`save_sampler_weights`), its creation config and step count
        (``tinker_state.json``) and, if ``with_optimizer`` and it has stepped, the AdamW
        state (``optimizer.pt``)."""
        ad = self._adapter(model_id)
        out = Path(out_dir)
        self.save_sampler_weights(model_id, out)
        opt = out / OPTIMIZER_FILE
        saved = with_optimizer and ad.optimizer is not None
        if saved:
            torch.save(ad.optimizer.state_dict(), opt)
        else:
            opt.unlink(missing_ok=True)
        state = {"format": 1, **ad.created, "lora_alpha": LORA_ALPHA, "steps": ad.steps,
                 "target_modules": ad.info["target_modules"], "optimizer": saved}
        (out / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @staticmethod
    def saved_config(src_dir: Path) -> dict[str, Any]:
        """The :meth:`create_model` keyword arguments of the adapter saved in ``src_dir``
        (base_model, rank, seed, train_mlp, train_attn, train_unembed)."""
        state = LoraBackend._read_state(Path(src_dir))
        return {k: state[k] for k in _CREATE_KEYS}

    def create_from_state(self, model_id: str, src_dir: Path,
                          with_optimizer: bool) -> dict[str, Any]:
        """:meth:`create_model` from ``src_dir``'s saved config, then :meth:`load_state`."""
        info = self.create_model(model_id, **self.saved_config(src_dir))
        try:
            self.load_state(model_id, src_dir, with_optimizer)
        except Exception:
            self.delete_model(model_id)
            raise
        return info

    def load_state(self, model_id: str, src_dir: Path, with_optimizer: bool) -> None:
        """Load a :meth:`save_state` directory into existing adapter ``model_id`` (same base,
        rank and targets): its weights, step count and, if ``with_optimizer`` and saved, the
        optimizer state (else a fresh optimizer). Pending gradients are dropped."""
        ad = self._adapter(model_id)
        src = Path(src_dir)
        state = self._read_state(src)
        mine = (ad.info["base_model"], ad.info["rank"], ad.info["target_modules"])
        theirs = (state["base_model"], state["rank"], state["target_modules"])
        if mine != theirs:
            raise TinkerError(f"{src}: saved for (base, rank, targets) {theirs}, but model "
                              f"{model_id!r} is {mine}")
        tensors = load_file(str(src / ADAPTER_WEIGHTS))
        bad = sorted(set(tensors) ^ set(ad.params)) or sorted(
            k for k, t in tensors.items() if t.shape != ad.params[k].shape)
        if bad:
            raise TinkerError(f"{src}: its adapter tensors do not fit model {model_id!r} "
                              f"(first mismatches: {bad[:3]})")
        opt_state = None
        if with_optimizer and state.get("optimizer"):
            opt_state = torch.load(src / OPTIMIZER_FILE, map_location=self.device,
                                   weights_only=True)
        with torch.no_grad():
            for k, w in ad.params.items():
                w.copy_(tensors[k])
                w.grad = None
        ad.optimizer, ad.steps = None, int(state.get("steps", 0))
        if opt_state is not None:
            ad.optimizer = torch.optim.AdamW(list(ad.params.values()))
            ad.optimizer.load_state_dict(opt_state)

    # ------------------------------------------------------------------ sampling (the engine)

    def sample(self, base_model: str, adapter_dir: Path | None, prompt: list[int],
               num_samples: int, params: SamplingParams) -> list[SampledSequence]:
        """``num_samples`` continuations of ``prompt`` from ``base_model`` with the adapter in
        ``adapter_dir`` (None: the base model); sample ``i`` uses seed ``params.seed + i``."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise TinkerError(f"num_samples must be a positive integer, got {num_samples!r}")
        base = self._base(base_model)
        with base.sampler.using(adapter_dir) as lora:
            return self._sample(base, lora, prompt, num_samples, params)

    def _sample(self, base: _Base, lora: str | None, prompt: list[int], num_samples: int,
                params: SamplingParams) -> list[SampledSequence]:
        from rl_core.engine.core import GenerateRequest
        from rl_core.engine.sampling import SamplingParams as EngineParams

        strings = [s for s in params.stop if isinstance(s, str)]
        ids = [int(s) for s in params.stop if not isinstance(s, str)]
        rid = uuid.uuid4().hex
        try:
            reqs = [GenerateRequest(f"tinker-{rid}-{i}", [int(t) for t in prompt], EngineParams(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_new_tokens=params.max_tokens, stop=strings, stop_token_ids=ids,
                ignore_eos=params.ignore_eos,
                seed=None if params.seed is None else params.seed + i),
                return_logprob=True, lora=lora) for i in range(num_samples)]
        except ValueError as e:
            raise TinkerError(f"sampling_params: {e}") from None
        outs = base.sampler.generate(reqs)
        return [SampledSequence(list(o.output_ids), [float(x) for x in o.output_logprobs],
                                "stop" if o.finish_reason.get("type") == "stop" else "length")
                for o in outs]

    def compute_logprobs(self, base_model: str, adapter_dir: Path | None,
                         tokens: list[int]) -> list[float | None]:
        """``[None, log p(tokens[1] | tokens[:1]), ...]`` under ``base_model`` with the adapter
        in ``adapter_dir`` (None: the base model)."""
        from rl_core.engine.core import GenerateRequest
        from rl_core.engine.sampling import SamplingParams as EngineParams

        base = self._base(base_model)
        with base.sampler.using(adapter_dir) as lora:
            req = GenerateRequest(f"tinker-score-{uuid.uuid4().hex}", [int(t) for t in tokens],
                                  EngineParams(max_new_tokens=0), return_logprob=True,
                                  logprob_start_len=0, lora=lora)
            out = base.sampler.generate([req])[0]
        return list(out.input_logprobs or [None] * len(tokens))

    def loaded_adapters(self, base_model: str) -> list[str]:
        """The adapter directories ``base_model``'s engine holds, least recently used first."""
        return list(self._base(base_model).sampler.loras)

    def close(self) -> None:
        """Stop every engine (a later sample starts a new one)."""
        for base in self._bases.values():
            base.sampler.close()

    def __enter__(self) -> LoraBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _base(self, name: str) -> _Base:
        if name not in self._bases:
            raise TinkerError(f"unknown base model {name!r}; this server has "
                              f"{sorted(self._bases)}")
        return self._bases[name]

    def _adapter(self, model_id: str) -> _Adapter:
        if model_id not in self._adapters:
            raise TinkerError(f"unknown model id {model_id!r}")
        return self._adapters[model_id]

    def _threads(self) -> None:
        if self.num_threads > 0 and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _load(self, base: _Base) -> torch.nn.Module:
        """``base``'s model, loaded on first use (float32, frozen, eval mode: no dropout)."""
        if base.model is None:
            from transformers import AutoModelForCausalLM

            self._threads()
            model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
            model = model.to(self.device).eval().requires_grad_(False)
            out, inp = model.get_output_embeddings(), model.get_input_embeddings()
            base.tied = out is not None and out.weight is inp.weight
            base.linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                           if isinstance(m, torch.nn.Linear)}
            base.vocab = int(inp.num_embeddings)
            cfg = model.config.get_text_config()
            base.context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 62)
            base.model = model
        return base.model

    def _new_adapter(self, base: _Base, name: str, rank: int, targets: list[str],
                     seed: int) -> None:
        from peft import LoraConfig, PeftModel, get_peft_model

        cfg = LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                         target_modules=list(targets), task_type="CAUSAL_LM",
                         base_model_name_or_path=str(base.path))
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with self._rng, torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            torch.manual_seed(seed)
            if isinstance(base.model, PeftModel):
                base.model.add_adapter(name, cfg)
            else:
                base.model = get_peft_model(base.model, cfg, adapter_name=name)
        base.model.eval()

    @staticmethod
    def _saved_name(param_name: str, adapter: str) -> str:
        return param_name.replace(f".{adapter}.weight", ".weight")

    def _activate(self, ad: _Adapter) -> None:
        """Make ``ad`` the adapter the shared model runs (only its parameters take grads)."""
        ad.base.model.set_adapter(ad.name)

    def _prepare(self, index: int, datum: Datum, loss_fn: str, required: tuple[str, ...],
                 base: _Base) -> _Prepared:
        where = f"datum {index}"
        tokens = [int(t) for t in datum.tokens]
        if not tokens:
            raise TinkerError(f"{where}: empty model_input")
        if len(tokens) > base.context:
            raise TinkerError(f"{where}: {len(tokens)} tokens exceed {base.name}'s context "
                              f"length {base.context}")
        if bad := [t for t in tokens if not 0 <= t < base.vocab]:
            raise TinkerError(f"{where}: token id {bad[0]} is outside the vocabulary "
                              f"[0, {base.vocab})")
        if missing := [k for k in required if k not in datum.inputs]:
            raise TinkerError(f"{where}: loss_fn {loss_fn!r} needs loss_fn_inputs {missing} "
                              f"(it has {sorted(datum.inputs)})")
        targets = np.asarray(datum.inputs["target_tokens"])
        if targets.ndim not in (1, 2) or targets.shape[0] != len(tokens):
            raise TinkerError(f"{where}: target_tokens has shape {targets.shape}; expected "
                              f"[{len(tokens)}] or [{len(tokens)}, K] (one row per input token)")
        if not np.issubdtype(targets.dtype, np.integer):
            raise TinkerError(f"{where}: target_tokens must be integers, got {targets.dtype}")
        if targets.size and not (targets.min() >= 0 and targets.max() < base.vocab):
            raise TinkerError(f"{where}: target_tokens holds ids outside [0, {base.vocab})")
        inputs = {}
        for key in required[1:]:
            value = np.asarray(datum.inputs[key])
            if value.shape != targets.shape:
                raise TinkerError(f"{where}: {key} has shape {value.shape}, target_tokens "
                                  f"{targets.shape}; they must match")
            if not (np.issubdtype(value.dtype, np.floating)
                    or np.issubdtype(value.dtype, np.integer)):
                raise TinkerError(f"{where}: {key} must be numbers, got {value.dtype}")
            inputs[key] = torch.as_tensor(value.astype(np.float32), device=self.device)
        return _Prepared(tokens, torch.as_tensor(targets.astype(np.int64), device=self.device),
                         inputs)

    def _chunks(self, items: list[_Prepared]) -> list[list[int]]:
        """Consecutive datums whose padded batch fits ``max_batch_tokens`` (at least one)."""
        chunks: list[list[int]] = []
        longest = 0
        for i, item in enumerate(items):
            n = len(item.tokens)
            if chunks and (len(chunks[-1]) + 1) * max(longest, n) <= self.max_batch_tokens:
                chunks[-1].append(i)
                longest = max(longest, n)
            else:
                chunks.append([i])
                longest = n
        return chunks

    def _logprobs(self, model: torch.nn.Module, items: list[_Prepared]) -> list[torch.Tensor]:
        """One right-padded forward; each item's float32 log-probs of its targets."""
        width = max(len(it.tokens) for it in items)
        ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for row, it in enumerate(items):
            ids[row, : len(it.tokens)] = torch.tensor(it.tokens)
            mask[row, : len(it.tokens)] = 1
        logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                       use_cache=False).logits
        out = []
        for row, it in enumerate(items):
            n = len(it.tokens)
            logp = torch.log_softmax(logits[row, :n].float(), dim=-1)
            out.append(logp.gather(-1, it.targets.reshape(n, -1)).reshape(it.targets.shape))
        return out

    @staticmethod
    def _read_state(src: Path) -> dict[str, Any]:
        path = src / STATE_FILE
        if not path.is_file() or not (src / ADAPTER_WEIGHTS).is_file():
            raise TinkerError(f"{src}: not a save_state directory (expected {STATE_FILE} and "
                              f"{ADAPTER_WEIGHTS})")
        state = json.loads(path.read_text())
        if missing := [k for k in (*_CREATE_KEYS, "target_modules") if k not in state]:
            raise TinkerError(f"{path}: missing {missing}")
        return state

    def _engine_kwargs(self) -> dict[str, Any]:
        return {"dtype": "float32", "device": str(self.device), "background": False,
                "max_loras_per_batch": MAX_LORAS_PER_BATCH, **self.engine_kwargs}
