"""algo/objectives.py, algo/rollout_correction.py, REINFORCE++-baseline and the distillation reward against slow
loops written from the papers' formulas (float64, ragged masks, gradients), and against TRL's and verl's formulas
re-derived here in tensor form."""

import math

import pytest
import torch

from algo import advantages as A
from algo.kl_control import make_kl_controller
from algo.losses import policy_loss
from algo.objectives import OBJECTIVES, TRL_LOSS_TYPES
from algo.pipeline import prepare_batch
from algo.rollout_correction import correction_weights
from tests.test_algo_losses import policy_inputs, ragged_mask, random_splits

T = 7


def valid_rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]


def sg(x):
    return x.detach()


def clip(x, lo, hi):
    return torch.clamp(x, 1 - lo, 1 + hi)


# ---------------------------------------------------------------- the papers' objectives as loops over scalars


def loop_gspo(lp, old, adv, mask, lo, hi):
    """GSPO (Zheng et al. 2025, eq. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = (prod_t pi/pi_old)^(1/|y_i|)
    with the gradient through s_i; A_i the sequence's advantage (the row's mean here). Returns -J."""
    terms = []
    for b, ts in enumerate(valid_rows(mask)):
        if not ts:
            continue
        s = torch.exp(sum(lp[b, t] - old[b, t] for t in ts) / len(ts))
        a = sum(adv[b, t] for t in ts) / len(ts)
        terms.append(torch.minimum(s * a, clip(s, lo, hi) * a))
    return -sum(terms) / len(terms)


def loop_gspo_token(lp, old, adv, mask, lo, hi):
    """GSPO-token (eq. 13-14): s_it = sg(s_i) * pi_t / sg(pi_t); J = 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(.))."""
    terms = []
    for b, ts in enumerate(valid_rows(mask)):
        if not ts:
            continue
        s_seq = sg(torch.exp(sum(lp[b, t] - old[b, t] for t in ts) / len(ts)))
        per = [torch.minimum(s * adv[b, t], clip(s, lo, hi) * adv[b, t])
               for t in ts for s in [s_seq * torch.exp(lp[b, t] - sg(lp[b, t]))]]
        terms.append(sum(per) / len(ts))
    return -sum(terms) / len(terms)


def loop_cispo(lp, old, adv, mask, lo, hi):
    """CISPO (MiniMax-M1 2025, eq. 4-5): J = 1/sum|y_i| sum_i sum_t sg(clip(r_it)) A_it log pi_it."""
    terms = [sg(clip(torch.exp(lp[b, t] - old[b, t]), lo, hi)) * adv[b, t] * lp[b, t]
             for b, ts in enumerate(valid_rows(mask)) for t in ts]
    return -sum(terms) / len(terms)


def loop_ppo(lp, old, adv, mask, lo, hi):
    terms = [torch.maximum(-adv[b, t] * r, -adv[b, t] * clip(r, lo, hi))
             for b, ts in enumerate(valid_rows(mask)) for t in ts for r in [torch.exp(lp[b, t] - old[b, t])]]
    return sum(terms) / len(terms)


CASES = [  # (objective, its loop, the paper's aggregation, clip_low, clip_high)
    ("ppo", loop_ppo, "token-mean", 0.2, 0.28),
    ("gspo", loop_gspo, "seq-mean-token-mean", 0.05, 0.08),
    ("gspo_token", loop_gspo_token, "seq-mean-token-mean", 0.05, 0.08),
    ("cispo", loop_cispo, "token-mean", 1.0, 0.3),
    ("cispo", loop_cispo, "token-mean", 0.1, 0.1),
]


def objective_inputs(seed, spread=0.3, batch=10):
    gen = torch.Generator().manual_seed(seed)
    logp, old, rollout, adv = policy_inputs(batch, T, gen, spread)
    return logp, old, rollout, adv, ragged_mask(batch, T, gen)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name,loop,agg,lo,hi", CASES)
