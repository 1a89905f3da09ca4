"""Tests for rl_core.engine.sampling: the seeded sampler, alone and as the engine uses it.

The sampler's parts are checked against hand-computed values (splitmix64 on Python ints, an
inverse CDF one token at a time). Sampling as the engine does it, over a tiny random Qwen2 on
disk, is checked against Hugging Face ``generate`` (greedy), a full forward pass over prompt
+ output (log-probs), the first-step distribution computed directly from the model (top-k /
top-p / min-p supports), and the engine itself: the same seeded request gives the same
tokens whatever batch it runs in.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
from conftest import EOS_ID, hf_greedy
from engine_helpers import save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.engine.core import EmbeddedEngine, GenerateOutput, GenerateRequest
from rl_core.engine.sampling import SamplingParams, sampling_uniforms

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [40, 2, 33, 17], [20, 21]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("sampler") / "m", seed=0)


@pytest.fixture(scope="module")
def tiny_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def engine(model_dir) -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(model_dir) as eng:
        yield eng


def generate(engine: EmbeddedEngine, prompts, params) -> list[GenerateOutput]:
    """One sample per prompt, submitted together; ``params`` shared or one per prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    batch = uuid.uuid4().hex[:8]
    pairs = enumerate(zip(prompts, params, strict=True))
    return engine.generate_sync([GenerateRequest(f"{batch}-{i}", list(p), sp)
                                 for i, (p, sp) in pairs])  # fmt: skip


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


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


def test_greedy_matches_hf_generate_and_rows_stop_independently(engine, tiny_model):
    n = 10
    free = generate(engine, PROMPTS, _greedy(n))
    for p, c in zip(PROMPTS, free, strict=True):
        assert c.output_ids == hf_greedy(tiny_model, p, n, eos=None)
        assert c.finish_reason == {"type": "length", "length": n}

    # A stop token that ends one row early (it then leaves the batch) but not the others.
    row, stop = _pick_stop_token([c.output_ids for c in free])
    outs = generate(engine, PROMPTS, _greedy(n, stop_token_ids=[stop]))
    stopped = 0
    for p, c in zip(PROMPTS, outs, strict=True):
        expected = hf_greedy(tiny_model, p, n, eos=stop)
        assert c.output_ids == expected
        if stop in expected:
            stopped += 1
            assert expected[-1] == stop and len(c.output_ids) < n
            assert c.finish_reason == {"type": "stop", "matched": stop}
        else:
            assert c.finish_reason == {"type": "length", "length": n}
    assert stopped >= 1 and len(outs[row].output_ids) < n


def test_greedy_is_independent_of_batch_composition(engine):
    batched = generate(engine, PROMPTS, _greedy(8))
    for p, c in zip(PROMPTS, batched, strict=True):
        alone = generate(engine, [p], _greedy(8))[0]
        assert alone.output_ids == c.output_ids
        torch.testing.assert_close(torch.tensor(alone.output_logprobs),
                                   torch.tensor(c.output_logprobs), atol=1e-5, rtol=0)  # fmt: skip


# --------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_including_the_stop_token(engine, tiny_model, temperature):
    seeds = [11, 12, 13, 14, 15]

    def params(**kw) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, max_new_tokens=12, seed=s,
                               ignore_eos=True, **kw) for s in seeds]  # fmt: skip

    _, stop = _pick_stop_token([c.output_ids for c in generate(engine, PROMPTS, params())])
    ended_on_stop = 0
    for p, c in zip(PROMPTS, generate(engine, PROMPTS, params(stop_token_ids=[stop])), strict=True):
        assert len(c.output_logprobs) == len(c.output_ids) > 0
        if c.finish_reason["type"] == "stop":
            ended_on_stop += 1
            assert c.output_ids[-1] == stop
        expected = _manual_logprobs(tiny_model, p, c.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)
    assert ended_on_stop >= 1  # the stop token's log-prob was checked too


