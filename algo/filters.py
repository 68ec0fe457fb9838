"""Threshold-based reward modelling: score filters, PF-PPO resampling, DAPO dynamic sampling and overlong
penalty, and a replay buffer of high-quality samples.

Scores are [B], one per sample; the samples of one prompt are `group_size` consecutive rows. A batch is a
dict of tensors sharing the sample axis 0.
"""

import math

import torch

from algo.advantages import as_groups, check_finite
from batch import pad_cat

PF_PPO_MODES = ("pow", "max_min", "max_random")
CAPACITY_UNITS = ("samples", "tokens")
# The replay buffer counts a sample's tokens from the first of these keys the batch has.
TOKEN_MASK_KEYS = ("response_mask", "attention_mask")


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    check_finite("scores", scores)


def reward_threshold_mask(
    scores: torch.Tensor, min_reward: float | None = None, filter_ratio: float = 0.0
) -> torch.Tensor:
    """Which samples to keep when low scores are treated as reward-model noise.

    1. drop every sample with score < min_reward (skipped when min_reward is None);
    2. of the survivors, drop the k = floor(filter_ratio * B) lowest-scoring ones (all of them if fewer remain),
       B being the full batch size; equal scores drop the lower index first.

    scores: [B]. Returns keep [B] bool. ValueError when filter_ratio is outside [0, 1] or scores are not finite.
    """
    _check_scores(scores)
    if not 0.0 <= filter_ratio <= 1.0:
        raise ValueError(f"filter_ratio must be in [0, 1], got {filter_ratio}")
    batch = scores.shape[0]
    keep = torch.ones(batch, dtype=torch.bool, device=scores.device)
    if min_reward is not None:
        keep &= scores >= min_reward
    # The epsilon makes 0.29 * 100 give 29 rather than 28 from binary rounding of the product.
    n_drop = math.floor(filter_ratio * batch + 1e-9)
    if n_drop > 0:
        survivors = keep.nonzero().squeeze(-1)
        lowest_first = torch.sort(scores[survivors], stable=True).indices
        keep[survivors[lowest_first[:n_drop]]] = False
    return keep