def test_objective_value_and_gradient_match_the_papers_loop(name, loop, agg, lo, hi, seed):
    logp, old, _, adv, mask = objective_inputs(seed)
    lp = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, lo, hi, agg=agg, objective=name, max_response_len=T)
    loss.backward()
    lp_loop = logp.clone().requires_grad_(True)
    expected = loop(lp_loop, old, adv, mask, lo, hi)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad, lp_loop.grad, rtol=1e-10, atol=1e-12)
    assert lp.grad[~mask.bool()].abs().max() == 0
    # the inputs clip some sequences or tokens and not others, else the comparison proves little
    assert 0 < metrics["pg_clipfrac"].item() < 1, (name, metrics["pg_clipfrac"])


def test_gspo_token_is_gspo_with_one_advantage_per_sequence():
    logp, old, _, adv, mask = objective_inputs(11)
    adv = adv[:, :1].expand_as(adv).clone()
    grads, values = [], []
    for name in ("gspo", "gspo_token"):
        lp = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, adv, mask, 0.05, 0.08, agg="seq-mean-token-mean", objective=name)
        loss.backward()
        values.append(loss.item())
        grads.append(lp.grad)
    assert values[0] == pytest.approx(values[1], abs=1e-14)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-14)


def trl_gspo_grpo(lp, old, adv_seq, mask, lo, hi):
    """TRL's GRPO loss with importance_sampling_level="sequence" and loss_type="grpo", re-derived: one log-weight per
    row (the mean log-ratio, gradient through it), per-token loss -min(w A, clip(w) A), mean over tokens per row,
    then over rows."""
    m = mask.to(lp.dtype)
    log_w = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    w = torch.exp(log_w)
    a = adv_seq.unsqueeze(-1)
    per_token = -torch.minimum(w * a, torch.clamp(w, 1 - lo, 1 + hi) * a)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def trl_cispo(lp, old, adv_seq, mask, epsilon_high):
    """TRL's loss_type="cispo", re-derived: the ratio capped at epsilon_high (an absolute bound, no lower one),
    detached, times A times log pi; summed over tokens and divided by the batch's token count."""
    m = mask.to(lp.dtype)
    w = torch.clamp(torch.exp(lp - old), max=epsilon_high).detach()
    return (-w * adv_seq.unsqueeze(-1) * lp * m).sum() / m.sum()


