"""Tests for rl_core.engine.core: the continuous-batching engine over a tiny Qwen2 on disk.

References: ``engine_helpers.assert_matches_hf`` (every sample is the one ``transformers``
and the sampler draw for it alone, without a KV cache: tokens exact, log-probs to 1e-5),
Hugging Face ``generate`` (greedy), a full forward pass (log-probs), and ``weights_checksum``
of the state dict a weight update delivers. Requests are injected at
exact decode steps through the engine's ``on_step`` hook, so "joins while others decode"
and "abort / pause mid-generation" are deterministic, not timing-dependent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import EOS_ID, PAD_ID, TINY_VOCAB, hf_greedy
from engine_helpers import (
    assert_matches_hf,
    bucket_meta,
    save_tiny_model,
    start_trainer_broadcast,
    wait_ready,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.engine.core import (
    EmbeddedEngine,
    EngineRequestError,
    EngineStateError,
    GenerateOutput,
    GenerateRequest,
)
from rl_core.engine.protocol import model_info, server_info
from rl_core.engine.sampling import SamplingParams
from rl_core.host import free_port
from rl_core.weight_sync import weights_checksum

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [40, 2, 33, 17], [20, 21]]
WAIT = 60.0  # bound on every wait in this module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("engine") / "m0", seed=0)


@pytest.fixture(scope="module")
def model_dir2(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("engine") / "m1", seed=1)


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return _load(model_dir)


@pytest.fixture(scope="module")
def ref_model2(model_dir2):
    return _load(model_dir2)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def make_engine(model_dir):
    engines: list[EmbeddedEngine] = []

    def make(path: Path | None = None, **kw) -> EmbeddedEngine:
        eng = EmbeddedEngine(path or model_dir, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def _same(out: GenerateOutput, model, req: GenerateRequest) -> None:
    assert_matches_hf(out, model, req.input_ids, req.params)


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _full_logprobs(model, tokens: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= start, from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : len(tokens) - 1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens[start:])[:, None]).squeeze(-1)


# --------------------------------------------------------------- continuous batching


@pytest.mark.parametrize("kv_layout", ["slots", "padded"])
def test_requests_joining_mid_decode_match_the_sampler(make_engine, ref_model, kv_layout):
    prompts = [*PROMPTS, [3, 4], [50, 51, 52, 53, 54, 55, 56, 57], [8]]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=11),
        SamplingParams(temperature=0.7, max_new_tokens=30, ignore_eos=True, seed=12),
        SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, max_new_tokens=9, seed=13),
        SamplingParams(temperature=1.0, top_k=5, max_new_tokens=14, seed=14),
        SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=20, seed=15),
        SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=6, seed=16),
        SamplingParams(temperature=1.2, max_new_tokens=11, seed=17),
    ]
    waves = {3: [3, 4], 7: [5, 6], 12: [7]}  # decode step -> requests submitted then
    futures = {}
    running_at_join: list[int] = []

    def req(i: int) -> GenerateRequest:
        return GenerateRequest(f"r{i}", prompts[i], params[i])

    def on_step(n: int) -> None:
        for i in waves.get(n, []):
            running_at_join.append(eng.load()["num_running_reqs"])
            futures[i] = eng.submit(req(i))

    eng = make_engine(on_step=on_step, kv_layout=kv_layout)
    assert eng.kv_layout == kv_layout
    for i in (0, 1, 2):
        futures[i] = eng.submit(req(i))
    _wait_for(lambda: len(futures) == len(prompts), "the last wave")
    outs = {i: f.result(timeout=WAIT) for i, f in futures.items()}

    assert len(running_at_join) == 5 and min(running_at_join) >= 3  # joined a live batch
    assert eng.stats["max_batch"] >= 5
    for i, p in enumerate(prompts):
        _same(outs[i], ref_model, req(i))
        assert outs[i].prompt_tokens == len(p)
        assert outs[i].completion_tokens == len(outs[i].output_ids)
        assert outs[i].cached_tokens == 0 and outs[i].weight_version == "default"
    assert eng.load()["num_running_reqs"] == 0 and eng.load()["num_used_tokens"] == 0


@pytest.mark.parametrize("kv_layout", ["slots", "padded"])
def test_a_groups_identical_prompts_are_prefilled_once(make_engine, ref_model, kv_layout):
    """GRPO's n samples of one prompt, beside other prompts in one prefill: the prompt is
    computed once and each sample decodes on its own copy; every sample equals the sampler's
    own answer (the model's forward), and a row that leaves early frees only its copy."""
    groups = [(PROMPTS[0], 4), (PROMPTS[1], 1), (PROMPTS[2], 3)]
    reqs = [GenerateRequest(f"s{g}-{j}", p, SamplingParams(
        temperature=1.0, max_new_tokens=(3 if j == 1 else 12), ignore_eos=True,
        seed=100 + 10 * g + j)) for g, (p, n) in enumerate(groups) for j in range(n)]
    eng = make_engine(kv_layout=kv_layout)
    outs = eng.generate_sync(reqs)
    assert eng.stats["prefill_batches"] == 1 and eng.stats["prefill_shared_rows"] == 3 + 0 + 2
    for r, out in zip(reqs, outs, strict=True):
        _same(out, ref_model, r)
        assert len(out.output_ids) == r.params.max_new_tokens
    assert len({tuple(o.output_ids) for o in outs[:4]}) > 1  # the copies sample independently


@pytest.mark.parametrize("kv_layout", ["slots", "padded"])
def test_greedy_equals_hf_generate(make_engine, ref_model, kv_layout):
    eng = make_engine(kv_layout=kv_layout)
    reqs = [
        GenerateRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12))
        for i, p in enumerate(PROMPTS)
    ]
    for p, out in zip(PROMPTS, eng.generate_sync(reqs), strict=True):
        assert out.output_ids == hf_greedy(ref_model, p, 12, eos=EOS_ID)


