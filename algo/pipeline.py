"""From scored rollouts to the training batch: the order in which scores, filters, the KL to the reference,
advantages, PF-PPO resampling and the replay buffer meet. Pure tensor code over one data-parallel rank's samples;
statistics that must cover the whole batch go through `reduce` (see algo/advantages.py).

The order (verl's, where verl has the step):
 1. shaped scores: the reward's score plus DAPO's overlong penalty. Every filter, the advantages, PF-PPO and the
    replay buffer's quality threshold use these same scores.
 2. the KL to the reference over the whole rollout batch (the current actor's log-probs, `policy_logprobs`, against
    the reference's: never the logging policy's of offline samples): the estimator in force (kl.reward_kind with
    kl.in_reward, kl.loss_kind with kl.in_loss); its per-token mean updates the KL controller. With distillation,
    the reverse KL to the teacher per token, k1 = log p_actor - log p_teacher, on the same log-probs.
 3. filters drop samples: the score threshold (filters.min_reward, raised by the guard rail), the lowest
    filters.filter_ratio of this rank's samples, DAPO dynamic sampling (groups whose scores are all equal).
 4. advantages on the survivors only, so a dropped sample sets no baseline: GAE (whitened over the whole batch),
    REINFORCE++ (whitened over the whole batch), GRPO / RLOO / REINFORCE++-baseline over each group's surviving
    samples (the last whitened over the whole batch after the group mean is taken off), with
    score - beta * sum_t kl_t as the sequence reward when the KL is in the reward, and
    task_weight * score - distill.coef * sum_t k1_t with distillation (GAE / REINFORCE++: the same per token).
 5. PF-PPO resampling of the survivors (with replacement, weights from the shaped scores).
 6. replay: a share of the rows is replaced by stored samples (which keep the log-probs, values and advantages of
    the step that produced them: their importance ratio is against that step's behaviour policy), then this step's
    qualifying survivors are added to the buffer, so a batch never replays its own samples.
"""

from __future__ import annotations

import torch

from algo import advantages as A
from algo.filters import ReplayBuffer, dynamic_sampling_keep, overlong_penalty, pf_ppo_resample, reward_threshold_mask
from algo.kl_control import kl_in_reward, kl_penalised_scores
from algo.losses import kl
from batch import Batch, batch_size, select


def kl_estimator(kl_cfg) -> str:
    """The estimator of the KL in force: in the reward or in the loss (config.KLConfig)."""
    return kl_cfg.loss_kind if kl_cfg.in_loss else kl_cfg.reward_kind


def _prefixed(prefix: str, stats: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in stats.items()}


def _global_mean(x: torch.Tensor, reduce: A.Reduce | None) -> float:
    totals = A.reduced(torch.stack([x.double().sum(), x.new_tensor(float(x.numel()), dtype=torch.float64)]), reduce)
    return float(totals[0] / totals[1].clamp(min=1))


def policy_logprobs(batch: Batch) -> torch.Tensor:
    """[B, T] the current actor's log-probs of the responses before the update: `policy_logprobs` where they differ
    from PPO's old ones (offline samples keep the logging policy's as old), else old_logprobs."""
    return batch["policy_logprobs"] if "policy_logprobs" in batch else batch["old_logprobs"]


