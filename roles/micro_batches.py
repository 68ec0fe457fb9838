"""A rank's samples cut into micro-batches by a token budget (grouped by length for padded forwards, by real tokens
for packed ones), the same count on every data-parallel rank, and their outputs joined back in the batch's order."""

from __future__ import annotations

import torch
import torch.distributed as dist

from algo.advantages import as_bool_mask
from batch import Batch, batch_size, fit_width, select
from parallel.distributed import comm_device

FULL_WIDTH_KEYS = ("input_ids", "attention_mask")  # [B, L]; every other 2-D key is response-aligned [B, R]

WIDTH_MULTIPLE = 16  # micro-batch widths are rounded up to this: fewer distinct shapes, tensor-core friendly


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def trim(batch: Batch, full: int, resp: int) -> Batch:
    """Cut or right-pad the full-width keys to `full` columns and the response-aligned ones to `resp`."""
    return {k: (fit_width(v, full) if k in FULL_WIDTH_KEYS else fit_width(v, resp)) if v.dim() >= 2 else v
            for k, v in batch.items()}


def dummy_row(batch: Batch) -> Batch:
    """One all-padding sample with the batch's keys: a rank with no samples still joins the sharded forwards."""
    out = {}
    for k, v in batch.items():
        shape = (1, 1, *v.shape[2:]) if v.dim() >= 2 else (1, *v.shape[1:])
        out[k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
    out["prompt_len"] = torch.ones_like(out["prompt_len"])
    out["lengths_host"] = torch.tensor([[1, 1]])
    out["row_index"] = torch.full((1,), -1, dtype=torch.long)
    return out


def greedy_runs(lengths: list[int], budget: int) -> list[list[int]]:
    """Samples sorted longest first, cut into contiguous runs of at most `budget` padded tokens (rows x the run's
    longest; a longer sample is a run by itself). Returns sample indices per run."""
    runs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if runs and (len(runs[-1]) + 1) * lengths[runs[-1][0]] <= budget:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def length_groups(lengths: list[int], parts: int) -> list[list[int]]:
    """Split samples into at most `parts` groups of similar lengths with the least padding: sorted longest first,
    cut into contiguous runs whose padded size (rows x longest) is at most the smallest budget that needs no more
    than `parts` runs (binary search). Then, while fewer than `parts` groups exist, the costliest group with two
    rows or more is halved, so every rank does real work in every micro-batch. Returns sample indices per group."""
    if not lengths:
        return []
    lo, hi = max(lengths), len(lengths) * max(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(greedy_runs(lengths, mid)) > parts else (lo, mid)
    return _split_until(greedy_runs(lengths, lo), parts, cost=lambda g: len(g) * lengths[g[0]],
                        halve=lambda g: [g[: len(g) // 2], g[len(g) // 2:]])


def _split_until(groups: list[list[int]], parts: int, cost, halve) -> list[list[int]]:
    """While fewer than `parts` groups exist, the costliest group of two samples or more is replaced by its two
    halves (halve(group) -> [first, second]), so every rank does real work in every micro-batch."""
    while len(groups) < parts:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        g = max(splittable, key=cost)
        at = groups.index(g)
        groups[at:at + 1] = halve(g)
    return groups


def balanced_groups(lengths: list[int], parts: int) -> list[list[int]]:
    """Longest first, each sample into the group with the fewest tokens so far (LPT): `parts` groups (fewer when
    there are fewer samples) whose token sums differ by at most the longest sample. Returns sample indices."""
    groups: list[list[int]] = [[] for _ in range(min(parts, len(lengths)))]
    sums = [0] * len(groups)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = min(range(len(groups)), key=lambda g: sums[g])
        groups[g].append(i)
        sums[g] += lengths[i]
    return groups


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, the lengths of a row summing to at most `capacity` (a longer
    sample is a row by itself)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def token_groups(lengths: list[int], budget: int, parts: int | None = None) -> list[list[int]]:
    """Samples in groups of at most `budget` tokens (first-fit decreasing, pack_rows; a longer sample is a group by
    itself), then, while fewer than `parts` groups exist, the one with the most tokens (two samples or more) is
    halved by balanced_groups. Returns sample indices."""
    return _split_until(pack_rows(lengths, budget), parts or 0, cost=lambda g: sum(lengths[i] for i in g),
                        halve=lambda g: [[g[j] for j in half] for half in balanced_groups([lengths[i] for i in g], 2)])


def micro_batches(batch: Batch, token_budget: int, group: dist.ProcessGroup | None,
                  packed: bool = False) -> list[Batch]:
    """Split a rank's samples into micro-batches of at most ~token_budget tokens.

    Padded (packed=False): the count is the one a budget of token_budget padded tokens needs (rows x longest, samples
    sorted by length), and within it the samples are grouped by length with the least padding (length_groups).
    packed=True (the forwards will pack, response_logits / response_values with pack): groups of at most
    token_budget real tokens, lengths mixed (token_groups: first-fit decreasing), which is what packing wants; a
    packed forward then holds those tokens plus the padding at the ends of its rows. Either way the count is the
    largest over the ranks
    of `group` (the data-parallel group): every rank runs the same number of forwards, because each forward of an
    FSDP model is a collective; a rank with fewer samples than micro-batches gets all-padding rows. Widths are
    rounded up to WIDTH_MULTIPLE. Each micro-batch carries `row_index` (its rows' indices in `batch`, -1 for padding
    rows; join_rows puts outputs back in order) and `lengths_host` ([b, 2] prompt and full lengths on the host, for
    the logits window, the attention mask and packing).
    One host sync: the lengths.
    """
    n = batch_size(batch)
    lengths = torch.stack([batch["prompt_len"], batch["response_len"]]).cpu() if n else torch.zeros(2, 0)
    host = torch.stack([lengths[0], lengths[0] + lengths[1]], 1).long()  # [n, 2]: prompt and full length
    full = host[:, 1].tolist()
    rounded = [round_up(x, WIDTH_MULTIPLE) for x in full]
    budget = max(token_budget, 1)
    needed = len(token_groups(full, budget)) if packed else len(greedy_runs(rounded, budget))
    count = torch.tensor([float(max(1, needed))])
    if group is not None and dist.get_world_size(group) > 1:
        count = count.to(comm_device(group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    count = int(count)
    out = []
    by_length = sorted(range(n), key=lambda i: -full[i])  # ties of the rounded widths: the longest first
    grouping = length_groups([rounded[i] for i in by_length], count) if not packed else \
        token_groups([full[i] for i in by_length], budget, count)
    for members in grouping:
        rows = [by_length[j] for j in members]
        index = torch.tensor(sorted(rows), dtype=torch.long)
        width = max(rounded[i] for i in rows)
        resp = max(int(lengths[1, index].max()), 1)
        mb = trim(select(batch, index.to(batch["prompt_len"].device)), width, resp)
        mb["lengths_host"] = host[index]
        mb["row_index"] = index
        out.append(mb)
    # padding rows go last (see join_rows)
    return out + [dummy_row(batch)] * (count - len(out))


def join_rows(parts: list[torch.Tensor], micro: list[Batch], batch: Batch) -> torch.Tensor:
    """Per-micro-batch [b, r] outputs back to [B, R] in the batch's row order (micro-batches from micro_batches;
    padding rows dropped), zero beyond each response."""
    n, width = batch_size(batch), batch["response_mask"].shape[1]
    out = torch.zeros((n, width), dtype=torch.float32, device=batch["response_mask"].device)
    covered = 0
    for p, mb in zip(parts, micro):
        real = mb["row_index"] >= 0
        if not bool(real.any()):
            continue
        rows, cols = mb["row_index"][real], min(p.shape[1], width)
        out[rows.to(out.device), :cols] = p[real.to(p.device), :cols].float()
        covered += int(real.sum())
    assert covered == n, "micro-batch outputs do not cover the batch"
    return out * as_bool_mask(batch["response_mask"], batch["response_mask"].shape)


def join_values(parts: list[torch.Tensor], micro: list[Batch], n: int) -> torch.Tensor:
    """Per-micro-batch [b] outputs back to [n] in the batch's row order (padding rows dropped)."""
    out = torch.zeros(n, dtype=torch.float32, device=parts[0].device if parts else None)
    for p, mb in zip(parts, micro):
        real = mb["row_index"] >= 0
        out[mb["row_index"][real].to(out.device)] = p[real.to(p.device)].float()
    return out
