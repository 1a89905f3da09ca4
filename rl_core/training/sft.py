"""The SFT trainer: next-token cross-entropy on the labelled tokens, and what a run needs.

:class:`SFTTrainer` is the GRPO ``TorchTrainer`` (loading, LoRA, AdamW and its schedule,
state, the merged export) with the SFT step: the mean loss over the step's labelled tokens
(``-100``: none), exactly accumulated over micro-batches, optionally on packed rows. Around it:
held-out loss, greedy accuracy, checkpoints (resumes are bit-identical on CPU) and the export
``grpo_train`` takes as ``model.path``. The flow holds only a small :class:`SFTHandle`
(:func:`start_session`). docs/sft.md.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rl_core.checkpoint import (
    CheckpointError,
    CheckpointState,
    fetch_checkpoint,
    load_checkpoint_state,
    restore_rng,
    write_checkpoint,
)
from rl_core.config import AlgorithmConfig, ConfigError, config_digest
from rl_core.data.sampler import PromptSampler
from rl_core.rewards import gsm8k_reward
from rl_core.sft import (
    Example,
    SFTConfig,
    SFTDataConfig,
    SFTTrainConfig,
    TokenizedExample,
    tokenize_example,
)
from rl_core.training.torch_trainer import TorchTrainer

__all__ = ["Rows", "SFTHandle", "SFTSession", "SFTTrainer", "close_session",
           "get_session", "pack", "pad_rows", "start_session"]

log = logging.getLogger(__name__)
IGNORE = -100


# ------------------------------------------------------------------------------- batches


@dataclass
class Rows:
    """One micro-batch as model inputs; ``targets[b, t]`` is the token position t must
    predict (``-100``: none), so no target crosses from one packed example into the next."""

    input_ids: torch.Tensor  # (B, T) long
    targets: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, or (B, 1, T, T) additive float (packed)
    position_ids: torch.Tensor | None  # (B, T) long (packed), else None
    slots: int  # B * T: with the real tokens, how much padding there is

    @property
    def tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


def _targets(ex: TokenizedExample) -> list[int]:
    return [*ex.labels[1:], IGNORE]


def pad_rows(examples: Sequence[TokenizedExample], pad_id: int) -> Rows:
    """One example per row, right-padded to the longest."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n], targets[i, :n], mask[i, :n] = torch.tensor(e.ids), torch.tensor(_targets(e)), 1
    return Rows(ids, targets, mask, None, ids.numel())


def pack(examples: Sequence[TokenizedExample], length: int) -> list[list[TokenizedExample]]:
    """First-fit, in order: each example goes to the first row it fits in (deterministic)."""
    rows: list[list[TokenizedExample]] = []
    used: list[int] = []
    for e in examples:
        if len(e.ids) > length:
            raise ValueError(f"example {e.id} has {len(e.ids)} tokens, more than the packed "
                             f"row's {length} (train.pack_length)")
        i = next((i for i, u in enumerate(used) if u + len(e.ids) <= length), len(rows))
        if i == len(rows):
            rows.append([])
            used.append(0)
        rows[i].append(e)
        used[i] += len(e.ids)
    return rows


