"""Tests for rl_core.tinker.backend: LoRA adapters trained with Tinker's losses on a tiny random
Qwen2 (tests/engine_helpers.py) and sampled through the embedded engine.

References: a hand-written torch loss over an independent ``peft`` model loaded from the
saved adapter (gradients per tensor), the trainer's own log-probs (the engine's scoring of the
same adapter), and bitwise equality of adapter weights (isolation, exact resume).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import EOS_ID
from engine_helpers import CHARS, save_tiny_model

from rl_core.engine.lora import parse_adapter, read_adapter
from rl_core.tinker import AdamParams, Datum, SamplingParams, TinkerError
from rl_core.tinker.backend import ATTN_MODULES, LoraBackend

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, TARGET = [5, 6, 7], [20, 21, 22, 23, EOS_ID]
ADAM = AdamParams(learning_rate=1e-2, beta2=0.99, eps=1e-8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tinker") / "m0", seed=0)


@pytest.fixture(scope="module")
def backend(model_dir, tmp_path_factory):
    tied = save_tiny_model(tmp_path_factory.mktemp("tinker") / "tied", seed=1, tie=True)
    b = LoraBackend({"tiny": model_dir, "tied": tied}, num_threads=1)
    yield b
    b.close()


def ce_datum(prompt=PROMPT, target=TARGET) -> Datum:
    full = prompt + target
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(target), np.float32)
    return Datum(full[:-1], {"target_tokens": np.array(full[1:]), "weights": weights})


def rl_datum(tokens, targets, sampler_logprobs, advantages) -> Datum:
    return Datum(list(tokens), {"target_tokens": np.asarray(targets, np.int64),
                                "logprobs": np.asarray(sampler_logprobs, np.float32),
                                "advantages": np.asarray(advantages, np.float32)})


def warm(b: LoraBackend, model_id: str, seed: int = 0, steps: int = 1) -> None:
    """A new adapter with a few CE steps behind it (B != 0: every LoRA tensor has a gradient)."""
    b.create_model(model_id, "tiny", 4, seed=seed)
    for _ in range(steps):
        b.forward_backward(model_id, [ce_datum()], "cross_entropy")
        b.optim_step(model_id, ADAM)


def grads_zero(b: LoraBackend, model_id: str) -> bool:
    return all(not g.any() for g in b.adapter_grads(model_id).values())


def test_create_model_info_targets_and_errors(backend):
    info = backend.create_model("info-all", "tiny", 8, seed=1)
    assert info["target_modules"] == sorted([*ATTN_MODULES, "gate_proj", "up_proj",
                                             "down_proj", "lm_head"])
    assert info["trainable_params"] == sum(w.numel()
                                           for w in backend.adapter_weights("info-all").values())
    assert info["rank"] == 8 and info["train_unembed"] and info["notes"] == []
    attn = backend.create_model("info-attn", "tiny", 2, train_mlp=False, train_unembed=False)
    assert attn["target_modules"] == sorted(ATTN_MODULES)
    assert all(".self_attn." in k for k in backend.adapter_weights("info-attn"))
    tied = backend.create_model("info-tied", "tied", 2, seed=0)
    assert not tied["train_unembed"] and "lm_head" not in tied["target_modules"]
    assert "tied" in tied["notes"][0]
    assert backend.base_model_names() == ["tiny", "tied"]
    assert backend.tokenizer_dir("tiny").endswith("m0")
    # the same seed draws the same initial adapter
    backend.create_model("info-all-2", "tiny", 8, seed=1)
    a, b = backend.adapter_weights("info-all"), backend.adapter_weights("info-all-2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(TinkerError, match="already exists"):
        backend.create_model("info-all", "tiny", 8)
    with pytest.raises(TinkerError, match=r"unknown base model 'nope'.*'tied', 'tiny'"):
        backend.create_model("x", "nope", 8)
    with pytest.raises(TinkerError, match="rank"):
        backend.create_model("x", "tiny", 0)
    with pytest.raises(TinkerError, match="at least one"):
        backend.create_model("x", "tiny", 2, train_mlp=False, train_attn=False,
                             train_unembed=False)
    backend.delete_model("info-attn")
    with pytest.raises(TinkerError, match="unknown model id 'info-attn'"):
        backend.forward_backward("info-attn", [ce_datum()], "cross_entropy")
    backend.forward_backward("info-all", [ce_datum()], "cross_entropy", forward_only=True)


def test_cross_entropy_learns_and_engine_logprobs_match_trainer(backend, tmp_path):
    backend.create_model("ce", "tiny", 8, seed=0)
    losses = []
    for _ in range(25):
        out, metrics = backend.forward_backward("ce", [ce_datum()], "cross_entropy")
        assert set(metrics) == {"loss:sum", "tokens:sum"} and metrics["tokens:sum"] == 5
        losses.append(metrics["loss:sum"])
        backend.optim_step("ce", ADAM)
    assert losses[-1] < 0.1 * losses[0]
    full = PROMPT + TARGET
    assert out[0].dtype == np.float32 and out[0].shape == (len(full) - 1,)
    assert metrics["loss:sum"] == pytest.approx(-out[0][len(PROMPT) - 1:].sum(), rel=1e-5)

    adapter = tmp_path / "sampler"
    backend.save_sampler_weights("ce", adapter)
    cfg, tensors = read_adapter(adapter)  # the engine's reader and checks accept it
    from transformers import AutoModelForCausalLM
    shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_pretrained(
        backend.tokenizer_dir("tiny")).state_dict().items()}
    parsed = parse_adapter("ce", cfg, tensors, shapes)
    assert "lm_head.weight" in parsed.deltas and parsed.rank == 8

    trainer, _ = backend.forward_backward("ce", [ce_datum()], "cross_entropy", forward_only=True)
    engine = backend.compute_logprobs("tiny", adapter, full)
    assert engine[0] is None and len(engine) == len(full)
    np.testing.assert_allclose(np.array(engine[1:]), trainer[0], atol=1e-4, rtol=0)
    base = backend.compute_logprobs("tiny", None, full)
    assert np.abs(np.array(base[1:]) - trainer[0]).max() > 1.0  # the adapter is applied

    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    [s] = backend.sample("tiny", adapter, PROMPT, 1, greedy)
    assert s.tokens == TARGET and s.stop_reason == "stop"
    np.testing.assert_allclose(s.logprobs, trainer[0][len(PROMPT) - 1:], atol=1e-4, rtol=0)
    by_id = backend.sample("tiny", adapter, PROMPT, 1, SamplingParams(8, 0.0, stop=(22,)))[0]
    by_str = backend.sample("tiny", adapter, PROMPT, 1, SamplingParams(8, 0.0, stop=(CHARS[19],)))
    assert by_id.tokens == TARGET[:3] == by_str[0].tokens and by_id.stop_reason == "stop"
    short = backend.sample("tiny", adapter, PROMPT, 1, SamplingParams(max_tokens=2,
                                                                     temperature=0.0))[0]
    assert short.tokens == TARGET[:2] and short.stop_reason == "length"
    no_stop = backend.sample("tiny", adapter, PROMPT, 1, SamplingParams(8, 0.0, ignore_eos=True))
    assert no_stop[0].tokens[:len(TARGET)] == TARGET and len(no_stop[0].tokens) == 8
    assert no_stop[0].stop_reason == "length"  # the SDK's stop=[]: not even EOS ends it
    seeded = SamplingParams(max_tokens=6, temperature=1.5, seed=7)
    first = backend.sample("tiny", None, PROMPT, 3, seeded)
    assert len(first) == 3 and all(len(s.logprobs) == len(s.tokens) for s in first)
    assert [s.tokens for s in first] == [s.tokens for s in backend.sample("tiny", None, PROMPT,
                                                                          3, seeded)]
    assert len({tuple(s.tokens) for s in first}) > 1  # seed + i: different samples

    # the same directory rewritten (more training) is reloaded, not served stale
    backend.forward_backward("ce", [ce_datum(target=[30, 31, EOS_ID])], "cross_entropy")
    backend.optim_step("ce", ADAM)
    backend.save_sampler_weights("ce", adapter)
    trainer2, _ = backend.forward_backward("ce", [ce_datum()], "cross_entropy", forward_only=True)
    np.testing.assert_allclose(backend.compute_logprobs("tiny", adapter, full)[1:], trainer2[0],
                               atol=1e-4, rtol=0)
    loaded = backend.loaded_adapters("tiny")  # the module's backend: other tests' adapters too
    assert loaded.count(str(adapter.resolve())) == 1 and loaded[-1] == str(adapter.resolve())


def test_engine_unloads_least_recently_used_adapter(backend, tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "max_loaded_adapters", 2)
    backend.create_model("lru", "tiny", 2, seed=0)
    dirs = [tmp_path / f"a{i}" for i in range(3)]
    for d in dirs:
        backend.save_sampler_weights("lru", d)
        backend.compute_logprobs("tiny", d, PROMPT)
    assert backend.loaded_adapters("tiny") == [str(d.resolve()) for d in dirs[1:]]
    backend.compute_logprobs("tiny", dirs[1], PROMPT)  # used: now the most recent
    assert backend.loaded_adapters("tiny")[-1] == str(dirs[1].resolve())
    with pytest.raises(TinkerError, match="no adapter"):
        backend.compute_logprobs("tiny", tmp_path / "missing", PROMPT)


def test_gradients_accumulate_across_calls(backend):
    d1, d2 = ce_datum(), ce_datum(prompt=[9, 10], target=[40, 41, 42])
    for mid in ("acc-split", "acc-joint"):
        warm(backend, mid)
    _, m1 = backend.forward_backward("acc-split", [d1], "cross_entropy")
    backend.forward_backward("acc-split", [d1], "cross_entropy", forward_only=True)  # no grads
    _, m2 = backend.forward_backward("acc-split", [d2], "cross_entropy")
    _, m12 = backend.forward_backward("acc-joint", [d1, d2], "cross_entropy")
    assert m12["loss:sum"] == pytest.approx(m1["loss:sum"] + m2["loss:sum"], rel=1e-5)
    assert m12["tokens:sum"] == m1["tokens:sum"] + m2["tokens:sum"]
    split, joint = backend.adapter_grads("acc-split"), backend.adapter_grads("acc-joint")
    for k in split:
        torch.testing.assert_close(split[k], joint[k], rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in split.values())
    # micro-batches (one datum per forward) sum to the same gradient
    warm(backend, "acc-micro")
    backend.max_batch_tokens, old = 1, backend.max_batch_tokens
    try:
        backend.forward_backward("acc-micro", [d1, d2], "cross_entropy")
    finally:
        backend.max_batch_tokens = old
    micro = backend.adapter_grads("acc-micro")
    for k in split:
        torch.testing.assert_close(micro[k], joint[k], rtol=1e-4, atol=1e-6)


def test_two_dimensional_targets(backend):
    warm(backend, "k2")
    tokens = PROMPT + TARGET[:-1]
    targets = np.array([[t, (t + 3) % 64] for t in PROMPT[1:] + TARGET])
    weights = np.array([[1.0, -0.5]] * len(tokens), np.float32)
    [lp2], m = backend.forward_backward("k2", [Datum(tokens, {"target_tokens": targets,
                                                              "weights": weights})],
                                       "cross_entropy", forward_only=True)
    assert lp2.shape == targets.shape
    for col in range(2):
        [lp1], _ = backend.forward_backward("k2", [Datum(tokens, {
            "target_tokens": targets[:, col], "weights": weights[:, col]})], "cross_entropy",
            forward_only=True)
        np.testing.assert_allclose(lp2[:, col], lp1, atol=1e-6)
    assert m["loss:sum"] == pytest.approx(float(-(lp2 * weights).sum()), rel=1e-5)


def test_adapters_on_one_base_are_isolated(backend):
    for mid in ("iso-a", "iso-b", "iso-c"):
        backend.create_model(mid, "tiny", 4, seed=5)
    other = ce_datum(prompt=[11, 12], target=[50, 51])
    backend.forward_backward("iso-a", [ce_datum()], "cross_entropy")
    assert grads_zero(backend, "iso-b")
    b_before = backend.adapter_weights("iso-b")
    backend.forward_backward("iso-b", [other], "cross_entropy")
    backend.forward_backward("iso-c", [other], "cross_entropy")
    a_grads = backend.adapter_grads("iso-a")
    backend.optim_step("iso-a", ADAM)
    after = backend.adapter_weights("iso-b")
    assert all(torch.equal(b_before[k], after[k]) for k in after)  # A's step left B alone
    torch.testing.assert_close(backend.adapter_grads("iso-b"), backend.adapter_grads("iso-c"),
                               rtol=0, atol=0)
    assert not all(torch.equal(a_grads[k], g) for k, g in backend.adapter_grads("iso-b").items())
    backend.optim_step("iso-b", ADAM)
    backend.optim_step("iso-c", ADAM)
    b, c = backend.adapter_weights("iso-b"), backend.adapter_weights("iso-c")
    assert all(torch.equal(b[k], c[k]) for k in b)  # B trained exactly as if alone


def _reference(model_dir, adapter_dir, data, loss_fn, config):
    """(loss, grads by saved name): an independent peft model on the saved adapter and the
    loss written out by hand, one unpadded forward per datum."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).eval()
    total = torch.zeros(())
    for d in data:
        logits = model(input_ids=torch.tensor([d.tokens])).logits[0]
        logp = torch.log_softmax(logits, -1).gather(
            -1, torch.as_tensor(d.inputs["target_tokens"])[:, None]).squeeze(-1)
        q = torch.as_tensor(d.inputs["logprobs"])
        adv = torch.as_tensor(d.inputs["advantages"])
        ratio = torch.exp(logp - q)
        lo = config.get("clip_low_threshold", 0.8)
        hi = config.get("clip_high_threshold", 1.2)
        if loss_fn == "importance_sampling":
            total = total - (ratio * adv).sum()
        elif loss_fn == "ppo":
            total = total - torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
        elif loss_fn == "cispo":
            total = total - (torch.clamp(ratio, lo, hi).detach() * logp * adv).sum()
        elif loss_fn == "gspo":  # tinker-docs losses/gspo, written out per datum
            marked = torch.as_tensor(d.inputs["sequence_ratio_mask"]) != 0
            seq = torch.exp((logp.detach() - q)[marked].mean())
            tok = seq * torch.exp(logp - logp.detach())
            total = total - torch.min(tok * adv, torch.clamp(tok, lo, hi) * adv).sum()
        else:  # dro
            total = total - (logp * adv - 0.5 * config["beta"] * (logp - q) ** 2).sum()
    total.backward()
    grads = {n.replace(".default.weight", ".weight"): p.grad for n, p in model.named_parameters()
             if p.requires_grad}
    return float(total.detach()), grads


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize(("loss_fn", "config"), [
    ("importance_sampling", {}), ("ppo", {}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("dro", {"beta": 0.3}),
    ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03})])