def test_gspo_and_cispo_equal_trls_formulas():
    logp, old, _, adv, mask = objective_inputs(5, batch=8)
    mask[:, 0] = True  # TRL averages over every row: no empty completion here
    adv_seq = adv[:, 0]
    full_adv = adv_seq[:, None].expand_as(adv).clone()
    for ours, theirs in (
        (lambda lp: policy_loss(lp, old, full_adv, mask, 0.05, 0.08, agg="seq-mean-token-mean", objective="gspo")[0],
         lambda lp: trl_gspo_grpo(lp, old, adv_seq, mask, 0.05, 0.08)),
        # TRL's epsilon_high=1.2 for CISPO is our clip_high=0.2 with no lower bound (clip_low=1)
        (lambda lp: policy_loss(lp, old, full_adv, mask, 1.0, 0.2, objective="cispo")[0],
         lambda lp: trl_cispo(lp, old, adv_seq, mask, 1.2)),
    ):
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        la, lb = ours(a), theirs(b)
        la.backward()
        lb.backward()
        assert la.item() == pytest.approx(lb.item(), abs=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def verl_cispo(lp, old, adv, mask, lo, hi):
    """verl's compute_policy_loss_cispo with loss_agg_mode token-mean, re-derived."""
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    pg = -adv * torch.clamp(ratio, 1 - lo, 1 + hi).detach() * lp
    m = mask.to(lp.dtype)
    return (pg * m).sum() / m.sum()


def test_cispo_equals_verls_formula():
    logp, old, _, adv, mask = objective_inputs(8)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    la, _ = policy_loss(a, old, adv, mask, 0.2, 0.28, objective="cispo")
    lb = verl_cispo(b, old, adv, mask, 0.2, 0.28)
    la.backward()
    lb.backward()
    assert la.item() == pytest.approx(lb.item(), abs=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_objective_micro_batches_add_up_to_the_batch(name, agg):
    """With the whole batch's counts, micro-batch losses add up to the batch's: what makes 1 rank and 2 ranks alike."""
    gen = torch.Generator().manual_seed(21)
    logp, old, rollout, adv, mask = objective_inputs(21, batch=10)
    weights, _ = correction_weights(old, rollout, mask, "sequence", 3.0, "token", 0.5, 2.0)
    lo = 1.0 if name == "cispo" else 0.1
    kw = {"agg": agg, "max_response_len": T, "objective": name, "weights": weights}
    whole, _ = policy_loss(logp, old, adv, mask, lo, 0.1, **kw)
    kw.update(global_tokens=int(mask.sum()), global_seqs=int(mask.any(1).sum()))
    parts = [policy_loss(logp[i], old[i], adv[i], mask[i], lo, 0.1, **{**kw, "weights": weights[i]})[0]
             for i in random_splits(10, gen)]
    torch.testing.assert_close(sum(parts), whole)


def test_objective_validation():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown policy objective 'grpo'; valid: ppo, gspo, gspo_token, cispo"):
        policy_loss(x, x, x, m, objective="grpo")
    with pytest.raises(ValueError, match="clip_low must be in"):
        policy_loss(x, x, x, m, clip_low=1.0, objective="gspo")
    policy_loss(x, x, x, m, clip_low=1.0, objective="cispo")  # no lower bound: allowed for CISPO
    with pytest.raises(ValueError, match="dual_clip bounds the ppo objective"):
        policy_loss(x, x, x, m, dual_clip=3.0, objective="cispo")


def test_trl_loss_types_are_valid_meshrl_configs():
    import config as C

    for loss_type, keys in TRL_LOSS_TYPES.items():
        overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
        cfg = C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                                   "algorithm.adv_estimator=grpo", "rollout.n=4", *overrides])
        C.check_ppo(cfg, 1, this_machine=False)
        for key, value in keys.items():
            section, name = key.split(".")
            assert getattr(getattr(cfg, section), name) == value, (loss_type, key)


# ---------------------------------------------------------------- rollout corrections


def loop_corrections(old, rollout, mask, weight, cap, reject, low, high):
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b, ts in enumerate(valid_rows(mask)):
        log_rho = {t: float(old[b, t] - rollout[b, t]) for t in ts}
        seq = sum(log_rho.values())
        for t in ts:
            w = 1.0
            if weight == "token":
                w = min(math.exp(log_rho[t]), cap)
            elif weight == "sequence":
                w = min(math.exp(seq), cap)
            stat = {"token": math.exp(log_rho[t]), "sequence": math.exp(seq),
                    "geometric": math.exp(seq / len(ts)), "off": 1.0}[reject]
            out[b][t] = w if low <= stat <= high else 0.0
    return torch.tensor(out, dtype=torch.float64)


LOW, HIGH = 0.8, 1.3  # mask bounds the test's log-ratios (spread 0.3 a token) cross in every mode


