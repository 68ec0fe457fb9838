"""algo/losses.py against slow per-element loops written from the formulas."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo import kernels
from algo.advantages import lengths_to_mask
from algo.losses import (
    AGG_MODES,
    LOSS_KL_KINDS,
    _ChunkedLogprobsEntropy,
    _FusedLogprobsEntropy,
    aggregate,
    entropy_from_logits,
    kl,
    logprobs_and_entropy,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)

MAX_LEN = 9


def ragged_mask(batch: int, steps: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(0, steps + 1, (batch,), generator=gen)
    lengths[0] = 0
    if batch > 1:
        lengths[-1] = steps
    return lengths_to_mask(lengths, steps)


def random_splits(batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A random partition of range(batch) into 1..batch non-empty micro-batches."""
    perm = torch.randperm(batch, generator=gen)
    n_parts = int(torch.randint(1, batch + 1, (1,), generator=gen))
    cuts = sorted(torch.randperm(batch - 1, generator=gen)[: n_parts - 1].add(1).tolist())
    return list(torch.tensor_split(perm, cuts))


# ---------------------------------------------------------------- slow references


def loop_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        x = min(max(ref - lp, -20.0), 20.0)
        return min(math.exp(x) - x - 1, 10.0)
    return abs(d)


def loop_aggregate(loss, mask, agg, max_response_len=None):
    rows = [[v for v, keep in zip(r, k, strict=True) if keep] for r, k in zip(loss.tolist(), mask.bool().tolist())]
    if agg == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / max(n, 1)
    nonempty = [r for r in rows if r]
    if agg == "seq-mean-token-sum":
        per_seq = [sum(r) for r in nonempty]
    elif agg == "seq-mean-token-mean":
        per_seq = [sum(r) / len(r) for r in nonempty]
    else:
        per_seq = [sum(r) / max_response_len for r in nonempty]
    return sum(per_seq) / max(len(nonempty), 1)


def loop_policy_token_losses(lp, old, adv, clip_low, clip_high, dual_clip=None, rollout=None, tis_cap=None):
    """Per-token loss and flags [(loss, clipped, lower, weight)] from the PPO / dual-clip / TIS formulas."""
    out = []
    for b in range(len(lp)):
        row = []
        for t in range(len(lp[b])):
            a = adv[b][t]
            ratio = math.exp(min(max(lp[b][t] - old[b][t], -20.0), 20.0))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss, clipped, lower = max(l1, l2), l2 > l1, False
            if dual_clip is not None and a < 0 and loss > -a * dual_clip:
                loss, lower = -a * dual_clip, True
            weight = 1.0
            if tis_cap is not None:
                weight = min(math.exp(old[b][t] - rollout[b][t]), tis_cap)
            row.append((loss * weight, clipped, lower, weight))
        out.append(row)
    return out


def loop_token_mean(values, mask):
    vals = [v for r, k in zip(values, mask.bool().tolist(), strict=True) for v, keep in zip(r, k) if keep]
    return sum(vals) / max(len(vals), 1)


def policy_inputs(batch, steps, gen, spread=1.0):
    logp = -torch.rand(batch, steps, generator=gen, dtype=torch.float64) * 3
    old = logp + spread * torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    rollout = old + spread * torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    return logp, old, rollout, adv


