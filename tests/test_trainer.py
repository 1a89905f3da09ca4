"""Tests for rl_core.training: the Batch layout and the torch GRPO trainer.

A tiny random Qwen2 (and a word-level tokenizer) is saved once per session to a temporary
HF directory; every trainer loads it from there, as the real flow does.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PAD_ID, make_batch, tiny_qwen2, tiny_tokenizer

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-tied")
    tiny_qwen2(1, tie=True).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def make_trainer(path, algo: dict | None = None, **train) -> TorchTrainer:
    cfg = TrainConfig(**{"lr": 1e-3, "steps": 10, **train})
    return TorchTrainer(path, cfg, AlgorithmConfig(**(algo or {})))


def random_batch(n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(3, 64, (length,), generator=g).tolist()

    prompts = [ids(1, 6) for _ in range(n)]
    responses = [ids(1, 9) for _ in range(n)]
    logps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    adv = torch.randn(n, generator=g)
    return make_batch(prompts, responses, logps, adv, PAD_ID)


def params_of(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def seq_logp(trainer: TorchTrainer, batch: Batch) -> torch.Tensor:
    """Summed response log-prob of every sample under the current policy."""
    return trainer.compute_logprobs(batch).sum(-1)


# ------------------------------------------------------------------------ batch layout


def test_build_train_batch_layout():
    b = make_batch(
        prompts=[[11, 12, 13], [14]],
        responses=[[21, 22], [23, 24, 25]],
        logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        advantages=[1.5, -0.5],
        pad_id=PAD_ID,
    )
    assert b.input_ids.dtype == torch.int32
    assert b.attention_mask.dtype == torch.bool
    assert b.response_mask.dtype == torch.bool
    assert b.rollout_logp.dtype == torch.float32
    assert b.advantages.dtype == torch.float32
    assert b.size == 2
    # Right padding: width 5 = 3 + 2.
    assert b.input_ids.tolist() == [[11, 12, 13, 21, 22], [14, 23, 24, 25, PAD_ID]]
    assert b.attention_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    # Position t scores token t + 1: row 0 scores 21 at t=2 and 22 at t=3.
    assert b.response_mask.shape == (2, 4)
    assert b.response_mask.tolist() == [
        [False, False, True, True],
        [True, True, True, False],
    ]
    for row in range(2):
        t = torch.nonzero(b.response_mask[row]).flatten()
        assert b.attention_mask[row, t + 1].all()
    torch.testing.assert_close(
        b.rollout_logp,
        torch.tensor([[0.0, 0.0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0.0]]),
    )
    torch.testing.assert_close(b.advantages, torch.tensor([1.5, -0.5]))
    assert b.old_logp is None and b.ref_logp is None


def test_build_train_batch_accepts_tensor_advantages():
    b = make_batch([[1, 2]], [[3]], [[-1.0]], torch.tensor([0.25], dtype=torch.float64), 0)
    assert b.advantages.dtype == torch.float32
    assert b.response_mask.tolist() == [[False, True]]


def test_build_train_batch_length_errors():
    with pytest.raises(ValueError, match="differ in length"):
        make_batch([[1], [2]], [[3]], [[-1.0]], [0.0], 0)
    with pytest.raises(ValueError, match="1 samples but 2 advantages"):
        make_batch([[1]], [[3]], [[-1.0]], [0.0, 1.0], 0)
    with pytest.raises(ValueError, match=r"sample 1: 2 tokens but 1 log-probs"):
        make_batch([[1], [2]], [[3], [4, 5]], [[-1.0], [-1.0]], [0.0, 1.0], 0)


def test_the_loss_mask_keeps_tool_and_environment_tokens_out_of_the_loss():
    """A multi-turn sample: completion = model turn, tool output, model turn. Only the
    model's tokens are trained on and carry their rollout log-probs."""
    from rl_core.types import Batch, Sample

    s = Sample([1, 2], [10, 11, 20, 21, 12], [-0.1, -0.2, -9.0, -9.0, -0.3],
               loss_mask=[1, 1, 0, 0, 1])
    b = Batch.from_samples([s], [1.0], pad_id=0)
    assert b.response_mask.tolist() == [[False, True, True, False, False, True]]
    assert b.rollout_logp[0].tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, 0.0, -0.3])
    with pytest.raises(ValueError, match="5 tokens but 2 mask values"):
        Batch.from_samples([Sample([1], [3] * 5, [0.0] * 5, loss_mask=[1, 0])], [0.0], 0)