def test_rl_losses_match_a_torch_reference(backend, model_dir, tmp_path, loss_fn, config):
    mid = f"ref-{loss_fn}"
    warm(backend, mid, seed=2, steps=2)
    rng = np.random.default_rng(0)
    seqs = [[5, 6, 7, 20, 21, 22], [9, 10, 40, 41]]
    probe = [rl_datum(s, s[1:] + [EOS_ID], np.zeros(len(s)), np.zeros(len(s))) for s in seqs]
    current, _ = backend.forward_backward(mid, probe, "importance_sampling", forward_only=True)
    data = []
    for s, lp in zip(seqs, current, strict=True):
        adv = rng.normal(size=len(s)).astype(np.float32)
        adv[0] = 0.0  # a prompt position: no loss
        data.append(rl_datum(s, s[1:] + [EOS_ID], lp + rng.uniform(-0.4, 0.4, len(s)), adv))
        if loss_fn == "gspo":  # the ratio over all but the first two positions
            data[-1].inputs["sequence_ratio_mask"] = (np.arange(len(s)) > 1).astype(np.float32)
    backend.save_sampler_weights(mid, tmp_path / "a")
    _, metrics = backend.forward_backward(mid, data, loss_fn, config)
    loss, grads = _reference(model_dir, tmp_path / "a", data, loss_fn, config)
    assert metrics["loss:sum"] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    assert metrics["tokens:sum"] == sum(len(s) - 1 for s in seqs)
    mine = backend.adapter_grads(mid)
    assert set(mine) == set(grads)
    for k in grads:
        torch.testing.assert_close(mine[k], grads[k], rtol=1e-4, atol=1e-6)
    if loss_fn in ("ppo", "cispo", "gspo"):
        assert 0 <= metrics["clipped_frac:mean"] <= 1
    if loss_fn in ("ppo", "cispo"):
        assert 0 < metrics["clipped_frac:mean"] < 1