@pytest.mark.parametrize("weight", ["off", "token", "sequence"])
@pytest.mark.parametrize("reject", ["off", "token", "sequence", "geometric"])
def test_correction_weights_match_loop(weight, reject):
    gen = torch.Generator().manual_seed(4)
    _, old, rollout, _ = policy_inputs(12, T, gen, spread=0.3)
    mask = ragged_mask(12, T, gen)
    got, metrics = correction_weights(old, rollout, mask, weight, 1.5, reject, LOW, HIGH)
    torch.testing.assert_close(got, loop_corrections(old, rollout, mask, weight, 1.5, reject, LOW, HIGH),
                               rtol=1e-12, atol=1e-12)
    valid = [(b, t) for b, ts in enumerate(valid_rows(mask)) for t in ts]
    k3 = [math.exp(float(old[b, t] - rollout[b, t])) - float(old[b, t] - rollout[b, t]) - 1 for b, t in valid]
    assert metrics["mismatch_kl"].item() == pytest.approx(sum(k3) / len(k3), rel=1e-12)
    assert metrics["mismatch_kl_max"].item() == pytest.approx(max(k3), rel=1e-12)
    if reject != "off":
        expected = loop_corrections(old, rollout, mask, "off", 1.0, reject, LOW, HIGH)
        share = sum(expected[b, t] == 0 for b, t in valid) / len(valid)
        assert metrics["masked_fraction"].item() == pytest.approx(float(share))
        assert 0 < share < 1, "the inputs must mask some tokens and keep others"
    if weight != "off":
        unmasked = loop_corrections(old, rollout, mask, weight, 1.5, "off", LOW, HIGH)
        assert metrics["is_weight_mean"].item() == pytest.approx(sum(float(unmasked[b, t]) for b, t in valid)
                                                                 / len(valid))


def test_correction_scales_the_token_losses():
    logp, old, rollout, adv, mask = objective_inputs(9)
    weights, _ = correction_weights(old, rollout, mask, "token", 2.0, "geometric", 0.8, 1.25)
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum", weights=weights)
    rows = []
    for b, ts in enumerate(valid_rows(mask)):
        if ts:
            rows.append(sum(float(weights[b, t]) * max(-float(adv[b, t]) * r, -float(adv[b, t]) * min(max(r, 0.8), 1.2))
                            for t in ts for r in [math.exp(float(logp[b, t] - old[b, t]))]))
    assert loss.item() == pytest.approx(sum(rows) / len(rows), rel=1e-12)
    dropped = [b for b, ts in enumerate(valid_rows(mask)) if ts and float(weights[b, ts[0]]) == 0]
    assert 0 < len(dropped) < len(rows), "the geometric mask must drop some rows and keep others"


def test_correction_validation():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown importance weight mode 'seq'"):
        correction_weights(x, x, m, weight="seq")
    with pytest.raises(ValueError, match=r"0 <= low < 1 < high, got \[0.5, 1.0\]"):
        correction_weights(x, x, m, reject="token", low=0.5, high=1.0)


# ---------------------------------------------------------------- advantages and the distillation reward


