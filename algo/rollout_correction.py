"""Importance-sampling corrections for the gap between the engine that sampled (vLLM, bf16 kernels) and the trainer
that computes the loss: the samples come from pi_rollout, the loss assumes pi_old (verl's "rollout correction",
TRL's vllm_importance_sampling_mode). With rho_t = pi_old(y_t) / pi_rollout(y_t) per token:

  weights (truncated importance sampling, detached, multiply the per-token loss)
    token      w_t = min(rho_t, cap)                                   (TIS, Yao et al. 2025)
    sequence   w_t = min(prod_t rho_t, cap) on every token of the row   (sequence-level TIS)
  masks (rejection: a masked token's loss is multiplied by 0; the normalisers keep counting it)
    token      tokens with rho_t outside [low, high]                   (token MIS / IcePop)
    sequence   rows whose prod_t rho_t is outside [low, high]           (sequence MIS)
    geometric  rows whose exp(mean_t log rho_t) is outside [low, high]  (geometric-mean mask)

Both engines' log-probs and the trainer's are of the full tempered distribution softmax(logits / T), before any
top-k / top-p cut (config.check_ppo refuses a correction with a cut on the native engine, where the weights would
ignore it). All [B, T] float tensors with a response mask; pure tensor code.
"""

from __future__ import annotations

import math

import torch

from algo.advantages import masked_mean
from algo.objectives import LOG_RATIO_CLAMP

WEIGHT_MODES = ("off", "token", "sequence")
MASK_MODES = ("off", "token", "sequence", "geometric")


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       weight: str = "off", cap: float = 2.0, reject: str = "off", low: float = 0.5,
                       high: float = 2.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token factors [B, T] (detached; weight times keep, 1 where nothing applies) for the policy loss, and
    detached 0-dim metrics over this call's valid tokens: is_weight_mean (the weight before the mask), masked_fraction
    (share of valid tokens masked), mismatch_kl (mean k3 estimate of KL(pi_rollout || pi_old) per token) and
    mismatch_kl_max (its largest token). old_logprobs, rollout_logprobs, mask: [B, T]."""
    if weight not in WEIGHT_MODES:
        raise ValueError(f"unknown importance weight mode {weight!r}; valid: {', '.join(WEIGHT_MODES)}")
    if reject not in MASK_MODES:
        raise ValueError(f"unknown importance mask mode {reject!r}; valid: {', '.join(MASK_MODES)}")
    if weight != "off" and not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    if reject != "off" and not 0 <= low < 1 < high:
        raise ValueError(f"the importance mask bounds need 0 <= low < 1 < high, got [{low}, {high}]")
    m = mask.bool()
    log_rho = torch.where(m, old_logprobs - rollout_logprobs, 0).detach()
    factors = torch.ones_like(log_rho)
    metrics = {}
    row_log = log_rho.sum(-1, keepdim=True)
    if weight == "token":
        factors = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)
    elif weight == "sequence":
        factors = row_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap).expand_as(log_rho)
    if weight != "off":
        metrics["is_weight_mean"] = masked_mean(factors, m)
    if reject != "off":
        if reject == "token":
            stat = log_rho
        elif reject == "sequence":
            stat = row_log.expand_as(log_rho)
        else:
            stat = (row_log / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_rho)
        lowest = math.log(low) if low > 0 else -math.inf
        inside = (stat >= lowest) & (stat <= math.log(high))
        factors = torch.where(inside, factors, 0)
        metrics["masked_fraction"] = masked_mean((~inside).float(), m)
    # k3 with d = log pi_rollout - log pi_old: the samples are pi_rollout's, so this estimates KL(pi_rollout || pi_old)
    x = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_kl = torch.where(m, torch.expm1(x) - x, 0)
    metrics["mismatch_kl"] = masked_mean(token_kl, m)
    metrics["mismatch_kl_max"] = token_kl.max() if token_kl.numel() else token_kl.new_zeros(())
    return torch.where(m, factors, 0), metrics
