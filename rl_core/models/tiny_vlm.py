"""The tiny vision-language model of the VLM demo (issue 37, docs/vlm.md): a Qwen2.5-VL-
architecture model of ~1M parameters (a 2-block vision tower and merger, a 4-layer Qwen2
language model with M-RoPE) and its processor, built on this machine: nothing is downloaded.

:func:`build_bare_vlm` trains the demo's byte-level BPE tokenizer on the shapes task's text,
adds Qwen-VL's vision tokens, and saves model, tokenizer, image processor (Qwen2-VL's
Pillow one: no torchvision) and a ChatML template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (to be expanded to one pad per merged 28x28
patch), all in Hugging Face format, loadable with ``AutoTokenizer``, ``AutoImageProcessor``
and ``Qwen2_5_VLForConditionalGeneration``. Deterministic for a seed on a given machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rl_core.data.shapes import shape_splits
from rl_core.models.tiny import BOS_CHAT, build_tokenizer, save_tokenizer

__all__ = ["TinyVLMSpec", "VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_bare_vlm"]

log = logging.getLogger(__name__)

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML, with content parts: an image part becomes Qwen-VL's vision span.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TinyVLMSpec:
    """Sizes of the tiny VLM and of the task its tokenizer is trained on."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 320
    max_position_embeddings: int = 1024
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    image_size: int = 64
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    train_size: int = 2000
    test_size: int = 200
    data_seed: int = 0  # the shapes task's (the run's data.seed: the same training split)
    seed: int = 0
    # Warm start (the SFT trainer on the training split's head): stop once greedy accuracy on
    # its last val_examples reaches target_accuracy (checked every eval_every steps).
    sft_max_steps: int = 600
    sft_batch_size: int = 32
    sft_lr: float = 1e-3
    target_accuracy: float = 0.35
    eval_every: int = 10
    val_examples: int = 100

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def build_bare_vlm(spec: TinyVLMSpec, out_dir: str | Path) -> Path:
    """Save the randomly initialised tiny VLM, its tokenizer and processor in ``out_dir``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Path(out_dir)
    train, _ = shape_splits(spec.train_size, spec.test_size, spec.data_seed, size=spec.image_size)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train]
    tokenizer = build_tokenizer(corpus, spec.vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = spec.hidden_size // spec.heads
    section = [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 8 * 3 // 2]  # t, h, w
    section[0] += head_dim // 2 - sum(section)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
            max_position_embeddings=spec.max_position_embeddings, rope_theta=10000.0,
            rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size, num_heads=spec.vision_heads,
            out_hidden_size=spec.hidden_size, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, fullatt_block_indexes=[spec.vision_depth - 1]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    log.info("built tiny VLM: %.2fM parameters (%.2fM in the vision tower)",
             sum(p.numel() for p in model.parameters()) / 1e6,
             sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}") / 1e6)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    # The image processor alone: transformers' Qwen2_5_VLProcessor insists on a video
    # processor, which needs torchvision (not in a CPU install); grpoflow expands the image
    # pads itself (one per merged patch), as SGLang does.
    Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                             patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(out)
    (out / "grpoflow_tiny_vlm.json").write_text(json.dumps(
        {"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    return out
