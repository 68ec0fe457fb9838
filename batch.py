"""The batch that flows through a PPO step: a plain dict of tensors sharing the sample axis (dim 0).

Token tensors are right-padded: `[B, T]`, row i valid up to its own length. Pieces with different T are joined by
right-padding with zeros, so splitting and joining never reorders or alters a sample's valid values.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, first padding every other dim on the right with 0 to the largest size.

    tensors: [N_i, *S_i], all with the same number of dims and the same dtype. Returns [sum N_i, *max S]
    (bool tensors pad with False). Used when batches generated with different response lengths meet.
    """
    if not tensors:
        raise ValueError("pad_cat needs at least one tensor")
    if len({t.dim() for t in tensors}) != 1 or len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"pad_cat needs one ndim and dtype, got {[(tuple(t.shape), t.dtype) for t in tensors]}")
    trailing = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = tensors[0].new_zeros((sum(t.shape[0] for t in tensors), *trailing))
    row = 0
    for t in tensors:
        out[(slice(row, row + t.shape[0]), *(slice(0, n) for n in t.shape[1:]))] = t
        row += t.shape[0]
    return out


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """[N, W, ...] -> [N, width, ...]: cut or right-pad dim 1 with zeros. Response-aligned tensors coming back from
    another pool are as wide as the widest batch that pool received; beyond a batch's own width they hold padding."""
    if t.shape[1] >= width:
        return t[:, :width]
    out = t.new_zeros((t.shape[0], width, *t.shape[2:]))
    out[:, : t.shape[1]] = t
    return out


def cat_batches(batches: list[Batch]) -> Batch:
    keys = batches[0].keys()
    for b in batches[1:]:
        if b.keys() != keys:
            raise ValueError(f"cannot join batches with different keys: {sorted(keys)} vs {sorted(b.keys())}")
    return {k: pad_cat([b[k] for b in batches]) for k in keys}


def select(batch: Batch, index) -> Batch:
    """Rows `index` (a slice, a LongTensor of indices, or a bool mask) of every tensor."""
    return {k: v[index] for k, v in batch.items()}


def batch_size(batch: Batch) -> int:
    return next(iter(batch.values())).shape[0] if batch else 0


def split_batch(batch: Batch, sizes: list[int]) -> list[Batch]:
    """Consecutive pieces of the given sizes along the sample axis."""
    out, start = [], 0
    for n in sizes:
        out.append(select(batch, slice(start, start + n)))
        start += n
    assert start == batch_size(batch), "split sizes must add up to the batch size"
    return out


def to_device(batch: Batch, device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
