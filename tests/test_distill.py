"""On-policy distillation (``teacher.path``): the teacher plane's prefill scoring, the
per-token reverse-KL advantages, the tokenizer check, and a distillation run through the flow.

Pinned here, on real engines (the in-process engine core and an HTTP engine process):

- A teacher's score of a sampled completion equals the log-softmax of a direct forward pass
  of the teacher model over prompt + completion (SGLang's prefill scoring:
  ``max_new_tokens: 0``, ``logprob_start_len = len(prompt) - 1``).
- The advantages are ``kl_weight * (log p_teacher - log p_student) + task_weight * A_grpo``
  per response token, zero elsewhere (``teacher.normalize``: the gap centred and scaled over
  the step's response tokens); a teacher identical to the student gives zero.
- A teacher with another vocabulary is refused, naming both models.
- Through Prefect: the teacher plane comes up beside the rollout plane, every step logs the
  reverse-KL estimate, and the student's reverse KL to the teacher falls as it trains.

The forward KL (SFT on the teacher's samples, the SFT flow's ``data.teacher``):

- The examples are the teacher's: with temperature 0, each kept example tokenizes to the
  prompt the engine answered followed by the teacher engine's own greedy tokens through EOS;
  sampled ones are reproducible by seed; ``keep: correct`` keeps exactly the samples the
  gsm8k reward accepts; a truncated sample is dropped.
- The snapshot's digest changes with the teacher (and a cached snapshot is reused); a short
  SFT flow on teacher samples, served by an HTTP engine process, runs end to end.
- A teacher with another tokenizer, chat rows and contradictory settings are refused, each
  naming what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import char_tokenizer, save_tiny_model
from transformers import AutoModelForCausalLM

from rl_core.config import TeacherConfig, load_config
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.teacher import (
    TEACHER_LOGPROBS,
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
    # teacher.normalize: the same gap, centred and scaled over the step's response tokens
    norm = distill_advantages(batch, samples, TeacherConfig(path="x", normalize=True))
    gap = adv[batch.response_mask] - (2.0 * grpo[:, None].expand_as(adv))[batch.response_mask]
    want = (gap / 0.5 - (gap / 0.5).mean()) / (gap / 0.5).std(unbiased=False)
    assert norm[batch.response_mask].tolist() == pytest.approx(want.tolist(), abs=1e-4)
    assert torch.all(norm[~batch.response_mask] == 0)
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
        "rollout.engine=embedded", f"teacher.path={demo_model}", "teacher.engine=local", "teacher.task_weight=0.5",
        "model.tiny_hidden_size=96", "model.tiny_layers=2", "model.tiny_intermediate_size=256",
        "model.tiny_sft_steps=20"], show_progress=False)  # fmt: skip
    metrics = [json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text()
               .splitlines()]  # fmt: skip
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # a smaller, barely trained student: far from the demo model
        assert m["distill/reverse_kl"] > 0.1 and m["time/teacher"] > 0
        assert m["distill/teacher_logp_mean"] > m["distill/student_logp_mean"] - 5
    assert (Path(out["model_dir"]) / "model.safetensors").is_file()


# ------------------------------------------------------------ the forward KL: teacher samples

SFT_CONFIG = ROOT / "configs" / "sft-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def sft_student(tiny_cache: Path) -> Path:
    """The bare tiny model (the demo's tokenizer, random weights): the SFT student."""
    from rl_core.base_model import build_bare_tiny
    from rl_core.sft import SFTConfig

    return build_bare_tiny(SFTConfig().model, SFTConfig().data, tiny_cache)


def _rows(n: int) -> list:
    from rl_core.sft import SFTDataConfig, synthetic_examples

    return synthetic_examples(SFTDataConfig(synthetic_train_size=200))[0][:n]


def test_teacher_samples_are_the_teachers_answers(demo_model: Path, sft_student: Path) -> None:
    from transformers import AutoTokenizer

    from rl_core.rewards import gsm8k_reward
    from rl_core.sft import SFTDataConfig, tokenize_example
    from rl_core.teacher import teacher_examples

    tok = AutoTokenizer.from_pretrained(sft_student)
    rows = _rows(24)
    greedy = SFTDataConfig(teacher={"path": "t", "temperature": 0.0, "max_new_tokens": 24})
    sampled = SFTDataConfig(teacher={"path": "t", "samples_per_prompt": 3,
                                     "max_new_tokens": 24})
    plane = InProcessPlane(demo_model)
    try:
        kept, counts = teacher_examples(plane, tok, rows, greedy)
        prompts = [tokenize_example(tok, r, greedy) for r in rows]
        direct = plane.generate([t.ids[: t.prompt_len] for t in prompts],
                                SamplingParams(temperature=0.0, max_new_tokens=24))
        correct, c_counts = teacher_examples(plane, tok, rows, greedy.model_copy(update={
            "teacher": greedy.teacher.model_copy(update={"keep": "correct"})}))
        drawn = [teacher_examples(plane, tok, rows[:4], sampled.model_copy(update={
            "teacher": sampled.teacher.model_copy(update={"seed": seed})}))[0]
            for seed in (0, 0, 1)]
    finally:
        plane.close()
    assert counts["samples"] == 24
    assert counts["kept"] + counts["truncated"] + counts["empty"] == 24 == len(direct)
    assert counts["truncated"] == sum(d.truncated for d in direct)
    by_row = {e.id.removesuffix("#teacher0"): e for e in kept}
    for row, want in zip(rows, direct, strict=True):
        if want.truncated:  # no end to imitate
            assert row.id not in by_row
            continue
        t = tokenize_example(tok, by_row[row.id], greedy)
        assert by_row[row.id].prompt == row.prompt
        assert t.ids[: t.prompt_len] == want.prompt_ids  # the prompt the teacher answered
        assert t.ids[t.prompt_len :] == want.completion_ids  # its tokens, through its EOS
        assert want.completion_ids[-1] == tok.eos_token_id
    right = [e for e in kept if gsm8k_reward(e.completion, _reference(rows, e)) == 1.0]
    assert 0 < len(right) < len(kept)  # the demo model is right about a third of the time
    assert [e.id for e in correct] == [e.id for e in right]
    assert c_counts["correct"] == counts["correct"] == c_counts["kept"] == len(right)
    # sampled: three per row, reproducible by seed, another seed draws others
    assert len({e.id for e in drawn[0]}) == len(drawn[0]) > 4
    assert [e.completion for e in drawn[0]] == [e.completion for e in drawn[1]]
    assert [e.completion for e in drawn[0]] != [e.completion for e in drawn[2]]


def _reference(rows: list, e) -> str:  # noqa: ANN001
    return next(r.completion for r in rows if e.id.startswith(f"{r.id}#"))


def test_teacher_samples_refuse_what_cannot_work(demo_model: Path, tiny_cache: Path,
                                                 tmp_path: Path) -> None:
    from rl_core.config import ConfigError
    from rl_core.planes import sample_teacher_examples
    from rl_core.sft import Example, SFTDataConfig, load_sft_config
    from rl_core.teacher import teacher_examples

    with pytest.raises(ConfigError, match=r"data.teacher.*samples_per_prompt=4 with temperature 0"):
        load_sft_config(SFT_CONFIG, ["data.teacher.temperature=0",
                                     "data.teacher.samples_per_prompt=4"])
    with pytest.raises(ConfigError, match="data.teacher.keep"):
        load_sft_config(SFT_CONFIG, ["data.teacher.keep=best"])
    d = SFTDataConfig(teacher={"path": str(demo_model), "engine": "local"})
    chat = Example("c", "chat.jsonl line 3", messages=(("user", "hi"), ("assistant", "#### 1")))
    with pytest.raises(ValueError, match=r"chat.jsonl line 3: data.teacher.path samples "
                       r"completions for prompt rows"):
        teacher_examples(None, None, [chat], d)
    other = save_tiny_model(tmp_path / "char-student")  # another vocabulary
    with pytest.raises(ValueError, match=rf"teacher.path '{demo_model}' has another tokenizer "
                       rf"than the student '{other}'"):
        sample_teacher_examples(_rows(2), d, other, tiny_cache, tmp_path / "work")


def test_sft_on_teacher_samples_through_the_flow(prefect_harness, tiny_cache: Path,
                                                 demo_model: Path, tmp_path: Path) -> None:
    """The SFT flow with data.teacher: an HTTP engine process serves the teacher, the
    snapshot holds its samples (and is reused when nothing changed), its digest follows the
    teacher, and the run trains, evaluates on the references and exports."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.sft import sft_train
    from rl_core.base_model import build_bare_tiny
    from rl_core.sft import load_sft_config
    from tasks.sft import prepare_sft_data, read_prepared

    overrides = [f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}",
                 "run_name=sft-teacher", "tracking.backend=none", "train.num_threads=1",
                 "data.synthetic_test_size=32",  # the demo's tokenizer: its train size
                 "data.max_train_examples=24", "train.batch_size=8", "train.micro_batch_size=8",
                 "train.steps=4", "eval.every=0", "eval.num_examples=16",
                 "eval.greedy_examples=8", "checkpoint.every=0",
                 f"data.teacher.path={demo_model}", "data.teacher.engine=embedded",
                 "data.teacher.samples_per_prompt=2", "data.teacher.max_new_tokens=32"]
    summary = sft_train(config=str(SFT_CONFIG), overrides=overrides, show_progress=False)
    assert summary["steps"] == 4 and Path(summary["model_dir"], "model.safetensors").is_file()
    assert summary["last_eval"]["accuracy_examples"] == 8

    cfg = load_sft_config(SFT_CONFIG, overrides)
    student = str(build_bare_tiny(cfg.model, cfg.data, tiny_cache))
    again = prepare_sft_data(cfg.data, str(tiny_cache), student, cfg.model, 1)
    assert again.cached and again.train_digest == summary["data"]["train_digest"]
    train = read_prepared(again.train_path)
    counts = json.loads((Path(again.train_path).parent / "teacher.json").read_text())
    assert len(train) == again.num_train == counts["kept"] > 24  # two samples of most rows
    assert all("#teacher" in e.id and ", teacher sample " in e.origin for e in train)
    assert (Path(again.train_path).parent / "teacher" / "engines").is_dir()  # its logs
    held = read_prepared(again.eval_path)
    assert all("#teacher" not in e.id for e in held)  # evaluated on the references

    # another teacher (the demo model, perturbed), or none: other data, other digests
    other = tmp_path / "teacher-b"
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    with torch.no_grad():
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(demo_model).save_pretrained(other)
    b = prepare_sft_data(cfg.data.model_copy(update={"teacher": cfg.data.teacher.model_copy(
        update={"path": str(other), "engine": "local"})}), str(tiny_cache), student, cfg.model, 1)
    plain = prepare_sft_data(cfg.data.model_copy(update={"teacher": cfg.data.teacher.model_copy(
        update={"path": None})}), str(tiny_cache), student, cfg.model, 1)
    assert not b.cached and len({again.train_digest, b.train_digest, plain.train_digest}) == 3
    assert again.eval_digest == b.eval_digest == plain.eval_digest
