"""The torch trainer on a vision-language policy (issue 37, docs/vlm.md, "The trainer"): the
engine's image log-probs equal the trainer's (the text test's check, on image prompts), packed
and unpacked; the vision tower frozen by default or trained; LoRA on the language model only;
a sample whose pads do not match its images refused by row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.config import AlgorithmConfig, LoraConfig, TrainConfig
from rl_core.data.prompts import encode_record_prompts
from rl_core.data.shapes import generate_shapes
from rl_core.engine.sampling import SamplingParams
from rl_core.models.vlm import vision_processor
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch, Sample

pytestmark = pytest.mark.usefixtures("one_thread")

N = 3  # samples per prompt


@pytest.fixture(scope="module")
def samples(vlm_dir: Path) -> list[Sample]:
    """N samples of each of 3 shapes prompts (and a text prompt) from the in-process engine."""
    records = generate_shapes(3, seed=9)
    plane = InProcessPlane(vlm_dir, max_running_requests=64)
    try:
        tok = plane.engine.tokenizer
        prompts = encode_record_prompts(tok, records, vision_processor(vlm_dir))
        text = tok("How many", add_special_tokens=False)["input_ids"]
        keys = [(p, r.images) for p, r in zip(prompts, records, strict=True)] + [(text, ())]
        keys = [k for k in keys for _ in range(N)]
        params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i, ignore_eos=True)
                  for i in range(len(keys))]
        out = plane.generate([k[0] for k in keys], params, images=[k[1] for k in keys])
    finally:
        plane.close()
    assert [s.images for s in out] == [k[1] for k in keys]
    return out


def _trainer(vlm_dir: Path, **train: object) -> TorchTrainer:
    freeze = train.pop("freeze_vision", True)
    return TorchTrainer(vlm_dir, TrainConfig(**{"lr": 1e-2, "micro_batch_size": 64, **train}),
                        AlgorithmConfig(), freeze_vision=bool(freeze))


@pytest.mark.parametrize("pack_groups", [True, False], ids=["packed", "padded"])
def test_the_engines_image_logprobs_equal_the_trainers(vlm_dir: Path, samples: list[Sample],
                                                       pack_groups: bool) -> None:
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    assert batch.images is not None and sum(1 for x in batch.images if x) == 3 * N
    trainer = _trainer(vlm_dir, pack_groups=pack_groups)
    if pack_groups:
        assert trainer.vision.packable(batch)
    got = trainer.compute_logprobs(batch)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        mine = got[i, start : start + len(s.completion_ids)]
        torch.testing.assert_close(mine, torch.tensor(s.logprobs), atol=1e-4, rtol=0)
    # the pixels matter: other images, other log-probs
    swapped = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    swapped.images = [batch.images[(i + N) % (3 * N)] if i < 3 * N else x
                      for i, x in enumerate(batch.images)]
    assert not torch.allclose(trainer.compute_logprobs(swapped)[: 3 * N], got[: 3 * N])


def _vision_and_lm(trainer: TorchTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    named = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    vision = {n: p for n, p in named.items() if ".visual." in f".{n}"}
    return vision, {n: p for n, p in named.items() if n not in vision}


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_the_vision_tower_is_frozen_by_default_or_trained(vlm_dir: Path, samples: list[Sample],
                                                          freeze: bool) -> None:
    trainer = _trainer(vlm_dir, freeze_vision=freeze)
    vision0, lm0 = _vision_and_lm(trainer)
    adv = [1.0 if i % N == 0 else -0.5 for i in range(len(samples))]
    metrics = trainer.train_step(Batch.from_samples(samples, adv, pad_id=0))
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    vision1, lm1 = _vision_and_lm(trainer)
    assert any(not torch.equal(lm0[n], lm1[n]) for n in lm0)
    moved = [n for n in vision0 if not torch.equal(vision0[n], vision1[n])]
    assert (not moved) if freeze else moved
    exported = trainer.export_weights()  # weight sync carries the tower (trained or not)
    assert any(".visual." in f".{n}" for n in exported)
    if not freeze:
        name = moved[0]
        torch.testing.assert_close(exported[name], vision1[name])


def test_lora_adapts_the_language_model_only(vlm_dir: Path, samples: list[Sample]) -> None:
    lora = LoraConfig(rank=4, alpha=8)
    trainer = TorchTrainer(vlm_dir, TrainConfig(lr=1e-2, micro_batch_size=64, lora=lora),
                           AlgorithmConfig())
    adapted = [n for n, _ in trainer.model.named_parameters() if "lora_" in n]
    assert adapted and not [n for n in adapted if ".visual." in n]
    assert any("gate_proj" in n for n in adapted)  # the LM's MLPs (the tower has them too)
    adv = [1.0 if i % N == 0 else -0.5 for i in range(len(samples))]
    trainer.train_step(Batch.from_samples(samples, adv, pad_id=0))
    assert all(".visual." not in n for n in trainer.export_weights())


def test_a_sample_whose_pads_do_not_match_its_images_is_refused(vlm_dir: Path,
                                                                samples: list[Sample]) -> None:
    bad = list(samples[:2])
    bad[1] = Sample(bad[1].prompt_ids, bad[1].completion_ids, bad[1].logprobs,
                    images=bad[1].images * 2)
    trainer = _trainer(vlm_dir)
    with pytest.raises(ValueError, match=r"batch row 1: 4 image pad tokens but its 2 image"):
        trainer.compute_logprobs(Batch.from_samples(bad, [0.0, 0.0], pad_id=0))
