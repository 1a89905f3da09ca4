"""Hand-computed tests for rl_core.algorithms (advantages and losses)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.algorithms.advantages import group_advantages
from rl_core.algorithms.losses import (
    KL_KINDS,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_grpo_loss,
    entropy_from_logits,
    gspo_ratio,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    rollout_correction,
    tis_weights,
)

LN = math.log


def close(a: torch.Tensor | float, b, atol: float = 1e-5) -> bool:
    a_t = torch.as_tensor(a, dtype=torch.float64)
    b_t = torch.as_tensor(b, dtype=torch.float64)
    return torch.allclose(a_t, b_t, atol=atol, rtol=1e-5)


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


# ======================================================================================
# advantages
# ======================================================================================


def test_grpo_advantages_single_group() -> None:
    # rewards [1,0,1,1], group 4: mean .75, deviations [.25,-.75,.25,.25]
    # unbiased std = sqrt((3 * .25^2 + .75^2) / 3) = sqrt(.75 / 3) = .5
    # -> advantages [.25/.5, -.75/.5, .25/.5, .25/.5] = [.5, -1.5, .5, .5]
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4)
    assert close(adv, [0.5, -1.5, 0.5, 0.5])


def test_grpo_advantages_two_groups_and_constant_group() -> None:
    # group 1: [1,0]: mean .5, unbiased std = sqrt((.25 + .25) / 1) = sqrt(.5) -> +-1/sqrt2
    # group 2: [2,2]: identical -> exactly 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    s = 0.5 / math.sqrt(0.5)
    assert close(adv, [s, -s, 0.0, 0.0])
    assert adv[2].item() == 0.0 and adv[3].item() == 0.0


def test_drgrpo_advantages() -> None:
    # drgrpo: r - mean = [1-.75, 0-.75, 1-.75, 1-.75]
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4, mode="drgrpo")
    assert close(adv, [0.25, -0.75, 0.25, 0.25])
    # group_size 1 is allowed for drgrpo (always 0)
    assert close(group_advantages(torch.tensor([3.0, 5.0]), 1, mode="drgrpo"), [0.0, 0.0])


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
def test_identical_rewards_give_exact_zero(mode: str) -> None:
    # 0.1 is not representable: mean(0.1, 0.1, 0.1) may differ from 0.1 by round-off, and
    # with eps=0 that would be 0/0. Must be exactly 0 anyway.
    adv = group_advantages(torch.full((6,), 0.1), 3, mode=mode, eps=0.0)
    assert torch.equal(adv, torch.zeros(6))


def test_advantages_int_and_bool_rewards() -> None:
    adv = group_advantages(torch.tensor([True, False, True, True]), 4)
    assert adv.dtype == torch.float32
    assert close(adv, [0.5, -1.5, 0.5, 0.5])


def test_advantage_errors() -> None:
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_advantages(torch.zeros(4), 0, mode="drgrpo")
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(torch.zeros(4), 2, mode="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        group_advantages(torch.zeros(2, 2), 2)


# ======================================================================================
# masked reductions
# ======================================================================================


def test_masked_sum_and_mean() -> None:
    x = torch.tensor([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    # sum = 1 + 2 + 4 + 6 = 13 over 4 tokens -> mean 3.25
    assert close(masked_sum(x, m), 13.0)
    assert close(masked_mean(x, m), 3.25)
    # per row: sums [3, 10], means [1.5, 5]
    assert close(masked_sum(x, m, dim=-1), [3.0, 10.0])
    assert close(masked_mean(x, m, dim=-1), [1.5, 5.0])
    # per column: col0 (1+4)/2, col1 2/1, col2 6/1
    assert close(masked_mean(x, m, dim=0), [2.5, 2.0, 6.0])
    # empty selection -> 0, not NaN (globally and per row)
    none = torch.zeros_like(m)
    assert masked_mean(x, none).item() == 0.0
    row = torch.tensor([[True, False, False], [False, False, False]])
    assert close(masked_mean(x, row, dim=-1), [1.0, 0.0])
    # bool x -> fraction; non-bool (int) mask accepted
    assert close(masked_mean(m, m.long()), 1.0)


def test_masked_mean_no_nan_gradient() -> None:
    x = torch.tensor([[1.0, math.inf]], requires_grad=True)
    m = torch.tensor([[True, False]])
    masked_mean(x * 2, m).backward()
    assert close(x.grad, [[2.0, 0.0]])


# ======================================================================================
# policy loss
# ======================================================================================


def _ppo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ratios chosen so each token sits in a known clip region.

    old_logp = 0, logp = ln(ratio). Row 0 has A = +1, row 1 has A = -1. The last column is
    padding holding garbage.
    """
    ratios = torch.tensor([[1.5, 0.5, 1.1, 7.0], [0.5, 4.0, 0.9, 7.0]])
    logp = ratios.log()
    old_logp = torch.zeros_like(logp)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    return logp, old_logp, adv, mask


