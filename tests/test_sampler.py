"""Tests for rl_core.rollout.sampler: batched KV-cache sampling over a tiny random Qwen2.

The reference for every behaviour is either Hugging Face ``generate`` (greedy), a full
forward pass over prompt + output (log-probs), or the first-step distribution computed
directly from the model (top-k / top-p / min-p supports).
"""

from __future__ import annotations

import pytest
import torch
from conftest import PAD_ID, hf_greedy, word

from rl_core.rollout.sampler import Completion, SamplingParams, generate, sampling_uniforms

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [40, 2, 33, 17], [20, 21]]


def _full_logits(model, prompt, output) -> torch.Tensor:
    """Logits (len(output), V) that scored each output token, from one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) - 1
    return logits[start : start + len(output)]


def _manual_logprobs(model, prompt, output, temperature: float) -> torch.Tensor:
    logits = _full_logits(model, prompt, output)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def _first_step_probs(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return torch.softmax(logits, dim=-1)


def _pick_stop_token(outputs: list[list[int]], min_pos: int = 2) -> tuple[int, int]:
    """(row, token) such that ``token`` first appears in ``outputs[row]`` at >= min_pos."""
    for row, out in enumerate(outputs):
        for pos in range(min_pos, len(out) - 1):
            if out[pos] not in out[:pos]:
                return row, out[pos]
    raise AssertionError(f"no usable stop token in {outputs}")


# ------------------------------------------------------------------------ greedy


def test_greedy_matches_hf_generate_with_left_padding_and_eos(tiny_model):
    n = 10
    free = generate(tiny_model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=n))
    for p, c in zip(PROMPTS, free, strict=True):
        assert c.output_ids == hf_greedy(tiny_model, p, n, eos=None)
        assert c.finish_reason == {"type": "length", "length": n}

    # An EOS id that stops one row early (it then leaves the KV cache) but not the others.
    row, eos = _pick_stop_token([c.output_ids for c in free])
    outs = generate(
        tiny_model,
        PROMPTS,
        SamplingParams(temperature=0.0, max_new_tokens=n),
        eos_token_ids=[eos],
        pad_token_id=PAD_ID,
    )
    stopped = 0
    for p, c in zip(PROMPTS, outs, strict=True):
        expected = hf_greedy(tiny_model, p, n, eos=eos)
        assert c.output_ids == expected
        if eos in expected:
            stopped += 1
            assert expected[-1] == eos
            assert c.finish_reason == {"type": "stop", "matched": eos}
            assert len(c.output_ids) < n
        else:
            assert c.finish_reason == {"type": "length", "length": n}
    assert stopped >= 1
    assert len(outs[row].output_ids) < n


def test_greedy_is_independent_of_batch_composition(tiny_model):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    batched = generate(tiny_model, PROMPTS, params)
    for p, c in zip(PROMPTS, batched, strict=True):
        alone = generate(tiny_model, [p], params)[0]
        assert alone.output_ids == c.output_ids
        torch.testing.assert_close(
            torch.tensor(alone.output_logprobs), torch.tensor(c.output_logprobs), atol=1e-5, rtol=0
        )


# --------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_including_eos(tiny_model, temperature):
    n = 12
    seeds = [11, 12, 13, 14, 15]
    free = generate(
        tiny_model,
        PROMPTS,
        [SamplingParams(temperature=temperature, max_new_tokens=n, seed=s) for s in seeds],
    )
    _, eos = _pick_stop_token([c.output_ids for c in free])
    outs = generate(
        tiny_model,
        PROMPTS,
        [SamplingParams(temperature=temperature, max_new_tokens=n, seed=s) for s in seeds],
        eos_token_ids=[eos],
    )
    ended_on_eos = 0
    for p, c in zip(PROMPTS, outs, strict=True):
        assert len(c.output_logprobs) == len(c.output_ids) > 0
        if c.finish_reason["type"] == "stop":
            ended_on_eos += 1
            assert c.output_ids[-1] == eos
        expected = _manual_logprobs(tiny_model, p, c.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)
    assert ended_on_eos >= 1  # the EOS token's log-prob was checked too


def test_greedy_logprobs_are_unscaled_log_softmax(tiny_model):
    c = generate(tiny_model, [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    expected = _manual_logprobs(tiny_model, PROMPTS[0], c.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)


def test_logprobs_are_taken_before_top_k_filtering(tiny_model):
    greedy = generate(tiny_model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    top1 = generate(
        tiny_model,
        PROMPTS,
        [SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6, seed=s) for s in range(5)],
    )
    for p, g, c in zip(PROMPTS, greedy, top1, strict=True):
        assert c.output_ids == g.output_ids  # top_k=1 is greedy
        lp = torch.tensor(c.output_logprobs)
        assert bool((lp < -1e-3).all()), "log-probs of filtered sampling must not be 0"
        expected = _manual_logprobs(tiny_model, p, c.output_ids, 1.0)
        torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- seeded sampling


def _sampled(model, prompts, seeds, **kw):
    mb = kw.pop("micro_batch_size", 256)
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=s) for s in seeds]
    return generate(model, prompts, params, micro_batch_size=mb, **kw)


def test_same_seed_same_sample_whatever_the_batch(tiny_model):
    seeds = [101, 202, 303, 404, 505]
    ref = _sampled(tiny_model, PROMPTS, seeds)
    variants = [
        [0, 1, 2, 3, 4],
        [4, 3, 2, 1, 0],
        [2, 0],
        [3],
        [1, 4, 1, 0],  # duplicates in one batch
    ]
    for order in variants:
        outs = _sampled(tiny_model, [PROMPTS[i] for i in order], [seeds[i] for i in order])
        for i, c in zip(order, outs, strict=True):
            assert c.output_ids == ref[i].output_ids, f"request {i} changed in batch {order}"
            torch.testing.assert_close(
                torch.tensor(c.output_logprobs),
                torch.tensor(ref[i].output_logprobs),
                atol=1e-5,
                rtol=0,
            )
    for mb in (1, 2, 3):
        outs = _sampled(tiny_model, PROMPTS, seeds, micro_batch_size=mb)
        assert [c.output_ids for c in outs] == [c.output_ids for c in ref]


def test_mixed_params_rows_do_not_interfere(tiny_model):
    greedy = generate(tiny_model, [PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = _sampled(tiny_model, [PROMPTS[0]], [7])
    mixed = generate(
        tiny_model,
        [PROMPTS[0], PROMPTS[2]],
        [
            SamplingParams(temperature=1.0, max_new_tokens=10, seed=7),
            SamplingParams(temperature=0.0, max_new_tokens=8),
        ],
    )
    assert mixed[0].output_ids == sampled[0].output_ids
    assert mixed[1].output_ids == greedy[0].output_ids


def test_different_seeds_differ(tiny_model):
    outs = _sampled(tiny_model, [PROMPTS[0]] * 8, list(range(8)))
    assert len({tuple(c.output_ids) for c in outs}) >= 6


def test_unseeded_requests_get_fresh_seeds(tiny_model):
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    outs = generate(tiny_model, [PROMPTS[0]] * 4, params)
    assert len({tuple(c.output_ids) for c in outs}) >= 3
    assert params.seed is None  # the caller's object is not mutated


# ---------------------------------------------------------- seeded inverse-CDF sampling


def test_sampling_uniforms_are_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([3, 5, 2**61 + 7, -9])
    pos = torch.tensor([0, 4, 17, 2])
    u = sampling_uniforms(seeds, pos)
    assert u.shape == (4,) and u.dtype == torch.float64
    assert bool(((u > 0) & (u < 1)).all())
    # Same (seed, position) in another batch or row order: same values, bit for bit.
    torch.testing.assert_close(
        sampling_uniforms(seeds[[2, 0]], pos[[2, 0]]), u[[2, 0]], atol=0, rtol=0
    )
    torch.testing.assert_close(sampling_uniforms(seeds.clone(), pos.clone()), u, atol=0, rtol=0)
    # Any change of seed or position changes every row's number.
    assert bool((sampling_uniforms(seeds + 1, pos) != u).all())
    assert bool((sampling_uniforms(seeds, pos + 1) != u).all())
    # Uniform on (0, 1): mean 1/2, variance 1/12 over many seeds.
    many = sampling_uniforms(torch.arange(20000) * 7919 + 13, torch.zeros(20000, dtype=torch.long))
    assert abs(float(many.mean()) - 0.5) < 0.01
    assert abs(float(many.var()) - 1 / 12) < 0.005


def test_sampling_uniforms_are_their_documented_formula_bit_for_bit():
    """splitmix64 on Python ints (unsigned 64-bit arithmetic), not on torch's int64."""
    from rl_core.rollout.sampler import _splitmix64

    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds = [0, 1, -5, 2**62 - 1, 123456789, -(2**63)]
    pos = [0, 7, 3, 999, 2**20, 1]
    want = [
        ((mix((mix(s & mask) + p) & mask) >> 11) + 0.5) / 2**53
        for s, p in zip(seeds, pos, strict=True)
    ]
    got = sampling_uniforms(torch.tensor(seeds), torch.tensor(pos))
    assert got.tolist() == want
    assert _splitmix64(torch.tensor([5])).item() == (mix(5) - (1 << 64) if mix(5) >> 63 else mix(5))


