"""GRPO maths against hand-computed values on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.algorithms.grpo import (
    ADV_EPS,
    aggregate,
    grpo_loss,
    k3_kl,
    pooled_advantages,
    sequence_nll,
)

# ----------------------------------------------------------------------------- advantages
# rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735; 0.5 / (0.57735 + 1e-4) = 0.865875
ADV_1001 = 0.8658754


def test_group_scale_uses_the_unbiased_std_with_eps():
    own = [1.0, 0.0, 0.0, 1.0]
    adv = pooled_advantages(own, own, "group")  # what the base step of every strategy computes
    assert ADV_EPS == 1e-4
    assert adv == pytest.approx([ADV_1001, -ADV_1001, -ADV_1001, ADV_1001], abs=1e-6)
    # population std (0.5) would give 0.9998 instead: make sure the unbiased one is used
    assert abs(adv[0] - 0.5 / (0.5 + 1e-4)) > 0.1


def _base_batch(groups, scale):
    from mutualrl.algorithms.sharing import OwnGroup, PeerRows, ShareContext, build_batch
    from mutualrl.config import GRPOOptions, SharingConfig
    from mutualrl.tasks.base import Problem

    own = [OwnGroup(Problem(f"t/{i}", "q", "1", "t"), [1], [[2]] * len(r), [[-1.0]] * len(r), r, r)
           for i, r in enumerate(groups)]
    ctx = ShareContext(own, PeerRows(), GRPOOptions(scale_rewards=scale, dynamic_sampling="off"), SharingConfig(),
                       lambda p, c: ([], []),
                       lambda p, t: [])
    return [row.advantage for row in build_batch("independent", ctx).rows]


def test_batch_scale_is_the_std_of_every_reward_of_the_step():
    # group means 0.5 and 0.75 centre each group; the scale is the std of all eight rewards:
    # mean 5/8, unbiased var = (5 * 0.375^2 + 3 * 0.625^2) / 7 = 1.875 / 7 -> std 0.5175492
    adv = _base_batch([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]], "batch")
    s = 0.5175492 + 1e-4
    assert adv[:4] == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-5)
    assert adv[4:] == pytest.approx([0.4829526, 0.4829526, 0.4829526, -1.4488577], abs=1e-5)


def test_zero_variance_groups_get_zero_advantage_and_none_only_centres():
    assert _base_batch([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], "group") == [0.0] * 6
    adv = _base_batch([[1.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0]], "none")
    assert adv == [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0]


def test_unknown_scale_is_refused():
    with pytest.raises(ValueError, match="scale_rewards"):
        pooled_advantages([1.0, 0.0], [1.0, 0.0], "grouped")


def test_pooled_advantages_equals_group_when_pool_is_own():
    own = [1.0, 0.0, 0.0, 1.0]
    assert pooled_advantages(own, own, "group") == pytest.approx([ADV_1001, -ADV_1001, -ADV_1001, ADV_1001],
                                                                   abs=1e-6)


def test_pooled_advantages_over_a_larger_pool():
    # own [1,0,0,0], pool adds a peer group [1,1,0,0]: mean 3/8, unbiased std 0.5175492
    own = [1.0, 0.0, 0.0, 0.0]
    adv = pooled_advantages(own, own + [1.0, 1.0, 0.0, 0.0], "group")
    assert adv == pytest.approx([1.2073814, -0.7244289, -0.7244289, -0.7244289], abs=1e-6)
    # none: only the pooled mean is subtracted
    assert pooled_advantages(own, own + [1.0, 1.0, 0.0, 0.0], "none") == pytest.approx(
        [0.625, -0.375, -0.375, -0.375])
    # batch: divided by the given batch std (+ eps)
    assert pooled_advantages(own, own, "batch", batch_std=0.5) == pytest.approx(
        [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])
    with pytest.raises(ValueError):
        pooled_advantages(own, own, "std")


# ----------------------------------------------------------------------------- clipped surrogate
def _one(ratio: float, adv: float, *, eps: float = 0.2, eps_high: float | None = 0.28):
    """Loss, d loss / d logp and stats of a single one-token row with the given ratio."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    out = grpo_loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                    epsilon=eps, epsilon_high=eps_high, loss_type="token_mean")
    out.loss.backward()
    return out.loss.item(), logp.grad.item(), out.stats