def test_policy_loss_asymmetric_clip() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    loss, m = policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
    # clip range [0.8, 1.28]
    # A=+1: r=1.5 -> -min(1.5, 1.28) = -1.28 (clip high active)
    #       r=0.5 -> -min(0.5, 0.8)  = -0.5  (unclipped: low side does not clip A>0)
    #       r=1.1 -> -1.1                    (inside)
    # A=-1: r=0.5 -> -min(-0.5, -0.8) = 0.8  (clip low active)
    #       r=4.0 -> -min(-4.0, -1.28) = 4.0 (unclipped: high side does not clip A<0)
    #       r=0.9 -> 0.9                     (inside)
    expected = [[-1.28, -0.5, -1.1, 0.0], [0.8, 4.0, 0.9, 0.0]]
    assert close(loss, expected)
    assert close(m["clip_frac"], 2 / 6)
    assert close(m["clip_frac_low"], 1 / 6)
    assert close(m["clip_frac_high"], 1 / 6)
    assert close(m["dual_clip_frac"], 0.0)
    # ratio mean = (1.5 + .5 + 1.1 + .5 + 4 + .9) / 6 = 8.5 / 6; max 4 (7 is padding)
    assert close(m["ratio_mean"], 8.5 / 6)
    assert close(m["ratio_max"], 4.0)
    # ppo_kl = mean(old - logp) = -ln(1.5 * .5 * 1.1 * .5 * 4 * .9) / 6 = -ln(1.485) / 6
    assert close(m["ppo_kl"], -LN(1.485) / 6)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())

    # (B, T) advantages give the same result as (B,) broadcast
    loss2, _ = policy_loss(logp, old_logp, adv[:, None].expand(2, 4), mask, 0.2, 0.28)
    assert torch.equal(loss, loss2)


def test_policy_loss_symmetric_default_clip() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    loss, m = policy_loss(logp, old_logp, adv, mask)
    # clip range [0.8, 1.2]: only the first token changes: -min(1.5, 1.2) = -1.2
    assert close(loss, [[-1.2, -0.5, -1.1, 0.0], [0.8, 4.0, 0.9, 0.0]])
    assert close(m["clip_frac"], 2 / 6)


def test_policy_loss_dual_clip() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    # dual_clip = 3, A = -1: cap = 3 * |A| = 3. r=4 -> min(4, 3) = 3 (active);
    # r=.5 -> .8 < 3 and r=.9 -> .9 < 3 (inactive); A=+1 row untouched.
    loss, m = policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, dual_clip=3.0)
    assert close(loss, [[-1.28, -0.5, -1.1, 0.0], [0.8, 3.0, 0.9, 0.0]])
    assert close(m["dual_clip_frac"], 1 / 6)
    assert close(m["clip_frac"], 2 / 6)
    # dual clip = 5 > 4: inactive everywhere
    loss5, m5 = policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, dual_clip=5.0)
    assert close(loss5, [[-1.28, -0.5, -1.1, 0.0], [0.8, 4.0, 0.9, 0.0]])
    assert close(m5["dual_clip_frac"], 0.0)


def test_policy_loss_gradients() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, dual_clip=3.0)
    loss.sum().backward()
    # unclipped token: d(-r A)/d logp = -A r. Clipped / dual-clipped / padded: 0.
    # row 0: [clipped, -0.5, -1.1, pad]; row 1: [clipped, dual (const), +0.9, pad]
    assert close(logp.grad, [[0.0, -0.5, -1.1, 0.0], [0.0, 0.0, 0.9, 0.0]])