def _reference_sample(probs: list[float], u: float) -> int:
    """Inverse CDF, one token at a time: the first token whose cumulative mass exceeds u."""
    total = sum(probs)
    acc = 0.0
    for j, p in enumerate(probs):
        acc += p
        if u * total < acc and p > 0:
            return j
    return max(j for j, p in enumerate(probs) if p > 0)


def test_sampling_step_is_inverse_cdf_per_row_greedy_or_not():
    from rl_core.rollout.sampler import _sample_next

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    seeds, pos = torch.arange(6) * 31 + 7, torch.tensor([0, 3, 1, 9, 4, 2])
    no_k, no_p, no_min = torch.full((6,), -1), torch.ones(6), torch.zeros(6)
    u = sampling_uniforms(seeds, pos)
    for temperature in (
        torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0]),  # mixed
        torch.zeros(6),  # all greedy
        torch.ones(6),
    ):
        token, logp = _sample_next(logits, temperature, no_k, no_p, no_min, seeds, pos)
        scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
        probs = torch.softmax(scaled.double(), dim=-1)
        expected = torch.tensor(
            [
                int(torch.argmax(scaled[i]))
                if temperature[i] == 0
                else _reference_sample(probs[i].tolist(), float(u[i]))
                for i in range(6)
            ]
        )
        assert torch.equal(token, expected)
        want = torch.log_softmax(scaled, dim=-1).gather(-1, expected[:, None]).squeeze(-1)
        torch.testing.assert_close(logp, want, atol=0, rtol=0)