@pytest.mark.parametrize("kv_layout", ["slots", "padded"])
def test_logprobs_equal_a_full_forward_pass(make_engine, ref_model, kv_layout):
    eng = make_engine(kv_layout=kv_layout)
    reqs = [
        GenerateRequest(
            f"lp{i}",
            p,
            SamplingParams(temperature=t, max_new_tokens=10, seed=40 + i),
            return_logprob=True,
            logprob_start_len=k,
        )
        for i, (p, t, k) in enumerate(
            zip(PROMPTS, [0.7, 1.0, 0.0, 1.3, 0.7], [0, 0, 2, 3, 1], strict=True)
        )
    ]
    for r, out in zip(reqs, eng.generate_sync(reqs), strict=True):
        t = r.params.temperature or 1.0  # greedy reports unscaled log-probs
        seq = r.input_ids + out.output_ids
        expected = _full_logprobs(ref_model, seq, len(r.input_ids), temperature=t)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-5, rtol=0)
        # Prompt log-probs (SGLang: unscaled, from position k, first entry None).
        k = r.logprob_start_len
        assert out.input_logprobs is not None
        assert len(out.input_logprobs) == len(r.input_ids) - k
        assert out.input_logprobs[0] is None
        if len(r.input_ids) - k > 1:
            expected_in = _full_logprobs(ref_model, r.input_ids, k + 1)
            torch.testing.assert_close(
                torch.tensor(out.input_logprobs[1:]), expected_in, atol=1e-5, rtol=0
            )


def test_scoring_request_reproduces_rollout_logprobs(make_engine):
    eng = make_engine()
    prompt = PROMPTS[2]
    gen = eng.generate_sync(
        [GenerateRequest("gen", prompt, SamplingParams(max_new_tokens=8, seed=5, ignore_eos=True))]
    )[0]
    score = eng.generate_sync(
        [
            GenerateRequest(
                "score",
                prompt + gen.output_ids,
                SamplingParams(max_new_tokens=0),
                return_logprob=True,
                logprob_start_len=len(prompt) - 1,
            )
        ]
    )[0]
    assert score.output_ids == [] and score.output_logprobs == []
    assert score.finish_reason == {"type": "length", "length": 0}
    assert score.input_logprobs is not None and score.input_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(score.input_logprobs[1:]),
        torch.tensor(gen.output_logprobs),
        atol=1e-5,
        rtol=0,
    )
    assert gen.input_logprobs is None  # not asked for


