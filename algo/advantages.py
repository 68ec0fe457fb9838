"""Masked statistics and advantage estimators: GAE, GRPO (and Dr. GRPO), RLOO, REINFORCE++.

Response tensors are [B, T]. `mask` is [B, T], bool or float, nonzero on response tokens and 0 on the padding
after a response ends; every [B, T] output is exactly 0 where the mask is 0. Scores are [B], one per sample;
the samples of one prompt are `group_size` consecutive rows, or carry one group id each (`group_ids` [B]) when
filters have left groups of different sizes.

Statistics that must cover the whole batch while each data-parallel rank holds a part of it take `reduce`: a callable
`reduce(t, op)` returning `t` reduced element-wise over the ranks with op "sum", "max" or "min" (the trainer passes an
all-reduce over its data-parallel group; None means this is the whole batch). Nothing here knows of processes.
"""

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


def reduced(t: torch.Tensor, reduce: Reduce | None, op: str = "sum") -> torch.Tensor:
    """`t` reduced over the ranks by `reduce` (see the module docstring), or `t` itself when reduce is None."""
    return t if reduce is None else reduce(t, op)


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


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  reduce: Reduce | None = None) -> torch.Tensor:
    """Whiten the valid entries of `x` with their own statistics: (x - mean) / sqrt(var + eps).

    mean and the unbiased var are taken over all valid entries, of every rank when `reduce` is given (the same
    values as masked_mean and masked_var on the concatenated batch). With shift_mean=False the mean is added back,
    so only the scale changes. x, mask: same shape; returns x's shape, 0 where mask is 0. Fewer than 2 valid
    entries in all: the spread is undefined, and the output is 0.
    """
    m = as_bool_mask(mask, x.shape)
    dtype = _float_dtype(x)
    totals = reduced(torch.stack([torch.where(m, x, 0).sum().to(dtype), m.sum().to(dtype)]), reduce)
    n = totals[1]
    mean = totals[0] / n.clamp(min=1)
    square = reduced(torch.where(m, (x - mean) ** 2, 0).sum().to(dtype), reduce)
    if float(n) < 2:
        return torch.zeros_like(x, dtype=dtype)
    whitened = (x - mean) * torch.rsqrt(square / (n - 1) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, 0)


def global_stats(x: torch.Tensor, reduce: Reduce | None = None) -> dict[str, float]:
    """mean, max, min and unbiased var of the entries of `x` (any shape) over every rank: {} when there is none,
    var only from 2 entries on. The same on every rank; one sum, one max and one min reduction."""
    x = x.detach().double().reshape(-1)
    totals = reduced(torch.stack([x.sum(), x.new_tensor(float(x.numel()))]), reduce)
    high = reduced(x.max() if x.numel() else x.new_tensor(-torch.inf), reduce, "max")
    low = reduced(x.min() if x.numel() else x.new_tensor(torch.inf), reduce, "min")
    n = float(totals[1])
    if n == 0:
        return {}
    mean = totals[0] / n
    square = float(reduced(((x - mean) ** 2).sum(), reduce))
    out = {"mean": float(mean), "max": float(high), "min": float(low)}
    if n >= 2:
        out["var"] = square / (n - 1)
    return out


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def valid_first(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] indices that put each row's valid positions first, in their order (then the masked ones):
    x.gather(1, order) packs a row's tokens together, out.scatter(1, order, packed) puts them back."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
    across_gaps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), not whitened.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 where mask_{t+1} = 0 or t + 1 = T
    A_t = delta_t + gamma * lam * A_{t+1}, with A_{t+1} = 0 likewise
    returns_t = A_t + V_t

    token_rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]), 0 where mask is 0.
    The recursion restarts after every masked position, so a mask with holes splits a row into episodes;
    across_gaps=True runs it over each row's valid tokens as one sequence instead (a multi-turn episode: the masked
    observation tokens between the model's turns are skipped, V_{t+1} is the next valid token's value).
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
    if across_gaps:
        order = valid_first(m)
        adv, ret = gae(token_rewards.gather(1, order), values.gather(1, order), m.gather(1, order), gamma, lam)
        return adv.new_zeros(adv.shape).scatter(1, order, adv), ret.new_zeros(ret.shape).scatter(1, order, ret)
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


def _group_index(scores: torch.Tensor, group_size: int, group_ids: torch.Tensor | None) -> torch.Tensor:
    """[B] dense group index 0..G-1 of every sample: from group_ids when given, else consecutive groups."""
    if group_ids is None:
        as_groups(scores, group_size)
        return torch.arange(scores.shape[0], device=scores.device) // group_size
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids must be [B] like scores {tuple(scores.shape)}, got {tuple(group_ids.shape)}")
    return torch.unique(group_ids, return_inverse=True)[1]