@pytest.mark.parametrize(
    "ratio, adv, loss, grad, clipped",
    [
        # inside [0.8, 1.28]: loss = -ratio * A, d/dlogp = -ratio * A
        (1.1, 1.0, -1.1, -1.1, 0.0),
        (0.9, -2.0, 1.8, 1.8, 0.0),
        # above 1 + eps_high with A > 0: clipped value 1.28 * A, no gradient
        (1.5, 1.0, -1.28, 0.0, 1.0),
        # below 1 - eps with A < 0: min(-0.5, -0.8) = -0.8 -> loss 0.8, no gradient
        (0.5, -1.0, 0.8, 0.0, 1.0),
        # below 1 - eps with A > 0: the unclipped term is smaller, so it is used (gradient flows)
        (0.5, 1.0, -0.5, -0.5, 0.0),
        # above 1 + eps_high with A < 0: the unclipped term -1.5 is smaller, gradient flows
        (1.5, -1.0, 1.5, 1.5, 0.0),
        # epsilon_high is the upper bound, not epsilon: 1.25 < 1.28 is inside
        (1.25, 2.0, -2.5, -2.5, 0.0),
    ],
)
def test_clipped_surrogate_cases(ratio, adv, loss, grad, clipped):
    got_loss, got_grad, stats = _one(ratio, adv)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert stats["clip_frac"] == clipped
    assert stats["ratio_mean"] == pytest.approx(ratio)


def test_epsilon_high_defaults_to_epsilon():
    # ratio 1.25 with A > 0 is clipped at 1.2 when epsilon_high is not given
    loss, grad, stats = _one(1.25, 2.0, eps_high=None)
    assert loss == pytest.approx(-2.4)
    assert grad == 0.0
    assert stats["clip_frac"] == 1.0


# ----------------------------------------------------------------------------- KL
def test_k3_kl_value():
    # logp = log 0.5, ref = log 0.25: d = log 0.5; exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    kl = k3_kl(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(0.1931472, abs=1e-6)
    assert k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_kl_term_in_loss():
    logp = torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    out = grpo_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                    beta=0.1, ref_logp=ref, loss_type="token_mean")
    # A = 0, so the loss is beta * KL = 0.1 * 0.1931472
    assert out.loss.item() == pytest.approx(0.01931472, abs=1e-7)
    assert out.stats["kl"] == pytest.approx(0.1931472, abs=1e-6)
    out.loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp) = 1 - 0.5 = 0.5 per token; token_mean over 2 tokens, beta 0.1
    assert logp.grad.flatten().tolist() == pytest.approx([0.025, 0.025])
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                  beta=0.1)


# ----------------------------------------------------------------------------- aggregation
def _agg_case():
    # two right-aligned rows, width 3: row 0 has 1 token (A = 1), row 1 has 3 tokens (A = 2);
    # ratio 1 everywhere, so the per-token loss is -A
    mask = torch.tensor([[False, False, True], [True, True, True]])
    logp = torch.tensor([[0.0, 0.0, -1.0], [-0.5, -0.7, -0.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)
    return logp, adv, mask


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", -1.5),        # mean of per-sequence means: (-1 + -2) / 2
    ("token_mean", -1.75),  # (-1 - 2 - 2 - 2) / 4 tokens
    ("dr_grpo", -0.7),     # -7 / (2 sequences x max_completion_length 5)
])
def test_loss_type_normalisers(loss_type, expected):
    logp, adv, mask = _agg_case()
    out = grpo_loss(logp, logp.detach(), adv, mask, loss_type=loss_type, max_completion_length=5)
    assert out.loss.item() == pytest.approx(expected)


def test_padding_positions_do_not_count():
    logp, adv, mask = _agg_case()
    # garbage in padded positions must not change anything
    logp2 = logp.detach().clone()
    logp2[0, :2] = 7.0
    old2 = logp.detach().clone()
    old2[0, :2] = -9.0
    for lt in ("grpo", "token_mean", "dr_grpo"):
        a = grpo_loss(logp.detach(), logp.detach(), adv, mask, loss_type=lt, max_completion_length=5)
        b = grpo_loss(logp2, old2, adv, mask, loss_type=lt, max_completion_length=5)
        assert a.loss.item() == pytest.approx(b.loss.item())
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "sum", 1)


