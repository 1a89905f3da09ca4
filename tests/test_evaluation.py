"""Tests for rl_core.evaluation, rl_core.grpo's step helpers and rl_core.weight_sync.

The rollout plane here is a stand-in that returns canned completions, so every number is
computed by hand; the rewards are the real runner (builtin and a custom plugin).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import tiny_qwen2

from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.evaluation import EvalResult, evaluate, pass_at_k
from rl_core.grpo import advantages_for, rollout_groups, summarize_samples
from rl_core.rewards import RewardRunner
from rl_core.types import Sample
from rl_core.weight_sync import WeightSyncError, weights_checksum

pytestmark = pytest.mark.usefixtures("one_thread")


GSM8K = RewardRunner("gsm8k")


class FakeEngine:
    """The generation side of the RolloutPlane interface with a canned response function."""

    def __init__(
        self,
        respond: Callable[[int, list[int], SamplingParams], Sample],
        weight_version: int = 0,
    ) -> None:
        self.respond = respond
        self.weight_version = weight_version
        self.calls: list[tuple[list[list[int]], list[SamplingParams]]] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Sample]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        self.calls.append(([list(p) for p in prompts], list(params)))
        pairs = enumerate(zip(prompts, params, strict=True))
        out = [self.respond(i, list(p), sp) for i, (p, sp) in pairs]
        for s in out:
            s.weight_version = self.weight_version
        return out


def completion(prompt, text, length, stop=True) -> Sample:
    reason = {"type": "stop", "matched": 1} if stop else {"type": "length", "length": length}
    return Sample(list(prompt), [7] * length, [-0.5] * length, reason, text=text)


# ----------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 1, 4, 1.0),  # k = n: any correct sample suffices
        (4, 0, 4, 0.0),
    ],
)
def test_pass_at_k_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(4, 5, 1), (4, -1, 1), (4, 1, 5), (4, 1, 0), (4, 1, -1), (-1, 0, 1)],
)
def test_pass_at_k_invalid_args(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_matches_unbiased_estimator_definition():
    # 1 - C(n-c, k)/C(n, k) is the probability that k draws without replacement hit a
    # correct sample; check it against the product form for all small cases.
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                prob_all_wrong = math.prod((n - c - i) / (n - i) for i in range(k))
                assert pass_at_k(n, c, k) == pytest.approx(1 - max(prob_all_wrong, 0.0))


# --------------------------------------------------------------------------- evaluate


RECORDS = [Record(f"r{i}", f"question {i}?", f"work\n#### {10 + i}") for i in range(4)]
PROMPTS = [[3 + i, 40] for i in range(4)]
# Greedy: r0, r1 right; r2 wrong; r3 has no answer and hits the length limit.
GREEDY = {
    0: ("#### 10", 2, True),
    1: ("so #### 11", 4, True),
    2: ("#### 99", 6, True),
    3: ("I am still thinking", 8, False),
}
# Sampled (k=2 on the first 3 records): correctness of sample j of record i.
SAMPLED = {0: [True, False], 1: [False, False], 2: [True, True]}


def _respond(k: int):
    def respond(i: int, prompt: list[int], p: SamplingParams) -> Sample:
        rec = prompt[0] - 3
        if p.temperature == 0:
            text, length, stop = GREEDY[rec]
            return completion(prompt, text, length, stop)
        ok = SAMPLED[i // k][i % k]
        assert rec == i // k  # prompts are record-major
        return completion(prompt, f"#### {10 + rec if ok else -1}", 3)

    return respond


def test_evaluate_pass_at_1_and_k():
    engine = FakeEngine(_respond(2))
    result = evaluate(
        engine,
        RECORDS,
        PROMPTS,
        GSM8K,
        max_new_tokens=16,
        k=2,
        k_examples=3,
        temperature=0.8,
        seed=5,
        keep_samples=2,
    )
    assert isinstance(result, EvalResult)
    assert result.pass_at_1 == pytest.approx(0.5)
    assert result.pass_at_k == pytest.approx(2 / 3)
    assert result.k == 2
    assert result.num_examples == 4
    assert result.response_len_mean == pytest.approx(5.0)  # (2 + 4 + 6 + 8) / 4
    assert result.truncation_rate == pytest.approx(0.25)
    assert result.reward_mean == pytest.approx(0.5)
    assert result.seconds >= 0

    # One greedy call over every record, one sampled call over the first k_examples.
    assert len(engine.calls) == 2
    greedy_prompts, greedy_params = engine.calls[0]
    assert greedy_prompts == PROMPTS
    assert all(p.temperature == 0 and p.max_new_tokens == 16 for p in greedy_params)
    prompts, params = engine.calls[1]
    assert prompts == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2 + [PROMPTS[2]] * 2
    assert all(p.temperature == 0.8 and p.max_new_tokens == 16 for p in params)
    seeds = [p.seed for p in params]
    assert len(set(seeds)) == len(seeds) == 6
    assert seeds == [sample_seed(5, -1, RECORDS[i // 2].id, i % 2) for i in range(6)]

    assert result.samples == [
        {"question": "question 0?", "completion": "#### 10", "answer": "10", "correct": "True"},
        {"question": "question 1?", "completion": "so #### 11", "answer": "11", "correct": "True"},
    ]
    assert result.to_dict()["pass_at_k"] == pytest.approx(2 / 3)


def test_evaluate_seeds_are_reproducible_and_depend_on_seed():
    def seeds(seed: int) -> list[int]:
        engine = FakeEngine(_respond(2))
        evaluate(engine, RECORDS, PROMPTS, GSM8K, max_new_tokens=4, k=2, k_examples=3, seed=seed)
        return [p.seed for p in engine.calls[1][1]]

    assert seeds(0) == seeds(0)
    assert set(seeds(0)).isdisjoint(seeds(1))


def test_evaluate_without_sampling():
    for k, k_examples in ((1, 64), (4, 0)):
        engine = FakeEngine(_respond(k))
        result = evaluate(engine, RECORDS, PROMPTS, GSM8K, max_new_tokens=8, k=k,
                          k_examples=k_examples)  # fmt: skip
        assert result.pass_at_k is None
        assert len(engine.calls) == 1 and result.pass_at_1 == pytest.approx(0.5)


def test_evaluate_handles_empty_text():
    engine = FakeEngine(lambda i, p, sp: Sample(p, [1], [-0.1], {"type": "stop"}))
    result = evaluate(engine, RECORDS[:2], PROMPTS[:2], GSM8K, max_new_tokens=4, k=1)
    assert result.pass_at_1 == 0.0
    assert result.samples[0]["completion"] == ""


def test_evaluation_scores_with_the_runs_own_reward_function():
    """A run with a custom reward (``reward.fn: package.module:function``) is evaluated by
    that function in its sandbox, not by GSM8K: here the plugin passes every completion that
    says "yes", whatever the reference answer, and the format of r0/r1 (right by GSM8K)
    counts for nothing."""
    texts = {0: "#### 10", 1: "#### 11", 2: "yes", 3: "yes indeed"}
    engine = FakeEngine(lambda i, p, sp: completion(p, texts[p[0] - 3], 2))
    with RewardRunner("eval_reward_plugin:says_yes", timeout_s=10) as custom:
        assert custom.isolated  # the same sandbox (a worker process) as in training
        result = evaluate(engine, RECORDS, PROMPTS, custom, max_new_tokens=4, k=1)
        assert custom.failed_streak == 0  # evaluations never count towards the fault budget
    assert result.pass_at_1 == pytest.approx(0.5) and result.reward_mean == pytest.approx(0.5)
    assert [row["correct"] for row in result.samples] == ["False", "False", "True", "True"]
    assert (result.reward_errors, result.reward_timeouts) == (0, 0)
    with RewardRunner("reward_plugins:raising_reward", timeout_s=10) as broken:
        failing = evaluate(engine, RECORDS, PROMPTS, broken, max_new_tokens=4, k=1)
    assert (failing.pass_at_1, failing.reward_errors) == (0.0, 4)  # counted, never raised
    from rl_core.report import format_eval

    assert "reward errors 4 timeouts 0" in format_eval({**failing.to_dict(), "step": 3})
    by_gsm8k = evaluate(engine, RECORDS, PROMPTS, GSM8K, max_new_tokens=4, k=1)
    assert [row["correct"] for row in by_gsm8k.samples] == ["True", "True", "False", "False"]


def test_one_evaluation_report_for_grpo_and_sft():
    from rl_core.report import eval_markdown

    sample = {"question": "1+1", "completion": "2 | two", "answer": "2", "correct": "True"}
    grpo = eval_markdown({"step": 3, "weight_version": 3, "pass_at_1": 0.5, "pass_at_k": 0.75,
                          "k": 4, "response_len_mean": 7.0, "truncation_rate": 0.0,
                          "num_examples": 8, "samples": [sample]}, "demo")
    assert "| greedy pass@1 | 0.500 |" in grpo and "| pass@4 (sampled) | 0.750 |" in grpo
    assert "| problems | 8 |" in grpo and "held-out loss" not in grpo
    assert "| 1+1 | 2 \\| two | 2 | True |" in grpo
    sft = eval_markdown({"step": 6, "weight_version": 6, "loss": 0.25, "num_examples": 64,
                         "pass_at_1": 0.375, "accuracy_examples": 8, "response_len_mean": 5.0,
                         "truncation_rate": 0.125}, "sft")
    assert "| held-out loss | 0.2500 |" in sft and "| examples | 64 |" in sft
    assert "| greedy pass@1 | 0.375 |" in sft and "| problems | 8 |" in sft
    loss_only = eval_markdown({"step": 0, "weight_version": 0, "loss": 5.5, "num_examples": 64,
                               "pass_at_1": None}, "sft")
    assert "pass@1" not in loss_only and "| held-out loss | 5.5000 |" in loss_only


# ----------------------------------------------------------------------- grpo helpers


def test_sample_seed_is_deterministic_and_distinct():
    s = sample_seed(0, 1, "r0", 2)
    assert s == sample_seed(0, 1, "r0", 2)
    assert s == 3834300423347773854  # pinned: resumed runs depend on it never changing
    assert 0 <= s < 2**62
    others = {
        sample_seed(1, 1, "r0", 2),
        sample_seed(0, 2, "r0", 2),
        sample_seed(0, 1, "r1", 2),
        sample_seed(0, 1, "r0", 3),
        sample_seed(0, -1, "r0", 2),
    }
    assert s not in others and len(others) == 5
    many = [
        sample_seed(7, step, f"id{r}", j) for step in range(5) for r in range(5) for j in range(8)
    ]
    assert len(set(many)) == len(many)
    assert all(0 <= x < 2**62 for x in many)


def test_rollout_groups_layout():
    records = [Record("r0", "q0", "#### 1"), Record("r1", "q1", "#### 2")]
    prompt_ids = [[3, 4], [5]]

    def respond(i: int, prompt: list[int], p: SamplingParams) -> Sample:
        out = [prompt[-1], 10 + i]
        text = "" if i == 5 else f"text{i}"
        reason = {"type": "length", "length": 2} if i == 1 else {"type": "stop", "matched": 1}
        return Sample(prompt, out, [-0.1 * (i + 1)] * 2, reason, text=text)

    engine = FakeEngine(respond, weight_version=7)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=5, stop=["\n"])
    samples = rollout_groups(engine, records, prompt_ids, n=3, params=params, step=4, seed=11)
    assert params.seed is None  # the template is not mutated
    assert len(engine.calls) == 1
    prompts, sent = engine.calls[0]
    assert prompts == [[3, 4]] * 3 + [[5]] * 3
    assert [p.seed for p in sent] == [
        sample_seed(11, 4, rid, j) for rid in ("r0", "r1") for j in range(3)
    ]
    for p in sent:
        assert (p.temperature, p.top_p, p.max_new_tokens, p.stop) == (0.9, 0.95, 5, ["\n"])

    assert [s.uid for s in samples] == ["4:r0:0", "4:r0:1", "4:r0:2", "4:r1:0", "4:r1:1", "4:r1:2"]
    assert [s.group for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.record_id for s in samples] == ["r0"] * 3 + ["r1"] * 3
    assert [s.answer for s in samples] == ["#### 1"] * 3 + ["#### 2"] * 3
    assert all(s.weight_version == 7 for s in samples)
    assert samples[4].prompt_ids == [5]
    assert samples[4].completion_ids == [5, 14]
    assert samples[4].logprobs == pytest.approx([-0.5, -0.5])
    assert samples[0].text == "text0" and samples[5].text == ""
    assert samples[1].truncated and not samples[0].truncated
    assert all(s.reward == 0.0 and s.correct is False for s in samples)


def _samples(rewards, lengths, truncated=()) -> list[Sample]:
    out = []
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        reason = {"type": "length", "length": n} if i in truncated else {"type": "stop"}
        out.append(
            Sample(
                uid=f"0:r{i}:0",
                group=0,
                record_id=f"r{i}",
                prompt_ids=[1],
                completion_ids=[2] * n,
                logprobs=[-1.0] * n,
                finish_reason=reason,
                text="",
                answer="1",
                weight_version=0,
                reward=float(r),
                correct=r > 0,
            )
        )
    return out


def test_advantages_for_grpo_and_drgrpo():
    samples = _samples([1, 0, 0, 0, 1, 1, 1, 1], [1] * 8)
    # Group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    adv = advantages_for(samples, 4, "grpo")
    assert adv.dtype == torch.float32
    expected = [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3 + [0.0] * 4
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    adv = advantages_for(samples, 4, "drgrpo")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    adv = advantages_for(_samples([0, 1, 2, 5], [1] * 4), 2, "grpo")
    # Pairs: (0, 1) -> std sqrt(0.5); (2, 5) -> std sqrt(4.5).
    assert adv.tolist() == pytest.approx(
        [-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5), -1.5 / math.sqrt(4.5), 1.5 / math.sqrt(4.5)],
        rel=1e-5,
    )
    with pytest.raises(ValueError):
        advantages_for(samples, 3, "grpo")  # 8 samples are not groups of 3


def test_summarize_samples():
    samples = _samples([1, 0, 0, 0, 1, 1, 1, 1], [2, 4, 6, 8, 1, 1, 1, 1], truncated={3})
    s = summarize_samples(samples, 4)
    assert s["reward_mean"] == pytest.approx(0.625)
    # Population std: (5 * 0.375^2 + 3 * 0.625^2) / 8 = 0.234375.
    assert s["reward_std"] == pytest.approx(math.sqrt(0.234375))
    assert s["accuracy"] == pytest.approx(0.625)
    assert s["response_len_mean"] == pytest.approx(3.0)
    assert s["response_len_max"] == 8.0
    assert s["truncation_rate"] == pytest.approx(0.125)
    assert s["zero_std_group_frac"] == pytest.approx(0.5)
    assert s["response_tokens"] == 24.0
    assert all(isinstance(v, float) for v in s.values())

    one = summarize_samples(_samples([0.5], [3]), 1)
    assert one["reward_std"] == 0.0 and one["zero_std_group_frac"] == 1.0
    assert summarize_samples(_samples([0, 0.5, 1.0], [1, 1, 1]), 3)["reward_std"] == (
        pytest.approx(statistics.pstdev([0, 0.5, 1.0]))
    )


# ------------------------------------------------------------------------ weight sync


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.ones(4),
        "lm_head.weight": torch.randn(6, 4, generator=g),
        "scalar": torch.tensor(3.0),
    }


def test_checksum_is_order_independent():
    w = _weights()
    digest = weights_checksum(w)
    algo, _, hexdigest = digest.partition(":")
    assert algo == "xxh3-128" and len(hexdigest) == 32 and int(hexdigest, 16) >= 0
    assert weights_checksum(dict(reversed(list(w.items())))) == digest
    assert weights_checksum({k: v.clone() for k, v in w.items()}) == digest


def test_checksum_changes_with_any_element_name_or_shape():
    w = _weights()
    digest = weights_checksum(w)
    changed = {k: v.clone() for k, v in w.items()}
    changed["lm_head.weight"][5, 3] += 1e-6
    assert weights_checksum(changed) != digest
    renamed = dict(w)
    renamed["lm_head.weight2"] = renamed.pop("lm_head.weight")
    assert weights_checksum(renamed) != digest
    reshaped = dict(w)
    reshaped["lm_head.weight"] = w["lm_head.weight"].reshape(4, 6)
    assert weights_checksum(reshaped) != digest
    missing = dict(w)
    del missing["scalar"]
    assert weights_checksum(missing) != digest


def test_checksum_ignore():
    w = _weights()
    without = {k: v for k, v in w.items() if k != "lm_head.weight"}
    assert weights_checksum(w, ignore=["lm_head.weight"]) == weights_checksum(without)
    assert weights_checksum(w, ignore={"not-there"}) == weights_checksum(w)


def test_checksum_handles_bfloat16_and_layout():
    w = {k: v.to(torch.bfloat16) for k, v in _weights().items()}
    digest = weights_checksum(w)
    assert weights_checksum({k: v.clone() for k, v in w.items()}) == digest
    # Same values as float32 are different weights to an engine: the dtype is hashed.
    assert weights_checksum({k: v.float() for k, v in w.items()}) != digest
    changed = dict(w)
    changed["model.norm.weight"] = w["model.norm.weight"].clone()
    changed["model.norm.weight"][0] = 2.0
    assert weights_checksum(changed) != digest
    # A non-contiguous view hashes like its contiguous copy.
    t = torch.randn(3, 5).t()
    assert not t.is_contiguous()
    assert weights_checksum({"t": t}) == weights_checksum({"t": t.contiguous()})
    assert weights_checksum({"t": t.requires_grad_()}) == weights_checksum({"t": t.detach()})


def test_checksum_of_model_state_dicts():
    a, b, c = tiny_qwen2(0), tiny_qwen2(0), tiny_qwen2(1)
    assert weights_checksum(a.state_dict()) == weights_checksum(b.state_dict())
    assert weights_checksum(a.state_dict()) != weights_checksum(c.state_dict())
    c.load_state_dict(a.state_dict())
    assert weights_checksum(c.state_dict()) == weights_checksum(a.state_dict())


def test_weight_sync_error_is_a_runtime_error():
    assert issubclass(WeightSyncError, RuntimeError)


def test_checksum_algorithm_is_named_so_mixed_versions_are_told_apart():
    from rl_core.rollout.http import _algorithm

    assert _algorithm(weights_checksum(_weights())) == "xxh3-128"
    assert _algorithm("ab" * 32) == "sha256"  # what engines of earlier versions served