# ---------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_matches_loop(kind):
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    lp[0, 0], ref[0, 0] = -40.0, -1.0  # ref - logp = 39 hits the k3 clamp
    lp[0, 1], ref[0, 1] = -1.0, -40.0
    expected = [[loop_kl(a, b, kind) for a, b in zip(ra, rb, strict=True)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    torch.testing.assert_close(kl(lp, ref, kind), torch.tensor(expected, dtype=torch.float64))


def test_k3_gradient_is_one_minus_ratio():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.2, -0.5], dtype=torch.float64)
    kl(lp, ref, "k3").sum().backward()
    expected = [1 - math.exp(r - p) for p, r in zip(lp.tolist(), ref.tolist(), strict=True)]
    torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_loss_gradient_on_a_softmax_is_a_true_kl_gradient(kind):
    """As a loss, kl(logp, ref) is averaged over tokens sampled from pi with the samples held fixed: its expected
    gradient is sum_y pi_y grad kl(log pi_y, log ref_y) (the sampling weight pi_y detached). Computed exactly over a
    vocabulary of 5 and compared with autograd of the divergences themselves."""
    gen = torch.Generator().manual_seed(7)
    theta = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)
    expected_term = (log_pi.exp().detach() * kl(log_pi, log_ref, kind)).sum()
    got = torch.autograd.grad(expected_term, theta, retain_graph=True)[0]
    pi, ref = log_pi.exp(), log_ref.exp()
    forward_kl = (pi * (log_pi - log_ref)).sum()  # KL(pi || ref)
    reverse_kl = (ref * (log_ref - log_pi)).sum()  # KL(ref || pi)
    if kind == "k1":
        torch.testing.assert_close(got, torch.zeros(5, dtype=torch.float64))  # why k1 is refused as a loss term
    elif kind == "k2":
        torch.testing.assert_close(got, torch.autograd.grad(forward_kl, theta, retain_graph=True)[0])
    else:
        torch.testing.assert_close(got, torch.autograd.grad(reverse_kl, theta, retain_graph=True)[0])
    assert (kind in LOSS_KL_KINDS) == (kind != "k1")


def test_kl_unknown_kind_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown KL kind 'k4'; valid kinds: k1, k2, k3, low_var_kl, abs"):
        kl(torch.zeros(2), torch.zeros(2), "k4")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-60, 0, width=32), st.floats(-60, 0, width=32)), min_size=1, max_size=20))
def test_k3_is_non_negative(pairs):
    lp = torch.tensor([p for p, _ in pairs], dtype=torch.float32)
    ref = torch.tensor([r for _, r in pairs], dtype=torch.float32)
    out = kl(lp, ref, "k3")
    assert torch.isfinite(out).all()
    assert (out >= 0).all()


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("shape", [(1, 1), (4, 6), (9, MAX_LEN)])
def test_aggregate_matches_loop(agg, shape):
    gen = torch.Generator().manual_seed(shape[0])
    loss = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask = ragged_mask(*shape, gen)
    expected = loop_aggregate(loss, mask, agg, MAX_LEN)
    assert aggregate(loss, mask, agg, max_response_len=MAX_LEN).item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("seed", range(5))
def test_aggregate_micro_batches_sum_to_batch(agg, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(2, 12, (1,), generator=gen))
    loss = torch.randn(batch, MAX_LEN, generator=gen, dtype=torch.float64)
    mask = ragged_mask(batch, MAX_LEN, gen).float()
    whole = aggregate(loss, mask, agg, max_response_len=MAX_LEN)
    tokens, seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())
    for as_tensor in (False, True):
        counts = (torch.tensor(tokens), torch.tensor(seqs)) if as_tensor else (tokens, seqs)
        parts = [aggregate(loss[i], mask[i], agg, *counts, max_response_len=MAX_LEN) for i in random_splits(batch, gen)]
        torch.testing.assert_close(sum(parts), whole)


def test_aggregate_all_masked_is_zero():
    for agg in AGG_MODES:
        out = aggregate(torch.randn(3, 4), torch.zeros(3, 4), agg, max_response_len=4)
        assert out.item() == 0.0


