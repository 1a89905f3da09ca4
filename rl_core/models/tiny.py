"""The embedded demo model: a tokenizer and a ~2M-parameter Qwen2 LM built on this machine.

``bootstrap_tiny_model`` trains a byte-level BPE tokenizer (digits split one per token, so
arithmetic is learnable) on the synthetic task, builds a small Qwen2-architecture causal LM
with ``transformers`` (:func:`build_bare`: ``embedded:tiny-init``), warm-starts it with the
SFT flow's trainer (:class:`~rl_core.training.sft.SFTTrainer`, the rows tokenized as
``grpoflow sft`` tokenizes prompt/completion rows) until its greedy accuracy on held-out
problems reaches a target (so GRPO has something to improve), and saves it in Hugging Face
format: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
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
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rl_core.data.prompts import encode_prompts
from rl_core.data.records import Record
from rl_core.data.synthetic import generate_splits
from rl_core.rewards import gsm8k_reward

if TYPE_CHECKING:
    from rl_core.sft import TokenizedExample
    from rl_core.training.sft import SFTTrainer

__all__ = ["CHAT_TEMPLATE", "TOOL_SYSTEM_PROMPT", "TinyModelSpec", "bootstrap_tiny_model"]

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


def _question_expression(question: str) -> str:
    return question.removeprefix("What is ").removesuffix("?")


def _tool_episode(tokenizer: PreTrainedTokenizerFast, rec: Record) -> tuple[list[int], list[int]]:
    """A calculator episode as the episode runner lays it out: (ids, labels); the labels are
    the model's turns only, never the tool's output or the template's text."""
    from rl_core.agents.chat import ChatTokens

    chat = ChatTokens(tokenizer)
    eos = tokenizer.eos_token_id
    prompt = chat.prompt_ids([{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                              {"role": "user", "content": rec.question}])
    call = chat.encode(tool_call_text(_question_expression(rec.question))) + [eos]
    obs = chat.observation_ids([{"role": "tool", "content": rec.final_answer}], call)
    answer = chat.encode(f"#### {rec.final_answer}") + [eos]
    ids = prompt + call + obs + answer
    return ids, [-100] * len(prompt) + call + [-100] * len(obs) + answer


def _warm_start_example(tokenizer: PreTrainedTokenizerFast, rec: Record, tool: bool,
                       system_prompt: str | None) -> TokenizedExample:
    """One demonstration as the SFT flow tokenizes a prompt/completion row (the prompt rendered
    as ``grpo_train`` renders it, the loss on the answer and its EOS), or a calculator episode."""
    from rl_core.sft import Example, SFTDataConfig, TokenizedExample, tokenize_example

    if tool:
        ids, labels = _tool_episode(tokenizer, rec)
        prompt_len = next(i for i, y in enumerate(labels) if y != -100)
        return TokenizedExample(rec.id, ids, labels, prompt_len, rec.answer)
    row = Example(rec.id, "synthetic", prompt=rec.question, completion=rec.answer)
    return tokenize_example(tokenizer, row, SFTDataConfig(system_prompt=system_prompt,
                                                          max_seq_len=10_000))


def greedy_accuracy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast,
                    records: Sequence[Record], max_new_tokens: int = 48,
                    tools: bool = False) -> float:
    """Fraction of ``records`` the model answers right with greedy decoding (``tools``: in
    calculator episodes, as ``agent.env: tools`` runs them)."""
    from rl_core.engine.core import EmbeddedEngine, GenerateRequest
    from rl_core.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    with tempfile.TemporaryDirectory() as d:  # the rollout engine itself, on these weights
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        if tools:
            texts = _tool_episode_answers(d, records, greedy)
        else:
            prompts = encode_prompts(tokenizer, [r.question for r in records])
            with EmbeddedEngine(d, max_running_requests=len(prompts) or 1) as engine:
                outs = engine.generate_sync(
                    [GenerateRequest(str(i), p, greedy) for i, p in enumerate(prompts)])
            texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    right = sum(gsm8k_reward(t, r.answer) for t, r in zip(texts, records, strict=True))
    return right / max(len(records), 1)


def _tool_episode_answers(model_dir: str, records: Sequence[Record], params: object) -> list[str]:
    from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, ToolEnv
    from rl_core.agents.tools import CALCULATOR
    from rl_core.rollout.inprocess import InProcessPlane

    plane = InProcessPlane(model_dir, max_running_requests=max(len(records), 1))
    try:
        runner = EpisodeRunner(
            plane, ChatTokens(plane.engine.tokenizer),
            lambda: ToolEnv({"calculator": CALCULATOR}, TOOL_SYSTEM_PROMPT),
            EpisodeLimits(max_turns=3, max_tokens=160), retries=0)
        samples = runner.run(records, n=1, params=params, step=0, seed=0)  # type: ignore[arg-type]
    finally:
        plane.close()
    return [s.text for s in samples]


