"""Guard rails: back the learning rate off when KL runs high, raise the reward threshold when reward variance does.

The trainer calls step() once per PPO step with the step's measured KL and reward variance, multiplies its
optimizer's learning rate by lr_scale, and adds min_reward_raise to its configured min_reward threshold
(algo.filters.reward_threshold_mask). The state is saved with the checkpoint.
"""

import math

import torch


def _measured(name: str, value: float | torch.Tensor | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class GuardRails:
    """Threshold controller over two step statistics.

    if kl > kl_limit:              lr_scale <- lr_scale * lr_decay        event "lr_backoff"
    if reward_var > var_limit:     min_reward_raise <- min_reward_raise + reward_step   event "min_reward_raise"
    A limit of None disables its rule; a measurement of None (not measured this step) skips its rule. Both
    adjustments are cumulative and never undone: a run that needed a lower learning rate keeps it.
    """

    def __init__(
        self,
        kl_limit: float | None = None,
        var_limit: float | None = None,
        lr_decay: float = 0.9,
        reward_step: float = 0.1,
    ):
        if kl_limit is not None and not kl_limit > 0:
            raise ValueError(f"kl_limit must be > 0 or None, got {kl_limit}")
        if var_limit is not None and not var_limit >= 0:
            raise ValueError(f"var_limit must be >= 0 or None, got {var_limit}")
        if not 0 < lr_decay <= 1:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
        if not reward_step >= 0:
            raise ValueError(f"reward_step must be >= 0, got {reward_step}")
        self.kl_limit = kl_limit
        self.var_limit = var_limit
        self.lr_decay = lr_decay
        self.reward_step = reward_step
        self.lr_scale = 1.0
        self.min_reward_raise = 0.0
        self.n_events = 0

    def step(self, kl: float | torch.Tensor | None, reward_var: float | torch.Tensor | None) -> list[dict]:
        """Apply the rules to this step's KL and reward variance; return the events fired, e.g.
        [{"event": "lr_backoff", "kl": 0.3, "lr_scale": 0.9}, {"event": "min_reward_raise", "reward_var": 2.0,
        "min_reward": 0.1}]."""
        kl = _measured("kl", kl)
        reward_var = _measured("reward_var", reward_var)
        events = []
        if self.kl_limit is not None and kl is not None and kl > self.kl_limit:
            self.lr_scale *= self.lr_decay
            events.append({"event": "lr_backoff", "kl": kl, "lr_scale": self.lr_scale})
        if self.var_limit is not None and reward_var is not None and reward_var > self.var_limit:
            self.min_reward_raise += self.reward_step
            events.append({"event": "min_reward_raise", "reward_var": reward_var, "min_reward": self.min_reward_raise})
        self.n_events += len(events)
        return events

    def metrics(self) -> dict[str, float]:
        """guard/lr_scale, guard/min_reward (the cumulative raise of the threshold), guard/events (count so far)."""
        return {
            "guard/lr_scale": self.lr_scale,
            "guard/min_reward": self.min_reward_raise,
            "guard/events": float(self.n_events),
        }

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "min_reward_raise": self.min_reward_raise, "n_events": self.n_events}

    def load_state_dict(self, state: dict) -> None:
        missing = {"lr_scale", "min_reward_raise", "n_events"} - set(state)
        if missing:
            raise ValueError(f"guard rails state lacks keys {sorted(missing)}")
        self.lr_scale = float(state["lr_scale"])
        self.min_reward_raise = float(state["min_reward_raise"])
        self.n_events = int(state["n_events"])