def test_build_train_batch_rejects_empty_prompt():
    # With no prompt token nothing scores the first response token; the mask would be wrong.
    with pytest.raises(ValueError, match="prompt"):
        make_batch([[1, 2], []], [[3], [4, 5]], [[-1.0], [-1.0, -2.0]], [0.0, 1.0], 0)


def test_select_trims_to_longest_selected_row():
    b = make_batch(
        [[11, 12, 13], [14], [15, 16]],
        [[21, 22], [23, 24, 25], [26]],
        [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6]],
        [1.0, 2.0, 3.0],
        PAD_ID,
    )
    b.old_logp = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s = b.select(torch.tensor([2, 1]))
    assert s.input_ids.tolist() == [[15, 16, 26, PAD_ID], [14, 23, 24, 25]]
    assert s.attention_mask.shape == (2, 4) and s.response_mask.shape == (2, 3)
    assert s.response_mask.tolist() == [[False, True, False], [True, True, True]]
    assert s.advantages.tolist() == [3.0, 2.0]
    assert s.old_logp.tolist() == [[8.0, 9.0, 10.0], [4.0, 5.0, 6.0]]
    assert s.ref_logp is None
    short = b.select(torch.tensor([2]))
    assert short.input_ids.tolist() == [[15, 16, 26]]
    assert short.response_mask.tolist() == [[False, True]]
    torch.testing.assert_close(short.rollout_logp, torch.tensor([[0.0, -0.6]]))


# -------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_manual_forward(model_dir, temperature):
    cfg = TrainConfig(micro_batch_size=3)
    trainer = TorchTrainer(model_dir, cfg, AlgorithmConfig(), temperature=temperature)
    batch = random_batch(7)
    got = trainer.compute_logprobs(batch)
    assert got.shape == batch.response_mask.shape and got.dtype == torch.float32
    assert trainer.model.training  # restored after the no-grad pass
    reference = tiny_qwen2(0)
    for i in range(batch.size):
        n = int(batch.attention_mask[i].sum())
        ids = batch.input_ids[i, :n].long()
        with torch.no_grad():
            logits = reference(input_ids=ids[None]).logits[0, :-1].float() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
        mask = batch.response_mask[i, : n - 1]
        torch.testing.assert_close(got[i, : n - 1][mask], expected[mask], atol=1e-5, rtol=0)
        assert bool((got[i][~batch.response_mask[i]] == 0).all())


def test_reference_logprobs_need_kl(model_dir):
    trainer = make_trainer(model_dir)
    assert trainer.ref_model is None
    with pytest.raises(ValueError, match=r"no reference model: algorithm\.kl_coef is 0"):
        trainer.compute_logprobs(random_batch(2), reference=True)


def test_reference_logprobs_stay_at_the_initial_policy(model_dir):
    trainer = make_trainer(model_dir, {"kl_coef": 0.01}, lr=1e-2)
    batch = random_batch(4)
    before = trainer.compute_logprobs(batch)
    ref = trainer.compute_logprobs(batch, reference=True)
    torch.testing.assert_close(ref, before, atol=1e-6, rtol=0)
    batch.ref_logp = ref
    trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(trainer.compute_logprobs(batch, reference=True), ref)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


# ------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_gradient_accumulation_is_exact(model_dir, loss_agg):
    batch = random_batch(8)
    results = []
    for mb in (8, 2):
        trainer = make_trainer(model_dir, {"loss_agg": loss_agg}, micro_batch_size=mb)
        # Adam's first step is ~lr * g / (|g| + eps): for a gradient that is mathematically
        # ~0 (|g| ~ 1e-9 < eps = 1e-8) it turns float round-off into O(lr) noise. A larger
        # eps keeps the update smooth in g so parameters can be compared at atol 1e-6.
        for group in trainer.optimizer.param_groups:
            group["eps"] = 1e-4
        metrics = trainer.train_step(batch)
        grads = {k: v.grad.clone() for k, v in trainer.model.named_parameters()}
        results.append((params_of(trainer), grads, metrics))
    (p_full, g_full, m_full), (p_micro, g_micro, m_micro) = results
    assert_params_close(g_full, g_micro, atol=1e-6)
    assert_params_close(p_full, p_micro, atol=1e-6)
    # Reported metrics do not depend on micro-batching either.
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "lr", "ratio_mean", "ratio_max"):
        assert m_micro[key] == pytest.approx(m_full[key], abs=1e-5), key


