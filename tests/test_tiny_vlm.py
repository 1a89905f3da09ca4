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
from rl_core.models.tiny_vlm import IMAGE_PAD


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


def _prompt(vlm_dir: Path, record) -> tuple[list[int], dict]:  # noqa: ANN001
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    pixels = AutoImageProcessor.from_pretrained(vlm_dir)(
        images=[Image.open(io.BytesIO(p)).convert("RGB") for p in record.images],
        return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod(-1).sum()) // 4
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": record.question}]}],
        add_generation_prompt=True, tokenize=False).replace(IMAGE_PAD, IMAGE_PAD * n)
    return tokenizer(text)["input_ids"], pixels


def test_per_sequence_mrope_prefill_and_decode_match_transformers(vlm_dir: Path) -> None:
    """What the engine does (rl_core/models/vlm.py): prefill with per-row M-RoPE positions,
    then decode step by step from the cache at the row's next position on all three rows; the
    greedy tokens and every step's logits equal transformers' own generate, which computes
    the same positions its stateful way."""
    from transformers import DynamicCache, Qwen2_5_VLForConditionalGeneration

    from rl_core.models.vlm import ImageInputs, is_vision_model, mrope_positions

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    assert is_vision_model(model)
    ids, pixels = _prompt(vlm_dir, generate_shapes(2, seed=5)[1])
    grid = pixels["image_grid_thw"]
    images = ImageInputs(pixels["pixel_values"], grid, (int(grid.prod()) // 4,))
    input_ids = torch.tensor([ids])
    positions, next_pos = mrope_positions(model, input_ids, torch.ones_like(input_ids), images)
    assert positions.shape == (3, 1, len(ids)) and int(next_pos[0]) < len(ids)  # 2x2 image
    steps = 6
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                    **pixels)
        mine, logits = [], [out.logits[0, -1]]
        for k in range(steps):
            token = int(logits[-1].argmax())
            mine.append(token)
            pos = (next_pos + k).view(1, 1, 1).expand(3, 1, 1)
            out = model(input_ids=torch.tensor([[token]]), position_ids=pos, cache=cache,
                        use_cache=True)
            logits.append(out.logits[0, -1])
        kinds = (input_ids == model.config.image_token_id).int()
        hf = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            mm_token_type_ids=kinds, max_new_tokens=steps, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                            **pixels)
    assert hf.sequences[0, len(ids):].tolist() == mine
    for a, b in zip(logits, hf.logits, strict=False):
        torch.testing.assert_close(a, b[0], atol=1e-4, rtol=1e-4)
    # a text-only row beside it, left-padded: plain positions after the padding
    text = [t for t in ids if t != model.config.image_token_id][:5]
    batch = torch.tensor([[0, 0, *text[:3]], text])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions, next_pos = mrope_positions(model, batch, mask, None)
    assert positions[:, 0].tolist() == [[0, 0, 0, 1, 2]] * 3 and next_pos.tolist() == [3, 5]


def test_megatron_refuses_a_vision_language_checkpoint_by_name(vlm_dir: Path) -> None:
    from rl_core.config import ConfigError, load_config
    from rl_core.preflight import preflight

    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml",
                      ["train.backend=megatron"])
    with pytest.raises(ConfigError, match=r"train.backend: megatron does not train "
                       r"vision-language models; .*\(qwen2_5_vl\). Use train.backend: torch"):
        preflight(cfg, model_path=vlm_dir, data=False)
    preflight(load_config(Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml"),
              model_path=vlm_dir, data=False)  # the torch backend takes it
