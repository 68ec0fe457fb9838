"""The batch that flows through a PPO step: a plain dict of tensors sharing the sample axis (dim 0).

Token tensors are right-padded: `[B, T]`, row i valid up to its own length. Pieces with different T are joined by
right-padding with zeros, so splitting and joining never reorders or alters a sample's valid values.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def pad_to(t: torch.Tensor, width: int, value=0) -> torch.Tensor:
    """Right-pad dim 1 of `t` ([B, T, ...]) to `width`."""
    if t.dim() < 2 or t.shape[1] == width:
        return t
    assert t.shape[1] < width, "pad_to never truncates"
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def pad_cat(pieces: list[torch.Tensor], value=0) -> torch.Tensor:
    """Concatenate `[B_i, T_i, ...]` tensors along dim 0, right-padding dim 1 to the widest."""
    if len(pieces) == 1:
        return pieces[0]
    if pieces[0].dim() >= 2:
        width = max(p.shape[1] for p in pieces)
        pieces = [pad_to(p, width, value) for p in pieces]
    return torch.cat(pieces, dim=0)


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
