"""Policy objectives: the per-token loss of each policy-gradient objective, one function per paper, chosen by name
(actor.policy_loss) through OBJECTIVES. algo/losses.policy_loss adds the dual clip, the importance weights of
algo/rollout_correction.py and the aggregation around them, so every objective works with every aggregation.

Every function takes logprobs (with gradient), old_logprobs, advantages and a bool mask, all [B, T], and the clip
bounds; it returns (token_loss [B, T], {"pg_clipfrac": fraction of valid tokens clipped, detached}).

  ppo         Schulman et al. 2017: r_t = pi / pi_old per token, l_t = max(-A r_t, -A clip(r_t, 1 - lo, 1 + hi)).
  gspo        Zheng et al. 2025 (GSPO): one ratio per sequence, the geometric mean of its token ratios,
              s_i = exp(mean_t log(pi / pi_old)), and the sequence's advantage A_i = mean_t A_t:
              l_t = max(-A_i s_i, -A_i clip(s_i, 1 - lo, 1 + hi)) on every token of the sequence. Its gradient is
              s_i * grad mean_t log pi; with loss_agg seq-mean-token-mean it is the paper's objective exactly.
  gspo_token  GSPO-token (the same paper): s_it = sg(s_i) * pi_t / sg(pi_t) (the value s_i, the gradient of one
              token) with each token's own advantage: equal to gspo when advantages are constant per sequence.
  cispo       MiniMax-M1 2025 (CISPO): l_t = -sg(clip(r_t, 1 - lo, 1 + hi)) * A_t * log pi_t. The clipped weight
              carries no gradient and no token's gradient is dropped; lo = 1 means no lower bound.
"""

from __future__ import annotations

import torch

from algo.advantages import masked_mean

# exp() of a log-ratio beyond +-20 overflows float16 and turns one bad token into inf; real policies never get there
LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0  # a sequence ratio above e^10 is clipped anyway; the bound keeps exp finite


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), {"pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach()}


def ppo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1] mean over each row's valid tokens of log(pi / pi_old): log of GSPO's sequence ratio (0 on empty rows)."""
    m = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def _gspo_ratio(logprobs, old_logprobs, mask):
    # value s_i on every token of row i, gradient that of one token's log-prob times s_i
    seq = sequence_log_ratio(logprobs, old_logprobs, mask).detach()
    return torch.exp((logprobs - logprobs.detach() + seq).clamp(max=GSPO_LOG_RATIO_MAX))


def gspo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    m = mask.to(advantages.dtype)
    seq_adv = (advantages * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return _clipped_surrogate(_gspo_ratio(logprobs, old_logprobs, mask), seq_adv.expand_as(advantages), mask,
                              clip_low, clip_high)


def gspo_token(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    return _clipped_surrogate(_gspo_ratio(logprobs, old_logprobs, mask), advantages, mask, clip_low, clip_high)


def cispo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, {"pg_clipfrac": masked_mean((weight != ratio).float(), mask)}


OBJECTIVES = {"ppo": ppo, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}

# TRL's GRPOConfig.loss_type (and importance_sampling_level) in meshrl's keys; README "Objectives" shows the table
TRL_LOSS_TYPES = {
    "grpo": {"actor.loss_agg": "seq-mean-token-mean"},
    "bnpo": {"actor.loss_agg": "token-mean"},
    "dapo": {"actor.loss_agg": "token-mean"},
    "dr_grpo": {"actor.loss_agg": "seq-mean-token-sum-norm", "algorithm.norm_by_std": False},
    "cispo": {"actor.loss_agg": "token-mean", "actor.policy_loss": "cispo"},
}