def test_policy_loss_validation() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old_logp, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="ratio_type"):
        policy_loss(logp, old_logp, adv, mask, ratio_type="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, old_logp, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        policy_loss(logp, old_logp, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old_logp, torch.ones(3), mask)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old_logp[:, :2], adv, mask)


def test_policy_loss_empty_mask_metrics() -> None:
    logp, old_logp, adv, mask = _ppo_case()
    loss, m = policy_loss(logp, old_logp, adv, torch.zeros_like(mask))
    assert torch.equal(loss, torch.zeros_like(loss))
    assert all(v.item() == 0.0 for v in m.values())


# ======================================================================================
# GSPO
# ======================================================================================


def _gspo_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # row 0: log-ratios [ln 2, 0, (pad)]       -> mean ln2 / 2   -> s_0 = sqrt(2)
    # row 1: log-ratios [ln .5, ln .5, ln .5]  -> mean ln .5     -> s_1 = .5
    old_logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
    delta = torch.tensor([[LN(2.0), 0.0, 9.0], [LN(0.5), LN(0.5), LN(0.5)]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return old_logp + delta, old_logp, mask


def test_gspo_ratio_value_and_gradient() -> None:
    logp, old_logp, mask = _gspo_case()
    s = torch.tensor([math.sqrt(2.0), 0.5])
    ratio = gspo_ratio(logp, old_logp, mask)
    assert close(ratio, s[:, None].expand(2, 3))  # value s_i everywhere (pad too)

    # Jacobian d ratio_{i,t} / d logp_{j,u} = s_i if (i,t) == (j,u) and valid, else 0
    jac = torch.autograd.functional.jacobian(lambda lp: gspo_ratio(lp, old_logp, mask), logp)
    jac = jac.reshape(6, 6)
    expected = torch.diag(torch.tensor([s[0], s[0], 0.0, s[1], s[1], s[1]]))
    assert close(jac, expected)


def test_gspo_ratio_fully_masked_row() -> None:
    logp = torch.tensor([[math.inf, math.nan]], requires_grad=True)
    ratio = gspo_ratio(logp, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))
    assert close(ratio, [[1.0, 1.0]])
    ratio.sum().backward()
    assert close(logp.grad, [[0.0, 0.0]])


def test_policy_loss_sequence_ratio() -> None:
    logp, old_logp, mask = _gspo_case()
    adv = torch.tensor([1.0, -1.0])
    # s_0 = 1.414 > 1 + 4e-4 with A=+1 -> loss -(1 + 4e-4), clipped high
    # s_1 = 0.5  < 1 - 3e-4 with A=-1 -> loss (1 - 3e-4), clipped low
    loss, m = policy_loss(logp, old_logp, adv, mask, 3e-4, 4e-4, ratio_type="sequence")
    assert close(loss, [[-1.0004, -1.0004, 0.0], [0.9997, 0.9997, 0.9997]])
    assert close(m["clip_frac"], 1.0)
    assert close(m["clip_frac_high"], 2 / 5)
    assert close(m["clip_frac_low"], 3 / 5)
    # wide clip range: nothing clipped; grad of -A s_i per token is -A * s_i
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old_logp, adv, mask, 0.9, 0.9, ratio_type="sequence")
    assert close(loss, [[-math.sqrt(2), -math.sqrt(2), 0.0], [0.5, 0.5, 0.5]])
    assert close(m["clip_frac"], 0.0)
    loss.sum().backward()
    assert close(lp.grad, [[-math.sqrt(2), -math.sqrt(2), 0.0], [0.5, 0.5, 0.5]])


# ======================================================================================
# KL penalty
# ======================================================================================


def test_kl_penalty_values() -> None:
    # logp - ref = d = [0, 1, -1]  ->  r = ref - logp = [0, -1, 1]
    logp = torch.tensor([[-1.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.0, -2.0, -1.0]])
    # k1 = d = [0, 1, -1]
    assert close(kl_penalty(logp, ref, "k1"), [[0.0, 1.0, -1.0]])
    # k2 = .5 d^2 = [0, .5, .5]
    assert close(kl_penalty(logp, ref, "k2"), [[0.0, 0.5, 0.5]])
    # k3 = e^r - r - 1 = [1 - 0 - 1, e^-1 + 1 - 1, e - 1 - 1] = [0, .367879, .718282]
    k3 = [[0.0, math.exp(-1.0), math.e - 2.0]]
    assert close(kl_penalty(logp, ref, "k3"), k3)
    assert close(kl_penalty(logp, ref, "low_var_kl"), k3)
    assert close(kl_penalty(logp, ref), k3)  # default kind is low_var_kl


def test_kl_penalty_clamps_extremes() -> None:
    # d = logp - ref = [-50, 50]  ->  r = [50, -50]
    logp = torch.tensor([[-60.0, -1.0]])
    ref = torch.tensor([[-10.0, -51.0]])
    # k3 unclamped: [e^50 - 50 - 1, e^-50 + 50 - 1] = [5.18e21, 49]
    k3 = kl_penalty(logp, ref, "k3")
    assert close(k3[0, 0] / math.exp(50.0), 1.0)
    assert close(k3[0, 1], 49.0)
    # low_var_kl: r clamped to [20, -20] -> [e^20 - 21, e^-20 + 19] = [4.85e8, 19] -> both 10
    assert close(kl_penalty(logp, ref, "low_var_kl"), [[10.0, 10.0]])
    # r = 100 would overflow k3 to inf in float32; low_var_kl stays 10 with finite grad
    lp = torch.tensor([[-101.0]], requires_grad=True)
    low = kl_penalty(lp, torch.tensor([[-1.0]]), "low_var_kl")
    assert close(low, [[10.0]])
    low.sum().backward()
    assert all_finite(lp.grad)


def test_kl_penalty_mask_and_errors() -> None:
    logp = torch.tensor([[-1.0, math.inf, math.nan]], requires_grad=True)
    ref = torch.tensor([[-2.0, -math.inf, 0.0]])
    mask = torch.tensor([[True, False, False]])
    for kind in KL_KINDS:
        kl = kl_penalty(logp, ref, kind, mask=mask)  # type: ignore[arg-type]
        assert all_finite(kl)
        assert kl[0, 1].item() == 0.0 and kl[0, 2].item() == 0.0
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert all_finite(g) and g[0, 1].item() == 0.0 and g[0, 2].item() == 0.0
    # k1 with d = 1: 1
    assert close(kl_penalty(logp, ref, "k1", mask=mask)[0, 0], 1.0)
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(logp, ref[:, :2], "k1", mask=mask)


# ======================================================================================
# aggregation
# ======================================================================================


def _agg_case() -> tuple[torch.Tensor, torch.Tensor]:
    # row 0: [1, 2 | nan, inf]  valid 2 -> sum 3,  mean 1.5
    # row 1: [5, 6, 7, 8]       valid 4 -> sum 26, mean 6.5
    # row 2: fully masked (excluded from every count)
    loss = torch.tensor(
        [[1.0, 2.0, math.nan, math.inf], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]]
    )
    mask = torch.tensor(
        [[True, True, False, False], [True, True, True, True], [False, False, False, False]]
    )
    return loss, mask


# token-mean: 29 / 6; seq-mean-token-mean: (1.5 + 6.5) / 2 = 4;
# seq-mean-token-sum: (3 + 26) / 2 = 14.5; sum-norm (C = T = 4): 29 / (2 * 4) = 3.625
AGG_EXPECTED = {
    "token-mean": 29 / 6,
    "seq-mean-token-mean": 4.0,
    "seq-mean-token-sum": 14.5,
    "seq-mean-token-sum-norm": 3.625,
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_modes_ragged(mode: str) -> None:
    loss, mask = _agg_case()
    assert close(aggregate_loss(loss, mask, mode), AGG_EXPECTED[mode])  # type: ignore[arg-type]


def test_aggregate_default_and_norm_const() -> None:
    loss, mask = _agg_case()
    assert close(aggregate_loss(loss, mask), 29 / 6)
    # Dr.GRPO with C = 8: 29 / (2 * 8) = 1.8125
    assert close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_const=8), 1.8125)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_empty_mask_is_zero_with_grad(mode: str) -> None:
    loss = torch.full((2, 3), math.nan, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(2, 3, dtype=torch.bool), mode)  # type: ignore[arg-type]
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_global_normalisers_match_full_batch(mode: str) -> None:
    loss, mask = _agg_case()
    loss = loss.clone().requires_grad_(True)
    full = aggregate_loss(loss, mask, mode)  # type: ignore[arg-type]
    (g_full,) = torch.autograd.grad(full, loss)
    # full batch: 6 tokens, 2 non-empty sequences; micro-batches rows [0] and [1, 2]
    # e.g. token-mean: 3/6 + 26/6 = 29/6; seq-mean-token-mean: 1.5/2 + 6.5/2 = 4
    kw = {"global_tokens": 6.0, "global_seqs": 2.0}
    micro = [
        aggregate_loss(loss[idx], mask[idx], mode, **kw)  # type: ignore[arg-type]
        for idx in (slice(0, 1), slice(1, 3))
    ]
    total = micro[0] + micro[1]
    assert close(total, AGG_EXPECTED[mode])
    assert close(total, full)
    (g_micro,) = torch.autograd.grad(total, loss)
    assert torch.allclose(g_micro, g_full)
    assert all_finite(g_full)