def test_ppo_clipping(backend):
    tokens = [5, 6, 7, 20, 21]
    targets = tokens[1:] + [22]
    backend.create_model("clip-probe", "tiny", 4, seed=3)
    [lp], _ = backend.forward_backward("clip-probe", [rl_datum(tokens, targets, np.zeros(5),
                                                               np.zeros(5))],
                                       "importance_sampling", forward_only=True)
    q = lp - math.log(1.5)  # ratio 1.5 everywhere
    cases = [("pos", 1.0, {}, True), ("neg", -1.0, {}, False),
             ("wide", 1.0, {"clip_high_threshold": 2.0}, False)]
    for name, sign, config, clipped in cases:
        mid = f"clip-{name}"
        backend.create_model(mid, "tiny", 4, seed=3)
        adv = sign * np.array([0.0, 1.0, 2.0, 0.5, 1.0], np.float32)
        q_case = q.copy()
        q_case[0] = -1e4  # zero advantage: its overflowing ratio must contribute nothing
        _, m = backend.forward_backward(mid, [rl_datum(tokens, targets, q_case, adv)], "ppo",
                                        config)
        grads = backend.adapter_grads(mid)
        assert all(torch.isfinite(g).all() for g in grads.values())
        assert m["tokens:sum"] == 4 and m["ratio:mean"] == pytest.approx(1.5, rel=1e-4)
        if clipped:  # A > 0 and ratio above 1 + eps: the clipped, constant term wins
            assert grads_zero(backend, mid)
            assert m["loss:sum"] == pytest.approx(-1.2 * adv.sum(), rel=1e-4)
            assert m["clipped_frac:mean"] == 1.0
        else:
            assert not grads_zero(backend, mid)
            assert m["loss:sum"] == pytest.approx(-1.5 * adv.sum(), rel=1e-4)
            assert m["clipped_frac:mean"] == (0.0 if config else 1.0)


