"""SFT on the one training step: demonstrations as a batch, ``algorithm.loss=nll``.

:class:`SFTTrainer` is the GRPO ``TorchTrainer`` (loading, LoRA, AdamW and its schedule,
state, the merged export, micro-batching, packing) whose step takes demonstrations as a
:class:`~rl_core.types.Batch` with advantage 1 and the mean negative log-likelihood of the
labelled tokens as loss. Around it: held-out loss, greedy accuracy, checkpoints (resumes are
bit-identical on CPU) and the export ``grpo_train`` takes as ``model.path`` (a vision-language
model's with its image processor). The flow holds only a small :class:`SFTHandle`
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

from rl_core.checkpoint import CheckpointState, restore_training, save_training
from rl_core.config import AlgorithmConfig, ConfigError, config_digest, resolve_device
from rl_core.data.sampler import PromptSampler
from rl_core.models.vlm import copy_processor, is_vision_checkpoint, vision_processor
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
from rl_core.types import Batch, Sample

__all__ = ["SFTHandle", "SFTSession", "SFTTrainer", "close_session", "demonstration_sample",
           "demonstrations_batch", "get_session", "start_session"]

log = logging.getLogger(__name__)
IGNORE = -100


# ------------------------------------------------------------------------------- trainer


def demonstration_sample(e: TokenizedExample) -> Sample:
    """A demonstration as the sample a rollout would have produced: the tokens before the
    first labelled one are the prompt, the labels the loss mask (tool output, a user turn:
    0, as in an agent's episode), no rollout log-probs."""
    first = next((i for i, y in enumerate(e.labels) if y != IGNORE and i > 0), len(e.ids))
    rest = e.labels[first:]
    return Sample(e.ids[:first], e.ids[first:], [0.0] * len(rest),
                  loss_mask=[int(y != IGNORE) for y in rest], uid=e.id, record_id=e.id,
                  answer=e.reference, images=e.images)


def demonstrations_batch(examples: Sequence[TokenizedExample], pad_id: int) -> Batch:
    """Demonstrations as the one training step's batch: GRPO's layout of their samples, each
    with advantage 1 (docs/sft.md)."""
    return Batch.from_samples([demonstration_sample(e) for e in examples],
                              [1.0] * len(examples), pad_id)


class SFTTrainer(TorchTrainer):
    """The torch trainer with ``algorithm.loss=nll`` on demonstrations (module docstring)."""

    def __init__(self, model_path: str | Path, train: SFTTrainConfig, *, pad_id: int,
                 pack_length: int, dtype: str = "float32", trust_remote_code: bool = False,
                 device: str = "cpu", freeze_vision: bool = True) -> None:
        super().__init__(model_path, train.torch_config(), AlgorithmConfig(loss="nll"),
                         dtype=dtype, trust_remote_code=trust_remote_code, device=device,
                         pack_length=pack_length if train.packing else None,
                         freeze_vision=freeze_vision)
        self.sft, self.pad_id = train, pad_id

    def sft_step(self, examples: Sequence[TokenizedExample], step: int) -> dict[str, float]:
        """One optimizer step on ``examples``: the token-mean loss, exactly accumulated over
        micro-batches of ``train.micro_batch_size`` examples (packed with ``train.packing``)."""
        started = time.perf_counter()
        batch = demonstrations_batch(examples, self.pad_id)
        self.forward_slots = 0
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.sft.seed * 1_000_003 + step)  # dropout: f(seed, step) only
            m = self.train_step(batch)
        seconds = time.perf_counter() - started
        real = sum(len(e.ids) for e in examples)
        return {"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": m["lr"],
                "tokens": float(batch.response_mask.sum()), "examples": float(len(examples)),
                "pad_fraction": 1.0 - real / max(self.forward_slots, 1),
                "tokens_per_s": real / max(seconds, 1e-9), "time/train": seconds}

    @torch.no_grad()
    def eval_loss(self, examples: Sequence[TokenizedExample], batch_size: int) -> float:
        """Mean next-token loss (nats) over the labelled tokens of ``examples``."""
        total, tokens = 0.0, 0.0
        for i in range(0, len(examples), batch_size):
            batch = demonstrations_batch(examples[i : i + batch_size], self.pad_id)
            total -= float(self.compute_logprobs(batch).sum())
            tokens += float(batch.response_mask.sum())
        return total / max(tokens, 1.0)


