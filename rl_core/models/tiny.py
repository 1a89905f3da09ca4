"""The embedded demo model: a tokenizer and a ~2M-parameter Qwen2 LM built on this machine.

:func:`build_bare` trains a byte-level BPE tokenizer (digits split one per token, so
arithmetic is learnable) on the synthetic task and builds a small Qwen2-architecture causal LM
with ``transformers`` (``embedded:tiny-init``), saved in Hugging Face format. Its warm start
(SFT until a target greedy accuracy) is :mod:`rl_core.base_model`'s. Nothing is downloaded;
deterministic for a seed on a given machine and thread count.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rl_core.data.records import Record
from rl_core.data.synthetic import generate_splits

__all__ = ["CHAT_TEMPLATE", "TOOL_SYSTEM_PROMPT", "TinyModelSpec", "build_bare", "build_model",
           "build_tokenizer", "save_tokenizer", "task_splits", "tool_call_text"]

log = logging.getLogger(__name__)

PAD, BOS_CHAT, EOS_CHAT = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# The system message of the calculator demo (configs/agent-calculator.yaml's
# agent.system_prompt): short, because the tiny model's context is.
TOOL_SYSTEM_PROMPT = "You can call the calculator tool."

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
    # Share of warm-start examples that are calculator episodes (docs/agents.md): the model
    # learns the tool-call format from them. The warm start then runs sft_max_steps (no
    # accuracy target) and records the greedy success of calculator episodes. 0: none.
    tool_demos: float = 0.0
    # A long-tailed task (data.synthetic_long_frac): this share has long_steps steps.
    long_frac: float = 0.0
    long_steps: int = 12
    # "dense" (Qwen2), or a mixture-of-experts architecture of rl_core.models.moe (every layer
    # MoE: `experts` experts of width moe_intermediate_size, experts_per_token per token).
    arch: str = "dense"
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    # How the warm start trains (part of the digest: a model built another way is rebuilt):
    # "sft": the SFT flow's trainer (rl_core.training.sft.SFTTrainer).
    recipe: str = "sft"

    def digest(self) -> str:
        import hashlib

        spec = asdict(self)
        if not self.tool_demos:  # models built before tool demos existed keep their digest
            spec.pop("tool_demos")
        if not self.long_frac:  # likewise before the long-tailed task
            spec.pop("long_frac")
            spec.pop("long_steps")
        if self.arch == "dense":  # likewise before MoE models
            for key in ("arch", "experts", "experts_per_token", "moe_intermediate_size"):
                spec.pop(key)
        blob = json.dumps(spec, sort_keys=True).encode()
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


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A randomly initialised Qwen2 causal LM sized by ``spec``, or its mixture-of-experts
    variant (``spec.arch``: :func:`rl_core.models.moe.build_tiny_moe`)."""
    if spec.arch != "dense":
        from rl_core.models.moe import build_tiny_moe

        return build_tiny_moe(
            spec.arch, vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
            layers=spec.layers, heads=spec.heads, kv_heads=spec.kv_heads, experts=spec.experts,
            experts_per_token=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size,
            max_position_embeddings=spec.max_position_embeddings,
            bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            seed=spec.seed)
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


def tool_call_text(expression: str) -> str:
    """The calculator call a tool demonstration makes (Hermes format)."""
    return ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
            f'{expression}"}}}}</tool_call>')


def question_expression(question: str) -> str:
    return question.removeprefix("What is ").removesuffix("?")


def _split_validation(records: Sequence[Record], n_val: int) -> tuple[list[Record], list[Record]]:
    """Hold out ``n_val`` problems whose question occurs nowhere else in ``records`` (one that
    is also a training example would measure memorisation and stop the warm start early)."""
    counts = Counter(r.question for r in records)
    val = [r for r in records if counts[r.question] == 1][-n_val:]
    held = {r.id for r in val}
    return [r for r in records if r.id not in held], val


def task_splits(spec: TinyModelSpec) -> tuple[list[Record], list[Record]]:
    """The warm start's (training, validation) problems: the run's training split only."""
    knobs = dict(digits=spec.digits, operations=spec.operations, steps=spec.steps,
                 long_frac=spec.long_frac, long_steps=spec.long_steps)
    train, _ = generate_splits(spec.train_size, spec.test_size, seed=spec.data_seed, **knobs)
    if len(train) <= 2 * spec.val_examples:
        raise ValueError(
            f"the tiny model's warm start needs more than {2 * spec.val_examples} training "
            f"problems, got {len(train)}; raise data.synthetic_train_size")
    return _split_validation(train, spec.val_examples)


def build_bare(spec: TinyModelSpec, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """The demo model before its warm start, saved in HF format in ``out_dir``: the tokenizer
    trained on the task's text and a randomly initialised Qwen2 LM (``embedded:tiny-init``)."""
    train, _ = task_splits(spec)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train[:2000]]
    if spec.tool_demos:  # the call's boilerplate becomes a few tokens, as in real vocabularies
        corpus += [f"{TOOL_SYSTEM_PROMPT}\n{tool_call_text(question_expression(r.question))}"
                   f"\ntool\n#### {r.final_answer}" for r in train[:2000]]
    tokenizer = build_tokenizer(corpus, spec.vocab_size)
    model = build_model(spec, tokenizer)
    log.info("built tiny %s model: %.2fM parameters", model.config.model_type,
             sum(p.numel() for p in model.parameters()) / 1e6)
    model.save_pretrained(out_dir, safe_serialization=True)
    if spec.arch != "dense":  # the warm start's loader runs the experts the fast way on CPU
        from rl_core.models.moe import pin_eager_experts

        pin_eager_experts(out_dir)
    save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True, temperature=1.0, top_p=1.0,
                     max_new_tokens=64).save_pretrained(out_dir)