def test_aggregate_validation():
    loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'; valid modes: token-mean"):
        aggregate(loss, mask, "mean")
    with pytest.raises(ValueError, match="needs max_response_len > 0, got None"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="global_tokens must be > 0, got 0"):
        aggregate(loss, mask, "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match="global_seqs must be > 0, got -1"):
        aggregate(loss, mask, "seq-mean-token-sum", global_seqs=-1)


# ---------------------------------------------------------------- policy loss


POLICY_CASES = [
    {},
    {"clip_low": 0.1, "clip_high": 0.28},
    {"dual_clip": 3.0},
    {"tis_cap": 2.0},
    {"dual_clip": 1.5, "tis_cap": 1.2, "clip_high": 0.3},
]


@pytest.mark.parametrize("case", POLICY_CASES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_matches_loop(case, agg):
    gen = torch.Generator().manual_seed(7)
    logp, old, rollout, adv = policy_inputs(6, MAX_LEN, gen)
    mask = ragged_mask(6, MAX_LEN, gen)
    clip_low, clip_high = case.get("clip_low", 0.2), case.get("clip_high", 0.2)
    dual_clip, tis_cap = case.get("dual_clip"), case.get("tis_cap")
    loss, metrics = policy_loss(
        logp, old, adv, mask, clip_low, clip_high, dual_clip, agg,
        rollout_logprobs=rollout, tis_cap=tis_cap, max_response_len=MAX_LEN,
    )  # fmt: skip
    tokens = loop_policy_token_losses(
        logp.tolist(), old.tolist(), adv.tolist(), clip_low, clip_high, dual_clip, rollout.tolist(), tis_cap
    )
    token_loss = torch.tensor([[t[0] for t in row] for row in tokens], dtype=torch.float64)
    assert loss.item() == pytest.approx(loop_aggregate(token_loss, mask, agg, MAX_LEN), abs=1e-12)
    flags = {name: [[float(t[i]) for t in row] for row in tokens] for i, name in [(1, "clip"), (2, "lower"), (3, "w")]}
    assert metrics["pg_clipfrac"].item() == pytest.approx(loop_token_mean(flags["clip"], mask))
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(loop_token_mean(flags["lower"], mask))
    kl_rows = [[o - lp for lp, o in zip(*r)] for r in zip(logp.tolist(), old.tolist())]
    assert metrics["ppo_kl"].item() == pytest.approx(loop_token_mean(kl_rows, mask))
    if tis_cap is None:
        assert "tis_weight_mean" not in metrics
    else:
        assert metrics["tis_weight_mean"].item() == pytest.approx(loop_token_mean(flags["w"], mask))
    # the inputs were chosen so every branch is exercised, else the comparison above proves little
    assert 0 < metrics["pg_clipfrac"].item() < 1
    if dual_clip is not None:
        assert metrics["pg_clipfrac_lower"].item() > 0


def test_policy_loss_gradient_is_zero_where_clipped():
    gen = torch.Generator().manual_seed(8)
    logp, old, _, adv = policy_inputs(5, 6, gen)
    mask = torch.ones(5, 6)
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, dual_clip=2.0)
    loss.backward()
    n = mask.numel()
    for b in range(5):
        for t in range(6):
            a, ratio = adv[b, t].item(), math.exp(logp[b, t].item() - old[b, t].item())
            clipped = (a > 0 and ratio > 1.2) or (a < 0 and ratio < 0.8) or (a < 0 and ratio > 2.0)
            expected = 0.0 if clipped else -a * ratio / n
            assert logp.grad[b, t].item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_policy_and_value_loss_micro_batches_sum_to_batch(agg, seed):
    gen = torch.Generator().manual_seed(50 + seed)
    batch = 10
    logp, old, rollout, adv = policy_inputs(batch, MAX_LEN, gen)
    values, old_values, returns = torch.randn(3, batch, MAX_LEN, generator=gen, dtype=torch.float64)
    mask = ragged_mask(batch, MAX_LEN, gen)
    kw = {"agg": agg, "max_response_len": MAX_LEN}
    whole_pg, _ = policy_loss(logp, old, adv, mask, dual_clip=3.0, rollout_logprobs=rollout, tis_cap=2.0, **kw)
    whole_vf, _ = value_loss(values, old_values, returns, mask, 0.2, **kw)
    kw.update(global_tokens=int(mask.sum()), global_seqs=int(mask.any(1).sum()))
    pg_parts, vf_parts = [], []
    for i in random_splits(batch, gen):
        tis = {"rollout_logprobs": rollout[i], "tis_cap": 2.0}
        pg_parts.append(policy_loss(logp[i], old[i], adv[i], mask[i], dual_clip=3.0, **tis, **kw)[0])
        vf_parts.append(value_loss(values[i], old_values[i], returns[i], mask[i], 0.2, **kw)[0])
    torch.testing.assert_close(sum(pg_parts), whole_pg)
    torch.testing.assert_close(sum(vf_parts), whole_vf)


def test_policy_loss_validation():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1, got 1.0"):
        policy_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low must be in"):
        policy_loss(x, x, x, m, clip_low=1.0)
    with pytest.raises(ValueError, match="tis_cap is set but rollout_logprobs is None"):
        policy_loss(x, x, x, m, tis_cap=2.0)
    with pytest.raises(ValueError, match="same"):
        policy_loss(x, torch.zeros(2, 4), x, m)


def test_policy_loss_rollout_logprobs_without_cap_changes_nothing():
    gen = torch.Generator().manual_seed(9)
    logp, old, rollout, adv = policy_inputs(3, 4, gen)
    mask = torch.ones(3, 4)
    plain = policy_loss(logp, old, adv, mask)[0]
    assert torch.equal(plain, policy_loss(logp, old, adv, mask, rollout_logprobs=rollout)[0])


# ---------------------------------------------------------------- value loss


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_matches_loop(agg):
    gen = torch.Generator().manual_seed(11)
    values, old_values, returns = torch.randn(3, 7, MAX_LEN, generator=gen, dtype=torch.float64)
    mask = ragged_mask(7, MAX_LEN, gen)
    clip = 0.3
    token_loss, clipped = [], []
    for v_row, o_row, r_row in zip(values.tolist(), old_values.tolist(), returns.tolist(), strict=True):
        loss_row, clip_row = [], []
        for v, o, r in zip(v_row, o_row, r_row, strict=True):
            v_clip = o + min(max(v - o, -clip), clip)
            l1, l2 = (v - r) ** 2, (v_clip - r) ** 2
            loss_row.append(0.5 * max(l1, l2))
            clip_row.append(float(l2 > l1))
        token_loss.append(loss_row)
        clipped.append(clip_row)
    loss, metrics = value_loss(values, old_values, returns, mask, clip, agg, max_response_len=MAX_LEN)
    expected = loop_aggregate(torch.tensor(token_loss, dtype=torch.float64), mask, agg, MAX_LEN)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(loop_token_mean(clipped, mask))
    assert 0 < metrics["vf_clipfrac"].item() < 1
    with pytest.raises(ValueError, match="value clip must be > 0, got 0"):
        value_loss(values, old_values, returns, mask, 0)


# ---------------------------------------------------------------- log-probs and entropy from logits


def loop_log_softmax(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - lse for v in row]


def loop_logprobs(logits, labels, temperature):
    return [
        [loop_log_softmax([v / temperature for v in pos])[lab] for pos, lab in zip(seq, lab_seq, strict=True)]
        for seq, lab_seq in zip(logits.double().tolist(), labels.tolist(), strict=True)
    ]


def loop_entropy(logits):
    return [
        [-sum(math.exp(lp) * lp for lp in loop_log_softmax(pos)) for pos in seq] for seq in logits.double().tolist()
    ]


LOGIT_CASES = [((1, 1, 5), 1), ((3, 4, 7), 1), ((3, 4, 7), 5), ((2, 5, 11), 1024), ((4, 3, 6), 7)]


@pytest.mark.parametrize("shape,chunk", LOGIT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_match_loop(shape, chunk, dtype):
    gen = torch.Generator().manual_seed(chunk)
    logits = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:2], generator=gen)
    for temperature in (1.0, 0.7):
        out = logprobs_from_logits(logits, labels, temperature, chunk_size=chunk)
        assert out.dtype == torch.float32
        expected = torch.tensor(loop_logprobs(logits, labels, temperature), dtype=torch.float32)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ent = entropy_from_logits(logits, chunk_size=chunk)
    torch.testing.assert_close(ent, torch.tensor(loop_entropy(logits), dtype=torch.float32), rtol=1e-5, atol=1e-5)
    scaled = torch.tensor(loop_entropy(logits.float() / 0.7), dtype=torch.float32)
    torch.testing.assert_close(entropy_from_logits(logits, 0.7, chunk_size=chunk), scaled, rtol=1e-5, atol=1e-5)


