"""algo/advantages.py against slow per-element loops written from the formulas."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo.advantages import (
    as_groups,
    check_finite,
    gae,
    grpo,
    lengths_to_mask,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp,
    rloo,
)

SHAPES = [(1, 1), (3, 5), (8, 17), (5, 1)]


def ragged_mask(batch: int, steps: int, gen: torch.Generator) -> torch.Tensor:
    """Prefix masks of random lengths, with an empty row and (when there are two rows) a full one."""
    lengths = torch.randint(0, steps + 1, (batch,), generator=gen)
    lengths[0] = 0
    if batch > 1:
        lengths[-1] = steps
    return lengths_to_mask(lengths, steps)


def holey_mask(batch: int, steps: int, gen: torch.Generator) -> torch.Tensor:
    """Masks with gaps, to pin down the meaning of 'V_{t+1} = 0 where mask_{t+1} = 0'."""
    mask = torch.rand(batch, steps, generator=gen) < 0.6
    mask[0] = False
    return mask


# ---------------------------------------------------------------- slow references


def loop_masked_mean(x, m):
    vals = [v for v, keep in zip(x.flatten().tolist(), m.flatten().tolist(), strict=True) if keep]
    return sum(vals) / len(vals) if vals else 0.0


def loop_gae(r, v, m, gamma, lam):
    r, v, m = r.tolist(), v.tolist(), m.bool().tolist()
    steps = len(r[0])
    adv = [[0.0] * steps for _ in r]
    for b in range(len(r)):
        for t in reversed(range(steps)):
            if not m[b][t]:
                continue
            nxt = t + 1 < steps and m[b][t + 1]
            v_next = v[b][t + 1] if nxt else 0.0
            a_next = adv[b][t + 1] if nxt else 0.0
            delta = r[b][t] + gamma * v_next - v[b][t]
            adv[b][t] = delta + gamma * lam * a_next
    ret = [[adv[b][t] + v[b][t] if m[b][t] else 0.0 for t in range(steps)] for b in range(len(r))]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def over_tokens(per_sample, mask):
    rows = [[per_sample[b] if keep else 0.0 for keep in row] for b, row in enumerate(mask.bool().tolist())]
    return torch.tensor(rows, dtype=torch.float64)


def loop_grpo(scores, group_size, mask, norm_by_std, eps=1e-6):
    s = scores.tolist()
    per_sample = []
    for g0 in range(0, len(s), group_size):
        group = s[g0 : g0 + group_size]
        mean = sum(group) / len(group)
        for x in group:
            if norm_by_std:
                per_sample.append(0.0 if group_size == 1 else (x - mean) / (statistics.stdev(group) + eps))
            else:
                per_sample.append(x - mean)
    return over_tokens(per_sample, mask)


def loop_rloo(scores, group_size, mask):
    s = scores.tolist()
    per_sample = []
    for g0 in range(0, len(s), group_size):
        group = s[g0 : g0 + group_size]
        for i, x in enumerate(group):
            others = group[:i] + group[i + 1 :]
            per_sample.append(x - sum(others) / len(others))
    return over_tokens(per_sample, mask)


# ---------------------------------------------------------------- masked statistics


def test_lengths_to_mask_matches_loop():
    lengths = torch.tensor([0, 3, 5, 1])
    expected = [[t < n for t in range(5)] for n in lengths.tolist()]
    assert lengths_to_mask(lengths, 5).tolist() == expected
    with pytest.raises(ValueError, match="lengths must lie in"):
        lengths_to_mask(torch.tensor([6]), 5)


@pytest.mark.parametrize("shape", SHAPES)
def test_masked_mean_matches_loop(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask = ragged_mask(*shape, gen)
    assert masked_mean(x, mask).item() == pytest.approx(loop_masked_mean(x, mask), abs=1e-12)
    rows = masked_mean(x, mask, dim=1)
    for b in range(shape[0]):
        assert rows[b].item() == pytest.approx(loop_masked_mean(x[b], mask[b]), abs=1e-12)
    # the empty first row reduces to 0, not NaN
    assert rows[0].item() == 0.0


def test_masked_mean_ignores_non_finite_padding_and_accepts_float_masks():
    x = torch.tensor([[1.0, 3.0, float("nan")], [float("inf"), 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 3 + 2 + 4) / 4)
    assert torch.equal(masked_mean(x, mask, dim=1), masked_mean(x, mask.bool(), dim=1))


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_loop(unbiased):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = ragged_mask(6, 9, gen)
    vals = x[mask].tolist()
    expected = statistics.variance(vals) if unbiased else statistics.pvariance(vals)
    assert masked_var(x, mask, unbiased=unbiased).item() == pytest.approx(expected, rel=1e-10)


def test_masked_var_needs_enough_entries():
    x = torch.tensor([[1.0, 2.0]])
    with pytest.raises(ValueError, match="at least 2 valid entries, got 1"):
        masked_var(x, torch.tensor([[True, False]]))
    assert masked_var(x, torch.tensor([[True, False]]), unbiased=False).item() == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(shift_mean):
    gen = torch.Generator().manual_seed(2)
    x = 3 * torch.randn(7, 11, generator=gen, dtype=torch.float64) + 5
    mask = ragged_mask(7, 11, gen)
    vals = x[mask].tolist()
    mean, var = statistics.fmean(vals), statistics.variance(vals)
    expected = [
        [((v - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)) if keep else 0.0 for v, keep in zip(r, k)]
        for r, k in zip(x.tolist(), mask.tolist(), strict=True)
    ]
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))


def test_mask_shape_mismatch_is_value_error():
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\), expected \(2, 4\)"):
        masked_mean(torch.zeros(2, 4), torch.ones(2, 3))


# ---------------------------------------------------------------- GAE and REINFORCE++


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
@pytest.mark.parametrize("mask_kind", ["ragged", "holey"])
def test_gae_matches_loop(shape, gamma, lam, mask_kind):
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    rewards = torch.randn(*shape, generator=gen, dtype=torch.float64)
    values = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask = (ragged_mask if mask_kind == "ragged" else holey_mask)(*shape, gen)
    adv, ret = gae(rewards, values, mask.float(), gamma, lam)
    exp_adv, exp_ret = loop_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))
    assert torch.equal(ret[~mask], torch.zeros_like(ret[~mask]))


def test_gae_ignores_values_in_padding():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    with_garbage = gae(rewards, torch.tensor([[0.5, 0.25, 100.0]]), mask, 0.9, 0.8)
    without = gae(rewards, torch.tensor([[0.5, 0.25, 0.0]]), mask, 0.9, 0.8)
    assert torch.equal(with_garbage[0], without[0])
    # last token: delta = 1 - 0.25; first: delta = 0 + 0.9 * 0.25 - 0.5, A = delta + 0.9 * 0.8 * 0.75
    torch.testing.assert_close(without[0], torch.tensor([[0.9 * 0.25 - 0.5 + 0.72 * 0.75, 0.75, 0.0]]))


def test_gae_rejects_bad_inputs():
    rewards = torch.zeros(2, 3)
    rewards[1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"token_rewards has 1 non-finite entries .* index \(1, 2\)"):
        gae(rewards, torch.zeros(2, 3), torch.ones(2, 3), 1.0, 1.0)
    values = torch.zeros(2, 3)
    values[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"values has 1 non-finite entries .* index \(0, 1\)"):
        gae(torch.zeros(2, 3), values, torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.5, 1.0)


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(shape, gamma):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask = holey_mask(*shape, gen) | ragged_mask(*shape, gen)
    r, m = rewards.tolist(), mask.tolist()
    returns = [[0.0] * shape[1] for _ in range(shape[0])]
    for b in range(shape[0]):
        running = 0.0
        for t in reversed(range(shape[1])):
            running = r[b][t] + gamma * running if m[b][t] else 0.0
            returns[b][t] = running
    vals = [returns[b][t] for b in range(shape[0]) for t in range(shape[1]) if m[b][t]]
    mean, std = statistics.fmean(vals), math.sqrt(statistics.variance(vals) + 1e-8)
    expected_adv = [[(g - mean) / std if keep else 0.0 for g, keep in zip(*row)] for row in zip(returns, m)]
    adv, ret = reinforce_pp(rewards, mask, gamma)
    torch.testing.assert_close(ret, torch.tensor(returns, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(expected_adv, dtype=torch.float64))


# ---------------------------------------------------------------- GRPO and RLOO


@pytest.mark.parametrize("group_size", range(1, 9))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(group_size, norm_by_std):
    gen = torch.Generator().manual_seed(group_size)
    batch = 3 * group_size
    scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    mask = ragged_mask(batch, 6, gen)
    out = grpo(scores, group_size, mask, norm_by_std=norm_by_std)
    expected = loop_grpo(scores, group_size, mask, norm_by_std)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("group_size", range(2, 9))
def test_rloo_matches_loop(group_size):
    gen = torch.Generator().manual_seed(100 + group_size)
    batch = 2 * group_size
    # integer parts make ties across samples likely; the fractions keep most groups varied
    scores = torch.randint(0, 3, (batch,), generator=gen) + torch.rand(batch, generator=gen, dtype=torch.float64)
    mask = ragged_mask(batch, 4, gen)
    torch.testing.assert_close(rloo(scores, group_size, mask), loop_rloo(scores, group_size, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("group_size", range(1, 9))
@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.3, 0.0])
def test_equal_scores_give_exact_zero(dtype, group_size, value):
    # one equal group followed by a varied group: the equal one must be exactly 0, not 1e-11-ish noise
    varied = torch.arange(group_size, dtype=torch.float64) * 0.37
    scores = torch.cat([torch.full((group_size,), value, dtype=torch.float64), varied]).to(dtype)
    mask = torch.ones(2 * group_size, 3, dtype=torch.bool)
    outputs = [grpo(scores, group_size, mask), grpo(scores, group_size, mask, norm_by_std=False)]
    if group_size >= 2:
        outputs.append(rloo(scores, group_size, mask))
    for out in outputs:
        assert torch.equal(out[:group_size], torch.zeros(group_size, 3, dtype=dtype))
        if group_size >= 2:
            assert out[group_size:].abs().sum() > 0


def test_grpo_group_size_one_is_zero():
    scores = torch.tensor([1.0, -2.0, 5.0])
    assert torch.equal(grpo(scores, 1, torch.ones(3, 2)), torch.zeros(3, 2))


def test_group_validation():
    with pytest.raises(ValueError, match="batch size 5 is not divisible by group_size 2"):
        grpo(torch.zeros(5), 2, torch.ones(5, 3))
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        as_groups(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="rloo needs group_size >= 2, got 1|rloo needs group_size >= 2 to leave"):
        rloo(torch.zeros(4), 1, torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] with B = 4"):
        grpo(torch.zeros(4), 2, torch.ones(3, 3))


@pytest.mark.parametrize("fn", [lambda s, m: grpo(s, 2, m), lambda s, m: rloo(s, 2, m)])
def test_non_finite_scores_name_count_and_first_index(fn):
    scores = torch.tensor([0.0, 1.0, 2.0, float("nan"), float("inf"), 3.0, float("-inf"), 1.0])
    with pytest.raises(ValueError, match=r"scores has 3 non-finite entries \(NaN or inf\); the first is at index 3"):
        fn(scores, torch.ones(8, 2))


def test_check_finite_accepts_finite():
    check_finite("x", torch.tensor([[1.0, -2.0], [3e38, 0.0]]))
    with pytest.raises(ValueError, match="x has 1 non-finite"):
        check_finite("x", torch.tensor([1.0, float("nan")]))


group_case = st.integers(1, 8).flatmap(
    lambda g: st.tuples(
        st.just(g),
        st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=g, max_size=4 * g).map(
            lambda xs, g=g: xs[: len(xs) - len(xs) % g]
        ),
    )
)


@settings(max_examples=60, deadline=None)
@given(group_case, st.booleans())
def test_grpo_properties(case, norm_by_std):
    group_size, values = case
    scores = torch.tensor(values, dtype=torch.float32)
    adv = grpo(scores, group_size, torch.ones(len(values), 1), norm_by_std=norm_by_std)
    adv = adv[:, 0].double().view(-1, group_size)
    spread = scores.double().view(-1, group_size).abs().max(dim=1).values + 1
    assert torch.all(adv.sum(dim=1).abs() <= 1e-5 * group_size * spread)
    if norm_by_std and group_size > 1:
        # a z-score with the unbiased std is at most (n - 1) / sqrt(n) in magnitude
        assert torch.all(adv.abs() <= (group_size - 1) / math.sqrt(group_size) + 1e-4)


@settings(max_examples=40, deadline=None)
@given(group_case.filter(lambda c: c[0] >= 2))
def test_rloo_sums_to_zero_per_group(case):
    group_size, values = case
    scores = torch.tensor(values, dtype=torch.float32)
    adv = rloo(scores, group_size, torch.ones(len(values), 1))[:, 0].double().view(-1, group_size)
    assert torch.all(adv.sum(dim=1).abs() <= 1e-4 * group_size)


@pytest.mark.parametrize("seed", range(4))
def test_grpo_and_rloo_with_group_ids_of_any_size_match_loop(seed):
    """What filters leave: groups of different sizes (1 included), interleaved rows, ids that are not 0..G-1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (14,), generator=gen) * 7 + 3
    scores = torch.rand(14, generator=gen, dtype=torch.float64)
    mask = ragged_mask(14, 6, gen)
    groups = {g: [i for i in range(14) if ids[i] == g] for g in ids.tolist()}
    grpo_expected, rloo_expected = [], []
    for i in range(14):
        members = [float(scores[j]) for j in groups[int(ids[i])]]
        mean = sum(members) / len(members)
        lone = len(members) == 1
        grpo_expected.append(0.0 if lone else (float(scores[i]) - mean) / (statistics.stdev(members) + 1e-6))
        rloo_expected.append(0.0 if lone else float(scores[i]) - (sum(members) - float(scores[i])) / (len(members) - 1))
    got = grpo(scores, 4, mask, group_ids=ids)
    torch.testing.assert_close(got, over_tokens(grpo_expected, mask))
    torch.testing.assert_close(rloo(scores, 4, mask, group_ids=ids), over_tokens(rloo_expected, mask))