def _group_deviation(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s - group mean, unbiased group std, group size), each [B] float64 and broadcast to the group's samples.

    A group whose scores are all equal gets a deviation of exactly 0: its float mean can differ from the
    scores in the last bit, and GRPO's division by (std + eps) would blow that rounding up to a real-looking
    advantage. A group of one sample has deviation 0 and std NaN (undefined).
    """
    s = scores.to(torch.float64)
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64, device=s.device).index_add_(0, index, torch.ones_like(s))
    mean = torch.zeros_like(count).index_add_(0, index, s) / count
    high = torch.full_like(count, -torch.inf).scatter_reduce_(0, index, s, "amax")
    low = torch.full_like(count, torch.inf).scatter_reduce_(0, index, s, "amin")
    flat = (high == low)[index]
    deviation = torch.where(flat, 0.0, s - mean[index])
    square = torch.zeros_like(count).index_add_(0, index, deviation**2)
    std = (square / (count - 1)).sqrt()
    return deviation, std[index], count[index]


def _check_response_mask(mask: torch.Tensor, batch: int) -> torch.Tensor:
    if mask.dim() != 2 or mask.shape[0] != batch:
        raise ValueError(f"mask must be [B, T] with B = {batch} (the number of scores), got {tuple(mask.shape)}")
    return as_bool_mask(mask, mask.shape)


def grpo(
    scores: torch.Tensor, group_size: int, mask: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025 with norm_by_std=False).

    A_i = (s_i - mean_g(s)) / (std_g(s) + eps)   norm_by_std=True, std unbiased (divides by |g| - 1)
    A_i = s_i - mean_g(s)                        norm_by_std=False
    where g is the group of i, broadcast over the response tokens of row i.

    scores: [B]; mask: [B, T]; group_ids: [B] (any integers; equal id = one group, of any size), or None for
    consecutive groups of group_size. Returns advantages [B, T], 0 where mask is 0. A group whose scores are all
    equal gives exactly 0; so does a group of one sample (it is its own mean, and its std is undefined).
    ValueError when B is not divisible by group_size (without group_ids) or scores are not finite.
    """
    check_finite("scores", scores)
    m = _check_response_mask(mask, scores.shape[0])
    deviation, std, count = _group_deviation(scores, _group_index(scores, group_size, group_ids))
    if norm_by_std:
        # a group of one has deviation 0 already: skip its NaN std
        deviation = torch.where(count > 1, deviation / (std + eps), 0.0)
    advantages = deviation.reshape(-1, 1).to(_float_dtype(scores))
    return torch.where(m, advantages, 0)


def rloo(scores: torch.Tensor, group_size: int, mask: torch.Tensor, group_ids: torch.Tensor | None = None
         ) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024).

    A_i = s_i - (sum_{j in g, j != i} s_j) / (|g| - 1) = |g| / (|g| - 1) * (s_i - mean_g(s)),
    broadcast over the response tokens of row i.

    scores: [B]; mask: [B, T]; group_ids as for grpo. Returns advantages [B, T], 0 where mask is 0; exactly 0 for a
    group of equal scores, and for a group of one sample (no other sample to form its baseline: filters can leave
    such groups). ValueError when group_size < 2 (no other sample to form a baseline) or B is not divisible by
    group_size.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 to leave one sample out, got {group_size}")
    check_finite("scores", scores)
    m = _check_response_mask(mask, scores.shape[0])
    deviation, _, count = _group_deviation(scores, _group_index(scores, group_size, group_ids))
    advantages = torch.where(count > 1, deviation * count / (count - 1), 0.0)
    return torch.where(m, advantages.reshape(-1, 1).to(_float_dtype(scores)), 0)


def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, reduce: Reduce | None = None,
                 across_gaps: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025): discounted returns whitened over the whole batch.

    G_t = r_t + gamma * G_{t+1}, with G_{t+1} = 0 where mask_{t+1} = 0 or t + 1 = T
    A = masked_whiten(G, mask, reduce)   (mean and unbiased std over all valid tokens of the batch, on every rank)

    token_rewards, mask: [B, T]. Returns (advantages [B, T], returns G [B, T]), 0 where mask is 0; advantages are
    0 when the whole batch has fewer than 2 valid tokens (no variance to whiten with).
    """
    # GAE with V = 0 and lam = 1 is exactly the discounted return: delta_t = r_t, A_t = r_t + gamma * A_{t+1}.
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0, across_gaps)
    return masked_whiten(returns, mask, reduce=reduce), returns


def reinforce_pp_baseline(scores: torch.Tensor, group_size: int, mask: torch.Tensor,
                          group_ids: torch.Tensor | None = None, reduce: Reduce | None = None) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++-baseline"): the group mean subtracted per
    prompt, then whitened over every valid token of the whole batch (not per group, unlike GRPO's std).

    A_it = masked_whiten(s_i - mean_g(s), mask, reduce)   broadcast over the response tokens of row i

    scores: [B]; mask: [B, T]; group_ids as for grpo. Returns advantages [B, T], 0 where mask is 0 (and everywhere
    when the batch has fewer than 2 valid tokens).
    """
    check_finite("scores", scores)
    m = _check_response_mask(mask, scores.shape[0])
    deviation, _, _ = _group_deviation(scores, _group_index(scores, group_size, group_ids))
    centred = torch.where(m, deviation.reshape(-1, 1).to(_float_dtype(scores)), 0)
    return masked_whiten(centred, m, reduce=reduce)