def packed_rows(rows: Sequence[Sequence[TokenizedExample]], pad_id: int,
                dtype: torch.dtype = torch.float32) -> Rows:
    """Packed rows as model inputs: positions restart per example, and a block-diagonal
    causal mask keeps each example to itself (padding attends to itself only)."""
    width = max(sum(len(e.ids) for e in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full_like(ids, IGNORE)
    pos = torch.zeros_like(ids)
    seg = torch.full_like(ids, -1)
    for r, row in enumerate(rows):
        at = 0
        for k, e in enumerate(row):
            n = len(e.ids)
            ids[r, at:at + n], targets[r, at:at + n] = torch.tensor(e.ids), torch.tensor(_targets(e))
            pos[r, at:at + n], seg[r, at:at + n] = torch.arange(n), k
            at += n
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # (T, T): key visible from query
    allowed = causal & (seg[:, None, :] == seg[:, :, None]) & (seg[:, None, :] >= 0)
    allowed |= torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return Rows(ids, targets, mask[:, None], pos, ids.numel())


# ------------------------------------------------------------------------------- trainer


class SFTTrainer(TorchTrainer):
    """The torch trainer with the SFT step (module docstring)."""

    def __init__(self, model_path: str | Path, train: SFTTrainConfig, *, pad_id: int,
                 pack_length: int, dtype: str = "float32", trust_remote_code: bool = False,
                 device: str = "cpu") -> None:
        super().__init__(model_path, train.torch_config(), AlgorithmConfig(), dtype=dtype,
                         trust_remote_code=trust_remote_code, device=device)
        self.sft, self.pad_id, self.pack_length = train, pad_id, pack_length

    def micro_batches(self, examples: Sequence[TokenizedExample], size: int,
                      packing: bool | None = None) -> list[Rows]:
        """``examples`` as micro-batches of ``size`` rows (packed rows with packing)."""
        if self.sft.packing if packing is None else packing:
            rows = pack(examples, self.pack_length)
            return [packed_rows(rows[i:i + size], self.pad_id, self.model.dtype)
                    for i in range(0, len(rows), size)]
        return [pad_rows(examples[i:i + size], self.pad_id) for i in range(0, len(examples), size)]

    def _token_loss_sum(self, rows: Rows) -> torch.Tensor:
        d = self.device
        out = self._train_module(
            input_ids=rows.input_ids.to(d), attention_mask=rows.attention_mask.to(d),
            position_ids=None if rows.position_ids is None else rows.position_ids.to(d))
        keep = rows.targets.to(d) != IGNORE
        return F.cross_entropy(out.logits[keep].float(), rows.targets.to(d)[keep],
                               reduction="sum")

    def sft_step(self, examples: Sequence[TokenizedExample], step: int) -> dict[str, float]:
        """One optimizer step on ``examples``: the token-mean loss, exactly accumulated."""
        started = time.perf_counter()
        micros = self.micro_batches(examples, self.sft.micro_batch_size)
        tokens = sum(r.tokens for r in micros)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.sft.seed * 1_000_003 + step)  # dropout: f(seed, step) only
            for rows in micros:
                loss = self._token_loss_sum(rows) / tokens
                loss.backward()
                total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trained(), self.sft.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        seconds = time.perf_counter() - started
        real = sum(len(e.ids) for e in examples)
        return {"loss": total, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "tokens": float(tokens), "examples": float(len(examples)),
                "pad_fraction": 1.0 - real / max(sum(r.slots for r in micros), 1),
                "tokens_per_s": real / max(seconds, 1e-9), "time/train": seconds}

    @torch.no_grad()
    def eval_loss(self, examples: Sequence[TokenizedExample], batch_size: int) -> float:
        """Mean next-token loss (nats) over the labelled tokens of ``examples``."""
        was = self.model.training
        self.model.eval()
        micros = self.micro_batches(examples, batch_size, packing=False)
        total = sum(float(self._token_loss_sum(r)) for r in micros)
        self.model.train(was)
        return total / max(sum(r.tokens for r in micros), 1)


def greedy_eval(trainer: SFTTrainer, tokenizer: Any, examples: Sequence[TokenizedExample],
                max_new_tokens: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Greedy answers of the current weights, by the rollout engine itself on an export of
    them (what ``grpo_train`` and the ``evaluate`` flow would measure), scored by
    ``gsm8k_reward`` against each reference's final number."""
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    context = int(trainer.model.config.max_position_embeddings)
    todo = [e for e in examples if e.scorable and e.prompt_len + max_new_tokens <= context]
    if not todo:
        return {}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpoflow-sft-eval-") as d:
        trainer.save_pretrained(d)
        tokenizer.save_pretrained(d)
        dtype = str(trainer.model.dtype).removeprefix("torch.")
        with EmbeddedEngine(d, max_running_requests=len(todo), device=str(trainer.device),
                            dtype=dtype) as engine:
            outs = engine.generate_sync([GenerateRequest(str(i), e.ids[: e.prompt_len], greedy)
                                         for i, e in enumerate(todo)], timeout=timeout_s)
    texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    right = [gsm8k_reward(t, e.reference) for t, e in zip(texts, todo, strict=True)]
    samples = [{"question": tokenizer.decode(e.ids[: e.prompt_len], skip_special_tokens=True),
                "completion": t, "answer": e.reference, "correct": str(bool(r))}
               for e, t, r in list(zip(todo, texts, right, strict=True))[:8]]
    return {"pass_at_1": sum(right) / len(todo), "accuracy_examples": len(todo),
            "response_len_mean": sum(len(o.output_ids) for o in outs) / len(outs),
            "truncation_rate": sum(o.finish_reason.get("type") == "length" for o in outs)
            / len(outs), "greedy_seconds": time.perf_counter() - started, "samples": samples}


# ------------------------------------------------------------------------------- session


@dataclass(frozen=True)
class SFTHandle:
    """A small, picklable reference to a run's :class:`SFTSession`."""

    key: str


@dataclass
class SFTSession:
    """The trainer, the tokenizer, the tokenized sets and the sampler of one SFT run."""

    config: SFTConfig
    trainer: SFTTrainer
    tokenizer: Any
    train: list[TokenizedExample]
    eval: list[TokenizedExample]
    sampler: PromptSampler
    skipped: dict[str, int] = field(default_factory=dict)

    def train_steps(self, first: int, last: int) -> list[dict[str, float]]:
        """Optimizer steps ``first..last``, each on the sampler's next batch."""
        return [self.trainer.sft_step([self.train[i] for i in self.sampler.next_batch()], step)
                for step in range(first, last + 1)]

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out loss on ``eval.num_examples``; greedy accuracy on ``eval.greedy_examples``."""
        e = self.config.eval
        started = time.perf_counter()
        held = self.eval[: e.num_examples]
        out: dict[str, Any] = {"step": step, "weight_version": step,
                               "loss": self.trainer.eval_loss(held, e.batch_size),
                               "num_examples": len(held), "pass_at_1": None}
        if e.greedy_examples:
            out.update(greedy_eval(self.trainer, self.tokenizer, held[: e.greedy_examples],
                                   e.max_new_tokens))
        out["seconds"] = time.perf_counter() - started
        return out

    def save(self, root: str, step: int, train_digest: str, run_id: str | None) -> str:
        """A complete checkpoint of ``step`` (model or adapter, optimizer, LR schedule, the
        sampler's position, RNG states), committed by its manifest (:mod:`rl_core.checkpoint`)."""
        def payload(tmp: Path) -> None:
            self.trainer.save_state(tmp)
            self.tokenizer.save_pretrained(tmp / "model")

        state = CheckpointState(step=step, weight_version=step,
                                sampler=self.sampler.state_dict(),
                                config_digest=config_digest(self.config),  # type: ignore[arg-type]
                                train_digest=train_digest, tracking_run_id=run_id)
        c = self.config
        return str(write_checkpoint(root, state, payload, keep_last=c.checkpoint.keep_last,
                                    cache_dir=c.storage.cache_dir))

    def restore(self, path: str, train_digest: str) -> int:
        """Load a verified checkpoint; the step it was written at."""
        local = fetch_checkpoint(path, self.config.storage.cache_dir)
        state, rng = load_checkpoint_state(local)
        if state.train_digest and state.train_digest != train_digest:
            raise CheckpointError(
                f"{path} was written for training data {state.train_digest[:12]}, but the data "
                f"prepared now is {train_digest[:12]}; resuming would skip or repeat examples. "
                "Restore the original data.source, or start a new run (--no-resume)")
        if state.config_digest != config_digest(self.config):  # type: ignore[arg-type]
            log.warning("resuming %s with a config that differs from the one that wrote it", path)
        self.trainer.load_state(local)
        self.sampler.load_state_dict(state.sampler)
        restore_rng(rng)
        return state.step

    def export(self, out_dir: str) -> str:
        """The model in Hugging Face format with its tokenizer (LoRA: merged, the adapter in
        ``adapter/``): what ``grpo_train`` takes as ``model.path``."""
        path = self.trainer.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(path)
        return str(path)


_SESSIONS: dict[str, SFTSession] = {}


def _tokenize_all(tokenizer: Any, examples: Sequence[Example], d: SFTDataConfig,
                  what: str) -> tuple[list[TokenizedExample], int]:
    """Every example tokenized; those with nothing to train on within data.max_seq_len are
    dropped and counted (all of them dropped: an error naming the first few)."""
    out, dropped = [], []
    for ex in examples:
        try:
            out.append(tokenize_example(tokenizer, ex, d))
        except ValueError as exc:
            if "nothing to train on" not in str(exc):
                raise  # the template or the tokenizer: every row would fail the same way
            dropped.append(str(exc))
    if not out:
        raise ValueError(f"no {what} example has anything to train on: " + "; ".join(dropped[:3]))
    if dropped:
        log.warning("%s: dropped %d of %d examples (%s)", what, len(dropped), len(examples),
                    dropped[0])
    return out, len(dropped)


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but torch sees no GPU here; use train.device=auto "
                          "or cpu")
    return name


def start_session(cfg: SFTConfig, model_path: str | Path, train: Sequence[Example],
                  evals: Sequence[Example]) -> SFTHandle:
    """Load the model and tokenizer from ``model_path``, tokenize both sets, place the sampler."""
    from transformers import AutoTokenizer

    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id  # padding carries no loss and is attended by nothing
    if pad_id is None:
        raise ConfigError(f"{model_path}: the tokenizer has neither pad_token nor eos_token; set "
                          "them in tokenizer_config.json")
    train_tok, dropped = _tokenize_all(tokenizer, train, cfg.data, "training")
    eval_tok, dropped_eval = _tokenize_all(tokenizer, evals, cfg.data, "held-out")
    trainer = SFTTrainer(model_path, cfg.train, pad_id=pad_id, pack_length=cfg.pack_length,
                         dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                         device=_device(cfg.train.device))
    sampler = PromptSampler(len(train_tok), cfg.train.batch_size, cfg.train.seed)
    key = uuid.uuid4().hex
    _SESSIONS[key] = SFTSession(cfg, trainer, tokenizer, train_tok, eval_tok, sampler,
                                {"train": dropped, "eval": dropped_eval})
    return SFTHandle(key)


def get_session(handle: SFTHandle) -> SFTSession:
    try:
        return _SESSIONS[handle.key]
    except KeyError:
        raise LookupError(f"SFT session {handle.key} is not up in this process (closed, or the "
                          "flow restarted); start it again") from None


def close_session(handle: SFTHandle) -> None:
    """Drop the session (the model and optimizer go with it)."""
    _SESSIONS.pop(handle.key, None)