def test_greedy_logprobs_are_unscaled_log_softmax(engine, tiny_model):
    c = generate(engine, [PROMPTS[0]], _greedy(6))[0]
    expected = _manual_logprobs(tiny_model, PROMPTS[0], c.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(c.output_logprobs), expected, atol=1e-5, rtol=0)


def test_logprobs_are_taken_before_top_k_filtering(engine, tiny_model):
    greedy = generate(engine, PROMPTS, _greedy(6))
    top1 = generate(engine, PROMPTS, [SamplingParams(top_k=1, max_new_tokens=6, seed=s,
                                                     ignore_eos=True)
                                      for s in range(5)])  # fmt: skip
    for p, g, c in zip(PROMPTS, greedy, top1, strict=True):
        assert c.output_ids == g.output_ids  # top_k=1 is greedy
        lp = torch.tensor(c.output_logprobs)
        assert bool((lp < -1e-3).all()), "log-probs of filtered sampling must not be 0"
        expected = _manual_logprobs(tiny_model, p, c.output_ids, 1.0)
        torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- seeded sampling


def _sampled(engine, prompts, seeds):
    return generate(engine, prompts, [SamplingParams(temperature=1.0, max_new_tokens=10, seed=s,
                                                     ignore_eos=True) for s in seeds])  # fmt: skip


def test_same_seed_same_sample_whatever_the_batch(engine, model_dir):
    seeds = [101, 202, 303, 404, 505]
    ref = _sampled(engine, PROMPTS, seeds)
    variants = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0], [3], [1, 4, 1, 0]]  # duplicates too
    for order in variants:
        outs = _sampled(engine, [PROMPTS[i] for i in order], [seeds[i] for i in order])
        for i, c in zip(order, outs, strict=True):
            assert c.output_ids == ref[i].output_ids, f"request {i} changed in batch {order}"
            torch.testing.assert_close(torch.tensor(c.output_logprobs),
                                       torch.tensor(ref[i].output_logprobs),
                                       atol=1e-5, rtol=0)  # fmt: skip
    for cap in (1, 2, 3):  # fewer rows at a time: requests wait and join a running batch
        with EmbeddedEngine(model_dir, max_running_requests=cap) as small:
            assert [c.output_ids for c in _sampled(small, PROMPTS, seeds)] == [
                c.output_ids for c in ref]  # fmt: skip


def test_mixed_params_rows_do_not_interfere(engine):
    greedy = generate(engine, [PROMPTS[2]], _greedy(8))
    sampled = _sampled(engine, [PROMPTS[0]], [7])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, ignore_eos=True)
    mixed = generate(engine, [PROMPTS[0], PROMPTS[2]], [sampling, _greedy(8)])
    assert mixed[0].output_ids == sampled[0].output_ids
    assert mixed[1].output_ids == greedy[0].output_ids


def test_different_seeds_differ(engine):
    outs = _sampled(engine, [PROMPTS[0]] * 8, list(range(8)))
    assert len({tuple(c.output_ids) for c in outs}) >= 6


