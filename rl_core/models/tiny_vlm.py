"""The tiny vision-language model of the VLM demo (issue 37, docs/vlm.md): a Qwen2.5-VL-
architecture model of ~1M parameters (a 2-block vision tower and merger, a 4-layer Qwen2
language model with M-RoPE) and its processor, built on this machine: nothing is downloaded.

:func:`build_bare_vlm` trains the demo's byte-level BPE tokenizer on the shapes task's text,
adds Qwen-VL's vision tokens, and saves model, tokenizer, image processor (Qwen2-VL's
Pillow one: no torchvision) and a ChatML template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (to be expanded to one pad per merged 28x28
patch), all in Hugging Face format, loadable with ``AutoTokenizer``, ``AutoImageProcessor``
and ``Qwen2_5_VLForConditionalGeneration``. Deterministic for a seed on a given machine.

``TinyVLMSpec(arch="qwen3_vl")`` builds the same-sized Qwen3-VL instead (16x16 patches, so 32x32
merged ones; deepstack features from the first vision block into the first LM layer;
interleaved M-RoPE): the tests' check that the engine and the trainer serve that family too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rl_core.data.shapes import shape_splits
from rl_core.models.tiny import BOS_CHAT, build_tokenizer, save_tokenizer

__all__ = ["ARCHS", "TinyVLMSpec", "VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_bare_vlm"]

log = logging.getLogger(__name__)

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
ARCHS = ("qwen2_5_vl", "qwen3_vl")

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

    arch: str = "qwen2_5_vl"  # or "qwen3_vl" (one of ARCHS)
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
        fields = asdict(self)
        if fields["arch"] == ARCHS[0]:  # the default: the digests from before `arch` stay
            del fields["arch"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def build_bare_vlm(spec: TinyVLMSpec, out_dir: str | Path) -> Path:
    """Save the randomly initialised tiny VLM, its tokenizer and processor in ``out_dir``."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if spec.arch not in ARCHS:
        raise ValueError(f"TinyVLMSpec.arch must be one of {ARCHS}, got {spec.arch!r}")
    out = Path(out_dir)
    train, _ = shape_splits(spec.train_size, spec.test_size, spec.data_seed, size=spec.image_size)
    corpus = [f"user\n{r.question}\nassistant\n{r.answer}" for r in train]
    tokenizer = build_tokenizer(corpus, spec.vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    config = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)](config)
    log.info("built tiny VLM (%s): %.2fM parameters (%.2fM in the vision tower)", spec.arch,
             sum(p.numel() for p in model.parameters()) / 1e6,
             sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}") / 1e6)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    # The image processor alone: transformers' Qwen2_5_VLProcessor insists on a video
    # processor, which needs torchvision (not in a CPU install); grpoflow expands the image
    # pads itself (one per merged patch), as SGLang does. Qwen3-VL's: 16x16 patches, mean and
    # std 0.5 (its checkpoints' preprocessor_config.json).
    vc = config.vision_config
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if spec.arch == "qwen3_vl" else {}
    Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                             patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                             temporal_patch_size=vc.temporal_patch_size, **norm).save_pretrained(out)
    (out / "grpoflow_tiny_vlm.json").write_text(json.dumps(
        {"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    return out


def _config(spec: TinyVLMSpec, tokenizer: Any) -> Any:  # noqa: ANN401 - transformers objects
    """The model config of ``spec.arch`` over ``tokenizer``'s vocabulary and vision tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    special = dict(bos_token_id=tokenizer.convert_tokens_to_ids(BOS_CHAT),
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.layers,
                num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.max_position_embeddings,
                tie_word_embeddings=True, **special)
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
                  intermediate_size=spec.vision_intermediate_size, num_heads=spec.vision_heads,
                  out_hidden_size=spec.hidden_size, spatial_merge_size=2, temporal_patch_size=2)
    top = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
               vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
               tie_word_embeddings=True, **special)
    head_dim = spec.hidden_size // spec.heads
    if spec.arch == "qwen3_vl":
        # interleaved M-RoPE over (t, h, w) frequencies: Qwen3-VL's [24, 20, 20] at its size
        hw = head_dim // 2 * 5 // 16
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                "mrope_section": [head_dim // 2 - 2 * hw, hw, hw]}
        return Qwen3VLConfig(
            text_config=dict(text, head_dim=head_dim, rope_parameters=rope),
            vision_config=dict(vision, patch_size=16, num_position_embeddings=256,
                               deepstack_visual_indexes=[0]), **top)
    section = [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 8 * 3 // 2]  # t, h, w
    section[0] += head_dim // 2 - sum(section)
    return Qwen2_5_VLConfig(
        text_config=dict(text, rope_theta=10000.0,
                         rope_scaling={"type": "mrope", "mrope_section": section}),
        vision_config=dict(vision, patch_size=14, window_size=56,
                           fullatt_block_indexes=[spec.vision_depth - 1]),
        torch_dtype="float32", **top)