def greedy_eval(trainer: SFTTrainer, tokenizer: Any, examples: Sequence[TokenizedExample],
                max_new_tokens: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Greedy answers of the current weights, by the rollout engine itself on an export of
    them (what ``grpo_train`` and the ``evaluate`` flow would measure), scored by
    ``gsm8k_reward`` against each reference's final number."""
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    context = int(trainer.model.config.get_text_config().max_position_embeddings)
    todo = [e for e in examples if e.scorable and e.prompt_len + max_new_tokens <= context]
    if not todo:
        return {}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpoflow-sft-eval-") as d:
        trainer.save_pretrained(d)
        tokenizer.save_pretrained(d)
        copy_processor(trainer.model_path, d)  # a vision-language model's image processor
        dtype = str(trainer.model.dtype).removeprefix("torch.")
        with EmbeddedEngine(d, max_running_requests=len(todo), device=str(trainer.device),
                            dtype=dtype) as engine:
            outs = engine.generate_sync([GenerateRequest(
                str(i), e.ids[: e.prompt_len], greedy,
                images=engine.images.processor.process(e.images) if e.images else None)
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
        sampler's position, RNG states): GRPO's (:func:`rl_core.checkpoint.save_training`)."""
        state = CheckpointState(step=step, weight_version=step,
                                sampler=self.sampler.state_dict(),
                                config_digest=config_digest(self.config),  # type: ignore[arg-type]
                                train_digest=train_digest, tracking_run_id=run_id)
        c = self.config
        return str(save_training(root, self.trainer, self.tokenizer, state,
                                 keep_last=c.checkpoint.keep_last, cache_dir=c.storage.cache_dir))

    def restore(self, path: str, train_digest: str) -> int:
        """Load a verified checkpoint; the step it was written at."""
        state, _ = restore_training(
            path, self.trainer, config_digest=config_digest(self.config),  # type: ignore[arg-type]
            train_digest=train_digest, cache_dir=self.config.storage.cache_dir,
            after_load=lambda s: self.sampler.load_state_dict(s.sampler))
        return state.step

    def export(self, out_dir: str) -> str:
        """The model in Hugging Face format with its tokenizer and, for a vision-language
        model, its image processor (LoRA: merged, the adapter in ``adapter/``): what
        ``grpo_train`` takes as ``model.path``."""
        path = self.trainer.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(path)
        copy_processor(self.trainer.model_path, path)
        return str(path)


_SESSIONS: dict[str, SFTSession] = {}


def _tokenize_all(tokenizer: Any, examples: Sequence[Example], d: SFTDataConfig,  # noqa: ANN401
                  what: str, vision: Any = None) -> tuple[list[TokenizedExample], int]:  # noqa: ANN401
    """Every example tokenized (``vision``: the model's image processor, for examples with
    images); those with nothing to train on within data.max_seq_len are dropped and counted
    (all of them dropped: an error naming the first few)."""
    out, dropped = [], []
    for ex in examples:
        try:
            out.append(tokenize_example(tokenizer, ex, d, vision))
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


def start_session(cfg: SFTConfig, model_path: str | Path, train: Sequence[Example],
                  evals: Sequence[Example]) -> SFTHandle:
    """Load the model and tokenizer from ``model_path``, tokenize both sets (a text model
    with examples that carry images is refused first), place the sampler."""
    from transformers import AutoTokenizer

    from rl_core.sft_images import check_vision_model

    pictured = sum(1 for e in (*train, *evals) if e.images)
    check_vision_model(model_path, cfg.data.image_field if pictured else None, pictured)
    vision = vision_processor(model_path, cfg.model.trust_remote_code) \
        if pictured and is_vision_checkpoint(model_path) else None
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id  # padding carries no loss and is attended by nothing
    if pad_id is None:
        raise ConfigError(f"{model_path}: the tokenizer has neither pad_token nor eos_token; set "
                          "them in tokenizer_config.json")
    train_tok, dropped = _tokenize_all(tokenizer, train, cfg.data, "training", vision)
    eval_tok, dropped_eval = _tokenize_all(tokenizer, evals, cfg.data, "held-out", vision)
    trainer = SFTTrainer(model_path, cfg.train, pad_id=pad_id, pack_length=cfg.pack_length,
                         dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                         device=resolve_device(cfg.train.device, "train.device"),
                         freeze_vision=cfg.model.freeze_vision)
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