def test_unseeded_requests_get_fresh_seeds(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    outs = generate(engine, [PROMPTS[0]] * 4, params)
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
    from rl_core.engine.sampling import _splitmix64

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
    from rl_core.engine.sampling import sample_next

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
        token, logp = sample_next(logits, temperature, no_k, no_p, no_min, seeds, pos)
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
    from rl_core.engine.sampling import _inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    for u in (1e-300, 0.25 - 1e-12, 0.25, 0.5, 1 - 2.0**-53, 1.0):  # 1.0: rounding's worst case
        token = _inverse_cdf(probs, torch.full((2,), u, dtype=torch.float64))
        assert token[1] == 2
        assert token[0] == (1 if u < 0.25 else 3), u


def test_inverse_cdf_samples_follow_softmax():
    from rl_core.engine.sampling import sample_next

    n = 4000
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(n, 4)
    ones, no_k, no_min = torch.ones(n), torch.full((n,), -1), torch.zeros(n)
    seeds = torch.arange(n) * 7919 + 13
    for position in (0, 5):
        pos = torch.full((n,), position)
        token, _ = sample_next(logits, ones, no_k, ones, no_min, seeds, pos)
        counts = torch.bincount(token, minlength=4)
        expected = torch.softmax(logits[0], -1) * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 3 degrees of freedom: P(chi2 > 25) < 2e-5, so this is a loose check.
        assert chi2 < 25.0, (counts.tolist(), expected.tolist())


# --------------------------------------------------------------------- filtering


def _first_tokens(engine, prompt, n, **kw) -> set[int]:
    params = [SamplingParams(max_new_tokens=1, seed=1000 + i, **kw) for i in range(n)]
    return {c.output_ids[0] for c in generate(engine, [prompt] * n, params)}


def test_top_k_restricts_to_top_k_tokens(engine, tiny_model):
    prompt = PROMPTS[0]
    top3 = set(torch.topk(_first_step_probs(tiny_model, prompt), 3).indices.tolist())
    assert len(_first_tokens(engine, prompt, 300)) > 3  # unfiltered is wider
    assert _first_tokens(engine, prompt, 300, top_k=3) == top3


def test_top_p_restricts_to_nucleus(engine, tiny_model):
    prompt = PROMPTS[3]
    sorted_p, order = torch.sort(_first_step_probs(tiny_model, prompt), descending=True)
    top_p = 0.5
    size = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # smallest prefix reaching top_p
    got = _first_tokens(engine, prompt, 400, top_p=top_p)
    assert got <= set(order[:size].tolist())
    assert len(got) >= min(size, 2)


def test_min_p_restricts_to_tokens_near_the_mode(engine, tiny_model):
    prompt = PROMPTS[2]
    probs = _first_step_probs(tiny_model, prompt)
    min_p = 0.3
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    got = _first_tokens(engine, prompt, 300, min_p=min_p)
    assert got <= allowed
    assert len(got) >= min(len(allowed), 2)


def test_top_p_one_keeps_every_token_whatever_the_batch():
    """float32 cumsum of a peaked distribution reaches 1.0 after its first token; a row
    with top_p=1 must still keep its tail when a top_p<1 row shares the batch."""
    from rl_core.engine.sampling import _filter_logits

    peaked = torch.tensor([[30.0] + [0.0] * 63])
    batch = torch.cat([peaked, torch.randn(1, 64)])
    out = _filter_logits(batch, torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]), torch.zeros(2))
    assert torch.equal(out[0], peaked[0])
    assert bool(torch.isinf(out[1]).any())  # the other row is filtered


def test_sampling_in_blocks_equals_one_block(monkeypatch):
    """Rows are sampled in blocks that stay under torch's parallel grain; any split gives
    the same tokens and log-probs."""
    from rl_core.engine import sampling as sampler

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
    whole = sampler.sample_next(*args)
    monkeypatch.setattr(sampler, "_BLOCK_ELEMENTS", 3 * vocab)  # blocks of 3 rows
    blocked = sampler.sample_next(*args)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])


def test_filtering_applies_at_the_sampling_temperature(engine, tiny_model):
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    temperature = 0.5
    sorted_p, order = torch.sort(torch.softmax(logits / temperature, -1), descending=True)
    size = int((sorted_p.cumsum(0) < 0.6).sum()) + 1
    got = _first_tokens(engine, prompt, 300, top_p=0.6, temperature=temperature)
    assert got <= set(order[:size].tolist())


# --------------------------------------------------------------- stop and length


def test_stop_token_ids(engine):
    n = 10
    free = generate(engine, PROMPTS, _greedy(n))
    row, stop = _pick_stop_token([c.output_ids for c in free])
    out = generate(engine, [PROMPTS[row]], _greedy(n, stop_token_ids=[stop]))[0]
    cut = free[row].output_ids.index(stop) + 1
    assert out.output_ids == free[row].output_ids[:cut]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert len(out.output_logprobs) == cut