def test_strided_logits_view():
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (3, 5), generator=gen)
    view = full[:, :-1]  # the usual shift: not reshapeable to [B*T, V] without a copy
    expected = torch.tensor(loop_logprobs(view, labels, 1.0), dtype=torch.float64)
    torch.testing.assert_close(logprobs_from_logits(view, labels, chunk_size=4), expected)
    expected_ent = torch.tensor(loop_entropy(view), dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(view, chunk_size=4), expected_ent)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_gradients_match_autograd_reference(chunk):
    gen = torch.Generator().manual_seed(chunk)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (3, 4), generator=gen)
    upstream = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    temperature = 0.8

    got_lp = torch.autograd.grad((logprobs_from_logits(logits, labels, temperature, chunk) * upstream).sum(), logits)[0]
    ref_lp = torch.log_softmax(logits / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got_lp, torch.autograd.grad((ref_lp * upstream).sum(), logits)[0])

    got_ent = torch.autograd.grad((entropy_from_logits(logits, temperature, chunk) * upstream).sum(), logits)[0]
    p = torch.softmax(logits / temperature, -1)
    ref_ent = -(p * torch.log_softmax(logits / temperature, -1)).sum(-1)
    torch.testing.assert_close(got_ent, torch.autograd.grad((ref_ent * upstream).sum(), logits)[0])


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 4, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, 1.3, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.6, chunk_size=2), (logits,))


