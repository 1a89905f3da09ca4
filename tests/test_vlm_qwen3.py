"""Qwen3-VL through the embedded engine and the torch trainer (docs/vlm.md): a tiny random
Qwen3-VL (``TinyVLMSpec(arch="qwen3_vl")``: 16x16 patches, deepstack features injected into
the first LM layer, interleaved M-RoPE) gets image requests on the padded KV layout whose
log-probs equal the HF model's own full forward (its own M-RoPE positions, from
``mm_token_type_ids``), and the trainer's log-probs equal the engine's, padded and packed."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.data.prompts import encode_record_prompts
from rl_core.data.shapes import generate_shapes
from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.sampling import SamplingParams
from rl_core.models.tiny_vlm import TinyVLMSpec, build_bare_vlm
from rl_core.models.vlm import BANNED_LOGIT, placeholder_ids, vision_processor
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch, Sample

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = generate_shapes(3, seed=5)
N = 3  # samples per prompt (the trainer's check)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-VL (~0.7M parameters: vision depth 2 of width 64, 2 LM layers of 128)."""
    spec = TinyVLMSpec(arch="qwen3_vl", layers=2, intermediate_size=256, train_size=200,
                       test_size=20)
    return build_bare_vlm(spec, tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def engine(qwen3_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine(qwen3_dir, control_timeout_s=30, kv_layout="padded")
    yield eng
    eng.close()


def _chat_ids(engine: EmbeddedEngine, question: str) -> list[int]:
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _wide(png: bytes) -> bytes:
    """``png`` stretched to 128x64 (a non-square grid: 2x4 merged patches, not 2x2)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").resize((128, 64)).save(buf, format="PNG")
    return buf.getvalue()


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int],
                 images: Any) -> list[float]:  # noqa: ANN401
    """The HF model's own forward over prompt + output: its own M-RoPE positions (from
    ``mm_token_type_ids``, no ``position_ids``), pixels, deepstack; each output token's
    log-prob at temperature 1 with the vision placeholders masked (as both planes do)."""
    ids = torch.tensor([prompt + output])
    extra: dict[str, Any] = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if images is not None:
        extra.update(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
    model.model.rope_deltas = None  # transformers' per-batch M-RoPE state: none carried over
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
    model.model.rope_deltas = None
    banned = torch.tensor(placeholder_ids(model.config))
    logp = torch.log_softmax(logits.float().index_fill(-1, banned, BANNED_LOGIT), -1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(output)]


def test_image_requests_have_the_hf_forwards_logprobs(engine: EmbeddedEngine,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A square and a wide image prompt and a text prompt in one batch, an image prompt
    admitted while they decode: each sample's log-probs are the model's own full forward's."""
    config = engine.model.config
    assert config.model_type == "qwen3_vl" and engine.kv_layout == "padded"
    assert list(config.vision_config.deepstack_visual_indexes) == [0]

    def req(rid: str, question: str, image: bytes | None, seed: int) -> GenerateRequest:
        params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed, ignore_eos=True)
        if image is None:
            ids = engine.tokenizer(question, add_special_tokens=False)["input_ids"]
            return GenerateRequest(rid, ids, params, return_logprob=True)
        ids, pixels = engine.images.prepare(_chat_ids(engine, question), [image])
        return GenerateRequest(rid, ids, params, return_logprob=True, images=pixels)

    first = [req("square", RECORDS[0].question, RECORDS[0].images[0], 1),
             req("wide", RECORDS[1].question, _wide(RECORDS[1].images[0]), 2),
             req("text", "How many red squares", None, 3)]
    # 16x16 patches merged 2x2: a 64x64 image is 2x2 pads, a 128x64 one 2x4
    assert first[0].images.tokens == (4,) and first[1].images.tokens == (8,)
    assert first[0].images.pixel_values.shape[1] == 3 * 2 * 16 * 16
    late = req("late", RECORDS[2].question, RECORDS[2].images[0], 4)
    futures = []

    def on_step(n: int) -> None:
        if n == start + 3 and not futures:
            futures.append(engine.submit(late))

    start = engine.stats["decode_steps"]
    engine.on_step = on_step
    try:
        outs = engine.generate_sync(first)
        assert futures, "the late request was not submitted"
        outs.append(futures[0].result(60))
    finally:
        engine.on_step = None
    for r, out in zip([*first, late], outs, strict=True):
        ref = _hf_logprobs(engine.model, r.input_ids, out.output_ids, r.images)
        assert max(abs(a - b) for a, b in zip(ref, out.output_logprobs, strict=True)) < 1e-4, r.rid
    # the check sees deepstack: without it the image samples' log-probs are not the engine's
    monkeypatch.setattr(engine.model.model.language_model, "_deepstack_process",
                        lambda hidden, *_: hidden)
    for r, out in zip(first[:2], outs[:2], strict=True):
        flat = _hf_logprobs(engine.model, r.input_ids, out.output_ids, r.images)
        assert max(abs(a - b) for a, b in zip(flat, out.output_logprobs, strict=True)) > 1e-3


@pytest.fixture(scope="module")
def samples(qwen3_dir: Path) -> list[Sample]:
    """N samples of each of 3 shapes prompts (and a text prompt) from the in-process engine."""
    records = generate_shapes(3, seed=9)
    plane = InProcessPlane(qwen3_dir, max_running_requests=64)
    try:
        tok = plane.engine.tokenizer
        prompts = encode_record_prompts(tok, records, vision_processor(qwen3_dir))
        text = tok("How many", add_special_tokens=False)["input_ids"]
        keys = [(p, r.images) for p, r in zip(prompts, records, strict=True)] + [(text, ())]
        keys = [k for k in keys for _ in range(N)]
        params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i, ignore_eos=True)
                  for i in range(len(keys))]
        return plane.generate([k[0] for k in keys], params, images=[k[1] for k in keys])
    finally:
        plane.close()


@pytest.mark.parametrize("pack_groups", [True, False], ids=["packed", "padded"])
def test_the_trainers_logprobs_equal_the_engines(qwen3_dir: Path, samples: list[Sample],
                                                 pack_groups: bool) -> None:
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    assert batch.images is not None and sum(1 for x in batch.images if x) == 3 * N
    trainer = TorchTrainer(qwen3_dir, TrainConfig(lr=1e-2, micro_batch_size=64,
                                                  pack_groups=pack_groups), AlgorithmConfig())
    got = trainer.compute_logprobs(batch)
    # packed: each group's prompt once (fewer forward slots than the padded rows)
    assert (trainer.forward_slots < batch.input_ids.numel()) == pack_groups
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        mine = got[i, start : start + len(s.completion_ids)]
        torch.testing.assert_close(mine, torch.tensor(s.logprobs), atol=1e-4, rtol=0)


def test_an_image_processor_of_other_patches_is_refused(qwen3_dir: Path, tmp_path: Path) -> None:
    """Qwen2.5-VL's processor (14x14 patches) beside a Qwen3-VL (16x16): refused by name."""
    other = tmp_path / "m"
    shutil.copytree(qwen3_dir, other)
    cfg = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**cfg, "patch_size": 14}))
    with pytest.raises(ValueError, match="processor's patch_size is 14 but the vision tower's "
                                         "patch_size is 16"):
        vision_processor(other)