def test_stop_strings_and_stop_token_ids_end_generation(make_engine, ref_model, tok):
    eng = make_engine()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = hf_greedy(ref_model, PROMPTS[0], 12, eos=None)
    stop_id = next(t for i, t in enumerate(out) if i >= 2 and t not in out[:i])
    cut = out.index(stop_id) + 1
    pair = tok.decode(out[5:7], skip_special_tokens=False)
    with_id = dataclasses.replace(greedy, stop_token_ids=[stop_id])
    params = [with_id, dataclasses.replace(with_id, ignore_eos=False),
              dataclasses.replace(greedy, stop=[pair]), dataclasses.replace(greedy, stop=["zzz"])]
    reqs = [GenerateRequest(f"s{i}", PROMPTS[0], p) for i, p in enumerate(params)]
    outs = eng.generate_sync(reqs)
    for r, got in zip(reqs, outs, strict=True):
        _same(got, ref_model, r)  # ignore_eos keeps explicit stop_token_ids
    by_id, _, by_str, never = outs
    assert by_id.output_ids == out[:cut] and by_id.finish_reason["matched"] == stop_id
    # A stop string ends generation at the first token whose text completes it.
    text = [tok.decode(out[:i], skip_special_tokens=False) for i in range(13)]
    assert by_str.output_ids == out[: next(i for i, t in enumerate(text) if pair in t)]
    assert by_str.finish_reason == {"type": "stop", "matched": pair}
    assert never.output_ids == out and never.finish_reason == {"type": "length", "length": 12}


# ------------------------------------------------------------------------- budgets


def test_kv_budget_and_running_cap_are_respected(make_engine, ref_model):
    reserved: list[int] = []
    running: list[int] = []

    def on_step(_: int) -> None:
        load = eng.load()
        reserved.append(load["num_reserved_tokens"])
        running.append(load["num_running_reqs"])

    eng = make_engine(max_total_tokens=40, on_step=on_step)
    params = [SamplingParams(max_new_tokens=12, seed=60 + i, ignore_eos=True) for i in range(6)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    reqs = [GenerateRequest(f"kv{i}", p, params[i]) for i, p in enumerate(prompts)]
    outs = eng.generate_sync(reqs)
    assert max(reserved) <= 40 and max(running) == 2  # each reserves prompt + 12 <= 18 tokens
    for r, out in zip(reqs, outs, strict=True):
        _same(out, ref_model, r)
    with pytest.raises(EngineRequestError, match="max_total_tokens=40"):
        eng.submit(GenerateRequest("big", [5] * 10, SamplingParams(max_new_tokens=31)))

    capped = make_engine(max_running_requests=2)
    outs = capped.generate_sync(reqs)
    assert capped.stats["max_batch"] == 2
    assert [o.output_ids for o in outs] == [
        o.output_ids
        for o in eng.generate_sync(
            [GenerateRequest(f"again{i}", r.input_ids, r.params) for i, r in enumerate(reqs)]
        )
    ]


# ---------------------------------------------------------------------- KV layouts


def _save_arch(path: Path, arch: str) -> Path:
    """A seeded random tiny ``arch`` model (conftest's vocab and special ids) in ``path``."""
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.2,
    )
    decoder = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**decoder, **common))
    elif arch == "qwen3":  # q/k norms, and a head_dim that is not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**decoder, head_dim=16, **common))
    else:
        model = GPT2LMHeadModel(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
        )
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_slot_layout_matches_transformers_on_other_llama_family_models(make_engine, tmp_path, arch):
    path = _save_arch(tmp_path / arch, arch)
    ref = _load(path)
    eng = make_engine(path)
    assert eng.kv_layout == "slots"
    greedy = [
        GenerateRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12))
        for i, p in enumerate(PROMPTS)
    ]
    for p, out in zip(PROMPTS, eng.generate_sync(greedy), strict=True):
        assert out.output_ids == hf_greedy(ref, p, 12, eos=EOS_ID)
    sampled = [
        GenerateRequest(f"s{i}", p, SamplingParams(max_new_tokens=10, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    for r, out in zip(sampled, eng.generate_sync(sampled), strict=True):
        expected = _full_logprobs(ref, r.input_ids + out.output_ids, len(r.input_ids))
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-5, rtol=0)


def test_other_architectures_fall_back_to_the_padded_layout(make_engine, tmp_path):
    path = _save_arch(tmp_path / "gpt2", "gpt2")
    with pytest.raises(ValueError, match="kv_layout='slots' is not possible.*'gpt2'"):
        make_engine(path, kv_layout="slots")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        make_engine(path, kv_layout="paged")
    eng = make_engine(path)
    assert eng.kv_layout == "padded"
    ref = _load(path)
    reqs = [
        GenerateRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8))
        for i, p in enumerate(PROMPTS)
    ]
    for p, out in zip(PROMPTS, eng.generate_sync(reqs), strict=True):
        assert out.output_ids == hf_greedy(ref, p, 8, eos=EOS_ID)