def test_loss_metric_is_the_minibatch_objective(model_dir):
    # With ratio 1 and no KL/entropy, token-mean pg loss is -sum(A_i * n_i) / sum(n_i).
    batch = random_batch(6, seed=3)
    n_tok = batch.response_mask.sum(-1).float()
    expected = float(-(batch.advantages * n_tok).sum() / n_tok.sum())
    for mb in (6, 4, 1):
        metrics = make_trainer(model_dir, micro_batch_size=mb).train_step(batch)
        assert metrics["pg_loss"] == pytest.approx(expected, abs=1e-5)
        assert metrics["loss"] == pytest.approx(expected, abs=1e-5)


def test_needs_old_logp_truth_table(model_dir):
    trainer = make_trainer(model_dir)
    cases = [
        ({}, {}, False),
        ({"mini_batches": 2}, {}, True),
        ({"ppo_epochs": 2}, {}, True),
        ({"mini_batches": 2, "ppo_epochs": 3}, {}, True),
        ({}, {"tis_cap": 2.0}, False),  # the training forward's detached log-probs serve
        ({"mini_batches": 2}, {"tis_cap": 2.0}, True),
        ({}, {"kl_coef": 0.1, "entropy_coef": 0.01}, False),
    ]
    for train, algo, expected in cases:
        trainer.train_cfg = TrainConfig(**train)
        trainer.algo = AlgorithmConfig(**algo)
        assert trainer.needs_old_logp is expected, (train, algo)


def test_positive_advantage_raises_that_samples_logprob(model_dir):
    batch = make_batch(
        [[5, 6, 7], [5, 6, 7], [9, 10]],
        [[30, 31, 32, 1], [40, 41, 1], [50, 51]],
        [[-4.0] * 4, [-4.0] * 3, [-4.0] * 2],
        [1.0, -1.0, 0.0],
        PAD_ID,
    )
    trainer = make_trainer(model_dir)
    before = seq_logp(trainer, batch)
    steps = [trainer.train_step(batch) for _ in range(3)]
    after = seq_logp(trainer, batch)
    assert trainer.global_step == 3
    assert after[0] > before[0] + 0.05
    assert after[1] < before[1] - 0.05
    assert all(math.isfinite(m["loss"]) for m in steps)