def test_inverse_cdf_never_returns_a_token_without_mass():
    from rl_core.rollout.sampler import _inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    for u in (1e-300, 0.25 - 1e-12, 0.25, 0.5, 1 - 2.0**-53, 1.0):  # 1.0: rounding's worst case
        token = _inverse_cdf(probs, torch.full((2,), u, dtype=torch.float64))
        assert token[1] == 2
        assert token[0] == (1 if u < 0.25 else 3), u


def test_inverse_cdf_samples_follow_softmax():
    from rl_core.rollout.sampler import _sample_next

    n = 4000
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(n, 4)
    ones, no_k, no_min = torch.ones(n), torch.full((n,), -1), torch.zeros(n)
    seeds = torch.arange(n) * 7919 + 13
    for position in (0, 5):
        pos = torch.full((n,), position)
        token, _ = _sample_next(logits, ones, no_k, ones, no_min, seeds, pos)
        counts = torch.bincount(token, minlength=4)
        expected = torch.softmax(logits[0], -1) * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 3 degrees of freedom: P(chi2 > 25) < 2e-5, so this is a loose check.
        assert chi2 < 25.0, (counts.tolist(), expected.tolist())


# --------------------------------------------------------------------- filtering


def _first_tokens(model, prompt, n, **kw) -> set[int]:
    params = [SamplingParams(max_new_tokens=1, seed=1000 + i, **kw) for i in range(n)]
    return {c.output_ids[0] for c in generate(model, [prompt] * n, params)}


def test_top_k_restricts_to_top_k_tokens(tiny_model):
    prompt = PROMPTS[0]
    probs = _first_step_probs(tiny_model, prompt)
    top3 = set(torch.topk(probs, 3).indices.tolist())
    assert len(_first_tokens(tiny_model, prompt, 300)) > 3  # unfiltered is wider
    got = _first_tokens(tiny_model, prompt, 300, top_k=3)
    assert got == top3