def test_gspo_by_hand():
    """GSPO-token on small tensors, value and gradient worked out by hand: two datums (3 and
    2 positions), each one sequence ratio s over its masked positions, clipped as a whole."""
    from rl_core.tinker.losses import compute_loss, loss_settings

    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7, -0.3], requires_grad=True)
    # datum a: masked log-ratios 0.05, 0.15 (position 0 unmasked, its 4 ignored): s = e^0.1
    # datum b: both log-ratios log 1.5: s = 1.5, above hi = 1.2
    q = torch.tensor([-5.0, -2.05, -0.65, -0.7 - math.log(1.5), -0.3 - math.log(1.5)])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    adv = torch.tensor([0.0, 1.0, -2.0, 1.0, -1.0])
    settings = loss_settings("gspo", None)
    assert settings == {"lo": 0.8, "hi": 1.2}
    loss, stats = compute_loss("gspo", logp, {"logprobs": q, "advantages": adv,
                                              "sequence_ratio_mask": mask}, settings, [3, 2])
    loss.backward()
    s_a = math.exp(0.1)
    # a: s_a in [0.8, 1.2], unclipped: -(s_a * 1 + s_a * -2). b: A = 1 > 0 takes the clipped
    # 1.2 (no gradient), A = -1 < 0 the unclipped 1.5 * -1.
    want = -(s_a - 2 * s_a) - (1.2 * 1.0 - 1.5)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    # d/dlogp_t = -A_t * s where the unclipped term is taken, 0 where the clipped one is
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -s_a, 2 * s_a, 0.0, 1.5]))
    m = stats.metrics("gspo")
    assert m["tokens:sum"] == 4 and m["ratio:mean"] == pytest.approx((2 * s_a + 3.0) / 4)
    assert m["clipped_frac:mean"] == 0.5  # b's two tokens lie outside [0.8, 1.2]
    none = torch.zeros(2)  # a datum whose mask marks nothing: s = 1
    loss, _ = compute_loss("gspo", torch.zeros(2), {"logprobs": torch.full((2,), -3.0),
                                                    "advantages": torch.ones(2),
                                                    "sequence_ratio_mask": none}, settings)
    assert float(loss) == -2.0