def test_off_policy_step_with_old_logprobs(model_dir):
    trainer = make_trainer(model_dir, {"tis_cap": 2.0}, mini_batches=2, ppo_epochs=2)
    batch = random_batch(8, seed=5)
    batch.old_logp = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    assert trainer.global_step == 4  # mini_batches * ppo_epochs optimizer steps
    for key in ("loss", "pg_loss", "ratio_mean", "tis_mean", "clip_frac", "grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["ratio_max"] >= metrics["ratio_mean"] > 0


# ---------------------------------------------------------------------------- weights


def test_export_weights_uses_hf_names(model_dir):
    trainer = make_trainer(model_dir)
    weights = trainer.export_weights()
    fresh = tiny_qwen2(5)
    assert set(weights) == set(fresh.state_dict())
    assert "model.embed_tokens.weight" in weights
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert "lm_head.weight" in weights
    assert not any(t.requires_grad for t in weights.values())
    fresh.load_state_dict(weights, strict=True)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(fresh.get_parameter(name), p.detach(), atol=0, rtol=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_and_load_state_round_trip(model_dir, tied_model_dir, tmp_path, tied):
    path = tied_model_dir if tied else model_dir
    kw = {"lr_schedule": "cosine", "warmup_steps": 1, "steps": 5, "weight_decay": 0.01}
    first = make_trainer(path, {"kl_coef": 0.01}, **kw)
    b1, b2 = random_batch(6, seed=1), random_batch(6, seed=2)
    for b in (b1, b2):
        b.ref_logp = first.compute_logprobs(b, reference=True)
    first.train_step(b1)
    first.train_step(b1)
    state_dir = first.save_state(tmp_path / "state")
    assert (state_dir / "trainer_state.pt").is_file()

    second = make_trainer(path, {"kl_coef": 0.01}, **kw)
    second.load_state(state_dir)
    assert second.global_step == first.global_step == 2
    assert_params_close(params_of(first), params_of(second), atol=0)
    assert second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    opt1, opt2 = first.optimizer.state_dict(), second.optimizer.state_dict()
    assert opt1["state"].keys() == opt2["state"].keys()
    for k in opt1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt1["state"][k][name], opt2["state"][k][name])

    m1, m2 = first.train_step(b2), second.train_step(b2)
    assert second.global_step == first.global_step == 3
    assert_params_close(params_of(first), params_of(second), atol=1e-7)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["lr"] == m2["lr"]


def test_save_pretrained_loads_back(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(model_dir, lr=1e-2)
    trainer.train_step(random_batch(4))
    out = trainer.save_pretrained(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(name), p.detach(), atol=0, rtol=0)


# ------------------------------------------------------------------------ lr schedule


def _lrs(trainer: TorchTrainer, batch: Batch, n: int) -> list[float]:
    out = [trainer.scheduler.get_last_lr()[0]]
    for _ in range(n):
        metrics = trainer.train_step(batch)
        out.append(trainer.scheduler.get_last_lr()[0])
        assert metrics["lr"] == out[-1]
    return out


def test_lr_warmup_then_constant(model_dir):
    trainer = make_trainer(model_dir, lr=1e-3, warmup_steps=4)
    got = _lrs(trainer, random_batch(2), 6)
    expected = [1e-3 * f for f in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0)]
    assert got == pytest.approx(expected, rel=1e-9)


def test_lr_warmup_then_cosine(model_dir):
    steps, warmup, min_ratio = 6, 2, 0.1
    trainer = make_trainer(
        model_dir,
        lr=1e-3,
        steps=steps,
        warmup_steps=warmup,
        lr_schedule="cosine",
        min_lr_ratio=min_ratio,
    )
    got = _lrs(trainer, random_batch(2), steps + 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    assert got == pytest.approx([1e-3 * factor(s) for s in range(steps + 2)], rel=1e-9)
    assert got[1] == pytest.approx(1e-3)  # warmup ends at the peak
    assert got[warmup + (steps - warmup) // 2] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert got[steps] == pytest.approx(1e-3 * min_ratio)
    assert got[-1] == pytest.approx(1e-3 * min_ratio)  # stays at the floor past the end


def test_cosine_counts_every_optimizer_step(model_dir):
    # total = steps * mini_batches * ppo_epochs optimizer steps.
    trainer = make_trainer(model_dir, lr=1.0, steps=2, mini_batches=2, lr_schedule="cosine")
    batch = random_batch(4)
    trainer.train_step(batch)
    assert trainer.global_step == 2
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.5)  # cos(pi/2): halfway
    trainer.train_step(batch)
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)


# ------------------------------------------------------------ prefix-shared packing


def grouped_batch(groups: int = 4, n: int = 4, seed: int = 0) -> Batch:
    """GRPO's layout: ``groups`` prompts, ``n`` responses each, contiguous."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(3, 64, (length,), generator=g).tolist()

    prompts = [p for p in (ids(6, 11) for _ in range(groups)) for _ in range(n)]
    responses = [ids(1, 9) for _ in prompts]
    logps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    return make_batch(prompts, responses, logps, torch.randn(len(prompts), generator=g), PAD_ID)


def test_packed_groups_train_exactly_like_the_padded_batch(model_dir):
    """One row per group, the prompt computed once: the same log-probs, losses, gradient
    norms and parameters as the padded batch, step after step."""
    from rl_core.training.packing import plan_packing

    batch = grouped_batch()
    packed, padded = make_trainer(model_dir), make_trainer(model_dir, pack_groups=False)
    cfg = packed.model.config
    plan = plan_packing(batch.input_ids.long(), batch.attention_mask, batch.prompt_lens,
                        params=packed._n_params, layers=cfg.num_hidden_layers,
                        hidden=cfg.hidden_size)
    assert plan is not None and plan.input_ids.shape[0] == 4  # it does pack: 4 rows, not 16
    torch.testing.assert_close(packed.compute_logprobs(batch), padded.compute_logprobs(batch),
                               atol=1e-5, rtol=0)
    for _ in range(3):
        a, b = packed.train_step(batch), padded.train_step(batch)
        for key in ("loss", "pg_loss", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert_params_close(params_of(packed), params_of(padded), atol=1e-5)


def test_packing_only_where_it_is_cheaper():
    """No shared prompt, or completions so long that the dense block mask's attention costs
    more than the padding it saves: the padded batch is kept."""
    from rl_core.training.packing import plan_packing

    def plan(batch: Batch, hidden: int) -> object:
        return plan_packing(batch.input_ids.long(), batch.attention_mask, batch.prompt_lens,
                            params=1_000_000, layers=4, hidden=hidden)

    assert plan(random_batch(), 64) is None  # every prompt different
    assert plan(grouped_batch(), 64) is not None
    long = make_batch([[5, 6]] * 8, [[7] * 200] * 8, [[-1.0] * 200] * 8, torch.randn(8), PAD_ID)
    assert plan(long, 4096) is None
