"""algo/pipeline.py: the order of filters, KL, advantages, PF-PPO and replay, against slow loops from the formulas.

The multi-rank side (statistics over the data-parallel group) is tests/dist/same_metrics.py via test_metrics.py.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import config as C
from algo.filters import ReplayBuffer
from algo.kl_control import make_kl_controller
from algo.pipeline import prepare_batch

N, T = 4, 5  # samples per prompt, response width


def rollout(groups: int, seed: int = 0, scores: list[float] | None = None, lengths: list[int] | None = None) -> dict:
    """A scored rollout batch of `groups` prompts x N samples, as train_ppo.py hands it to prepare_batch."""
    gen = torch.Generator().manual_seed(seed)
    b = groups * N
    lens = torch.tensor(lengths) if lengths is not None else torch.randint(1, T + 1, (b,), generator=gen)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -torch.rand(b, T, generator=gen, dtype=torch.float64) * 3 * mask
    return {
        "scores": torch.tensor(scores, dtype=torch.float32) if scores is not None else torch.rand(b, generator=gen),
        "response_len": lens, "response_mask": mask, "prompt_len": torch.full((b,), 3),
        "old_logprobs": old, "ref_logprobs": (old - torch.rand(b, T, generator=gen, dtype=torch.float64)) * mask,
        "values": torch.randn(b, T, generator=gen, dtype=torch.float64) * mask,
        "prompt_index": torch.arange(b) // N + 100 * seed,
    }


def algorithm(**overrides) -> C.AlgorithmConfig:
    return C.load_config(None, [f"algorithm.{k}={v}" for k, v in overrides.items()]).algorithm


def prepare(batch, algo, kl_ctl=None, **kw):
    kl_ctl = kl_ctl or make_kl_controller(algo.kl.controller, algo.kl.coef, algo.kl.target, algo.kl.horizon)
    return prepare_batch(dict(batch), algo, kl_ctl, group_size=N, max_response_len=T,
                         min_reward=kw.pop("min_reward", None), **kw)


def loop_sequence_rewards(batch, beta):
    """score - beta * sum_t (logp - ref) over each row's response tokens (k1, the reward's default estimator)."""
    out = []
    for i in range(len(batch["scores"])):
        n = int(batch["response_len"][i])
        kl_sum = sum(float(batch["old_logprobs"][i, t] - batch["ref_logprobs"][i, t]) for t in range(n))
        out.append(float(batch["scores"][i]) - beta * kl_sum)
    return out


def loop_group_advantages(rewards, groups, estimator):
    """GRPO (unbiased std, eps 1e-6) or RLOO over the given groups (lists of row indices)."""
    adv = {}
    for rows in groups:
        values = [rewards[i] for i in rows]
        mean = sum(values) / len(values)
        for i in rows:
            if len(rows) == 1 or len(set(values)) == 1:
                adv[i] = 0.0
            elif estimator == "grpo":
                adv[i] = (rewards[i] - mean) / (statistics.stdev(values) + 1e-6)
            else:
                adv[i] = rewards[i] - (sum(values) - rewards[i]) / (len(rows) - 1)
    return [adv[i] for i in sorted(adv)]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_apply_the_kl_penalty_in_the_reward(estimator):
    batch = rollout(3, seed=1)
    algo = algorithm(adv_estimator=estimator, **{"kl.in_reward": "true", "kl.coef": 0.3})
    out, m = prepare(batch, algo)
    rewards = loop_sequence_rewards(batch, 0.3)
    expected = loop_group_advantages(rewards, [list(range(g * N, g * N + N)) for g in range(3)], estimator)
    torch.testing.assert_close(out["advantages"][:, 0].double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert m["actor/kl_coef"] == 0.3
    # without the penalty the advantages differ: the test would notice a dropped KL term
    plain, _ = prepare(batch, algorithm(adv_estimator=estimator, **{"kl.in_reward": "false"}))
    assert not torch.allclose(plain["advantages"], out["advantages"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_filtered_samples_set_no_baseline(estimator):
    """min_reward drops samples before the advantages: the survivors' group baseline is their own."""
    scores = [0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.05, 0.6]
    batch = rollout(2, seed=2, scores=scores)
    out, m = prepare(batch, algorithm(adv_estimator=estimator, **{"kl.in_reward": "false"}), min_reward=0.15)
    kept = [i for i, s in enumerate(scores) if s >= 0.15]
    assert out["prompt_index"].tolist() == batch["prompt_index"][kept].tolist()
    groups = [[i for i in kept if i // N == g] for g in range(2)]
    expected = loop_group_advantages(scores, groups, estimator)
    torch.testing.assert_close(out["advantages"][:, 0].double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert m["data/kept_fraction"] == pytest.approx(len(kept) / len(scores))


def test_pf_ppo_resamples_on_the_same_shaped_scores_as_the_filters():
    """Raw scores all equal, lengths differing: only the overlong penalty separates the samples, and PF-PPO's
    best-worst mode must see it (on raw scores every sample is both the best and the worst)."""
    lengths = [1, 2, 3, 5, 5, 4, 1, 3]
    batch = rollout(2, seed=3, scores=[1.0] * 8, lengths=lengths)
    algo = algorithm(adv_estimator="grpo", **{"kl.in_reward": "false", "filters.overlong_buffer": 3,
                                             "filters.pf_ppo": "max_min"})
    out, m = prepare(batch, algo, generator=torch.Generator().manual_seed(0))
    start = T - 3
    shaped = [1.0 - max(0, n - start) / 3 for n in lengths]
    extremes = {max(shaped), min(shaped)}
    picked = [shaped[lengths.index(int(n))] for n in out["response_len"]]
    assert set(picked) <= extremes and len(out["response_len"]) == 8, (picked, extremes)
    assert m["reward/shaped_score/min"] == pytest.approx(min(shaped))


def test_adaptive_kl_controller_moves_towards_its_target_in_both_modes():
    batch = rollout(2, seed=4)
    for mode in ({"kl.in_reward": "true"}, {"kl.in_reward": "false", "kl.in_loss": "true"}):
        for target, direction in ((1e-6, 1), (1e6, -1)):
            algo = algorithm(adv_estimator="grpo", **mode, **{"kl.controller": "adaptive", "kl.target": target,
                                                             "kl.coef": 0.1, "kl.horizon": 100})
            ctl = make_kl_controller("adaptive", 0.1, target, 100)
            _, m = prepare(batch, algo, ctl)
            assert m["actor/kl_coef"] == 0.1, "the step trains with the coefficient before the update"
            # err clipped to +-0.2, n_steps = 8 samples, horizon 100
            assert ctl.value == pytest.approx(0.1 * (1 + direction * 0.2 * 8 / 100)), (mode, target)


def test_adaptive_kl_controller_measures_the_per_token_mean():
    batch = rollout(2, seed=5)
    algo = algorithm(adv_estimator="grpo", **{"kl.in_reward": "true"})
    _, m = prepare(batch, algo)
    mask = batch["response_mask"].bool()
    per_token = (batch["old_logprobs"] - batch["ref_logprobs"])[mask]
    assert m["actor/reward_kl"] == pytest.approx(float(per_token.mean()))


def test_replay_mixes_before_it_adds():
    replay = ReplayBuffer(capacity=100, quality_threshold=-1.0, mix_fraction=0.5, seed=0)
    algo = algorithm(adv_estimator="grpo", **{"kl.in_reward": "false"})
    first, m = prepare(rollout(2, seed=6), algo, replay=replay)
    assert m["replay/mixed"] == 0 and len(replay) == 8, "a batch must not replay its own samples"
    assert first["prompt_index"].tolist() == rollout(2, seed=6)["prompt_index"].tolist()
    second, m = prepare(rollout(2, seed=7), algo, replay=replay)
    assert m["replay/mixed"] == 4 and len(replay) == 16
    from_first = [i for i in second["prompt_index"].tolist() if i < 700]  # seed 6's prompts are 600 and 601
    assert len(from_first) == 4, second["prompt_index"]


def test_everything_filtered_gives_an_empty_batch_not_nan():
    batch = rollout(2, seed=8, scores=[1.0] * 8)
    algo = algorithm(adv_estimator="grpo", **{"kl.in_reward": "false", "filters.dynamic_sampling": "true"})
    out, m = prepare(batch, algo)
    assert out["advantages"].shape[0] == 0 and m["data/dropped_groups"] == 2 and m["data/kept_fraction"] == 0
    assert m["data/flat_group_fraction"] == 1.0 and m["critic/score/mean"] == m["reward/score/mean"] == 1.0
    assert all(v == v for v in m.values()), m


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_whole_pipeline_runs_on_cuda_tensors():
    """The trainer's batch lives on the GPU while its shuffling generator lives on the CPU."""
    batch = {k: v.cuda() for k, v in rollout(3, seed=9).items()}
    algo = algorithm(adv_estimator="grpo", **{"kl.in_reward": "true", "filters.pf_ppo": "pow",
                                             "filters.overlong_buffer": 2, "filters.min_reward": 0.1})
    replay = ReplayBuffer(capacity=100, quality_threshold=0.0, mix_fraction=0.25)
    out, m = prepare(batch, algo, generator=torch.Generator().manual_seed(0), replay=replay)
    assert out["advantages"].is_cuda and all(v == v for v in m.values()), m


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", "grpo", "rloo"])
def test_without_a_kl_term_no_estimator_reads_the_old_logprobs(estimator):
    """config.old_logprobs_pass leaves them out of such a batch (the update's forward gives them): every estimator
    gives the advantages and metrics it gives with them."""
    batch = rollout(3, seed=2)
    algo = algorithm(adv_estimator=estimator, **{"kl.in_reward": "false"})
    with_old, m_with = prepare(batch, algo)
    without = {k: v for k, v in batch.items() if k != "old_logprobs"}
    got, m_without = prepare(without, algo)
    torch.testing.assert_close(got["advantages"], with_old["advantages"], rtol=0, atol=0)
    assert "old_logprobs" not in got and m_without == m_with