def test_aggregate_errors() -> None:
    loss, mask = _agg_case()
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(loss, mask, "sum")  # type: ignore[arg-type]
    for kw in ({"norm_const": 0.0}, {"global_tokens": 0.0}, {"global_seqs": -1.0}):
        with pytest.raises(ValueError, match="must be > 0"):
            aggregate_loss(loss, mask, "token-mean", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(loss[:, :2], mask)


# ======================================================================================
# entropy and log-probs
# ======================================================================================


def test_entropy_uniform_and_peaked() -> None:
    # uniform over V=8: H = ln 8
    assert close(entropy_from_logits(torch.zeros(2, 3, 8)), torch.full((2, 3), LN(8.0)))
    # [100, 0, 0, 0]: p_1 ~ 1 - 3e-44 -> H ~ 0
    peaked = torch.tensor([[[100.0, 0.0, 0.0, 0.0]]])
    assert abs(entropy_from_logits(peaked).item()) < 1e-6
    # [0, ln 3]: p = [.25, .75]; H = .25 ln 4 + .75 ln(4/3) = .346574 + .215762 = .562335
    two = torch.tensor([[[0.0, LN(3.0)]]])
    assert close(entropy_from_logits(two), [[0.25 * LN(4) + 0.75 * LN(4 / 3)]])


def test_entropy_neg_inf_logit_and_bf16() -> None:
    # [0, 0, -inf] is a uniform over 2 tokens: H = ln 2, finite gradient
    z = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(z)
    assert close(h, [[LN(2.0)]])
    h.sum().backward()
    assert all_finite(z.grad)
    out = entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and close(out, [[LN(4.0)]])


def test_logprobs_from_logits_hand_values() -> None:
    # logits [0, ln 3], label 1: p = 3/4 -> ln .75 = -.287682
    logits = torch.tensor([[[0.0, LN(3.0)]]])
    labels = torch.tensor([[1]])
    assert close(logprobs_from_logits(logits, labels), [[LN(0.75)]])
    # temperature 2: logits/2 = [0, ln sqrt3] -> p = sqrt3 / (1 + sqrt3) = .633975
    s3 = math.sqrt(3.0)
    assert close(logprobs_from_logits(logits, labels, temperature=2.0), [[LN(s3 / (1 + s3))]])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_log_softmax(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 5), generator=g)
    ref = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None])[..., 0]
    out = logprobs_from_logits(logits, labels, temperature=temperature)
    assert torch.allclose(out, ref, atol=1e-5)
    out_bf16 = logprobs_from_logits(logits.bfloat16(), labels, temperature=temperature)
    assert out_bf16.dtype == torch.float32


def test_logprobs_from_logits_bad_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), 0.0)


# ======================================================================================
# truncated importance sampling
# ======================================================================================