def test_slot_layout_reuses_freed_slots_and_grows_in_place(make_engine, ref_model):
    """Rows finish at different steps and newcomers take their slots; the buffers grow as
    rows get longer, stay within the running cap and the longest reserve, are kept between
    batches and are freed by flush_cache."""
    eng = make_engine(max_running_requests=4)
    prompts = [PROMPTS[i % len(PROMPTS)] + [30 + i] * (i % 3) for i in range(10)]
    # Two finish at prefill (1 token, so staged rows are compacted) and the columns outgrow
    # their first allocation (16 for an 8-token prefill).
    lengths = [1, 12, 5, 30, 1, 9, 4, 14, 2, 7]
    params = [
        SamplingParams(max_new_tokens=n, seed=70 + i, ignore_eos=i % 2 == 0)
        for i, n in enumerate(lengths)
    ]
    reqs = [GenerateRequest(f"f{i}", p, params[i]) for i, p in enumerate(prompts)]
    first = eng.generate_sync(reqs)
    for r, out in zip(reqs, first, strict=True):
        _same(out, ref_model, r)
    slots, _, columns, _ = eng._kv.k[0].shape
    assert slots == 4
    assert columns <= max(len(r.input_ids) + r.params.max_new_tokens for r in reqs)
    again = [GenerateRequest(f"a{i}", r.input_ids, r.params) for i, r in enumerate(reqs)]
    assert [o.output_ids for o in eng.generate_sync(again)] == [o.output_ids for o in first]
    assert eng.flush_cache() and eng._kv.k == []


# ------------------------------------------------------------------- abort and pause


def _long(rid: str, prompt: list[int], seed: int, n: int = 40) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt, SamplingParams(max_new_tokens=n, seed=seed, ignore_eos=True)
    )


def test_abort_running_request_keeps_partial_tokens(make_engine, ref_model):
    def on_step(n: int) -> None:
        if n == 5:
            aborted.append(eng.abort("victim"))  # prefix match, like SGLang

    aborted: list[int] = []
    eng = make_engine(on_step=on_step)
    victim = _long("victim-7", PROMPTS[0], seed=1)
    other = _long("other", PROMPTS[1], seed=2, n=12)
    out_v, out_o = eng.generate_sync([victim, other])
    assert aborted == [1]
    assert out_v.finish_reason["type"] == "abort" and out_v.finish_reason["message"] == "Aborted"
    assert out_v.completion_tokens == len(out_v.output_ids) == 6  # prefill token + 5 steps
    assert_matches_hf(out_v, ref_model, victim.input_ids, victim.params, finished=False)
    _same(out_o, ref_model, other)


