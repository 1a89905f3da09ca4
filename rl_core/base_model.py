"""A run's base model as a verified local directory: the hub, S3 or a directory
(:mod:`rl_core.models.hub`), or the embedded demo model built and warm-started here.

The demo model (:mod:`rl_core.models.tiny`: tokenizer and bare Qwen2 LM) is warm-started with
the SFT trainer until its held-out greedy accuracy reaches ``model.tiny_target_accuracy`` (so
GRPO has something to improve), optionally on calculator episodes run by the agents' episode
runner. It sits above training, agents and the engine, which it drives (docs/models.md).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, ToolEnv
from rl_core.agents.tools import CALCULATOR
from rl_core.config import DataConfig, ModelConfig
from rl_core.data.prompts import encode_prompts, encode_record_prompts
from rl_core.data.records import Record
from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.sampling import SamplingParams
from rl_core.models.hub import (
    EMBEDDED_TINY,
    EMBEDDED_TINY_VLM,
    TINY_MARKER,
    TINY_VLM_MARKER,
    ModelSnapshot,
    download_model,
    tiny_dir,
    tiny_spec_for,
    tiny_vlm_dir,
    tiny_vlm_spec_for,
    verify_model_dir,
)
from rl_core.models.tiny import (
    TOOL_SYSTEM_PROMPT,
    TinyModelSpec,
    build_bare,
    question_expression,
    save_tokenizer,
    task_splits,
    tool_call_text,
)
from rl_core.models.tiny_vlm import TinyVLMSpec
from rl_core.rewards import gsm8k_reward
from rl_core.rewards.builtins import exact_match
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.sft import Example, SFTDataConfig, SFTTrainConfig, TokenizedExample, tokenize_example
from rl_core.training.sft import SFTTrainer, greedy_eval

__all__ = ["bootstrap_tiny_model", "build_bare_tiny", "build_tiny_vlm", "greedy_accuracy",
           "snapshot_model", "vlm_greedy_accuracy", "warm_start"]

log = logging.getLogger(__name__)


def snapshot_model(model: ModelConfig, data: DataConfig, cache_dir: str | Path, *,
                   revision: str | None = None, token: str | None = None) -> ModelSnapshot:
    """``model.path`` -> a verified local directory (building the embedded tiny model);
    ``revision`` defaults to ``model.revision``, else ``main``."""
    if model.path == EMBEDDED_TINY_VLM:
        return _snapshot_tiny_vlm(model, data, Path(cache_dir))
    if model.path != EMBEDDED_TINY:
        return download_model(model.path, cache_dir, token=token,
                              revision=revision if revision is not None else model.revision,
                              trust_remote_code=model.trust_remote_code)
    spec = tiny_spec_for(model, data)
    out = tiny_dir(Path(cache_dir), spec)
    cached = (out / TINY_MARKER).is_file()
    if not cached:
        log.info("building the embedded tiny model in %s (first run only)", out)

    def progress(step: int, loss: float, acc: float | None) -> None:
        if acc is not None:
            log.info("  warm start step %d: loss %.3f, validation greedy accuracy %.3f (stops "
                     "at %.2f)", step, loss, acc, spec.target_accuracy)

    bootstrap_tiny_model(out, spec, progress=progress)
    return ModelSnapshot(verify_model_dir(out), spec.digest(), "tiny", EMBEDDED_TINY, None, cached)


def build_bare_tiny(model: ModelConfig, data: SFTDataConfig, cache_dir: str | Path) -> Path:
    """The demo's tiny model before its warm start (``model.path: embedded:tiny-init``): a
    byte-level BPE tokenizer with the chat template and a randomly initialised Qwen2 LM, sized
    by ``model.tiny_*`` (:func:`rl_core.models.tiny.build_bare`); built once into
    ``<cache_dir>/models/tiny-init-<digest>``."""
    spec = tiny_spec_for(model, data.grpo_data())
    out = Path(cache_dir) / "models" / f"tiny-init-{spec.digest()}"
    if (out / "grpoflow_tiny_init.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    build_bare(spec, tmp)
    (tmp / "grpoflow_tiny_init.json").write_text(json.dumps({"digest": spec.digest()}))
    try:
        tmp.rename(out)
    except OSError:  # another process built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tool_episode(tokenizer: PreTrainedTokenizerFast, rec: Record) -> tuple[list[int], list[int]]:
    """A calculator episode as the episode runner lays it out: (ids, labels); the labels are
    the model's turns only, never the tool's output or the template's text."""
    chat = ChatTokens(tokenizer)
    eos = tokenizer.eos_token_id
    prompt = chat.prompt_ids([{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                              {"role": "user", "content": rec.question}])
    call = chat.encode(tool_call_text(question_expression(rec.question))) + [eos]
    obs = chat.observation_ids([{"role": "tool", "content": rec.final_answer}], call)
    answer = chat.encode(f"#### {rec.final_answer}") + [eos]
    ids = prompt + call + obs + answer
    return ids, [-100] * len(prompt) + call + [-100] * len(obs) + answer


def _warm_start_example(tokenizer: PreTrainedTokenizerFast, rec: Record, tool: bool,
                       system_prompt: str | None) -> TokenizedExample:
    """One demonstration as the SFT flow tokenizes a prompt/completion row (the prompt rendered
    as ``grpo_train`` renders it, the loss on the answer and its EOS), or a calculator episode."""
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


def bootstrap_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, *, force: bool = False,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> Path:
    """Build (or reuse) the tiny demo model in ``out_dir``; returns the HF directory."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / TINY_MARKER
    if (not force and marker.is_file()
            and json.loads(marker.read_text()).get("digest") == spec.digest()):
        return out
    started = time.perf_counter()
    train, val = task_splits(spec)
    with tempfile.TemporaryDirectory(prefix="grpoflow-tiny-init-") as bare:
        tokenizer = build_bare(spec, bare)
        trainer, steps, acc = warm_start(bare, tokenizer, train, val, spec, progress)
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    info = {"digest": spec.digest(), "spec": asdict(spec), "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "sft_steps": steps, "val_greedy_accuracy": acc,
            "seconds": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(info, indent=2))
    if not math.isfinite(acc):
        raise RuntimeError("tiny model warm start diverged (non-finite accuracy)")
    return out


# ---------------------------------------------------------------- the vision-language demo


def _snapshot_tiny_vlm(model: ModelConfig, data: DataConfig, cache: Path) -> ModelSnapshot:
    """``embedded:tiny-vlm``: the tiny VLM, built and warm-started once per spec."""
    spec = tiny_vlm_spec_for(model, data)
    out = tiny_vlm_dir(cache, spec)
    cached = (out / TINY_VLM_MARKER).is_file()
    if not cached:
        log.info("building the embedded tiny VLM in %s (first run only)", out)

        def progress(step: int, loss: float, acc: float | None) -> None:
            if acc is not None:
                log.info("  VLM warm start step %d: loss %.3f, validation greedy accuracy %.3f "
                         "(stops at %.2f)", step, loss, acc, spec.target_accuracy)

        build_tiny_vlm(out, spec, progress=progress)
    return ModelSnapshot(verify_model_dir(out), spec.digest(), "tiny", EMBEDDED_TINY_VLM, None,
                         cached)


def _vlm_example(tokenizer: Any, vision: Any, rec: Record) -> TokenizedExample:  # noqa: ANN401
    """A shapes record as a demonstration: its prompt rendered (image placed and expanded) as
    the run renders it, the loss on the answer and its EOS."""
    [prompt] = encode_record_prompts(tokenizer, [rec], vision)
    answer = tokenizer(str(rec.answer), add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    return TokenizedExample(rec.id, prompt + answer, [-100] * len(prompt) + answer, len(prompt),
                            str(rec.answer), rec.images)


def vlm_greedy_accuracy(model: torch.nn.Module, model_dir: str | Path,
                        examples: Sequence[TokenizedExample], max_new_tokens: int = 8) -> float:
    """Exact-match greedy accuracy of ``model`` (in memory; its tokenizer and processor in
    ``model_dir``) on ``examples``, answered by the embedded engine."""
    trained = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0)
    try:
        with EmbeddedEngine(model_dir, model=model, max_running_requests=len(examples) or 1,
                            kv_layout="padded") as engine:
            reqs = [GenerateRequest(str(i), e.ids[: e.prompt_len], greedy,
                                    images=engine.images.processor.process(e.images))
                    for i, e in enumerate(examples)]
            outs = engine.generate_sync(reqs)
            tok = engine.tokenizer
            right = [exact_match(tok.decode(o.output_ids, skip_special_tokens=True), e.reference)
                     for o, e in zip(outs, examples, strict=True)]
    finally:  # the engine froze the shared model for inference
        for p in trained:
            p.requires_grad_(True)
        model.train(was_training)
    return sum(right) / max(len(examples), 1)


def build_tiny_vlm(out_dir: str | Path, spec: TinyVLMSpec,
                   progress: Callable[[int, float, float | None], None] | None = None) -> Path:
    """The tiny VLM (:func:`rl_core.models.tiny_vlm.build_bare_vlm`) warm-started by the SFT
    trainer on the shapes task's training split until greedy accuracy on its last
    ``val_examples`` reaches ``spec.target_accuracy``; saved in ``out_dir`` with its
    tokenizer and image processor (built in a temporary directory, then renamed)."""
    from transformers import AutoTokenizer

    from rl_core.data.shapes import shape_splits
    from rl_core.models.tiny_vlm import build_bare_vlm
    from rl_core.models.vlm import vision_processor

    out, started = Path(out_dir), time.perf_counter()
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    records, _ = shape_splits(spec.train_size, spec.test_size, spec.data_seed,
                              size=spec.image_size)
    train, val = records[: -spec.val_examples], records[-spec.val_examples :]
    build_bare_vlm(spec, tmp)
    tokenizer, vision = AutoTokenizer.from_pretrained(tmp), vision_processor(tmp)
    sft = SFTTrainConfig(steps=spec.sft_max_steps, batch_size=spec.sft_batch_size,
                         micro_batch_size=spec.sft_batch_size, lr=spec.sft_lr, warmup_steps=10,
                         lr_schedule="constant", weight_decay=0.0, grad_clip=1.0, seed=spec.seed)
    # the bare tower is random: the warm start trains it with the language model
    trainer = SFTTrainer(tmp, sft, pad_id=tokenizer.pad_token_id, pack_length=10_000,
                         freeze_vision=False)
    held = [_vlm_example(tokenizer, vision, r) for r in val]
    rng, order, acc, step = random.Random(spec.seed), [], 0.0, 0
    for step in range(1, spec.sft_max_steps + 1):
        if len(order) < spec.sft_batch_size:
            order = list(range(len(train)))
            rng.shuffle(order)
        batch = [_vlm_example(tokenizer, vision, train[order.pop()])
                 for _ in range(spec.sft_batch_size)]
        loss = trainer.sft_step(batch, step)["loss"]
        checked = None
        if step % spec.eval_every == 0:
            acc = checked = vlm_greedy_accuracy(trainer.model, tmp, held)
        if progress is not None:
            progress(step, loss, checked)
        if checked is not None and acc >= spec.target_accuracy:
            break
    trainer.save_pretrained(tmp)  # the weights over the bare ones; tokenizer etc. stay
    (tmp / TINY_VLM_MARKER).write_text(json.dumps(
        {"digest": spec.digest(), "spec": asdict(spec), "sft_steps": step,
         "val_greedy_accuracy": acc, "seconds": round(time.perf_counter() - started, 1)},
        indent=2))
    if out.exists():
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:  # another process built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out