def _tis_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # log-ratio old - rollout: row 0 [0, ln 3, ln .5]; row 1 [ln 3, pad, pad]
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    delta = torch.tensor([[0.0, LN(3.0), LN(0.5)], [LN(3.0), math.inf, math.nan]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return rollout + delta, rollout, mask


def test_tis_token_level() -> None:
    old, rollout, mask = _tis_case()
    old = old.clone().requires_grad_(True)
    w, m = tis_weights(old, rollout, mask, cap=2.0)
    # raw [1, 3, .5 | 3] -> capped at 2: [1, 2, .5 | 2], pads 0
    assert close(w, [[1.0, 2.0, 0.5], [2.0, 0.0, 0.0]])
    assert not w.requires_grad
    assert close(m["tis_mean"], 5.5 / 4)  # (1 + 2 + .5 + 2) / 4
    assert close(m["tis_max"], 2.0)
    assert close(m["tis_clip_frac"], 2 / 4)
    # mean |log-ratio| = (0 + ln3 + ln2 + ln3) / 4 = ln 18 / 4
    assert close(m["rollout_trainer_logp_diff"], LN(18.0) / 4)


def test_tis_sequence_level() -> None:
    old, rollout, mask = _tis_case()
    w, m = tis_weights(old, rollout, mask, cap=2.0, level="sequence")
    # row 0: exp(0 + ln3 + ln.5) = 1.5 (< cap); row 1: exp(ln 3) = 3 -> 2 (capped)
    assert close(w, [[1.5, 1.5, 1.5], [2.0, 0.0, 0.0]])
    assert close(m["tis_mean"], (3 * 1.5 + 2.0) / 4)
    assert close(m["tis_max"], 2.0)
    assert close(m["tis_clip_frac"], 1 / 4)


def test_tis_errors_and_empty() -> None:
    old, rollout, mask = _tis_case()
    with pytest.raises(ValueError, match="level"):
        tis_weights(old, rollout, mask, level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, rollout, mask, cap=0.0)
    w, m = tis_weights(old, rollout, torch.zeros_like(mask))
    assert torch.equal(w, torch.zeros_like(w))
    assert m["tis_max"].item() == 0.0


# ======================================================================================
# rollout corrections: MIS, IcePop, sequence masking (and TIS, composed)
# ======================================================================================


def _corr_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # rollout_logp = 0, so d = old - rollout = old exactly: a ratio of 2 is exactly 2 after exp
    # and the band edges exactly ln(edge). Ratios: row 0 [1, 3, .5, 2]; row 1 [.4, 1.25, pad].
    ratios = torch.tensor([[1.0, 3.0, 0.5, 2.0], [0.4, 1.25, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    old = torch.where(mask, ratios.log(), torch.tensor(math.nan))
    return old, torch.zeros_like(old), mask


def test_mis_token_level_masks_above_the_cap_and_keeps_the_edge() -> None:
    old, rollout, mask = _corr_case()
    w, keep, m = rollout_correction(old, rollout, mask, tis_cap=2.0, tis_mode="mask")
    # 3 > 2 is masked; exactly 2 is kept with weight 2; the others keep their raw ratio
    assert close(w, [[1.0, 0.0, 0.5, 2.0], [0.4, 1.25, 0.0, 0.0]])
    assert keep.tolist() == [[True, False, True, True], [True, True, False, False]]
    assert w[0, 3].item() == 2.0
    assert close(m["mis_masked_token_frac"], 1 / 6)
    assert close(m["tis_clip_frac"], 1 / 6)
    assert close(m["tis_mean"], (1 + 0 + 0.5 + 2 + 0.4 + 1.25) / 6)
    assert close(m["tis_max"], 2.0)
    assert "mis_masked_sample_frac" not in m  # token level: no sample is masked as a whole
    assert {"icepop_masked_token_frac", "seq_masked_sample_frac"}.isdisjoint(m)


def test_mis_sequence_and_geometric_levels_mask_whole_samples() -> None:
    old, rollout, mask = _corr_case()
    # sequence: row 0 product 1 * 3 * .5 * 2 = 3 > 2 -> all of row 0 masked; row 1 .4 * 1.25 = .5
    w, keep, m = rollout_correction(old, rollout, mask, tis_cap=2.0, tis_level="sequence",
                                    tis_mode="mask")  # fmt: skip
    assert close(w, [[0.0] * 4, [0.5, 0.5, 0.0, 0.0]])
    assert keep.tolist() == [[False] * 4, [True, True, False, False]]
    assert close(m["mis_masked_token_frac"], 4 / 6)
    assert close(m["mis_masked_sample_frac"], 1 / 2)
    assert close(m["tis_mean"], 1.0 / 6) and close(m["tis_max"], 0.5)
    # geometric: row 0 3^(1/4) = 1.316 > 1.2 masked; row 1 .5^(1/2) = .707 kept
    w, keep, m = rollout_correction(old, rollout, mask, tis_cap=1.2, tis_level="geometric",
                                    tis_mode="mask")  # fmt: skip
    assert close(w, [[0.0] * 4, [0.5**0.5] * 2 + [0.0] * 2])
    assert close(m["mis_masked_sample_frac"], 1 / 2)
    # ... and truncated at the geometric level: both rows capped at 1.2 / kept below it
    w, keep, _ = rollout_correction(old, rollout, mask, tis_cap=1.2, tis_level="geometric")
    assert close(w, [[1.2] * 4, [0.5**0.5] * 2 + [0.0] * 2])
    assert torch.equal(keep, mask)


def test_icepop_masks_outside_the_band_edges_included() -> None:
    old, rollout, mask = _corr_case()
    w, keep, m = rollout_correction(old, rollout, mask, icepop_low=0.5, icepop_high=2.0)
    # row 0 [1, 3, .5, 2]: only 3 is outside [.5, 2] (both edges are kept); row 1: .4 is below
    assert keep.tolist() == [[True, False, True, True], [False, True, False, False]]
    assert torch.equal(w, keep.float())  # masked or not: no reweighting
    assert close(m["icepop_masked_token_frac"], 2 / 6)
    assert set(m) == {"rollout_trainer_logp_diff", "icepop_masked_token_frac"}
    # just inside / just outside the edges
    d = torch.tensor([[LN(0.5) - 1e-4, LN(0.5) + 1e-4, LN(2.0) - 1e-4, LN(2.0) + 1e-4]])
    _, keep, _ = rollout_correction(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool),
                                    icepop_low=0.5, icepop_high=2.0)  # fmt: skip
    assert keep.tolist() == [[False, True, True, False]]


def test_sequence_masking_max_and_mean_metrics() -> None:
    old, rollout, mask = _corr_case()
    # max |d|: row 0 ln 3 = 1.10 > 1 -> dropped; row 1 max(|ln .4|, ln 1.25) = .92 -> kept
    w, keep, m = rollout_correction(old, rollout, mask, seq_mask_threshold=1.0)
    assert keep.tolist() == [[False] * 4, [True, True, False, False]]
    assert torch.equal(w, keep.float())
    assert close(m["seq_masked_sample_frac"], 1 / 2)
    # |mean d|: row 0 ln 3 / 4 = .27 -> kept; row 1 |ln .5| / 2 = .35 > .3 -> dropped
    _, keep, m = rollout_correction(old, rollout, mask, seq_mask_threshold=0.3,
                                    seq_mask_metric="mean")  # fmt: skip
    assert keep.tolist() == [[True] * 4, [False] * 4]
    assert close(m["seq_masked_sample_frac"], 1 / 2)


def test_corrections_compose() -> None:
    old, rollout, mask = _corr_case()
    w, keep, m = rollout_correction(old, rollout, mask, tis_cap=1.5, icepop_low=0.5,
                                    icepop_high=2.0, seq_mask_threshold=0.3,
                                    seq_mask_metric="mean")  # fmt: skip
    # TIS truncates row 0 to [1, 1.5, .5, 1.5]; IcePop drops row 0's 3 and row 1's .4;
    # the sequence mask drops row 1
    assert keep.tolist() == [[True, False, True, True], [False] * 4]
    assert close(w, [[1.0, 0.0, 0.5, 1.5], [0.0] * 4])
    # each rule reports its own share; the TIS metrics describe the TIS factor alone
    assert close(m["tis_mean"], (1 + 1.5 + 0.5 + 1.5 + 0.4 + 1.25) / 6)
    assert close(m["tis_clip_frac"], 2 / 6)
    assert close(m["icepop_masked_token_frac"], 2 / 6)
    assert close(m["seq_masked_sample_frac"], 1 / 2)
    # mean |d| = (0 + ln3 + ln2 + ln2 + |ln .4| + ln 1.25) / 6
    diff = (LN(3) + 2 * LN(2) - LN(0.4) + LN(1.25)) / 6
    assert close(m["rollout_trainer_logp_diff"], diff)
    # IcePop's own objective: M(k) = k on [low, high], 0 outside = IcePop + TIS with C >= high
    w, _, _ = rollout_correction(old, rollout, mask, tis_cap=2.0, icepop_low=0.5, icepop_high=2.0)
    assert close(w, [[1.0, 0.0, 0.5, 2.0], [0.0, 1.25, 0.0, 0.0]])


def test_tis_weights_is_rollout_correction_with_tis_alone() -> None:
    old, rollout, mask = _corr_case()
    for level in ("token", "sequence", "geometric"):
        w, m = tis_weights(old, rollout, mask, cap=2.0, level=level)  # type: ignore[arg-type]
        w2, keep, m2 = rollout_correction(old, rollout, mask, tis_cap=2.0, tis_level=level)  # type: ignore[arg-type]
        assert torch.equal(w, w2) and torch.equal(keep, mask)
        assert set(m) == {"tis_mean", "tis_max", "tis_clip_frac", "rollout_trainer_logp_diff"}
        assert all(torch.equal(m[k], m2[k]) for k in m)


def test_corrections_non_finite_log_probs() -> None:
    # valid tokens: rollout -inf (ratio +inf), rollout NaN (counts as +inf), old -inf (ratio 0),
    # and one clean token; padding holds inf / NaN in both inputs
    old = torch.tensor([[-1.0, -1.0, -math.inf, -1.0, math.inf], [math.nan, 0, 0, 0, 0]])
    rollout = torch.tensor([[-math.inf, math.nan, -1.0, -1.0, math.nan],
                            [-math.inf, 0, 0, 0, 0]])  # fmt: skip
    mask = torch.tensor([[True, True, True, True, False], [False, True, True, False, False]])
    configs = [
        {"tis_cap": 2.0}, {"tis_cap": 2.0, "tis_mode": "mask"},
        {"tis_cap": 2.0, "tis_level": "sequence"}, {"tis_cap": 2.0, "tis_level": "geometric"},
        {"icepop_low": 0.5, "icepop_high": 2.0}, {"seq_mask_threshold": 1.0},
        {"seq_mask_threshold": 1.0, "seq_mask_metric": "mean"},
    ]
    for kw in configs:
        w, keep, m = rollout_correction(old, rollout, mask, **kw)  # type: ignore[arg-type]
        assert all_finite(w), kw
        assert all(math.isfinite(v.item()) for v in m.values()), kw
        assert torch.equal(w[~mask], torch.zeros(int((~mask).sum()))), kw
        assert not (keep & ~mask).any(), kw
        assert close(m["rollout_trainer_logp_diff"], 0.0)  # over the finite log-ratios only
    w, _, m = rollout_correction(old, rollout, mask, tis_cap=2.0)
    assert close(w[0, :4], [2.0, 2.0, 0.0, 1.0])  # +inf, NaN -> capped; -inf -> 0
    assert close(m["tis_clip_frac"], 2 / 6)
    _, keep, m = rollout_correction(old, rollout, mask, tis_cap=2.0, tis_mode="mask")
    assert keep[0, :4].tolist() == [False, False, True, True]
    _, keep, m = rollout_correction(old, rollout, mask, icepop_low=0.5, icepop_high=2.0)
    assert keep[0, :4].tolist() == [False, False, False, True]  # ratio 0 is below the band
    _, keep, m = rollout_correction(old, rollout, mask, seq_mask_threshold=1.0)
    assert keep.tolist()[0] == [False] * 5 and keep[1].tolist() == mask[1].tolist()
    assert close(m["seq_masked_sample_frac"], 1 / 2)


def test_corrections_errors_and_empty_mask() -> None:
    old, rollout, mask = _corr_case()
    bad = [
        ({"tis_cap": 2.0, "tis_mode": "clip"}, "mode"),
        ({"tis_cap": 2.0, "tis_level": "seq"}, "level"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"icepop_low": 0.5}, "together"),
        ({"icepop_low": 1.0, "icepop_high": 2.0}, "icepop_low < 1"),
        ({"icepop_low": 0.5, "icepop_high": 1.0}, "1 < icepop_high"),
        ({"seq_mask_threshold": 0.0}, "seq_mask_threshold"),
        ({"seq_mask_threshold": 1.0, "seq_mask_metric": "median"}, "seq_mask_metric"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            rollout_correction(old, rollout, mask, **kw)  # type: ignore[arg-type]
    empty = torch.zeros_like(mask)
    w, keep, m = rollout_correction(old, rollout, empty, tis_cap=2.0, tis_mode="mask",
                                    tis_level="sequence", icepop_low=0.5, icepop_high=2.0,
                                    seq_mask_threshold=1.0)  # fmt: skip
    assert torch.equal(w, torch.zeros_like(w)) and not keep.any()
    assert all(v.item() == 0.0 for v in m.values())


# ======================================================================================
# composition and NaN safety
# ======================================================================================


def _random_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.tensor(
        [
            [True] * 6,
            [True] * 3 + [False] * 3,
            [True] + [False] * 5,
            [True] * 5 + [False],
        ]
    )
    return {
        "logp": old + 0.3 * torch.randn(B, T, generator=g),
        "old_logp": old,
        "ref_logp": old + 0.2 * torch.randn(B, T, generator=g),
        "rollout_logp": old + 0.5 * torch.randn(B, T, generator=g),
        "entropy": torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "mask": mask,
    }


@pytest.mark.parametrize(
    ("loss_agg", "ratio_type", "tis_level"),
    [
        ("token-mean", "token", "token"),
        ("seq-mean-token-mean", "sequence", "sequence"),
        ("seq-mean-token-sum-norm", "token", "sequence"),
    ],
)
def test_compute_grpo_loss_equals_manual(loss_agg: str, ratio_type: str, tis_level: str) -> None:
    b = _random_batch()
    kw = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "ratio_type": ratio_type}
    loss, metrics = compute_grpo_loss(
        b["logp"],
        b["old_logp"],
        b["advantages"],
        b["mask"],
        ref_logp=b["ref_logp"],
        kl_coef=0.1,
        kl_kind="k3",
        loss_agg=loss_agg,  # type: ignore[arg-type]
        entropy=b["entropy"],
        entropy_coef=0.01,
        rollout_logp=b["rollout_logp"],
        tis_cap=1.5,
        tis_level=tis_level,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    mask = b["mask"]
    pg, pm = policy_loss(b["logp"], b["old_logp"], b["advantages"], mask, **kw)  # type: ignore[arg-type]
    w, tm = tis_weights(b["old_logp"], b["rollout_logp"], mask, 1.5, tis_level)  # type: ignore[arg-type]
    kl = kl_penalty(b["logp"], b["ref_logp"], "k3", mask)
    pg_loss = aggregate_loss(pg * w, mask, loss_agg)  # type: ignore[arg-type]
    manual = (
        pg_loss
        + 0.1 * aggregate_loss(kl, mask, loss_agg)  # type: ignore[arg-type]
        - 0.01 * aggregate_loss(b["entropy"], mask, loss_agg)  # type: ignore[arg-type]
    )
    assert close(loss, manual, atol=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(pm) | set(tm) | {"pg_loss", "kl", "entropy", "loss"} == set(metrics)
    assert close(metrics["pg_loss"], pg_loss)
    assert close(metrics["loss"], manual)
    assert close(metrics["kl"], masked_mean(kl, mask))
    assert close(metrics["entropy"], masked_mean(b["entropy"], mask))
    for k in list(pm) + list(tm):
        assert close(metrics[k], {**pm, **tm}[k])


def test_compute_grpo_loss_minimal_and_optional_terms() -> None:
    b = _random_batch(1)
    args = (b["logp"], b["old_logp"], b["advantages"], b["mask"])
    loss, metrics = compute_grpo_loss(*args)
    pg, _ = policy_loss(*args)
    assert close(loss, aggregate_loss(pg, b["mask"]))
    assert {"kl", "entropy", "tis_mean"}.isdisjoint(metrics)
    # ref/entropy given with zero coefficients: reported, not added; TIS needs a cap too
    loss2, metrics2 = compute_grpo_loss(
        *args, ref_logp=b["ref_logp"], entropy=b["entropy"], rollout_logp=b["rollout_logp"]
    )
    assert close(loss2, loss)
    assert "kl" in metrics2 and "entropy" in metrics2 and "tis_mean" not in metrics2
    with pytest.raises(ValueError, match="ref_logp"):
        compute_grpo_loss(*args, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        compute_grpo_loss(*args, entropy_coef=0.1)


def test_compute_grpo_loss_global_normalisers_microbatch() -> None:
    b = _random_batch(2)
    logp = b["logp"].clone().requires_grad_(True)

    def run(sl: slice, **extra: float) -> torch.Tensor:
        loss, _ = compute_grpo_loss(
            logp[sl],
            b["old_logp"][sl],
            b["advantages"][sl],
            b["mask"][sl],
            ref_logp=b["ref_logp"][sl],
            kl_coef=0.05,
            clip_high=0.28,
            entropy=b["entropy"][sl],
            entropy_coef=0.01,
            **extra,
        )
        return loss

    n_tok = float(b["mask"].sum())
    full = run(slice(0, 4))
    (g_full,) = torch.autograd.grad(full, logp)
    micro = run(slice(0, 2), global_tokens=n_tok) + run(slice(2, 4), global_tokens=n_tok)
    (g_micro,) = torch.autograd.grad(micro, logp)
    assert close(micro, full, atol=1e-6)
    assert torch.allclose(g_micro, g_full, atol=1e-7)


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("kl_kind", KL_KINDS)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_masked_inf_nan_do_not_leak(ratio_type: str, kl_kind: str, loss_agg: str) -> None:
    b = _random_batch(3)
    pad = ~b["mask"]
    # poison every padded position of every input with inf / -inf / NaN
    poison = torch.where(torch.rand(pad.shape) < 0.5, math.inf, math.nan)
    logp = torch.where(pad, poison, b["logp"]).requires_grad_(True)
    old = torch.where(pad, -math.inf, b["old_logp"])
    ref = torch.where(pad, math.nan, b["ref_logp"])
    rollout = torch.where(pad, math.inf, b["rollout_logp"])
    ent = torch.where(pad, math.nan, b["entropy"])
    adv = torch.where(pad, math.nan, b["advantages"][:, None].expand_as(pad))
    loss, metrics = compute_grpo_loss(
        logp,
        old,
        adv,
        b["mask"],
        ref_logp=ref,
        kl_coef=0.1,
        kl_kind=kl_kind,  # type: ignore[arg-type]
        dual_clip=3.0,
        ratio_type=ratio_type,  # type: ignore[arg-type]
        loss_agg=loss_agg,  # type: ignore[arg-type]
        entropy=ent,
        entropy_coef=0.01,
        rollout_logp=rollout,
        tis_cap=2.0,
    )
    assert all_finite(loss)
    assert all(math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert all_finite(logp.grad)
    assert torch.equal(logp.grad[pad], torch.zeros(int(pad.sum())))
    # and the value equals the loss on clean inputs
    clean, _ = compute_grpo_loss(
        b["logp"],
        b["old_logp"],
        b["advantages"],
        b["mask"],
        ref_logp=b["ref_logp"],
        kl_coef=0.1,
        kl_kind=kl_kind,  # type: ignore[arg-type]
        dual_clip=3.0,
        ratio_type=ratio_type,  # type: ignore[arg-type]
        loss_agg=loss_agg,  # type: ignore[arg-type]
        entropy=b["entropy"],
        entropy_coef=0.01,
        rollout_logp=b["rollout_logp"],
        tis_cap=2.0,
    )
    assert close(loss, clean, atol=1e-6)


# ======================================================================================
# rollout corrections inside the loss: gradients and the normaliser
# ======================================================================================


def _grad(b: dict[str, torch.Tensor], loss_agg: str = "token-mean",
          **kw: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = compute_grpo_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], clip_high=0.28,
        loss_agg=loss_agg, rollout_logp=b["rollout_logp"], **kw)  # type: ignore[arg-type]  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    return loss, g, metrics


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_masked_tokens_get_zero_gradient_and_the_others_the_unmasked_one(loss_agg: str) -> None:
    b = _random_batch(4)
    mask = b["mask"]
    kw = {"icepop_low": 0.7, "icepop_high": 1.4, "seq_mask_threshold": 1.0}
    _, keep, _ = rollout_correction(b["old_logp"], b["rollout_logp"], mask, **kw)  # type: ignore[arg-type]
    dropped = mask & ~keep
    assert dropped.any() and keep.any()  # the case exercises both
    loss, g, metrics = _grad(b, loss_agg, **kw)
    plain_loss, g_plain, plain_metrics = _grad(b, loss_agg)
    assert torch.equal(g[dropped], torch.zeros(int(dropped.sum())))
    assert torch.equal(g[keep], g_plain[keep])
    # masked tokens stay in the normaliser: the loss is the kept tokens' part of the plain one
    pg, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], mask, clip_high=0.28)
    assert close(loss, aggregate_loss(torch.where(keep, pg, 0.0), mask, loss_agg), atol=1e-7)  # type: ignore[arg-type]
    # the policy-loss metrics are over every response token, as without the correction
    assert metrics["clip_frac"] == plain_metrics["clip_frac"]
    assert metrics["ratio_mean"] == plain_metrics["ratio_mean"]
    assert {"icepop_masked_token_frac", "seq_masked_sample_frac"} <= set(metrics)


def test_mis_gradient_is_the_weighted_unmasked_one() -> None:
    b = _random_batch(5)
    kw = {"tis_cap": 1.5, "tis_mode": "mask"}
    w, keep, m = rollout_correction(b["old_logp"], b["rollout_logp"], b["mask"], **kw)  # type: ignore[arg-type]
    dropped = b["mask"] & ~keep
    assert dropped.any() and keep.any()
    _, g, metrics = _grad(b, **kw)
    _, g_plain, _ = _grad(b)
    assert torch.equal(g[dropped], torch.zeros(int(dropped.sum())))
    assert torch.allclose(g[keep], w[keep] * g_plain[keep], atol=1e-8, rtol=1e-6)
    assert close(metrics["mis_masked_token_frac"], m["mis_masked_token_frac"])
    assert metrics["mis_masked_token_frac"] > 0


def test_corrections_in_the_loss_with_poisoned_padding() -> None:
    b = _random_batch(6)
    pad = ~b["mask"]
    logp = torch.where(pad, math.nan, b["logp"]).requires_grad_(True)
    old = torch.where(pad, math.inf, b["old_logp"])
    rollout = torch.where(pad, math.nan, b["rollout_logp"])
    kw = {"tis_cap": 1.5, "tis_mode": "mask", "tis_level": "geometric", "icepop_low": 0.5,
          "icepop_high": 2.0, "seq_mask_threshold": 1.2}
    loss, metrics = compute_grpo_loss(logp, old, b["advantages"], b["mask"], rollout_logp=rollout,
                                      **kw)  # type: ignore[arg-type]  # fmt: skip
    clean, _ = compute_grpo_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"],
                                 rollout_logp=b["rollout_logp"], **kw)  # type: ignore[arg-type]  # fmt: skip
    loss.backward()
    assert all_finite(loss) and all_finite(logp.grad)
    assert all(math.isfinite(v) for v in metrics.values())
    assert torch.equal(logp.grad[pad], torch.zeros(int(pad.sum())))
    assert close(loss, clean, atol=1e-7)
    assert {"mis_masked_token_frac", "mis_masked_sample_frac", "icepop_masked_token_frac",
            "seq_masked_sample_frac", "tis_mean"} <= set(metrics)
