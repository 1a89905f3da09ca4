"""On-policy distillation (``teacher.path``): the teacher plane's prefill scoring, the
per-token reverse-KL advantages, the tokenizer check, and a distillation run through the flow.

Pinned here, on real engines (the in-process engine core and an HTTP engine process):

- A teacher's score of a sampled completion equals the log-softmax of a direct forward pass
  of the teacher model over prompt + completion (SGLang's prefill scoring:
  ``max_new_tokens: 0``, ``logprob_start_len = len(prompt) - 1``).
- The advantages are ``kl_weight * (log p_teacher - log p_student) + task_weight * A_grpo``
  per response token, zero elsewhere; a teacher identical to the student gives zero.
- A teacher with another vocabulary is refused, naming both models.
- Through Prefect: the teacher plane comes up beside the rollout plane, every step logs the
  reverse-KL estimate, and the student's reverse KL to the teacher falls as it trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import char_tokenizer, save_tiny_model
from transformers import AutoModelForCausalLM

from rl_core.config import load_config
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.teacher import (
    TEACHER_LOGPROBS,
    TeacherConfig,
    check_tokenizers,
    distill_advantages,  # fmt: skip
    score_with_teacher,
)
from rl_core.types import Batch

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5 + i, 6, 7 + i] for i in range(3)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "student", seed=1), save_tiny_model(root / "teacher", seed=2)


def _direct(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    pos = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return [float(logp[p, ids[0, p + 1]]) for p in pos]


def _check_scores(student_plane, teacher_plane, teacher_dir: Path) -> list:  # noqa: ANN001
    samples = student_plane.generate([p for p in PROMPTS for _ in range(2)], PARAMS)
    score_with_teacher(teacher_plane, samples)
    for s in samples:
        want = _direct(teacher_dir, s.prompt_ids, s.completion_ids)
        assert s.meta[TEACHER_LOGPROBS] == pytest.approx(want, abs=1e-4)
    return samples


def test_teacher_scores_equal_a_direct_forward_pass(models: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    student, teacher = models
    plane, local_teacher = InProcessPlane(student), InProcessPlane(teacher)
    pool = EnginePool(embedded_engine_command(teacher, num_threads=1), 1,
                      log_dir=tmp_path / "engines", startup_timeout_s=120)
    http_teacher = HttpPlane(pool, request_batch_size=8).start()
    try:
        samples = _check_scores(plane, local_teacher, teacher)
        _check_scores(plane, http_teacher, teacher)
        metrics = score_with_teacher(http_teacher, samples)
        gaps = [lp - t for s in samples for lp, t in zip(s.logprobs, s.meta[TEACHER_LOGPROBS],
                                                         strict=True)]  # fmt: skip
        assert metrics["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-6)
        # the student scoring itself: its sampler's log-probs, so a zero advantage
        score_with_teacher(plane, samples)
        batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
        adv = distill_advantages(batch, samples, TeacherConfig(path="x"))
        assert adv.abs().max() < 1e-4
    finally:
        for p in (plane, local_teacher, http_teacher):
            p.close()


def test_advantages_are_the_weighted_per_token_gap(models: tuple[Path, Path]) -> None:
    student, teacher = models
    plane, t = InProcessPlane(student), InProcessPlane(teacher)
    try:
        samples = plane.generate(PROMPTS, PARAMS)
        score_with_teacher(t, samples)
    finally:
        plane.close()
        t.close()
    grpo = torch.tensor([1.0, -0.5, 0.25])
    batch = Batch.from_samples(samples, grpo, pad_id=0)
    adv = distill_advantages(batch, samples, TeacherConfig(path="x", kl_weight=0.5,
                                                           task_weight=2.0))
    assert adv.shape == batch.response_mask.shape
    assert torch.all(adv[~batch.response_mask] == 0)
    for i, s in enumerate(samples):
        row = adv[i][batch.response_mask[i]]
        want = [0.5 * (t - lp) + 2.0 * float(grpo[i])
                for t, lp in zip(s.meta[TEACHER_LOGPROBS], s.logprobs, strict=True)]
        assert row.tolist() == pytest.approx(want, abs=1e-5)
    # the batch trains through the loss as (B, T) advantages, selected per micro-batch
    batch.advantages = adv
    part = batch.select(torch.tensor([0, 2]))
    assert part.advantages.shape == part.response_mask.shape
    assert torch.equal(part.advantages, adv[[0, 2], : part.response_mask.shape[1]])


def test_a_teacher_with_another_tokenizer_is_refused(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"teacher.path 'char' has another tokenizer than the "
                       r"student 'demo'"):
        check_tokenizers(AutoTokenizer.from_pretrained(demo_model), char_tokenizer(), "demo",
                         "char")
    demo = ROOT / "configs" / "tiny-cpu.yaml"
    with pytest.raises(ValueError, match="rollout.temperature=1.0"):
        load_config(demo, ["teacher.path=x", "rollout.temperature=0.7"])


def test_training_on_the_advantages_moves_the_student_to_the_teacher(
        models: tuple[Path, Path]) -> None:
    """The objective's direction, without sampling noise: a few updates on one batch of the
    student's samples raise the student's log-prob of the tokens the teacher prefers and
    lower the others, so the per-token gap to the teacher shrinks."""
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    student, teacher = models
    plane, t = InProcessPlane(student), InProcessPlane(teacher)
    try:
        samples = plane.generate([p for p in PROMPTS for _ in range(4)], PARAMS)
        score_with_teacher(t, samples)
    finally:
        plane.close()
        t.close()
    trainer = TorchTrainer(student, TrainConfig(lr=3e-3), AlgorithmConfig(clip_high=10.0,
                                                                          clip_low=0.9))
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    teacher_lp = torch.zeros_like(batch.rollout_logp)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        teacher_lp[i, start : start + len(s.completion_ids)] = torch.tensor(
            s.meta[TEACHER_LOGPROBS])
    mask = batch.response_mask

    def gap() -> float:
        return float(((trainer.compute_logprobs(batch) - teacher_lp).abs() * mask).sum()
                     / mask.sum())

    before = gap()
    for _ in range(5):
        now = batch.rollout_logp
        batch.rollout_logp = trainer.compute_logprobs(batch) * mask  # on-policy each time
        batch.advantages = torch.zeros(batch.size)
        batch.advantages = distill_advantages(batch, _rescored(samples, batch), TeacherConfig(
            path="x"))
        batch.rollout_logp = now
        trainer.train_step(batch)
    assert gap() < 0.8 * before, (before, gap())


def _rescored(samples: list, batch: Batch) -> list:
    """``samples`` with their log-probs replaced by ``batch.rollout_logp`` (the current
    student's), so the advantages are the current gap."""
    import copy

    out = []
    for i, s in enumerate(samples):
        c = copy.copy(s)
        start = len(s.prompt_ids) - 1
        c.logprobs = batch.rollout_logp[i, start : start + len(s.completion_ids)].tolist()
        out.append(c)
    return out


def test_distillation_through_the_flow(prefect_harness, tiny_cache: Path, demo_model: Path,
                                       tmp_path: Path) -> None:
    """A distillation run: the teacher plane (in process) beside the HTTP rollout plane,
    every step scored, the reverse-KL estimate logged, the run finishes and exports."""
    from flows.grpo_train import grpo_train

    out = grpo_train(config=str(ROOT / "configs" / "tiny-cpu.yaml"), overrides=[
        f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}", "run_name=distill",
        "train.steps=3", "train.prompts_per_step=8", "rollout.n_samples=4",
        "eval.every=0", "eval.num_examples=8", "eval.pass_k_examples=0",
        "tracking.backend=none", "train.num_threads=1", "rollout.engine_threads=1",
        f"teacher.path={demo_model}", "teacher.engine=local", "teacher.task_weight=0.5",
        "model.tiny_hidden_size=96", "model.tiny_layers=2", "model.tiny_intermediate_size=256",
        "model.tiny_sft_steps=20"], show_progress=False)  # fmt: skip
    metrics = [json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text()
               .splitlines()]  # fmt: skip
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # a smaller, barely trained student: far from the demo model
        assert m["distill/reverse_kl"] > 0.1 and m["time/teacher"] > 0
        assert m["distill/teacher_logp_mean"] > m["distill/student_logp_mean"] - 5
    assert (Path(out["model_dir"]) / "model.safetensors").is_file()
