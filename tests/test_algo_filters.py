"""algo/filters.py against slow loops written from the rules in its docstrings."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo.filters import (
    ReplayBuffer,
    dynamic_sampling_keep,
    overlong_penalty,
    pf_ppo_resample,
    reward_threshold_mask,
)
from batch import pad_cat

# ---------------------------------------------------------------- reward thresholds


def loop_threshold(scores, min_reward, filter_ratio):
    keep = [min_reward is None or s >= min_reward for s in scores]
    survivors = sorted((s, i) for i, s in enumerate(scores) if keep[i])  # (score, index): ties drop lower index
    for _, i in survivors[: math.floor(round(filter_ratio * len(scores), 9))]:
        keep[i] = False
    return keep


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([-1.0, 0.0, 0.25, 0.5, 1.0, 2.0]), min_size=1, max_size=30),
    st.one_of(st.none(), st.sampled_from([-0.5, 0.0, 0.5, 1.0])),
    st.sampled_from([0.0, 0.1, 0.25, 0.29, 0.5, 1.0]),
)
def test_reward_threshold_mask_matches_loop(scores, min_reward, filter_ratio):
    keep = reward_threshold_mask(torch.tensor(scores), min_reward, filter_ratio)
    assert keep.tolist() == loop_threshold(scores, min_reward, filter_ratio)


def test_reward_threshold_mask_examples():
    scores = torch.tensor([0.5, 0.1, 0.1, 0.9, -1.0, 0.1])
    # min_reward drops index 4; floor(0.5 * 6) = 3 of the survivors go, lowest first, ties by index: 1, 2, 5
    assert reward_threshold_mask(scores, 0.0, 0.5).tolist() == [True, False, False, True, False, False]
    # 0.29 * 100 is 28.999999999999996 in binary; the rule means 29
    assert int((~reward_threshold_mask(torch.arange(100.0), None, 0.29)).sum()) == 29


def test_reward_threshold_mask_validation():
    with pytest.raises(ValueError, match="filter_ratio must be in"):
        reward_threshold_mask(torch.zeros(3), filter_ratio=1.5)
    with pytest.raises(ValueError, match=r"scores has 2 non-finite entries \(NaN or inf\); the first is at index 1"):
        reward_threshold_mask(torch.tensor([0.0, float("nan"), 1.0, float("inf")]))


# ---------------------------------------------------------------- PF-PPO


def draw_counts(scores, mode, weight_pow=1.0, rounds=400):
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(scores))
    for _ in range(rounds):
        idx = pf_ppo_resample(torch.tensor(scores), mode, weight_pow, generator=gen)
        assert idx.shape == (len(scores),) and idx.dtype == torch.long
        counts += torch.bincount(idx, minlength=len(scores))
    return counts / counts.sum()


def assert_frequencies(freq, probs, draws):
    # 5 binomial standard deviations: with a fixed seed this is deterministic, and a wrong weight rule is far off
    for f, p in zip(freq.tolist(), probs, strict=True):
        assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / draws) + 1e-12, (freq, probs)


def test_pf_ppo_pow_frequencies():
    scores = [0.0, 0.5, 1.0, 2.0]
    weight_pow = 2.0
    weights = [((s - 0.0) / 2.0) ** weight_pow for s in scores]
    probs = [w / sum(weights) for w in weights]
    assert_frequencies(draw_counts(scores, "pow", weight_pow), probs, 400 * len(scores))


def test_pf_ppo_max_min_frequencies():
    scores = [3.0, 1.0, 2.0, 1.0, 3.0, 2.5]
    # max at 0 and 4, min at 1 and 3, each w = 1; the rest w = 0
    assert_frequencies(draw_counts(scores, "max_min"), [0.25, 0.25, 0.0, 0.25, 0.25, 0.0], 400 * len(scores))


def test_pf_ppo_max_random_frequencies():
    scores = [1.0, 0.2, 0.3, 0.2, 0.0]
    # w = 4 for the max, 1 for the rest
    assert_frequencies(draw_counts(scores, "max_random"), [4 / 8, 1 / 8, 1 / 8, 1 / 8, 1 / 8], 400 * len(scores))


def test_pf_ppo_equal_scores_are_uniform_and_seeded():
    for mode in ("pow", "max_min", "max_random"):
        assert_frequencies(draw_counts([0.3] * 4, mode), [0.25] * 4, 1600)
    scores = torch.linspace(0, 1, 16)
    assert torch.equal(
        pf_ppo_resample(scores, "pow", generator=torch.Generator().manual_seed(5)),
        pf_ppo_resample(scores, "pow", generator=torch.Generator().manual_seed(5)),
    )


def test_pf_ppo_validation():
    with pytest.raises(ValueError, match="unknown PF-PPO mode 'best'; valid modes: pow, max_min, max_random"):
        pf_ppo_resample(torch.zeros(3), "best")
    with pytest.raises(ValueError, match="weight_pow must be >= 0"):
        pf_ppo_resample(torch.zeros(3), "pow", weight_pow=-1.0)
    with pytest.raises(ValueError, match="1 non-finite entries .* index 2"):
        pf_ppo_resample(torch.tensor([0.0, 1.0, float("inf")]), "pow")
    assert pf_ppo_resample(torch.zeros(0), "pow").shape == (0,)


# ---------------------------------------------------------------- DAPO


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8).flatmap(lambda g: st.tuples(st.just(g), st.integers(1, 5))), st.data())
def test_dynamic_sampling_matches_loop(sizes, data):
    group_size, n_groups = sizes
    scores = data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=group_size * n_groups,
                                max_size=group_size * n_groups))  # fmt: skip
    keep, dropped = dynamic_sampling_keep(torch.tensor(scores), group_size)
    expected, expected_dropped = [], 0
    for g0 in range(0, len(scores), group_size):
        group = scores[g0 : g0 + group_size]
        equal = all(s == group[0] for s in group)
        expected_dropped += equal
        expected += [not equal] * group_size
    assert keep.tolist() == expected and dropped == expected_dropped


def test_dynamic_sampling_validation():
    with pytest.raises(ValueError, match="batch size 5 is not divisible by group_size 2"):
        dynamic_sampling_keep(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="1 non-finite entries .* index 0"):
        dynamic_sampling_keep(torch.tensor([float("nan"), 0.0]), 2)


@pytest.mark.parametrize("max_len,buffer,factor", [(10, 4, 1.0), (16, 16, 0.5), (8, 1, 2.0)])
def test_overlong_penalty_matches_loop(max_len, buffer, factor):
    lengths = list(range(0, max_len + 4))
    expected = []
    for n in lengths:
        start = max_len - buffer
        if n <= start:
            expected.append(0.0)
        elif n <= max_len:
            expected.append(-(n - start) / buffer * factor)
        else:
            expected.append(-factor)
    out = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor)
    torch.testing.assert_close(out, torch.tensor(expected))
    with pytest.raises(ValueError, match="need 0 < buffer_len <= max_response_len"):
        overlong_penalty(torch.tensor(lengths), max_len, max_len + 1)


# ---------------------------------------------------------------- pad_and_cat and the replay buffer


def test_pad_cat():
    a = torch.arange(6).view(2, 3)
    b = torch.arange(10, 14).view(1, 4)
    out = pad_cat([a, b])
    assert out.tolist() == [[0, 1, 2, 0], [3, 4, 5, 0], [10, 11, 12, 13]]
    masks = pad_cat([torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)])
    assert masks.tolist() == [[True, True, False], [True, True, True]]
    assert pad_cat([torch.tensor([1.0]), torch.tensor([2.0, 3.0])]).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="one ndim and dtype"):
        pad_cat([a, b.float()])


def make_batch(ids, lengths, steps):
    """Sample i has response ids filled with ids[i] over its first lengths[i] tokens."""
    mask = torch.arange(steps) < torch.tensor(lengths).unsqueeze(-1)
    return {
        "response_ids": torch.tensor(ids).unsqueeze(-1) * mask,
        "response_mask": mask,
        "uid": torch.tensor(ids),
    }


def test_replay_buffer_keeps_qualified_fifo():
    buf = ReplayBuffer(capacity=4, quality_threshold=0.5, mix_fraction=0.5)
    assert buf.add(make_batch([1, 2, 3], [2, 2, 2], 2), torch.tensor([0.5, 0.4, 0.9])) == 2
    assert buf.add(make_batch([4, 5, 6, 7], [1, 3, 3, 1], 3), torch.tensor([1.0, 1.0, 0.0, 0.7])) == 3
    # stored in order 1, 3, 4, 5, 7; capacity 4 evicts the oldest (1)
    assert len(buf) == 4
    got = buf.sample(10)
    assert sorted(got["uid"].tolist()) == [3, 4, 5, 7]
    # rows from the T=2 add are padded to T=3 with 0
    for uid, ids, mask in zip(got["uid"].tolist(), got["response_ids"].tolist(), got["response_mask"].tolist()):
        n = {3: 2, 4: 1, 5: 3, 7: 1}[uid]
        assert ids == [uid] * n + [0] * (3 - n) and mask == [True] * n + [False] * (3 - n)
    metrics = buf.metrics()
    assert metrics["replay/size"] == 4 and metrics["replay/hit_rate"] == pytest.approx(5 / 7)
    assert metrics["replay/fill"] == 1.0


def test_replay_buffer_token_capacity():
    buf = ReplayBuffer(capacity=6, quality_threshold=0.0, mix_fraction=0.0, capacity_unit="tokens")
    buf.add(make_batch([1, 2, 3], [2, 3, 2], 4), torch.ones(3))  # 7 tokens > 6: evict uid 1 (2 tokens)
    assert sorted(buf.sample(5)["uid"].tolist()) == [2, 3]
    assert buf.add(make_batch([4, 5], [8, 2], 8), torch.ones(2)) == 1  # 8 tokens can never fit: skipped
    assert sorted(buf.sample(5)["uid"].tolist()) == [3, 5]  # 5 + 2 > 6 evicts uid 2
    assert buf.metrics()["replay/fill"] == pytest.approx(4 / 6)
    assert buf.metrics()["replay/hit_rate"] == 1.0
    buf = ReplayBuffer(capacity=6, quality_threshold=0.0, mix_fraction=0.0, capacity_unit="tokens")
    with pytest.raises(ValueError, match="capacity_unit 'tokens' needs one of the keys"):
        buf.add({"uid": torch.tensor([1])}, torch.ones(1))


def test_replay_buffer_mix_replaces_rows():
    buf = ReplayBuffer(capacity=10, quality_threshold=1.0, mix_fraction=0.25, seed=3)
    buf.add(make_batch([100, 101, 102], [5, 5, 5], 5), torch.ones(3))
    batch = make_batch(list(range(8)), [1, 2, 3, 1, 2, 3, 1, 2], 3)
    mixed = buf.mix(batch)
    uids = mixed["uid"].tolist()
    assert len(uids) == 8 and mixed["response_ids"].shape == (8, 5)
    replayed = [u for u in uids if u >= 100]
    assert len(replayed) == round(0.25 * 8) and len(set(replayed)) == len(replayed)
    for row, uid in enumerate(uids):  # untouched rows keep their place and content, padded to T = 5
        if uid < 100:
            assert uid == row
            assert mixed["response_ids"][row, :3].tolist() == batch["response_ids"][row].tolist()
            assert mixed["response_ids"][row, 3:].tolist() == [0, 0]
    assert buf.metrics()["replay/mixed"] == 2
    # more to replace than stored: only what is stored is replayed
    small = ReplayBuffer(capacity=10, quality_threshold=0.0, mix_fraction=1.0)
    small.add(make_batch([50], [1], 1), torch.ones(1))
    assert sorted(small.mix(make_batch([0, 1, 2], [1, 1, 1], 1))["uid"].tolist())[-1] == 50
    assert small.metrics()["replay/mixed"] == 1
    # an empty buffer leaves the batch as it is
    empty = ReplayBuffer(capacity=10, quality_threshold=0.0, mix_fraction=0.5)
    assert empty.mix(batch)["uid"].tolist() == list(range(8))


def test_replay_buffer_state_round_trip():
    buf = ReplayBuffer(capacity=20, quality_threshold=0.0, mix_fraction=0.5, seed=1)
    buf.add(make_batch(list(range(10)), [2] * 10, 2), torch.linspace(-1, 1, 10))
    buf.sample(3)  # advance the generator so its state matters
    state = buf.state_dict()
    other = ReplayBuffer(capacity=20, quality_threshold=0.0, mix_fraction=0.5, seed=99)
    other.load_state_dict(state)
    assert other.metrics() == buf.metrics()
    assert torch.equal(other.sample(4)["uid"], buf.sample(4)["uid"])
    smaller = ReplayBuffer(capacity=2, quality_threshold=0.0, mix_fraction=0.5)
    smaller.load_state_dict(state)
    assert len(smaller) == 2
    with pytest.raises(ValueError, match="lacks keys"):
        smaller.load_state_dict({"samples": []})


def test_replay_buffer_validation():
    with pytest.raises(ValueError, match="capacity_unit"):
        ReplayBuffer(capacity=4, quality_threshold=0.0, mix_fraction=0.5, capacity_unit="bytes")
    with pytest.raises(ValueError, match="mix_fraction must be in"):
        ReplayBuffer(capacity=4, quality_threshold=0.0, mix_fraction=1.5)
    buf = ReplayBuffer(capacity=4, quality_threshold=0.0, mix_fraction=0.5)
    with pytest.raises(ValueError, match="disagree on the sample axis"):
        buf.add({"a": torch.zeros(2, 3), "b": torch.zeros(3)}, torch.zeros(2))
    with pytest.raises(ValueError, match="scores has 3 entries for a batch of 2"):
        buf.add({"a": torch.zeros(2, 3)}, torch.zeros(3))
    buf.add({"a": torch.zeros(2, 3)}, torch.zeros(2))
    with pytest.raises(ValueError, match="differ from the buffer's keys"):
        buf.add({"b": torch.zeros(2, 3)}, torch.zeros(2))
    with pytest.raises(ValueError, match="2 non-finite entries"):
        buf.add({"a": torch.zeros(2, 3)}, torch.tensor([float("nan"), float("inf")]))