def pf_ppo_resample(
    scores: torch.Tensor, mode: str, weight_pow: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Policy-filtration resampling (PF-PPO, Shen et al. 2025, "Policy Filtration in RLHF").

    Draws B indices with replacement, index i with probability w_i / sum(w):
      pow:        w_i = ((s_i - min s) / (max s - min s)) ** weight_pow; uniform when all scores are equal
      max_min:    w_i = 1 if s_i is the batch max or min, else 0 (PF-PPO's best-worst)
      max_random: w_i = 4 if s_i is the batch max, else 1 (PF-PPO's best-random; the 0.4 / 0.1 of verl's
                  compute_pf_ppo_reweight_data), so the best samples are over-represented but the rest still appear
    scores: [B]. Returns indices [B] int64 into the batch, on scores' device (generator must be on that device).
    """
    _check_scores(scores)
    if mode not in PF_PPO_MODES:
        raise ValueError(f"unknown PF-PPO mode {mode!r}; valid modes: {', '.join(PF_PPO_MODES)}")
    if not weight_pow >= 0:
        raise ValueError(f"weight_pow must be >= 0, got {weight_pow}")
    batch = scores.shape[0]
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    s = scores.to(torch.float64)
    lo, hi = s.min(), s.max()
    if mode == "pow":
        weights = ((s - lo) / (hi - lo)) ** weight_pow if hi > lo else torch.ones_like(s)
    elif mode == "max_min":
        weights = ((s == hi) | (s == lo)).to(torch.float64)
    else:
        weights = torch.where(s == hi, 4.0, 1.0)
    return torch.multinomial(weights, batch, replacement=True, generator=generator)


def dynamic_sampling_keep(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling (Yu et al. 2025): drop the groups whose scores are all equal.

    Such a group has zero group-relative advantage and only dilutes the gradient. With group_size 1 every group
    is trivially equal, so everything is dropped. scores: [B]. Returns (keep [B] bool, number of dropped groups).
    ValueError when B is not divisible by group_size or scores are not finite.
    """
    _check_scores(scores)
    groups = as_groups(scores, group_size)
    varied = (groups != groups[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size), int((~varied).sum())


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), added to the score.

    With start = max_response_len - buffer_len:
      0                                           if len <= start
      -(len - start) / buffer_len * penalty_factor  if start < len <= max_response_len
      -penalty_factor                             if len > max_response_len
    response_lengths: [B]. Returns [B] float (default dtype).
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"need 0 < buffer_len <= max_response_len, got {buffer_len} and {max_response_len}")
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    start = max_response_len - buffer_len
    excess = (response_lengths.to(torch.get_default_dtype()) - start).clamp(min=0)
    return (-excess / buffer_len * penalty_factor).clamp(min=-penalty_factor)


class ReplayBuffer:
    """FIFO store of high-quality samples, replayed into later batches.

    add() keeps the samples whose score is >= quality_threshold and evicts the oldest ones while the buffer
    holds more than `capacity`, counted in samples or in tokens (the sum of the sample's "response_mask", else
    "attention_mask"; a sample larger than the whole capacity is skipped). Samples are stored on the CPU, one row
    each, so batches of different response lengths can be mixed: sample() and mix() pad on the right with 0.
    All randomness comes from one generator seeded with `seed` and saved in state_dict(), so a resumed run replays
    the same samples.
    """

    def __init__(
        self,
        capacity: int,
        quality_threshold: float,
        mix_fraction: float,
        capacity_unit: str = "samples",
        seed: int = 0,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0.0 <= mix_fraction <= 1.0:
            raise ValueError(f"mix_fraction must be in [0, 1], got {mix_fraction}")
        if capacity_unit not in CAPACITY_UNITS:
            raise ValueError(f"unknown capacity_unit {capacity_unit!r}; valid units: {', '.join(CAPACITY_UNITS)}")
        self.capacity = capacity
        self.quality_threshold = quality_threshold
        self.mix_fraction = mix_fraction
        self.capacity_unit = capacity_unit
        self._samples: list[dict[str, torch.Tensor]] = []
        self._costs: list[int] = []
        self._keys: tuple[str, ...] | None = None
        self._n_added = 0
        self._n_qualified = 0
        self._last_mixed = 0
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self._samples)

    def _check_batch(self, batch: dict[str, torch.Tensor]) -> int:
        if not batch:
            raise ValueError("the batch is empty: it needs at least one tensor")
        sizes = {key: value.shape[0] for key, value in batch.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"batch tensors disagree on the sample axis 0: {sizes}")
        keys = tuple(sorted(batch))
        if self._keys is not None and keys != self._keys:
            raise ValueError(f"batch keys {list(keys)} differ from the buffer's keys {list(self._keys)}")
        return next(iter(sizes.values()))

    def _sample_costs(self, rows: dict[str, torch.Tensor], n: int) -> list[int]:
        if self.capacity_unit == "samples":
            return [1] * n
        for key in TOKEN_MASK_KEYS:
            if key in rows:
                return [int(c) for c in rows[key].reshape(n, -1).ne(0).sum(dim=1)]
        raise ValueError(f"capacity_unit 'tokens' needs one of the keys {TOKEN_MASK_KEYS}, got {sorted(rows)}")

    def _evict(self) -> None:
        used, n_evict = sum(self._costs), 0
        while used > self.capacity:
            used -= self._costs[n_evict]
            n_evict += 1
        del self._samples[:n_evict]
        del self._costs[:n_evict]

    def add(self, batch: dict[str, torch.Tensor], scores: torch.Tensor) -> int:
        """Store the samples of batch (tensors [B, ...]) with scores [B] >= quality_threshold; return how many
        were stored (qualified ones larger than the capacity are not)."""
        _check_scores(scores)
        batch_size = self._check_batch(batch)
        if scores.shape[0] != batch_size:
            raise ValueError(f"scores has {scores.shape[0]} entries for a batch of {batch_size} samples")
        keep = (scores >= self.quality_threshold).nonzero().squeeze(-1)
        n_qualified = keep.shape[0]
        rows = {key: value[keep.to(value.device)].detach().cpu() for key, value in batch.items()}
        costs = self._sample_costs(rows, n_qualified)
        self._keys = tuple(sorted(batch))
        self._n_added += batch_size
        self._n_qualified += n_qualified
        # A sample that alone exceeds the capacity could only be stored by evicting everything, itself included.
        fitting = [i for i in range(n_qualified) if costs[i] <= self.capacity]
        self._costs.extend(costs[i] for i in fitting)
        # clone() gives each row its own storage, so evicting a row frees it instead of pinning its whole batch.
        self._samples.extend({key: rows[key][i].clone() for key in rows} for i in fitting)
        self._evict()
        return len(fitting)

    def sample(self, k: int) -> dict[str, torch.Tensor]:
        """Return min(k, len(self)) distinct stored samples, drawn uniformly, as a CPU batch padded to the longest
        row; {} when nothing would be returned."""
        n = min(k, len(self._samples))
        if n <= 0:
            return {}
        picked = torch.randperm(len(self._samples), generator=self._generator)[:n].tolist()
        assert self._keys is not None
        return {key: pad_cat([self._samples[i][key].unsqueeze(0) for i in picked]) for key in self._keys}

    def mix(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return a copy of batch with n = round(mix_fraction * B) rows replaced by replayed samples.

        Replacing (not appending) keeps B, so the batch still splits evenly over data-parallel ranks. The replaced
        rows are drawn uniformly without replacement; n shrinks to len(self) when the buffer holds fewer samples.
        Rows are padded on the right with 0 to the longer of the batch's and the replayed samples' lengths, and
        moved to each tensor's device and dtype. batch: tensors [B, ...]; returns the same keys, [B, ...].
        """
        batch_size = self._check_batch(batch)
        replay = self.sample(round(self.mix_fraction * batch_size))
        if not replay:
            self._last_mixed = 0
            return dict(batch)
        n = next(iter(replay.values())).shape[0]
        slots = torch.randperm(batch_size, generator=self._generator)[:n]
        order = torch.arange(batch_size)
        order[slots] = torch.arange(batch_size, batch_size + n)
        self._last_mixed = n
        mixed = {}
        for key, value in batch.items():
            merged = pad_cat([value, replay[key].to(device=value.device, dtype=value.dtype)])
            mixed[key] = merged[order.to(value.device)]
        return mixed

    def metrics(self) -> dict[str, float]:
        """replay/size (samples held), replay/fill (held / capacity, in capacity_unit), replay/hit_rate (fraction
        of all samples ever added that qualified), replay/mixed (rows replaced by the last mix)."""
        return {
            "replay/size": float(len(self._samples)),
            "replay/fill": sum(self._costs) / self.capacity,
            "replay/hit_rate": self._n_qualified / max(self._n_added, 1),
            "replay/mixed": float(self._last_mixed),
        }

    def state_dict(self) -> dict:
        return {
            "samples": list(self._samples),
            "costs": list(self._costs),
            "keys": None if self._keys is None else list(self._keys),
            "n_added": self._n_added,
            "n_qualified": self._n_qualified,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"samples", "costs", "keys", "n_added", "n_qualified", "generator"} - set(state)
        if missing:
            raise ValueError(f"replay buffer state lacks keys {sorted(missing)}")
        if len(state["samples"]) != len(state["costs"]):
            raise ValueError(f"replay buffer state has {len(state['samples'])} samples but {len(state['costs'])} costs")
        self._samples = list(state["samples"])
        self._costs = [int(c) for c in state["costs"]]
        self._keys = None if state["keys"] is None else tuple(state["keys"])
        self._n_added = int(state["n_added"])
        self._n_qualified = int(state["n_qualified"])
        self._generator.set_state(state["generator"])
        # The capacity may have been lowered in the config of the resumed run.
        self._evict()