def test_abort_waiting_and_abort_all(make_engine):
    eng = make_engine()
    eng.pause("in_place")
    waiting = [eng.submit(_long(f"w{i}", PROMPTS[i], seed=i)) for i in range(3)]
    assert eng.abort("w1") == 1
    out = waiting[1].result(timeout=WAIT)
    assert out.output_ids == [] and out.finish_reason["message"] == "Abort before prefill"
    assert eng.abort(abort_all=True) == 2
    for f in (waiting[0], waiting[2]):
        assert f.result(timeout=WAIT).finish_reason["type"] == "abort"
    assert eng.abort("nothing-matches") == 0
    eng.resume()
    assert eng.generate_sync([_long("after", PROMPTS[0], seed=3, n=3)])[0].completion_tokens == 3


def _pause_at(step: int, mode: str, eng_box: list[EmbeddedEngine]) -> Callable[[int], None]:
    def on_step(n: int) -> None:
        if n == step:
            eng_box[0].pause(mode)

    return on_step


def test_pause_in_place_keeps_state_and_resumes_identically(make_engine, ref_model):
    box: list[EmbeddedEngine] = []
    eng = make_engine(on_step=_pause_at(4, "in_place", box))
    box.append(eng)
    reqs = [_long("a", PROMPTS[0], seed=21, n=20), _long("b", PROMPTS[2], seed=22, n=25)]
    futures = [eng.submit(r) for r in reqs]
    _wait_for(lambda: eng.paused, "the pause")
    steps = eng.stats["decode_steps"]
    time.sleep(0.1)
    assert eng.stats["decode_steps"] == steps == 4
    assert eng.load()["num_running_reqs"] == 2 and not any(f.done() for f in futures)
    assert eng.flush_cache() is False  # requests are still running
    eng.resume()
    for r, f in zip(reqs, futures, strict=True):
        out = f.result(timeout=WAIT)
        _same(out, ref_model, r)
        assert out.num_retractions == 0
    assert eng.flush_cache() is True


def test_pause_retract_recomputes_and_resumes_identically(make_engine, ref_model):
    box: list[EmbeddedEngine] = []
    eng = make_engine(on_step=_pause_at(4, "retract", box))
    box.append(eng)
    reqs = [_long("a", PROMPTS[3], seed=31, n=20), _long("b", PROMPTS[4], seed=32, n=15)]
    futures = [eng.submit(r) for r in reqs]
    _wait_for(lambda: eng.paused, "the pause")
    load = eng.load()
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 2
    eng.resume()
    for r, f in zip(reqs, futures, strict=True):
        out = f.result(timeout=WAIT)
        _same(out, ref_model, r)
        assert out.num_retractions == 1


def test_pause_abort_returns_partials_and_queues_new_requests(make_engine, ref_model):
    box: list[EmbeddedEngine] = []
    eng = make_engine(on_step=_pause_at(4, "abort", box))
    box.append(eng)
    first = eng.submit(_long("a", PROMPTS[0], seed=41))
    out = first.result(timeout=WAIT)
    assert out.finish_reason["type"] == "abort" and out.completion_tokens == 5
    assert eng.paused
    later = _long("later", PROMPTS[1], seed=42, n=6)
    fut = eng.submit(later)
    time.sleep(0.1)
    assert not fut.done() and eng.load()["num_waiting_reqs"] == 1
    eng.resume()
    _same(fut.result(timeout=WAIT), ref_model, later)