def test_max_new_tokens_gives_length_finish(engine):
    params = [SamplingParams(max_new_tokens=m, seed=m, ignore_eos=True) for m in (1, 4, 7)]
    for m, c in zip((1, 4, 7), generate(engine, PROMPTS[:3], params), strict=True):
        assert len(c.output_ids) == len(c.output_logprobs) == c.completion_tokens == m
        assert c.finish_reason == {"type": "length", "length": m}


def test_max_new_tokens_zero_returns_empty(engine):
    out = generate(engine, [PROMPTS[0]], SamplingParams(max_new_tokens=0, seed=1))[0]
    assert out.output_ids == [] and out.output_logprobs == []
    assert out.finish_reason == {"type": "length", "length": 0}
    assert out.prompt_tokens == len(PROMPTS[0])
    # Mixed with a live row in one batch.
    mixed = generate(engine, [PROMPTS[0], PROMPTS[1]], [
        SamplingParams(max_new_tokens=0, seed=1), _greedy(3)])  # fmt: skip
    assert mixed[0].output_ids == [] and mixed[0].finish_reason == {"type": "length", "length": 0}
    assert len(mixed[1].output_ids) == 3


def test_ignore_eos(engine):
    """The model's EOS ends a sample unless ``ignore_eos``, which does not disable explicit
    ``stop_token_ids``."""
    params = [SamplingParams(max_new_tokens=40, seed=s) for s in range(40)]
    outs = generate(engine, [PROMPTS[0]] * 40, params)
    seed, stopped = next(((p.seed, c.output_ids) for p, c in zip(params, outs, strict=True)
                          if c.finish_reason == {"type": "stop", "matched": EOS_ID}),
                         (None, []))  # fmt: skip
    assert seed is not None, "no sample ended on EOS"
    assert stopped[-1] == EOS_ID and EOS_ID not in stopped[:-1]
    ignored = generate(engine, [PROMPTS[0]], SamplingParams(max_new_tokens=40, seed=seed,
                                                            ignore_eos=True))[0]  # fmt: skip
    assert ignored.output_ids[: len(stopped)] == stopped
    assert ignored.finish_reason == {"type": "length", "length": 40}
    explicit = generate(engine, [PROMPTS[0]], SamplingParams(
        max_new_tokens=40, seed=seed, ignore_eos=True, stop_token_ids=[EOS_ID]))[0]  # fmt: skip
    assert explicit.output_ids == stopped


# ------------------------------------------------------------------ stop strings


def test_stop_strings(engine, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    n = 10
    free = generate(engine, PROMPTS, _greedy(n))
    row, token = _pick_stop_token([c.output_ids for c in free])
    out = free[row].output_ids
    cut = out.index(token) + 1

    # One-token stop string.
    stop = tok.decode([token])
    got = generate(engine, [PROMPTS[row]], _greedy(n, stop=[stop]))[0]
    first = next(i for i in range(1, n + 1) if stop in tok.decode(out[:i]))
    assert got.output_ids == out[:first] and first <= cut
    assert got.finish_reason == {"type": "stop", "matched": stop}

    # A stop string spanning two tokens, given as a bare string.
    pair = tok.decode(out[cut - 2 : cut])
    first = next(i for i in range(1, n + 1) if pair in tok.decode(out[:i]))
    got = generate(engine, [PROMPTS[row]], _greedy(n, stop=pair))[0]
    assert got.output_ids == out[:first]
    assert got.finish_reason == {"type": "stop", "matched": pair}

    # A stop string that never appears does not stop anything.
    got = generate(engine, [PROMPTS[row]], _greedy(n, stop=["zzz"]))[0]
    assert got.output_ids == out
    assert got.finish_reason == {"type": "length", "length": n}


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