@pytest.mark.parametrize("loss_type", ["grpo", "token_mean", "dr_grpo"])
def test_gradient_matches_analytic(loss_type):
    """d loss / d logp = -A * ratio / normaliser for unclipped tokens, 0 for clipped or padded ones."""
    torch.manual_seed(0)
    b, c, lmax = 3, 4, 6
    lens = [4, 2, 3]
    mask = torch.arange(c).unsqueeze(0) >= (c - torch.tensor(lens)).unsqueeze(1)
    old = -torch.rand(b, c, dtype=torch.float64) - 0.5
    # ratios: most within [0.8, 1.2], row 0 position 3 pushed to 1.5 (clipped, A > 0)
    delta = (torch.rand(b, c, dtype=torch.float64) - 0.5) * 0.2
    delta[0, 3] = math.log(1.5)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    out = grpo_loss(logp, old, adv, mask, epsilon=0.2, loss_type=loss_type, max_completion_length=lmax)
    out.loss.backward()
    ratio = torch.exp(delta)
    expected = torch.zeros(b, c, dtype=torch.float64)
    for i in range(b):
        for j in range(c):
            if not mask[i, j]:
                continue
            r, a = ratio[i, j].item(), adv[i].item()
            if (a > 0 and r > 1.2) or (a < 0 and r < 0.8):
                continue
            norm = {"grpo": b * lens[i], "token_mean": sum(lens), "dr_grpo": b * lmax}[loss_type]
            expected[i, j] = -a * r / norm
    assert torch.allclose(logp.grad, expected, atol=1e-12)
    assert logp.grad[0, 3] == 0.0
    assert out.stats["clip_frac"] == pytest.approx(1 / sum(lens))


# ----------------------------------------------------------------------------- off-policy rows
def test_offpolicy_rows_use_truncated_is_weight():
    # row 0 on-policy (ratio 1, A = 1); row 1 off-policy with A = 2, is_weight 0.5 on both tokens,
    # and a huge ratio vs old_logp (0) that must NOT be clipped or used
    logp = torch.tensor([[-1.0, -1.0], [-3.0, -0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    old[1] = torch.tensor([-10.0, -10.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    isw = torch.tensor([[1.0, 1.0], [0.5, 0.25]], dtype=torch.float64)
    off = torch.tensor([False, True])
    out = grpo_loss(logp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask, loss_type="token_mean",
                    is_weight=isw, offpolicy=off)
    # per-token: row 0: -1, -1; row 1: -0.5*2, -0.25*2 -> (-1 -1 -1 -0.5) / 4
    assert out.loss.item() == pytest.approx(-0.875)
    out.loss.backward()
    # gradient of an off-policy token is -w * A / N (exp(logp - stopgrad(logp)) has derivative 1)
    assert logp.grad[1].tolist() == pytest.approx([-0.5 * 2 / 4, -0.25 * 2 / 4])
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -0.25])
    # stats only over on-policy rows: ratio 1, nothing clipped
    assert out.stats["clip_frac"] == 0.0
    assert out.stats["ratio_mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="is_weight"):
        grpo_loss(logp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask, offpolicy=off)


def test_row_weight_scales_rows():
    logp = torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)
    out = grpo_loss(logp, logp.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64),
                    torch.ones(2, 1, dtype=torch.bool), loss_type="token_mean",
                    row_weight=torch.tensor([1.0, 0.5], dtype=torch.float64))
    assert out.loss.item() == pytest.approx(-0.75)
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, -0.25])


# ----------------------------------------------------------------------------- sequence NLL
def test_sequence_nll_is_length_normalised():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [9.0, 0.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [False, True, True]])
    nll = sequence_nll(logp, mask)
    assert nll.tolist() == pytest.approx([3.5 / 3, 1.5])
    nll.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0.0, -0.5, -0.5])
