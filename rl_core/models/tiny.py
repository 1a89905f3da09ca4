"""The embedded demo model: a tokenizer and a ~2M-parameter Qwen2 LM built on this machine.

``bootstrap_tiny_model`` trains a byte-level BPE tokenizer (digits split one per token, so
arithmetic is learnable) on the synthetic task, builds a small Qwen2-architecture causal LM
with ``transformers``, warm-starts it with a short supervised pass until its greedy accuracy
on held-out problems reaches a target (so GRPO has something to improve), and saves it in
Hugging Face format: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``generation_config.json``. Anything that loads HF models loads it. Nothing is downloaded.

Deterministic for a seed on a given machine and thread count. Never imports Prefect or
MLflow.
"""

from __future__ import annotations

import json
import logging
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rl_core.data.prompts import encode_prompts
from rl_core.data.records import Record
from rl_core.data.synthetic import generate_splits
from rl_core.rewards import gsm8k_reward

__all__ = ["CHAT_TEMPLATE", "TinyModelSpec", "bootstrap_tiny_model"]

log = logging.getLogger(__name__)

PAD, BOS_CHAT, EOS_CHAT = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen's ChatML shape, so the prompt path is the one real chat models take.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TinyModelSpec:
    """Everything that determines the built model; its digest names the cache entry."""

    hidden_size: int = 192
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 384
    max_position_embeddings: int = 512
    # The synthetic task the warm start learns: the same knobs, seed and sizes as the run's
    # data, so the warm start sees only the run's training split and never its eval split.
    digits: tuple[int, int] = (1, 1)
    operations: tuple[str, ...] = ("+", "-")
    steps: tuple[int, int] = (1, 2)
    data_seed: int = 0
    train_size: int = 3000
    test_size: int = 300
    # Warm start: stop once greedy accuracy on the validation tail of the training split
    # reaches target_accuracy (checked every eval_every steps).
    sft_max_steps: int = 600
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    target_accuracy: float = 0.3
    eval_every: int = 10
    val_examples: int = 200
    seed: int = 0

    def digest(self) -> str:
        import hashlib

        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def build_tokenizer(corpus: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer whose digits are always single tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS_CHAT, EOS_CHAT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_CHAT, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=512)


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized by ``spec``."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32")
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config)


def _sft_batch(
    tokenizer: PreTrainedTokenizerFast, examples: Sequence[Record]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prompts = encode_prompts(tokenizer, [r.question for r in examples])
    seqs, labels = [], []
    for prompt, rec in zip(prompts, examples, strict=True):
        target = tokenizer.encode(rec.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    shape = (len(seqs), max(len(s) for s in seqs))
    ids = torch.full(shape, tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full(shape, -100, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    for i, (s, y) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(s)] = 1
    return ids, lab, mask


def greedy_accuracy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast,
                    records: Sequence[Record], max_new_tokens: int = 48) -> float:
    """Fraction of ``records`` the model answers right with greedy decoding."""
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    prompts = encode_prompts(tokenizer, [r.question for r in records])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    with tempfile.TemporaryDirectory() as d:  # the rollout engine itself, on these weights
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        with EmbeddedEngine(d, max_running_requests=len(prompts) or 1) as engine:
            outs = engine.generate_sync(
                [GenerateRequest(str(i), p, greedy) for i, p in enumerate(prompts)])
    texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    right = sum(gsm8k_reward(t, r.answer) for t, r in zip(texts, records, strict=True))
    return right / max(len(records), 1)


def warm_start(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, train: Sequence[Record],
    val: Sequence[Record], spec: TinyModelSpec,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> tuple[int, float]:
    """Supervised pass until greedy accuracy on ``val`` reaches ``spec.target_accuracy``;
    returns (steps taken, final held-out greedy accuracy). Stopping on a target, not a step
    count, lands the demo's starting accuracy in a known band on any machine."""
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # warmup
    order = list(range(len(train)))
    acc = 0.0
    model.train()
    for step in range(1, spec.sft_max_steps + 1):
        if len(order) < spec.sft_batch_size:
            order = list(range(len(train)))
        rng.shuffle(order)
        batch = [train[order.pop()] for _ in range(spec.sft_batch_size)]
        ids, labels, mask = _sft_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        checked = None
        if step % spec.eval_every == 0:
            acc = checked = greedy_accuracy(model, tokenizer, val)
        if progress is not None:
            progress(step, loss.item(), checked)
        if checked is not None and acc >= spec.target_accuracy:
            return step, acc
    return spec.sft_max_steps, acc


def _split_validation(records: Sequence[Record], n_val: int) -> tuple[list[Record], list[Record]]:
    """Hold out ``n_val`` problems whose question occurs nowhere else in ``records`` (one that
    is also a training example would measure memorisation and stop the warm start early)."""
    counts = Counter(r.question for r in records)
    val = [r for r in records if counts[r.question] == 1][-n_val:]
    held = {r.id for r in val}
    return [r for r in records if r.id not in held], val


def bootstrap_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, *, force: bool = False,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> Path:
    """Build (or reuse) the tiny demo model in ``out_dir``; returns the HF directory."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / "grpoflow_tiny.json"
    if (not force and marker.is_file()
            and json.loads(marker.read_text()).get("digest") == spec.digest()):
        return out
    started = time.perf_counter()
    knobs = dict(digits=spec.digits, operations=spec.operations, steps=spec.steps)
    train, _ = generate_splits(spec.train_size, spec.test_size, seed=spec.data_seed, **knobs)
    if len(train) <= 2 * spec.val_examples:
        raise ValueError(
            f"the tiny model's warm start needs more than {2 * spec.val_examples} training "
            f"problems, got {len(train)}; raise data.synthetic_train_size")
    train, val = _split_validation(train, spec.val_examples)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train[:2000]]
    tokenizer = build_tokenizer(corpus, spec.vocab_size)
    model = build_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built tiny Qwen2 model: %.2fM parameters", n_params / 1e6)
    steps, acc = warm_start(model, tokenizer, train, val, spec, progress)

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True, temperature=1.0, top_p=1.0,
                     max_new_tokens=64).save_pretrained(out)
    info = {"digest": spec.digest(), "spec": asdict(spec), "parameters": n_params,
            "sft_steps": steps, "val_greedy_accuracy": acc,
            "seconds": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(info, indent=2))
    if not math.isfinite(acc):
        raise RuntimeError("tiny model warm start diverged (non-finite accuracy)")
    return out