def prepare_batch(batch: Batch, algo, kl_ctl, *, group_size: int, max_response_len: int, min_reward: float | None,
                  replay: ReplayBuffer | None = None, generator: torch.Generator | None = None,
                  reduce: A.Reduce | None = None) -> tuple[Batch, dict[str, float]]:
    """Filters, KL, advantages, resampling and replay for this rank's part of the rollout batch, in the order of the
    module docstring. batch: scores [B], prompt_len and response_len [B], response_mask, old_logprobs (or
    policy_logprobs, see policy_logprobs) and ref_logprobs [B, T] (with a KL term), teacher_logprobs [B, T] (with
    distillation), values [B, T] (GAE); the samples of one prompt are `group_size` consecutive rows. algo:
    config.AlgorithmConfig; kl_ctl: its controller (updated here). Returns the training batch (with advantages, and
    returns for GAE / REINFORCE++; may be empty) and metrics that are the same on every rank."""
    f, kl_cfg, distill = algo.filters, algo.kl, algo.distill
    use_ref = kl_cfg.in_reward or kl_cfg.in_loss
    mask = batch["response_mask"]
    m: dict[str, float] = {}
    score_stats = A.global_stats(batch["scores"], reduce)
    m.update(_prefixed("reward/score", score_stats))
    m.update(_prefixed("critic/score", {k: v for k, v in score_stats.items() if k != "var"}))  # verl's name
    # the model's tokens: the response's length, but for an episode's observations (mask 0) between its turns
    lengths = mask.sum(-1).float()
    m.update(_prefixed("response_length", A.global_stats(lengths, reduce)))
    m.pop("response_length/var", None)
    m.update({f"prompt_length/{k}": v for k, v in A.global_stats(batch["prompt_len"].float(), reduce).items()
              if k != "var"})
    m["response_length/clip_ratio"] = _global_mean((lengths >= max_response_len).float(), reduce)

    # 1. shaped scores
    scores = batch["scores"].float()
    if f.overlong_buffer:
        scores = scores + overlong_penalty(lengths, max_response_len, f.overlong_buffer,
                                           f.overlong_penalty).to(scores.dtype)
        m.update(_prefixed("reward/shaped_score", A.global_stats(scores, reduce)))

    # 2. the KL to the reference, measured on the whole rollout batch
    token_kl = teacher_kl = None
    if use_ref:
        token_kl = torch.where(mask.bool(), kl(policy_logprobs(batch), batch["ref_logprobs"], kl_estimator(kl_cfg)), 0)
        totals = A.reduced(torch.stack([token_kl.double().sum(), mask.double().sum(),
                                        token_kl.new_tensor(float(batch_size(batch)), dtype=torch.float64)]), reduce)
        kl_mean = float(totals[0] / totals[1].clamp(min=1))
        m["actor/reward_kl"] = kl_mean
        # k3 is never negative, unlike k1 on a finite sample: what the KL guard rail compares with its limit
        k3 = torch.where(mask.bool(), kl(policy_logprobs(batch), batch["ref_logprobs"], "k3"), 0)
        m["actor/ref_kl"] = float(A.reduced(k3.double().sum(), reduce) / totals[1].clamp(min=1))
        m["actor/kl_coef"] = kl_ctl.value  # the coefficient this step trains with
        kl_ctl.update(kl_mean, int(totals[2]))
    if distill.coef > 0:  # the reverse KL to the teacher: k1 per token is the reward's unbiased estimate
        teacher_kl = torch.where(mask.bool(), kl(policy_logprobs(batch), batch["teacher_logprobs"], "k1"), 0)
        m["distill/reverse_kl"] = _token_mean(teacher_kl, mask, reduce)
        m["distill/reverse_kl_k3"] = _token_mean(
            torch.where(mask.bool(), kl(policy_logprobs(batch), batch["teacher_logprobs"], "k3"), 0), mask, reduce)

    if group_size > 1:  # every rank reduces, also one whose batch is empty (partial rollouts: no group ended)
        groups = scores.view(-1, group_size)
        flat = (groups == groups[:, :1]).all(dim=1).float()
        m["data/flat_group_fraction"] = _global_mean(flat, reduce)  # groups that teach GRPO / RLOO nothing

    # 3. filters
    keep = reward_threshold_mask(scores, min_reward, f.filter_ratio)
    if f.dynamic_sampling:
        groups_keep, dropped = dynamic_sampling_keep(scores, group_size)
        keep &= groups_keep
        m["data/dropped_groups"] = float(A.reduced(torch.tensor(float(dropped)), reduce))
    m["data/kept_fraction"] = _global_mean(keep.float(), reduce)
    group_ids = torch.arange(batch_size(batch), device=scores.device) // group_size
    rows = keep.nonzero().squeeze(1)
    batch, scores, group_ids = select(batch, rows), scores[rows], group_ids[rows]
    token_kl = token_kl[rows] if token_kl is not None else None
    teacher_kl = teacher_kl[rows] if teacher_kl is not None else None
    mask = batch["response_mask"]

    # 4. advantages on the survivors
    beta = m.get("actor/kl_coef", 0.0)
    estimator = algo.adv_estimator
    task = scores * distill.task_weight if teacher_kl is not None else scores
    if estimator in ("gae", "reinforce_pp"):
        if kl_cfg.in_reward:
            logp, ref = policy_logprobs(batch), batch["ref_logprobs"]
        else:  # the score alone: no KL term reads log-probs (a batch may have no old ones, config.old_logprobs_pass)
            logp = ref = torch.zeros_like(mask, dtype=torch.float32)
        token_rewards, _ = kl_in_reward(task, logp, ref, mask, beta if kl_cfg.in_reward else 0.0,
                                        kl_cfg.reward_kind)
        if teacher_kl is not None:
            token_rewards = token_rewards - distill.coef * teacher_kl
    if estimator == "gae":
        # over the model's tokens only: an episode's observation tokens (mask 0 between turns) are skipped
        adv, returns = A.gae(token_rewards, batch["values"], mask, algo.gamma, algo.lam, across_gaps=True)
        if algo.whiten_advantages:
            adv = A.masked_whiten(adv, mask, reduce=reduce)
        batch["returns"] = returns
        valid = mask.bool()
        m["critic/vf_explained_var"] = explained_variance(batch["values"][valid], returns[valid], reduce)
        m.update(_prefixed("critic/values", A.global_stats(batch["values"][valid], reduce)))
    elif estimator == "reinforce_pp":
        adv, batch["returns"] = A.reinforce_pp(token_rewards, mask, algo.gamma, reduce=reduce, across_gaps=True)
    else:
        sequence = kl_penalised_scores(task, token_kl, mask, beta) if kl_cfg.in_reward else task
        if teacher_kl is not None:
            sequence = kl_penalised_scores(sequence, teacher_kl, mask, distill.coef)
        if estimator == "grpo":
            adv = A.grpo(sequence, group_size, mask, norm_by_std=algo.norm_by_std, group_ids=group_ids)
        elif estimator == "reinforce_pp_baseline":
            adv = A.reinforce_pp_baseline(sequence, group_size, mask, group_ids=group_ids, reduce=reduce)
        else:
            adv = A.rloo(sequence, group_size, mask, group_ids=group_ids)
    batch["advantages"] = adv
    valid = mask.bool()
    for name, values in (("advantages", adv), ("returns", batch.get("returns"))):
        if values is not None:
            m.update({f"critic/{name}/{k}": v for k, v in A.global_stats(values[valid], reduce).items() if k != "var"})
    sequence_rewards = token_rewards.sum(-1) if estimator in ("gae", "reinforce_pp") else sequence
    m.update({f"critic/rewards/{k}": v for k, v in A.global_stats(sequence_rewards, reduce).items() if k != "var"})

    # 5. PF-PPO (with replacement: the replay buffer is given the survivors before it, without duplicates)
    fresh, fresh_scores = batch, scores
    if f.pf_ppo != "off" and batch_size(batch):
        # drawn on the CPU, where the trainer's generator for shuffles and resampling lives
        picked = pf_ppo_resample(scores.cpu(), f.pf_ppo, f.weight_pow, generator)
        batch = select(batch, picked.to(scores.device))

    # 6. replay: mix, then add
    if replay is not None:
        if batch_size(batch):
            batch = replay.mix(batch)
        if batch_size(fresh):
            replay.add(fresh, fresh_scores)
        m.update(replay.metrics())
    return batch, m


def _token_mean(x: torch.Tensor, mask: torch.Tensor, reduce: A.Reduce | None) -> float:
    """Mean of x [B, T] over the valid tokens of every rank."""
    totals = A.reduced(torch.stack([torch.where(mask.bool(), x, 0).double().sum(), mask.double().sum()]), reduce)
    return float(totals[0] / totals[1].clamp(min=1))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, reduce: A.Reduce | None = None) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens of every rank. values, returns: [N] (the
    response tokens). 0 with fewer than 2 tokens or returns without spread."""
    residual = A.global_stats(returns - values, reduce).get("var")
    spread = A.global_stats(returns, reduce).get("var")
    if residual is None or not spread:
        return 0.0
    return 1.0 - residual / spread
