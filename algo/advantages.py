"""Masked statistics and advantage estimators: GAE, GRPO (and Dr. GRPO), RLOO, REINFORCE++.

Response tensors are [B, T]. `mask` is [B, T], bool or float, nonzero on response tokens and 0 on the padding
after a response ends; every [B, T] output is exactly 0 where the mask is 0. Scores are [B], one per sample;
the samples of one prompt are `group_size` consecutive rows.
"""

import torch


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ValueError when `x` (any shape) holds NaN or inf.

    The message names the number of non-finite entries and the index of the first one in row-major order, so a
    broken reward function can be traced to the sample that produced it; one NaN would otherwise spread through
    group statistics and whitening to the whole batch.
    """
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        where = first[0] if len(first) == 1 else first
        raise ValueError(f"{name} has {int(bad.sum())} non-finite entries (NaN or inf); the first is at index {where}")


def as_bool_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Return `mask` as a bool tensor (nonzero -> True) after checking it has exactly `shape`."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def lengths_to_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Response mask from response lengths: mask[b, t] = t < lengths[b].

    lengths: [B] integers in [0, max_len]. Returns bool [B, max_len].
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    if lengths.numel() and not (0 <= int(lengths.min()) and int(lengths.max()) <= max_len):
        raise ValueError(f"lengths must lie in [0, {max_len}], got min {int(lengths.min())} max {int(lengths.max())}")
    return torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(-1)


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is set: sum(x * mask, dim) / sum(mask, dim).

    x, mask: same shape (any). Returns a 0-dim tensor when dim is None, else `x` reduced over `dim`.
    A reduction with no valid entry gives 0 rather than NaN, so an all-padding micro-batch logs 0 and
    cannot poison a running average.
    """
    m = as_bool_mask(mask, x.shape)
    total = torch.where(m, x, 0).sum() if dim is None else torch.where(m, x, 0).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of `x`: sum(mask * (x - mean)^2) / (n - 1) if unbiased else / n.

    x, mask: same shape (any); n = number of valid entries. Returns a 0-dim tensor.
    ValueError when n < 2 (unbiased) or n < 1 (biased): the estimate is undefined there.
    """
    m = as_bool_mask(mask, x.shape)
    n = int(m.sum())
    needed = 2 if unbiased else 1
    if n < needed:
        kind = "unbiased" if unbiased else "biased"
        raise ValueError(f"the {kind} masked variance needs at least {needed} valid entries, got {n}")
    mean = masked_mean(x, m)
    return torch.where(m, (x - mean) ** 2, 0).sum() / (n - 1 if unbiased else n)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten the valid entries of `x` with their own statistics: (x - mean) / sqrt(var + eps).

    mean and the unbiased var are taken over all valid entries (masked_mean, masked_var). With
    shift_mean=False the mean is added back, so only the scale changes. x, mask: same shape; returns x's shape,
    0 where mask is 0.
    """
    m = as_bool_mask(mask, x.shape)
    mean = masked_mean(x, m)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, m) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, 0)


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), not whitened.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 where mask_{t+1} = 0 or t + 1 = T
    A_t = delta_t + gamma * lam * A_{t+1}, with A_{t+1} = 0 likewise
    returns_t = A_t + V_t

    token_rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]), 0 where mask is 0.
    The recursion restarts after every masked position, so a mask with holes splits a row into episodes.
    """
    check_finite("token_rewards", token_rewards)
    check_finite("values", values)
    if token_rewards.dim() != 2 or values.shape != token_rewards.shape:
        raise ValueError(
            f"token_rewards and values must both be [B, T], got {tuple(token_rewards.shape)} and {tuple(values.shape)}"
        )
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    m = as_bool_mask(mask, token_rewards.shape)
    dtype = torch.promote_types(_float_dtype(token_rewards), _float_dtype(values))
    rewards = torch.where(m, token_rewards.to(dtype), 0)
    # Zeroing V at padding makes V_{t+1} = 0 past the end of a response without a second mask lookup.
    vals = torch.where(m, values.to(dtype), 0)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_adv = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        next_adv = torch.where(m[:, t], delta + gamma * lam * next_adv, 0)
        advantages[:, t] = next_adv
        next_value = vals[:, t]
    return advantages, torch.where(m, advantages + vals, 0)


def as_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """View scores [B] as [B // group_size, group_size]: the samples of one prompt are consecutive rows.

    ValueError when scores is not 1-D, group_size < 1, or B is not divisible by group_size.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(f"batch size {scores.shape[0]} is not divisible by group_size {group_size}")
    return scores.view(-1, group_size)


def _group_deviation(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (s - group mean, s), both [B // group_size, group_size] float64.

    A group whose scores are all equal gets a deviation of exactly 0: its float mean can differ from the
    scores in the last bit, and GRPO's division by (std + eps) would blow that rounding up to a real-looking
    advantage.
    """
    groups = as_groups(scores, group_size).to(torch.float64)
    flat = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    deviation = torch.where(flat, 0.0, groups - groups.mean(dim=1, keepdim=True))
    return deviation, groups


def _check_response_mask(mask: torch.Tensor, batch: int) -> torch.Tensor:
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(f"mask must be [B, T] with B = {batch} (the number of scores), got {tuple(mask.shape)}")
    return as_bool_mask(mask, mask.shape)


def grpo(
    scores: torch.Tensor, group_size: int, mask: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025 with norm_by_std=False).

    A_i = (s_i - mean_g(s)) / (std_g(s) + eps)   norm_by_std=True, std unbiased (divides by group_size - 1)
    A_i = s_i - mean_g(s)                        norm_by_std=False
    where g is the group of i, broadcast over the response tokens of row i.

    scores: [B]; mask: [B, T]. Returns advantages [B, T], 0 where mask is 0. A group whose scores are all equal
    gives exactly 0. group_size 1: the std of one sample is undefined, and the sample is its own mean, so the
    advantage is 0. ValueError when B is not divisible by group_size or scores are not finite.
    """
    check_finite("scores", scores)
    m = _check_response_mask(mask, scores.shape[0])
    deviation, groups = _group_deviation(scores, group_size)
    # group_size 1 skips the division: the deviation is already exactly 0 and std would be NaN.
    if norm_by_std and group_size > 1:
        deviation = deviation / (groups.std(dim=1, keepdim=True) + eps)
    advantages = deviation.reshape(-1, 1).to(_float_dtype(scores))
    return torch.where(m, advantages, 0)


def rloo(scores: torch.Tensor, group_size: int, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024).

    A_i = s_i - (sum_{j in g, j != i} s_j) / (group_size - 1) = group_size / (group_size - 1) * (s_i - mean_g(s)),
    broadcast over the response tokens of row i.

    scores: [B]; mask: [B, T]. Returns advantages [B, T], 0 where mask is 0; exactly 0 for a group of equal scores.
    ValueError when group_size < 2 (no other sample to form a baseline) or B is not divisible by group_size.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 to leave one sample out, got {group_size}")
    check_finite("scores", scores)
    m = _check_response_mask(mask, scores.shape[0])
    deviation, _ = _group_deviation(scores, group_size)
    advantages = (deviation * (group_size / (group_size - 1))).reshape(-1, 1).to(_float_dtype(scores))
    return torch.where(m, advantages, 0)


def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025): discounted returns whitened over the whole batch.

    G_t = r_t + gamma * G_{t+1}, with G_{t+1} = 0 where mask_{t+1} = 0 or t + 1 = T
    A = masked_whiten(G, mask)   (mean and unbiased std over all valid tokens of the batch)

    token_rewards, mask: [B, T]. Returns (advantages [B, T], returns G [B, T]), 0 where mask is 0.
    ValueError when the batch has fewer than 2 valid tokens (no variance to whiten with).
    """
    # GAE with V = 0 and lam = 1 is exactly the discounted return: delta_t = r_t, A_t = r_t + gamma * A_{t+1}.
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask), returns
