"""KL penalty coefficient controllers, the KL-shaped token reward and the KL-penalised sequence score.

The controllers hold beta, the weight of the KL to the reference policy: in the reward (kl_in_reward for GAE and
REINFORCE++, kl_penalised_scores for GRPO and RLOO) or in the loss. The KL they compare with their target is the
per-token mean of the estimator in use over the response tokens of the whole rollout batch (the unit verl uses;
a target near 0.1 nats per token), measured every step in both modes. Their state is saved with the checkpoint so a
resumed run continues with the adapted coefficient.
"""

import math

import torch

from algo.advantages import as_bool_mask, check_finite
from algo.losses import kl

KL_CONTROLLER_KINDS = ("fixed", "adaptive")


def _check_coef(coef: float) -> None:
    if not (math.isfinite(coef) and coef >= 0.0):
        raise ValueError(f"KL coefficient must be finite and >= 0, got {coef}")


def _load_value(state: dict) -> float:
    if "value" not in state:
        raise ValueError(f"KL controller state needs key 'value', got keys {sorted(state)}")
    value = float(state["value"])
    _check_coef(value)
    return value


class FixedKLController:
    """A constant KL coefficient: .value == coef forever; update() is a no-op kept for interface parity."""

    def __init__(self, coef: float):
        _check_coef(coef)
        self.value = float(coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Leave the coefficient unchanged."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _load_value(state)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

    err = clip(current_kl / target_kl - 1, -0.2, 0.2)
    value <- value * (1 + err * n_steps / horizon)
    The coefficient grows while the measured KL is above target and shrinks while below; the clip bounds the
    change per update whatever the measurement. current_kl and target_kl share one unit: meshrl measures the
    per-token mean KL (see the module docstring), so a target is in nats per token (Ziegler et al.'s 6 nats is a
    whole-sequence figure: divide it by the response length). n_steps / horizon: samples per update / horizon in
    samples, as in the paper.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float):
        _check_coef(init_coef)
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Adapt the coefficient to current_kl measured over n_steps samples (or steps: the unit of horizon)."""
        current = float(current_kl)
        if not math.isfinite(current):
            raise ValueError(f"current_kl must be finite, got {current}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        err = min(max(current / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _load_value(state)


def make_kl_controller(
    kind: str, coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller: kind "fixed" uses coef; "adaptive" starts at coef and needs target_kl and horizon."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"the adaptive KL controller needs target_kl and horizon, got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; valid kinds: {', '.join(KL_CONTROLLER_KINDS)}")


def kl_in_reward(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with a per-token KL penalty and the sequence score at the last response token.

    kl_t = kl(logp_t, ref_t, kind) * mask_t
    r_t = -beta * kl_t + score * [t is the last valid token of the row]
    Rows whose mask is empty get nothing (all zeros). The last valid token is the largest t with mask_t set.

    scores: [B]; logprobs, ref_logprobs, mask: [B, T]. Returns (token_rewards [B, T], kl [B, T]), 0 where
    mask is 0.
    """
    check_finite("scores", scores)
    if scores.dim() != 1 or logprobs.dim() != 2 or logprobs.shape[0] != scores.shape[0]:
        raise ValueError(
            f"need scores [B] and logprobs [B, T] with one B, got {tuple(scores.shape)} and {tuple(logprobs.shape)}"
        )
    m = as_bool_mask(mask, logprobs.shape)
    token_kl = torch.where(m, kl(logprobs, ref_logprobs, kind), 0)
    rewards = -beta * token_kl
    positions = torch.arange(1, m.shape[1] + 1, device=m.device)
    # argmax of position * mask is the last valid index; an empty row gives index 0 and a zero-scaled score.
    last = (positions * m).argmax(dim=-1, keepdim=True)
    bonus = torch.where(m.any(dim=-1), scores.to(rewards.dtype), 0).unsqueeze(-1)
    return rewards.scatter_add(-1, last, bonus), token_kl


def kl_penalised_scores(scores: torch.Tensor, token_kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Sequence rewards for the critic-free group estimators (GRPO, RLOO) with the KL penalty in the reward:

    r_i = s_i - beta * sum_t mask_it * kl_it

    the same total reward a sample receives from kl_in_reward, summed over its tokens (Ahmadian et al. 2024 apply
    it so for RLOO); the group baseline is then taken over these rewards. scores: [B]; token_kl, mask: [B, T].
    Returns [B] in the scores' float dtype.
    """
    check_finite("scores", scores)
    if token_kl.dim() != 2 or token_kl.shape[0] != scores.shape[0]:
        raise ValueError(f"need scores [B] and token_kl [B, T] with one B, got {tuple(scores.shape)} and "
                         f"{tuple(token_kl.shape)}")
    m = as_bool_mask(mask, token_kl.shape)
    return scores - beta * torch.where(m, token_kl, 0).sum(-1).to(scores.dtype)