def test_reinforce_pp_baseline_matches_loop():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(12, generator=gen, dtype=torch.float64)
    mask = ragged_mask(12, T, gen)
    mask[:, 0] = True
    got = A.reinforce_pp_baseline(scores, 4, mask)
    centred = [float(scores[b] - scores[b // 4 * 4 : b // 4 * 4 + 4].mean()) for b in range(12)]
    values = [centred[b] for b, ts in enumerate(valid_rows(mask)) for _ in ts]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) + 1e-8)
    for b, ts in enumerate(valid_rows(mask)):
        for t in range(T):
            expected = (centred[b] - mean) / std if t in ts else 0.0
            assert got[b, t].item() == pytest.approx(expected, abs=1e-12)


class Algo:
    """config.AlgorithmConfig's fields the pipeline reads, for a GRPO / REINFORCE++ step with distillation."""

    def __init__(self, estimator, coef, task_weight, kl_in_reward=False):
        import config as C

        self.__dict__.update(vars(C.AlgorithmConfig(adv_estimator=estimator, norm_by_std=False)))
        self.kl = C.KLConfig(in_reward=kl_in_reward, coef=0.3)
        self.distill = C.DistillConfig(coef=coef, task_weight=task_weight)


def distill_batch(gen, rows=8):
    mask = ragged_mask(rows, T, gen)
    mask[:, 0] = True
    old = -torch.rand(rows, T, generator=gen, dtype=torch.float64) * 2 * mask
    return {"scores": torch.rand(rows, generator=gen, dtype=torch.float64), "response_mask": mask.double(),
            "response_len": mask.sum(-1), "prompt_len": torch.full((rows,), 3), "old_logprobs": old,
            "policy_logprobs": old - 0.1 * mask, "ref_logprobs": old - 0.2 * mask,
            "teacher_logprobs": (old - torch.rand(rows, T, generator=gen, dtype=torch.float64)) * mask}


def test_distillation_reward_for_group_and_token_estimators_matches_loop():
    gen = torch.Generator().manual_seed(6)
    batch = distill_batch(gen)
    valid = valid_rows(batch["response_mask"])
    # GRPO without std: A_i = r_i - mean_g(r), r_i = w s_i - coef sum_t (log p_actor - log p_teacher) - beta sum_t kl
    algo = Algo("grpo", 0.7, 0.5, kl_in_reward=True)
    out, m = prepare_batch(dict(batch), algo, make_kl_controller("fixed", 0.3, 1, 1), group_size=4,
                           max_response_len=T, min_reward=None)
    lp, teacher, ref = batch["policy_logprobs"], batch["teacher_logprobs"], batch["ref_logprobs"]
    r = [0.5 * float(batch["scores"][b]) - 0.7 * sum(float(lp[b, t] - teacher[b, t]) for t in ts)
         - 0.3 * sum(float(lp[b, t] - ref[b, t]) for t in ts) for b, ts in enumerate(valid)]
    for b, ts in enumerate(valid):
        g = b // 4
        # the pipeline keeps scores in float32
        assert out["advantages"][b, ts[0]].item() == pytest.approx(r[b] - sum(r[4 * g : 4 * g + 4]) / 4, abs=1e-6)
    kl_tokens = [float(lp[b, t] - teacher[b, t]) for b, ts in enumerate(valid) for t in ts]
    assert m["distill/reverse_kl"] == pytest.approx(sum(kl_tokens) / len(kl_tokens))
    # REINFORCE++ (gamma 1): each token's return is the sum of the rewards from it on; the task score at the end
    out, _ = prepare_batch(dict(batch), Algo("reinforce_pp", 0.7, 0.0), make_kl_controller("fixed", 0.0, 1, 1),
                           group_size=4, max_response_len=T, min_reward=None)
    for b, ts in enumerate(valid):
        for t in ts:
            expected = -0.7 * sum(float(lp[b, u] - teacher[b, u]) for u in ts if u >= t)
            assert out["returns"][b, t].item() == pytest.approx(expected, abs=1e-6)


def test_kl_is_measured_on_the_current_policy_not_the_logging_one():
    """Offline samples logged by the reference itself: old = ref, but the actor has moved (policy_logprobs)."""
    gen = torch.Generator().manual_seed(7)
    batch = distill_batch(gen)
    batch["old_logprobs"] = batch["ref_logprobs"].clone()
    algo = Algo("grpo", 0.0, 1.0, kl_in_reward=True)
    _, m = prepare_batch(dict(batch), algo, make_kl_controller("fixed", 0.3, 1, 1), group_size=4,
                         max_response_len=T, min_reward=None)
    moved = [float(batch["policy_logprobs"][b, t] - batch["ref_logprobs"][b, t])
             for b, ts in enumerate(valid_rows(batch["response_mask"])) for t in ts]
    assert m["actor/reward_kl"] == pytest.approx(sum(moved) / len(moved)) and m["actor/reward_kl"] > 0.05


def test_trl_and_verl_objective_keys_are_translated_in_the_unknown_key_error():
    import config as C

    for given, needle in (("loss_type=dr_grpo", "dr_grpo: seq-mean-token-sum-norm with algorithm.norm_by_std=false"),
                          ("importance_sampling_level=sequence", "actor.policy_loss (sequence: gspo"),
                          ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor.policy_loss (vanilla: ppo")):
        with pytest.raises(C.ConfigError, match="unknown key") as err:
            C.load_config(None, [given])
        assert needle in str(err.value), err.value
    for loss_type in TRL_LOSS_TYPES:  # every loss_type the table maps is named in the hint
        assert f"{loss_type}:" in C.FOREIGN_NAMES["loss_type"] or f"{loss_type}," in C.FOREIGN_NAMES["loss_type"]