def warm_start(
    model_dir: str | Path, tokenizer: PreTrainedTokenizerFast, train: Sequence[Record],
    val: Sequence[Record], spec: TinyModelSpec,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> tuple[SFTTrainer, int, float]:
    """Supervised fine-tuning of the bare model in ``model_dir`` with the SFT flow's trainer
    (:class:`~rl_core.training.sft.SFTTrainer`: token-mean loss on the answers, AdamW with
    warmup) until greedy accuracy on ``val`` reaches ``spec.target_accuracy``; returns (the
    trainer, steps taken, final held-out greedy accuracy). Stopping on a target, not a step
    count, lands the demo's starting accuracy in a known band on any machine."""
    from rl_core.sft import SFTTrainConfig
    from rl_core.training.sft import SFTTrainer, greedy_eval

    sft = SFTTrainConfig(steps=spec.sft_max_steps, batch_size=spec.sft_batch_size,
                         micro_batch_size=spec.sft_batch_size, lr=spec.sft_lr, warmup_steps=10,
                         lr_schedule="constant", weight_decay=0.0, grad_clip=1.0, seed=spec.seed)
    trainer = SFTTrainer(model_dir, sft, pad_id=tokenizer.pad_token_id, pack_length=10_000)
    system = TOOL_SYSTEM_PROMPT if spec.tool_demos else None
    held = [_warm_start_example(tokenizer, r, False, system) for r in val]
    rng = random.Random(spec.seed)
    order = list(range(len(train)))
    acc = 0.0
    for step in range(1, spec.sft_max_steps + 1):
        if len(order) < spec.sft_batch_size:
            order = list(range(len(train)))
        rng.shuffle(order)
        batch = [train[order.pop()] for _ in range(spec.sft_batch_size)]
        tools = [rng.random() < spec.tool_demos if spec.tool_demos else False for _ in batch]
        loss = trainer.sft_step([_warm_start_example(tokenizer, r, t, system)
                                 for r, t in zip(batch, tools, strict=True)], step)["loss"]
        checked = None
        # With tool demos the greedy policy answers directly (most demonstrations do) and
        # rarely succeeds, so there is no start level to stop at: train sft_max_steps, so the
        # tool path is learned, and measure once (GRPO then learns when to take it).
        if spec.tool_demos and step == spec.sft_max_steps:
            acc = checked = greedy_accuracy(trainer.model, tokenizer, val, tools=True)
        elif not spec.tool_demos and step % spec.eval_every == 0:
            acc = checked = greedy_eval(trainer, tokenizer, held, 48).get("pass_at_1", 0.0)
        if progress is not None:
            progress(step, loss, checked)
        if checked is not None and acc >= spec.target_accuracy:
            return trainer, step, acc
    return trainer, spec.sft_max_steps, acc


def _split_validation(records: Sequence[Record], n_val: int) -> tuple[list[Record], list[Record]]:
    """Hold out ``n_val`` problems whose question occurs nowhere else in ``records`` (one that
    is also a training example would measure memorisation and stop the warm start early)."""
    counts = Counter(r.question for r in records)
    val = [r for r in records if counts[r.question] == 1][-n_val:]
    held = {r.id for r in val}
    return [r for r in records if r.id not in held], val


def _splits(spec: TinyModelSpec) -> tuple[list[Record], list[Record]]:
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
    train, _ = _splits(spec)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train[:2000]]
    if spec.tool_demos:  # the call's boilerplate becomes a few tokens, as in real vocabularies
        corpus += [f"{TOOL_SYSTEM_PROMPT}\n{tool_call_text(_question_expression(r.question))}"
                   f"\ntool\n#### {r.final_answer}" for r in train[:2000]]
    tokenizer = build_tokenizer(corpus, spec.vocab_size)
    model = build_model(spec, tokenizer)
    log.info("built tiny %s model: %.2fM parameters", model.config.model_type,
             sum(p.numel() for p in model.parameters()) / 1e6)
    model.save_pretrained(out_dir, safe_serialization=True)
    if spec.arch != "dense":  # the warm start's loader runs the experts the fast way on CPU
        from rl_core.models.moe import pin_eager_experts

        pin_eager_experts(out_dir)
    _save_tokenizer(tokenizer, out_dir)
    return tokenizer


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True, temperature=1.0, top_p=1.0,
                     max_new_tokens=64).save_pretrained(out_dir)


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
    train, val = _splits(spec)
    with tempfile.TemporaryDirectory(prefix="grpoflow-tiny-init-") as bare:
        tokenizer = build_bare(spec, bare)
        trainer, steps, acc = warm_start(bare, tokenizer, train, val, spec, progress)
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    info = {"digest": spec.digest(), "spec": asdict(spec), "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "sft_steps": steps, "val_greedy_accuracy": acc,
            "seconds": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(info, indent=2))
    if not math.isfinite(acc):
        raise RuntimeError("tiny model warm start diverged (non-finite accuracy)")
    return out