def test_save_load_resumes_exactly(backend, tmp_path):
    params = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                        weight_decay=0.1, grad_clip_norm=0.5)
    data = [ce_datum(), ce_datum(prompt=[9, 10], target=[40, 41, 42])]

    def steps(mid: str, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            backend.forward_backward(mid, data, "cross_entropy")
            out.append(backend.optim_step(mid, params))
        return out

    backend.create_model("run-1", "tiny", 4, seed=11, train_unembed=False)
    steps("run-1", 2)
    saved = backend.adapter_weights("run-1")
    backend.save_state("run-1", tmp_path / "state")
    cont = steps("run-1", 3)
    assert cont[0]["grad_norm:mean"] > 0 and cont[-1]["step:max"] == 5
    assert LoraBackend.saved_config(tmp_path / "state") == {
        "base_model": "tiny", "rank": 4, "seed": 11, "train_mlp": True, "train_attn": True,
        "train_unembed": False}
    backend.create_from_state("run-2", tmp_path / "state", with_optimizer=True)
    resumed = steps("run-2", 3)
    a, b = backend.adapter_weights("run-1"), backend.adapter_weights("run-2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["grad_norm:mean"] for m in cont] == [m["grad_norm:mean"] for m in resumed]
    assert resumed[-1]["step:max"] == 5
    # without the optimizer state: the same weights to start from, a fresh AdamW
    backend.create_from_state("run-3", tmp_path / "state", with_optimizer=False)
    assert all(torch.equal(saved[k], w) for k, w in backend.adapter_weights("run-3").items())
    steps("run-3", 3)
    assert not all(torch.equal(a[k], w) for k, w in backend.adapter_weights("run-3").items())
    # loading into an existing adapter restores the saved weights; a misfit is refused
    backend.load_state("run-1", tmp_path / "state", with_optimizer=True)
    assert all(torch.equal(saved[k], w) for k, w in backend.adapter_weights("run-1").items())
    backend.create_model("run-other", "tiny", 8, seed=0)
    with pytest.raises(TinkerError, match="saved for"):
        backend.load_state("run-other", tmp_path / "state", with_optimizer=True)
    with pytest.raises(TinkerError, match="not a save_state directory"):
        backend.load_state("run-1", tmp_path, with_optimizer=True)
    # a training checkpoint can be sampled too
    assert len(backend.compute_logprobs("tiny", tmp_path / "state", PROMPT)) == 3


def test_refused_requests_name_the_problem_and_change_nothing(backend):
    backend.create_model("err", "tiny", 2, seed=0)
    good = ce_datum()
    with pytest.raises(TinkerError, match=r"unknown loss_fn 'nope'.*cross_entropy"):
        backend.forward_backward("err", [good], "nope")
    with pytest.raises(TinkerError, match=r"datum 1: loss_fn 'cross_entropy' needs "
                                          r"loss_fn_inputs \['weights'\]"):
        backend.forward_backward("err", [good, Datum(good.tokens, {
            "target_tokens": good.inputs["target_tokens"]})], "cross_entropy")
    with pytest.raises(TinkerError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        backend.forward_backward("err", [good], "ppo")
    with pytest.raises(TinkerError, match="beta"):
        backend.forward_backward("err", [rl_datum([5, 6], [6, 7], [0, 0], [1, 1])], "dro")
    with pytest.raises(TinkerError, match="clip_low_threshold"):
        backend.forward_backward("err", [rl_datum([5, 6], [6, 7], [0, 0], [1, 1])], "ppo",
                                 {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2})
    with pytest.raises(TinkerError, match="weights has shape"):
        backend.forward_backward("err", [good, Datum(good.tokens, {
            "target_tokens": good.inputs["target_tokens"], "weights": np.ones(2)})],
            "cross_entropy")
    with pytest.raises(TinkerError, match="outside the vocabulary"):
        backend.forward_backward("err", [Datum([5, 999], {"target_tokens": np.array([6, 7]),
                                                          "weights": np.ones(2)})],
                                 "cross_entropy")
    with pytest.raises(TinkerError, match="at least one datum"):
        backend.forward_backward("err", [], "cross_entropy")
    with pytest.raises(TinkerError, match="unknown model id 'ghost'"):
        backend.forward_backward("ghost", [good], "cross_entropy")
    with pytest.raises(TinkerError, match="unknown model id 'ghost'"):
        backend.optim_step("ghost", ADAM)
    with pytest.raises(TinkerError, match=r"unknown base model 'ghost'.*'tiny'"):
        backend.sample("ghost", None, PROMPT, 1, SamplingParams())
    with pytest.raises(TinkerError, match="beta1"):
        backend.optim_step("err", AdamParams(beta1=1.0))
    with pytest.raises(TinkerError, match="num_samples"):
        backend.sample("tiny", None, PROMPT, 0, SamplingParams())
    with pytest.raises(TinkerError, match="empty"):
        backend.compute_logprobs("tiny", None, [])
    with pytest.raises(TinkerError, match=r"needs loss_fn_inputs \['sequence_ratio_mask'\]"):
        backend.forward_backward("err", [rl_datum([5, 6], [6, 7], [0, 0], [1, 1])], "gspo")
    with pytest.raises(TinkerError, match="stable_reinforce' is not served: Tinker has not "
                                          "published its objective"):
        backend.forward_backward("err", [rl_datum([5, 6], [6, 7], [0, 0], [1, 1])],
                                 "stable_reinforce")
    assert grads_zero(backend, "err")  # the good datums of refused requests left no gradient
