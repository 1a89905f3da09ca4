"""The tiny VLM (rl_core/models/tiny_vlm.py): built here, it loads back with transformers'
own classes, its processor renders a shapes record's image into one pad token per merged
patch, and the model reads the pixels (a forward with and without them differs)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from rl_core.data.shapes import generate_shapes
from rl_core.models.tiny_vlm import IMAGE_PAD, TinyVLMSpec, build_bare_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bare_vlm(TinyVLMSpec(train_size=200, test_size=20),
                          tmp_path_factory.mktemp("tiny-vlm"))


def test_it_loads_renders_an_image_and_reads_its_pixels(vlm_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    images = AutoImageProcessor.from_pretrained(vlm_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    record = generate_shapes(1, seed=0)[0]
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": record.question}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                    f"{record.question}<|im_end|>\n<|im_start|>assistant\n")
    image = Image.open(io.BytesIO(record.images[0])).convert("RGB")
    pixels = images(images=[image], return_tensors="pt")
    t, h, w = pixels["image_grid_thw"][0].tolist()
    assert (t, h, w) == (1, 4, 4)  # 64x64 -> 56x56 after smart_resize: 4x4 patches of 14
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = tokenizer(text.replace(IMAGE_PAD, IMAGE_PAD * (t * h * w // 4)),  # 2x2 merged
                    return_tensors="pt")["input_ids"]
    assert int((ids == pad).sum()) == 4
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels}
    with torch.no_grad():
        seen = model(**inputs).logits[0, -1]
        other = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
        blind = model(**other).logits[0, -1]
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert not torch.allclose(seen, blind)  # the answer depends on the picture
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4 or out[0, -1] == model.config.eos_token_id