def test_async_generate_and_cancellation_aborts(make_engine, ref_model):
    eng = make_engine()

    async def run() -> tuple[GenerateOutput, int]:
        ok = await eng.generate(_long("x", PROMPTS[0], seed=5, n=8))
        eng.pause("in_place")
        task = asyncio.ensure_future(eng.generate(_long("cancel-me", PROMPTS[1], seed=6)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if eng.load()["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.01)
        return ok, eng.load()["num_waiting_reqs"]

    ok, waiting = asyncio.run(asyncio.wait_for(run(), WAIT))
    _same(ok, ref_model, _long("x", PROMPTS[0], seed=5, n=8))
    assert waiting == 0  # the cancelled request left the queue


# ------------------------------------------------------------------------- memory


def test_release_and_resume_memory_mid_run_keeps_outputs(make_engine, ref_model):
    released = threading.Event()

    def on_step(n: int) -> None:
        if n == 3:
            eng.release_memory()
            released.set()

    eng = make_engine(on_step=on_step)
    before = eng.checksum()
    reqs = [_long("a", PROMPTS[0], seed=51, n=15), _long("b", PROMPTS[3], seed=52, n=10)]
    futures = [eng.submit(r) for r in reqs]
    assert released.wait(WAIT)
    assert eng.memory_released == {"weights": True, "kv_cache": True}
    assert all(p.numel() == 0 for p in eng.model.parameters())
    assert eng.checksum() == before  # the host buffer still holds the weights
    assert eng.load()["num_waiting_reqs"] == 2 and not any(f.done() for f in futures)
    eng.resume_memory()
    assert eng.memory_released == {"weights": False, "kv_cache": False}
    for r, f in zip(reqs, futures, strict=True):
        out = f.result(timeout=WAIT)
        _same(out, ref_model, r)
        assert out.num_retractions == 1
    assert eng.checksum() == before
    with pytest.raises(EngineRequestError, match="unknown memory tags"):
        eng.release_memory(["gpu"])


# ------------------------------------------------------------------ weight updates


def test_update_weights_from_disk(make_engine, model_dir2, ref_model, ref_model2):
    eng = make_engine()
    req = _long("a", PROMPTS[0], seed=3, n=10)
    _same(eng.generate_sync([req])[0], ref_model, req)
    checksum = eng.update_weights_from_disk(model_dir2, weight_version=3)
    assert checksum == eng.checksum() == weights_checksum(ref_model2.state_dict())
    assert eng.weight_version == "3"
    out = eng.generate_sync([dataclasses.replace(req, rid="b")])[0]
    _same(out, ref_model2, req)
    assert out.weight_version == "3"
    assert eng.model_path == str(model_dir2)


def test_update_weights_from_disk_rejects_mismatches(make_engine, model_dir2, tmp_path):
    eng = make_engine()
    before = eng.checksum()
    weights = load_file(str(model_dir2 / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "unknown names": {**weights, "model.extra.weight": torch.zeros(2)},
        "missing names": {k: v for k, v in weights.items() if k != name},
        "shape mismatches": {**weights, name: torch.zeros(3, 3)},
    }
    for i, (msg, named) in enumerate(cases.items()):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        save_file(named, str(d / "model.safetensors"))
        with pytest.raises(EngineRequestError, match=msg):
            eng.update_weights_from_disk(d, weight_version="bad")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
        eng.update_weights_from_disk(empty)
    assert eng.checksum() == before and eng.weight_version == "default"


def test_update_weights_from_tensors_in_buckets(make_engine, ref_model2):
    eng = make_engine()
    new = {k: v.clone() for k, v in ref_model2.state_dict().items()}
    names = sorted(new)
    eng.update_weights_from_tensors({k: new[k] for k in names[: len(names) // 2]})
    assert eng.weight_version == "default"  # no version given: unchanged
    checksum = eng.update_weights_from_tensors(
        {k: new[k] for k in names[len(names) // 2 :]}, weight_version="7"
    )
    assert checksum == weights_checksum(ref_model2.state_dict()) and eng.weight_version == "7"
    req = GenerateRequest("a", PROMPTS[1], SamplingParams(max_new_tokens=8, seed=9))
    _same(eng.generate_sync([req])[0], ref_model2, req)
    with pytest.raises(EngineRequestError, match="unknown names"):
        eng.update_weights_from_tensors({"nope": torch.zeros(1)})
    assert eng.update_weight_version(8) == "8" and eng.weight_version == "8"


def test_checksum_is_cached_and_recomputed_when_weights_are_applied(make_engine, ref_model,
                                                                    ref_model2):  # fmt: skip
    eng = make_engine()
    loaded = weights_checksum(ref_model.state_dict())
    assert eng.checksum() == loaded
    with torch.no_grad():  # behind the engine's back: the cached value is what it serves
        eng.model.lm_head.weight[0, 0] += 1.0
    assert eng.checksum() == loaded
    eng.release_memory(["weights"])
    eng.resume_memory(["weights"])  # the same bytes come back: nothing to recompute
    assert eng.checksum() == loaded
    new = weights_checksum(ref_model2.state_dict())
    assert eng.update_weights_from_tensors(ref_model2.state_dict()) == eng.checksum() == new


def test_tied_model_disk_update_and_memory_release(make_engine, tmp_path):
    a = save_tiny_model(tmp_path / "tied0", seed=0, tie=True)
    b = save_tiny_model(tmp_path / "tied1", seed=1, tie=True)
    assert "lm_head.weight" not in load_file(str(b / "model.safetensors"))
    model_b = _load(b)
    eng = make_engine(a)
    eng.release_memory(["weights"])
    checksum = eng.update_weights_from_disk(b, weight_version="1")  # lands in the host buffer
    eng.resume_memory(["weights"])
    assert checksum == eng.checksum() == weights_checksum(model_b.state_dict())
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
    req = GenerateRequest("t", PROMPTS[0], SamplingParams(max_new_tokens=8, seed=4))
    _same(eng.generate_sync([req])[0], model_b, req)


def test_distributed_update_from_a_gloo_trainer_process(
    make_engine, model_dir2, ref_model2, tmp_path
):
    eng = make_engine(weight_sync_timeout_s=60)
    new = {k: v.contiguous() for k, v in ref_model2.state_dict().items()}
    weights_file = tmp_path / "trainer.safetensors"
    save_file(new, str(weights_file))
    port = free_port()
    trainer = start_trainer_broadcast(weights_file, port, "wg", world_size=2)
    try:
        wait_ready(trainer)
        eng.init_weights_update_group(
            "127.0.0.1", port, rank_offset=1, world_size=2, group_name="wg"
        )
        with pytest.raises(EngineStateError, match="already exists"):
            eng.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wg")
        names, dtypes, shapes = bucket_meta(new)
        checksum = eng.update_weights_from_distributed(
            names, dtypes, shapes, group_name="wg", weight_version="12"
        )
        eng.destroy_weights_update_group("wg")
        log, _ = trainer.communicate(timeout=WAIT)
        assert trainer.returncode == 0, log
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=WAIT)
    assert checksum == weights_checksum(ref_model2.state_dict()) and eng.weight_version == "12"
    req = GenerateRequest("d", PROMPTS[4], SamplingParams(max_new_tokens=8, seed=10))
    _same(eng.generate_sync([req])[0], ref_model2, req)
    with pytest.raises(EngineStateError, match="no weight update group"):
        eng.update_weights_from_distributed(names, dtypes, shapes, group_name="wg")
    with pytest.raises(EngineRequestError, match="needs an accelerator"):
        eng.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="x", backend="nccl")


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("input_ids", "max_new", "start", "match"),
    [
        ([], 4, -1, "input_ids cannot be empty"),
        ([5, 64], 4, -1, "token id 64 outside the vocabulary"),
        ([5, -1], 4, -1, "outside the vocabulary"),
        ([5] * 256, 0, -1, "longer than the model's context length"),
        ([5] * 250, 7, -1, "exceeds the model's maximum context length of 256"),
        ([5, 6], 4, 3, "logprob_start_len=3 is higher than the number of input tokens 2"),
        ([5, 6], 4, -2, "logprob_start_len must be -1 or >= 0"),
    ],
)
def test_invalid_requests_are_refused(make_engine, input_ids, max_new, start, match):
    eng = make_engine()
    req = GenerateRequest("bad", input_ids, SamplingParams(max_new_tokens=max_new), True, start)
    with pytest.raises(EngineRequestError, match=match):
        eng.submit(req)
    assert eng.load()["num_waiting_reqs"] == 0


def test_duplicate_rid_and_closed_engine(make_engine):
    eng = make_engine()
    eng.pause("in_place")
    fut = eng.submit(_long("dup", PROMPTS[0], seed=1))
    with pytest.raises(EngineRequestError, match="Duplicate request ID"):
        eng.submit(_long("dup", PROMPTS[0], seed=1))
    eng.close()
    with pytest.raises(EngineStateError):
        fut.result(timeout=WAIT)
    with pytest.raises(EngineStateError, match="closed"):
        eng.submit(_long("late", PROMPTS[0], seed=1))


def test_info_and_load_reports(make_engine, model_dir):
    eng = make_engine(max_total_tokens=1000, max_running_requests=8)
    info = model_info(eng)
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["weight_version"] == "default"
    server = server_info(eng)
    for key in ("tp_size", "pp_size", "dp_size", "ep_size"):
        assert server[key] == 1
    assert server["disaggregation_mode"] == "null" and server["context_length"] == 256
    assert server["max_total_num_tokens"] == 1000 and server["max_running_requests"] == 8
    assert eng.load()["token_usage"] == 0.0
    assert eng.eos_token_ids == [EOS_ID]


def test_engine_needs_no_files_once_loaded(make_engine, tmp_path):
    """Weights live in memory (one copy shared by every request); the checksum is the model's."""
    src = save_tiny_model(tmp_path / "copy", seed=2)
    eng = make_engine(src)
    shutil.rmtree(src)  # everything needed is in memory after loading
    outs = eng.generate_sync([_long(f"c{i}", PROMPTS[i], seed=i, n=4) for i in range(5)])
    assert all(o.completion_tokens == 4 for o in outs)
    assert eng.checksum() == weights_checksum(eng.model.state_dict())


def test_an_engine_without_a_thread_runs_on_its_callers(make_engine, ref_model):
    """background=False (the in-process plane): no scheduler thread; the thread waiting in
    generate_sync or a control call runs the scheduler. Same outputs as the threaded engine,
    controls from another thread run while one thread drives, and a paused engine's wait
    stays bounded."""
    threaded, driven = make_engine(), make_engine(background=False)
    assert driven._thread is None
    reqs = [_long(f"d{i}", p, seed=i, n=10) for i, p in enumerate(PROMPTS)]
    outs = driven.generate_sync(reqs)
    assert [o.output_ids for o in outs] == [o.output_ids for o in threaded.generate_sync(reqs)]
    for req, out in zip(reqs, outs, strict=True):
        _same(out, ref_model, req)
    # a control from a second thread while this one drives a long generation: it aborts it
    started = threading.Event()

    first = driven.stats["decode_steps"]

    def on_step(n: int) -> None:  # on the driving thread: hold step 5 until the abort is queued
        if n == first + 5:
            started.set()
            _wait_for(lambda: bool(driven._controls), "the other thread's abort")

    driven.on_step = on_step
    aborter = threading.Thread(target=lambda: (started.wait(WAIT), driven.abort(abort_all=True)))
    aborter.start()
    (out,) = driven.generate_sync([_long("long", PROMPTS[0], seed=9, n=200)], timeout=WAIT)
    aborter.join(WAIT)
    assert out.finish_reason["type"] == "abort" and len(out.output_ids) == 6
    driven.on_step = None
    driven.pause("abort")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        driven.generate_sync([_long("paused", PROMPTS[0], seed=3, n=4)], timeout=0.3)
    assert time.monotonic() - t0 < 5
    driven.resume()
    assert driven.generate_sync([_long("after", PROMPTS[1], seed=4, n=3)])[0].output_ids