def test_no_full_float32_copy_is_saved_for_backward():
    batch, steps, vocab = 2, 8, 64
    logits = torch.randn(batch, steps, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, steps))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = logprobs_from_logits(logits, labels, chunk_size=4).sum() + entropy_from_logits(logits, chunk_size=4).sum()
    big_fp32 = [n for dtype, n in saved if dtype == torch.float32 and n > batch * steps]
    assert saved and not big_fp32
    out.backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == logits.shape


def test_logits_validation():
    with pytest.raises(ValueError, match="need logits"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        entropy_from_logits(torch.zeros(2, 3, 4), chunk_size=0)


@pytest.mark.parametrize("shape,chunk", LOGIT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_together_match_the_loops(shape, chunk, dtype):
    gen = torch.Generator().manual_seed(chunk + 1)
    logits = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:2], generator=gen)
    for temperature in (1.0, 0.7):
        logp, ent = logprobs_and_entropy(logits, labels, temperature, chunk_size=chunk)
        assert logp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(logp, torch.tensor(loop_logprobs(logits, labels, temperature)), rtol=1e-5,
                                   atol=1e-5)
        expected = torch.tensor(loop_entropy(logits.float() / temperature), dtype=torch.float32)
        torch.testing.assert_close(ent, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logprobs_and_entropy_gradients_match_autograd_on_the_formulas(chunk, which, temperature):
    gen = torch.Generator().manual_seed(chunk)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (3, 4), generator=gen)
    up_lp, up_ent = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen,
                                                                                        dtype=torch.float64)
    logp, ent = logprobs_and_entropy(logits, labels, temperature, chunk)
    scaled = logits / temperature
    ref_lp = torch.log_softmax(scaled, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    terms = {"both": ((logp, ref_lp, up_lp), (ent, ref_ent, up_ent)), "logp": ((logp, ref_lp, up_lp),),
             "entropy": ((ent, ref_ent, up_ent),)}[which]
    got = torch.autograd.grad(sum((t * u).sum() for t, _, u in terms), logits, retain_graph=True)[0]
    want = torch.autograd.grad(sum((r * u).sum() for _, r, u in terms), logits)[0]
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the Triton kernels (algo/kernels.py), interpreted


def fused(logits, labels, temperature):
    """The GPU path of logprobs_and_entropy, run by Triton's interpreter on CPU tensors (tests/conftest.py)."""
    pytest.importorskip("triton")
    if not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU, or Triton's interpreter, runs the kernels")
    return _FusedLogprobsEntropy.apply(logits, labels, temperature)


# vocabularies below, at and across the kernel's tile (a smaller tile makes several tiles per row here)
@pytest.mark.parametrize("vocab,block", [(7, 4096), (97, 32), (64, 64), (300, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_loops(vocab, block, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_V", block)
    gen = torch.Generator().manual_seed(vocab)
    full = (4 * torch.randn(3, 5, vocab, generator=gen)).to(dtype)
    logits = full[:, 1:]  # a strided view, as the update's logits window is
    labels = torch.randint(0, vocab, (3, 4), generator=gen)
    for temperature in (1.0, 0.7):
        logp, ent = fused(logits, labels, temperature)
        assert logp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(logp, torch.tensor(loop_logprobs(logits, labels, temperature)), rtol=1e-5,
                                   atol=1e-5)
        expected = torch.tensor(loop_entropy(logits.float() / temperature), dtype=torch.float32)
        torch.testing.assert_close(ent, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_kernel_gradients_match_autograd_on_the_formulas(which, temperature, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_V", 16)  # 37 entries: three tiles, the last one partial
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 4, 37, generator=gen, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 37, (3, 4), generator=gen)
    up_lp, up_ent = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    logp, ent = fused(logits, labels, temperature)
    exact = logits.detach().double().requires_grad_(True)
    scaled = exact / temperature
    ref_lp = torch.log_softmax(scaled, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    terms = {"both": ((logp, ref_lp, up_lp), (ent, ref_ent, up_ent)), "logp": ((logp, ref_lp, up_lp),),
             "entropy": ((ent, ref_ent, up_ent),)}[which]
    got = torch.autograd.grad(sum((t * u).sum() for t, _, u in terms), logits)[0]
    want = torch.autograd.grad(sum((r * u.double()).sum() for _, r, u in terms), exact)[0]
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)


def test_kernel_gradient_in_bfloat16_with_the_entropy_unused():
    gen = torch.Generator().manual_seed(12)
    logits = (3 * torch.randn(2, 3, 50, generator=gen)).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 50, (2, 3), generator=gen)
    logp, ent = fused(logits, labels, 1.0)
    logp.sum().backward()
    exact = logits.detach().double().requires_grad_(True)
    torch.log_softmax(exact, -1).gather(-1, labels.unsqueeze(-1)).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_kernels_give_zero_gradient_to_a_minus_infinity_logit(which, monkeypatch):
    """A -inf logit (a banned token) has probability 0: it adds nothing to the sums and gets a zero gradient."""
    monkeypatch.setattr(kernels, "BLOCK_V", 16)
    gen = torch.Generator().manual_seed(13)
    values = torch.randn(2, 3, 37, generator=gen)
    values[0, 1, 5] = values[1, 2, 20] = float("-inf")
    labels = torch.randint(0, 37, (2, 3), generator=gen).clamp(max=4)
    logits = values.clone().requires_grad_(True)
    logp, ent = fused(logits, labels, 1.0)
    (logp if which == "logp" else ent).sum().backward()
    exact = values.double().requires_grad_(True)
    ref_lp = torch.log_softmax(exact, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(exact, -1)
    ref_ent = -(p * torch.where(p > 0, torch.log_softmax(exact, -1), 0.0)).sum(-1)
    (ref_lp if which == "logp" else ref_ent).sum().backward()
    torch.testing.assert_close(logp, ref_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 1, 5] == 0 and logits.grad[1, 2, 20] == 0
    torch.testing.assert_close(logits.grad, torch.nan_to_num(exact.grad).float(), rtol=1e-4, atol=1e-6)


def test_kernels_give_a_nan_log_prob_for_a_label_out_of_range():
    logits = torch.randn(1, 2, 9)
    logp, ent = fused(logits, torch.tensor([[3, 9]]), 1.0)
    assert torch.isfinite(logp[0, 0]) and torch.isnan(logp[0, 1]) and torch.isfinite(ent).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_kernels_give_the_chunked_values_and_gradients():
    """The e2e benchmark's shape class: a 152k vocabulary in bfloat16, a strided window, temperature 0.9."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = (3 * torch.randn(4, 65, 151936, generator=gen, device="cuda")).bfloat16()
    labels = torch.randint(0, 151936, (4, 64), generator=gen, device="cuda")
    up_lp, up_ent = torch.randn(2, 4, 64, generator=gen, device="cuda")
    results = []
    for apply in (lambda x: _FusedLogprobsEntropy.apply(x, labels, 0.9),
                  lambda x: _ChunkedLogprobsEntropy.apply(x, labels, 0.9, 1024)):
        logits = full.clone().requires_grad_(True)
        logp, ent = apply(logits[:, 1:])
        ((logp * up_lp).sum() + (ent * up_ent).sum()).backward()
        results.append((logp, ent, logits.grad.float()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the public functions take the kernels on a GPU
    leaf = full.clone().requires_grad_(True)
    for out in (logprobs_and_entropy(leaf[:, 1:], labels, 0.9)[0], logprobs_from_logits(leaf[:, 1:], labels, 0.9)):
        assert type(out.grad_fn).__name__ == "_FusedLogprobsEntropyBackward"