def test_top_p_restricts_to_nucleus(tiny_model):
    prompt = PROMPTS[3]
    probs = _first_step_probs(tiny_model, prompt)
    sorted_p, order = torch.sort(probs, descending=True)
    top_p = 0.5
    size = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # smallest prefix reaching top_p
    nucleus = set(order[:size].tolist())
    got = _first_tokens(tiny_model, prompt, 400, top_p=top_p)
    assert got <= nucleus
    assert len(got) >= min(size, 2)


def test_min_p_restricts_to_tokens_near_the_mode(tiny_model):
    prompt = PROMPTS[2]
    probs = _first_step_probs(tiny_model, prompt)
    min_p = 0.3
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    got = _first_tokens(tiny_model, prompt, 300, min_p=min_p)
    assert got <= allowed
    assert len(got) >= min(len(allowed), 2)


def test_top_p_one_keeps_every_token_whatever_the_batch():
    """float32 cumsum of a peaked distribution reaches 1.0 after its first token; a row
    with top_p=1 must still keep its tail when a top_p<1 row shares the batch."""
    from rl_core.rollout.sampler import _filter_logits

    peaked = torch.tensor([[30.0] + [0.0] * 63])
    batch = torch.cat([peaked, torch.randn(1, 64)])
    out = _filter_logits(batch, torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]), torch.zeros(2))
    assert torch.equal(out[0], peaked[0])
    assert bool(torch.isinf(out[1]).any())  # the other row is filtered


def test_sampling_in_blocks_equals_one_block(monkeypatch):
    """Rows are sampled in blocks that stay under torch's parallel grain; any split gives
    the same tokens and log-probs."""
    from rl_core.rollout import sampler

    torch.manual_seed(1)
    n, vocab = 13, 64
    args = (
        torch.randn(n, vocab) * 2,
        torch.tensor([0.0, 1.0, 0.7] * 4 + [1.0]),
        torch.tensor([-1, 5] * 6 + [3]),
        torch.tensor([1.0, 0.9, 1.0] * 4 + [0.8]),
        torch.tensor([0.0, 0.0, 0.1] * 4 + [0.0]),
        torch.arange(n) * 101 + 3,
        torch.arange(n) % 5,
    )
    whole = sampler._sample_next(*args)
    monkeypatch.setattr(sampler, "_BLOCK_ELEMENTS", 3 * vocab)  # blocks of 3 rows
    blocked = sampler._sample_next(*args)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])


def test_filtering_applies_at_the_sampling_temperature(tiny_model):
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    temperature = 0.5
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = torch.sort(probs, descending=True)
    size = int((sorted_p.cumsum(0) < 0.6).sum()) + 1
    got = _first_tokens(tiny_model, prompt, 300, top_p=0.6, temperature=temperature)
    assert got <= set(order[:size].tolist())


# --------------------------------------------------------------- stop and length


def test_stop_token_ids(tiny_model):
    n = 10
    free = generate(tiny_model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=n))
    row, stop = _pick_stop_token([c.output_ids for c in free])
    out = generate(
        tiny_model,
        [PROMPTS[row]],
        SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[stop]),
    )[0]
    cut = free[row].output_ids.index(stop) + 1
    assert out.output_ids == free[row].output_ids[:cut]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert len(out.output_logprobs) == cut
    assert not out.truncated


def test_max_new_tokens_gives_length_finish(tiny_model):
    outs = generate(
        tiny_model,
        PROMPTS[:3],
        [SamplingParams(temperature=1.0, max_new_tokens=m, seed=m) for m in (1, 4, 7)],
    )
    for m, c in zip((1, 4, 7), outs, strict=True):
        assert len(c.output_ids) == len(c.output_logprobs) == m
        assert c.finish_reason == {"type": "length", "length": m}
        assert c.truncated


