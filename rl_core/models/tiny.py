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

    def digest(self) -> str:
        import hashlib

        spec = asdict(self)
        if not self.tool_demos:  # models built before tool demos existed keep their digest
            spec.pop("tool_demos")
        if not self.long_frac:  # likewise before the long-tailed task
            spec.pop("long_frac")
            spec.pop("long_steps")
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


def _sft_batch(
    tokenizer: PreTrainedTokenizerFast, examples: Sequence[Record], tools: Sequence[bool] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tools = list(tools) or [False] * len(examples)
    system = TOOL_SYSTEM_PROMPT if any(tools) else None
    prompts = encode_prompts(tokenizer, [r.question for r in examples], system_prompt=system)
    seqs, labels = [], []
    for prompt, rec, tool in zip(prompts, examples, tools, strict=True):
        if tool:
            ids, lab = _tool_episode(tokenizer, rec)
            seqs.append(ids)
            labels.append(lab)
            continue
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
        tools = [rng.random() < spec.tool_demos for _ in batch] if spec.tool_demos else []
        ids, labels, mask = _sft_batch(tokenizer, batch, tools)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        checked = None
        # With tool demos the greedy policy answers directly (most demonstrations do) and
        # rarely succeeds, so there is no start level to stop at: train sft_max_steps, so the
        # tool path is learned, and measure once (GRPO then learns when to take it).
        if (step == spec.sft_max_steps if spec.tool_demos else step % spec.eval_every == 0):
            acc = checked = greedy_accuracy(model, tokenizer, val, tools=spec.tool_demos > 0)
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
    knobs = dict(digits=spec.digits, operations=spec.operations, steps=spec.steps,
                 long_frac=spec.long_frac, long_steps=spec.long_steps)
    train, _ = generate_splits(spec.train_size, spec.test_size, seed=spec.data_seed, **knobs)
    if len(train) <= 2 * spec.val_examples:
        raise ValueError(
            f"the tiny model's warm start needs more than {2 * spec.val_examples} training "
            f"problems, got {len(train)}; raise data.synthetic_train_size")
    train, val = _split_validation(train, spec.val_examples)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train[:2000]]
    if spec.tool_demos:  # the call's boilerplate becomes a few tokens, as in real vocabularies
        corpus += [f"{TOOL_SYSTEM_PROMPT}\n{tool_call_text(_question_expression(r.question))}"
                   f"\ntool\n#### {r.final_answer}" for r in train[:2000]]
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
