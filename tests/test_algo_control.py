"""algo/kl_control.py and algo/controller.py against loops written from the update rules."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo.advantages import lengths_to_mask
from algo.controller import GuardRails
from algo.kl_control import AdaptiveKLController, FixedKLController, kl_in_reward, make_kl_controller
from algo.losses import kl

# ---------------------------------------------------------------- KL controllers


def test_fixed_controller_is_constant():
    ctl = make_kl_controller("fixed", 0.05)
    assert isinstance(ctl, FixedKLController)
    for measured in (0.0, 10.0, 1e6):
        ctl.update(measured, 256)
    assert ctl.value == 0.05


@settings(max_examples=50, deadline=None)
@given(
    st.floats(0.001, 1.0),
    st.floats(0.01, 1.0),
    st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 512)), min_size=1, max_size=10),
)
def test_adaptive_controller_matches_loop(init, target, steps):
    horizon = 10_000
    ctl = AdaptiveKLController(init, target, horizon)
    expected = init
    for current, n in steps:
        ctl.update(torch.tensor(current, dtype=torch.float64), n)
        err = current / target - 1
        err = 0.2 if err > 0.2 else (-0.2 if err < -0.2 else err)
        expected = expected * (1 + err * n / horizon)
        assert ctl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_direction_and_clip():
    ctl = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    ctl.update(1.0, 10)  # KL 50x the target: the error is clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    ctl.update(0.0, 10)  # KL far below: -0.2
    assert ctl.value == pytest.approx(0.1 * (1 - 0.2 * 10 / 100))
    ctl = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    ctl.update(0.021, 10)  # within the clip: err = 0.05
    assert ctl.value == pytest.approx(0.1 * (1 + (0.021 / 0.02 - 1) * 10 / 100))


def test_controller_state_round_trip():
    ctl = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=50)
    ctl.update(0.2, 20)
    restored = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=50)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value != 0.1
    fixed = FixedKLController(0.3)
    fixed.load_state_dict({"value": 0.7})
    assert fixed.value == 0.7
    with pytest.raises(ValueError, match="needs key 'value'"):
        fixed.load_state_dict({})


def test_controller_validation():
    with pytest.raises(ValueError, match="unknown KL controller kind 'pid'; valid kinds: fixed, adaptive"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="KL coefficient must be finite and >= 0"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="current_kl must be finite, got nan"):
        AdaptiveKLController(0.1, 0.1, 10).update(float("nan"), 1)


# ---------------------------------------------------------------- KL in the reward


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("mask_kind", ["prefix", "holey"])
def test_kl_in_reward_matches_loop(kind, mask_kind):
    gen = torch.Generator().manual_seed(4)
    batch, steps, beta = 6, 7, 0.05
    scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    logp = -torch.rand(batch, steps, generator=gen, dtype=torch.float64) * 2
    ref = -torch.rand(batch, steps, generator=gen, dtype=torch.float64) * 2
    if mask_kind == "prefix":
        lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
        lengths[0] = 0
        mask = lengths_to_mask(lengths, steps).float()
    else:
        mask = (torch.rand(batch, steps, generator=gen) < 0.5).float()
        mask[0] = 0
        mask[1, -1] = 1
    rewards, token_kl = kl_in_reward(scores, logp, ref, mask, beta, kind)
    for b in range(batch):
        valid = [t for t in range(steps) if mask[b, t] == 1]
        for t in range(steps):
            k = kl(logp[b, t : t + 1], ref[b, t : t + 1], kind).item() if t in valid else 0.0
            r = -beta * k + (scores[b].item() if valid and t == max(valid) else 0.0)
            assert token_kl[b, t].item() == pytest.approx(k, abs=1e-12)
            assert rewards[b, t].item() == pytest.approx(r, abs=1e-12)
    assert torch.equal(rewards[0], torch.zeros(steps, dtype=torch.float64))


def test_kl_in_reward_validation():
    with pytest.raises(ValueError, match=r"scores has 1 non-finite entries \(NaN or inf\); the first is at index 1"):
        kl_in_reward(torch.tensor([0.0, float("inf")]), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)
    with pytest.raises(ValueError, match="one B"):
        kl_in_reward(torch.zeros(3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.1)


# ---------------------------------------------------------------- guard rails


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 4)), max_size=15))
def test_guard_rails_match_loop(measurements):
    guard = GuardRails(kl_limit=0.5, var_limit=2.0, lr_decay=0.9, reward_step=0.1)
    lr_scale, raise_, count = 1.0, 0.0, 0
    for kl_value, var in measurements:
        events = guard.step(kl_value, torch.tensor(var))
        expected = []
        if kl_value > 0.5:
            lr_scale *= 0.9
            expected.append("lr_backoff")
        if var > 2.0:
            raise_ += 0.1
            expected.append("min_reward_raise")
        count += len(expected)
        assert [e["event"] for e in events] == expected
    metrics = guard.metrics()
    assert metrics["guard/lr_scale"] == pytest.approx(lr_scale)
    assert metrics["guard/min_reward"] == pytest.approx(raise_)
    assert metrics["guard/events"] == count


def test_guard_rails_events_and_state():
    guard = GuardRails(kl_limit=0.1, var_limit=1.0)
    assert guard.step(0.1, 1.0) == []  # at the limit is not above it
    events = guard.step(0.3, 1.5)
    assert events == [
        {"event": "lr_backoff", "kl": 0.3, "lr_scale": pytest.approx(0.9)},
        {"event": "min_reward_raise", "reward_var": 1.5, "min_reward": pytest.approx(0.1)},
    ]
    guard.step(0.3, None)
    assert guard.lr_scale == pytest.approx(0.81) and guard.min_reward_raise == pytest.approx(0.1)
    restored = GuardRails(kl_limit=0.1, var_limit=1.0)
    restored.load_state_dict(guard.state_dict())
    assert (
        restored.metrics()
        == guard.metrics()
        == {
            "guard/lr_scale": pytest.approx(0.81),
            "guard/min_reward": pytest.approx(0.1),
            "guard/events": 3.0,
        }
    )
    with pytest.raises(ValueError, match="lacks keys"):
        restored.load_state_dict({"lr_scale": 1.0})


def test_guard_rails_disabled_limits_never_fire():
    guard = GuardRails()
    for _ in range(5):
        assert guard.step(1e9, 1e9) == []
    assert guard.metrics() == {"guard/lr_scale": 1.0, "guard/min_reward": 0.0, "guard/events": 0.0}


def test_guard_rails_validation():
    with pytest.raises(ValueError, match="lr_decay must be in"):
        GuardRails(lr_decay=1.5)
    with pytest.raises(ValueError, match="kl_limit must be > 0"):
        GuardRails(kl_limit=0.0)
    with pytest.raises(ValueError, match="kl must be finite, got nan"):
        GuardRails(kl_limit=0.1).step(math.nan, 0.0)