def test_max_new_tokens_zero_returns_empty(tiny_model):
    outs = generate(tiny_model, [PROMPTS[0]], SamplingParams(max_new_tokens=0, seed=1))
    assert outs[0].output_ids == [] and outs[0].output_logprobs == []
    assert outs[0].finish_reason == {"type": "length", "length": 0}
    assert outs[0].prompt_ids == PROMPTS[0]
    # Mixed with a live row in one batch.
    mixed = generate(
        tiny_model,
        [PROMPTS[0], PROMPTS[1]],
        [SamplingParams(max_new_tokens=0, seed=1), SamplingParams(max_new_tokens=3, seed=2)],
    )
    assert mixed[0].output_ids == []
    assert mixed[0].finish_reason == {"type": "length", "length": 0}
    assert len(mixed[1].output_ids) == 3


def test_ignore_eos(tiny_model):
    n = 10
    free = generate(tiny_model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=n))
    row, eos = _pick_stop_token([c.output_ids for c in free])
    prompt = PROMPTS[row]
    stopped = generate(
        tiny_model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=n), eos_token_ids=[eos]
    )[0]
    assert stopped.finish_reason == {"type": "stop", "matched": eos}
    ignored = generate(
        tiny_model,
        [prompt],
        SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
        eos_token_ids=[eos],
    )[0]
    assert ignored.output_ids == free[row].output_ids
    assert ignored.finish_reason == {"type": "length", "length": n}
    # ignore_eos does not disable explicit stop_token_ids.
    explicit = generate(
        tiny_model,
        [prompt],
        SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, stop_token_ids=[eos]),
        eos_token_ids=[eos],
    )[0]
    assert explicit.output_ids == stopped.output_ids


def test_no_eos_ids_means_no_early_stop(tiny_model):
    # Without eos_token_ids nothing stops a row early (the model config's EOS is not used).
    outs = generate(
        tiny_model,
        PROMPTS,
        [SamplingParams(temperature=1.0, max_new_tokens=12, seed=s) for s in range(5)],
    )
    assert all(c.finish_reason == {"type": "length", "length": 12} for c in outs)


# ------------------------------------------------------------------ stop strings


def test_stop_strings_with_tokenizer(tiny_model, tiny_tok):
    n = 10
    free = generate(
        tiny_model, PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=n), tokenizer=tiny_tok
    )
    for c in free:
        assert c.text == tiny_tok.decode(c.output_ids, skip_special_tokens=True)
    row, tok = _pick_stop_token([c.output_ids for c in free])
    out = free[row].output_ids
    cut = out.index(tok) + 1

    # One-token stop string.
    stop = word(tok)
    got = generate(
        tiny_model,
        [PROMPTS[row]],
        SamplingParams(temperature=0.0, max_new_tokens=n, stop=[stop]),
        tokenizer=tiny_tok,
    )[0]
    assert got.output_ids == out[:cut]
    assert got.finish_reason == {"type": "stop", "matched": stop}
    assert got.text is not None and got.text.endswith(stop)

    # A stop string spanning two tokens, given as a bare string.
    pair = f"{word(out[cut - 2])} {word(out[cut - 1])}"
    first = tiny_tok.decode(out, skip_special_tokens=False).find(pair)
    expected_len = len(tiny_tok.decode(out, skip_special_tokens=False)[: first + len(pair)].split())
    got = generate(
        tiny_model,
        [PROMPTS[row]],
        SamplingParams(temperature=0.0, max_new_tokens=n, stop=pair),
        tokenizer=tiny_tok,
    )[0]
    assert got.output_ids == out[:expected_len]
    assert got.finish_reason == {"type": "stop", "matched": pair}

    # A stop string that never appears does not stop anything.
    got = generate(
        tiny_model,
        [PROMPTS[row]],
        SamplingParams(temperature=0.0, max_new_tokens=n, stop=["zzz"]),
        tokenizer=tiny_tok,
    )[0]
    assert got.output_ids == out
    assert got.finish_reason == {"type": "length", "length": n}


def test_text_is_none_without_tokenizer(tiny_model):
    c = generate(tiny_model, [PROMPTS[0]], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert isinstance(c, Completion)
    assert c.text is None


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_new_tokens": -1},
        {"min_p": -0.1},
        {"min_p": 1.5},
    ],
)
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="####").stop == ["####"]


def test_empty_prompt_raises(tiny_model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny_model, [[1, 2], []], SamplingParams(max_new_tokens=2, seed=0))


def test_params_count_must_match_prompts(tiny_model):
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        generate(tiny_model, [[1, 2], [3]], [SamplingParams(max_new_tokens=2)])
