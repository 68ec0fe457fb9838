"""Moving a batch from the ranks of one pool to the ranks of another (split placement).

The source pool's data-parallel shards, in dp order, form one sequence of samples; it is cut into balanced
contiguous ranges (sizes differ by at most one), one per destination data-parallel index, and every rank of that
index (its tp peers too) receives it. Metadata (counts, keys, shapes) is exchanged with one small object all-gather
over the two pools' ranks; tensors go point to point. Widths (dim 1) may differ between source shards: a destination
right-pads the pieces it receives to the widest (see batch.pad_cat).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from batch import Batch, pad_cat
from parallel.layout import Layout, Pool


def balanced_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of `parts` contiguous ranges covering range(n), sizes differing by at most one."""
    return [(n * j) // parts for j in range(parts + 1)]


def transfer(batch: Batch | None, src: Pool, dst: Pool, layout: Layout, device: torch.device,
             want: int | None = None) -> Batch | None:
    """Send `batch` (held by every rank of `src`; tp peers hold the same shard) to the ranks of `dst`.

    Call on every rank of both pools. Returns the received shard on `dst` ranks and None elsewhere.
    Same pool: returns `batch` unchanged (colocated roles share the data).
    want: on `dst` ranks, the number of rows this rank's data-parallel index is to receive (every dst rank passes
    it, tp peers the same number; the counts must add up to the rows sent). Sending results back to the pool a
    batch came from with its original shard sizes puts every row back where it started, whatever the shards' sizes.
    None on every rank: balanced ranges.
    """
    if src is dst:
        return batch
    group = layout.union_group(src, dst)
    if group is None:
        return None
    rank = layout.rank
    sending = src.has(rank) and src.tp_rank_of(rank) == 0
    meta = None
    if sending:
        assert batch is not None, f"rank {rank} of pool {src.name} has no batch to send"
        n = next(iter(batch.values())).shape[0] if batch else 0
        meta = (rank, n, {k: (v.dtype, tuple(v.shape[1:])) for k, v in sorted(batch.items())})
    wanted = (dst.dp_rank_of(rank), want) if dst.has(rank) and want is not None else None
    metas: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, (meta, wanted), group=group)
    wants = dict(w for _, w in metas if w is not None)
    senders = sorted((m for m, _ in metas if m is not None), key=lambda m: src.dp_rank_of(m[0]))
    keys = list(senders[0][2])
    for m in senders[1:]:
        if list(m[2]) != keys or any(m[2][k][0] != senders[0][2][k][0] for k in keys):
            raise ValueError(
                f"pool {src.name}: ranks hold batches with different keys or dtypes: {m[2]} vs {senders[0][2]}"
            )

    offsets = [0]
    for m in senders:
        offsets.append(offsets[-1] + m[1])
    if wants:
        if sorted(wants) != list(range(dst.dp_size)) or sum(wants.values()) != offsets[-1]:
            raise ValueError(f"transfer {src.name} -> {dst.name}: the destination asked for rows {wants} (by dp "
                             f"index) but {offsets[-1]} rows are sent; every dp index must ask, for all of them")
        bounds = [0]
        for j in range(dst.dp_size):
            bounds.append(bounds[-1] + wants[j])
    else:
        bounds = balanced_bounds(offsets[-1], dst.dp_size)
    my_dst = dst.dp_rank_of(rank) if dst.has(rank) else None

    ops: list[dist.P2POp] = []
    received: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    keep: list = []  # tensors handed to isend must stay alive until the ops finish
    for s, (src_rank, _, specs) in enumerate(senders):
        for j in range(dst.dp_size):
            lo, hi = max(offsets[s], bounds[j]), min(offsets[s + 1], bounds[j + 1])
            if lo >= hi:
                continue
            targets = [r for r in dst.ranks if dst.dp_rank_of(r) == j]
            for k in keys:
                dtype, tail = specs[k]
                if rank == src_rank:
                    piece = batch[k][lo - offsets[s] : hi - offsets[s]]
                    wire = _to_wire(piece.contiguous())
                    for t in targets:
                        if t == rank:
                            received[k].append(piece.to(device))
                        elif wire.numel():
                            keep.append(wire)
                            ops.append(dist.P2POp(dist.isend, wire, t, group=group))
                if j == my_dst and rank != src_rank:
                    buf = torch.empty((hi - lo, *tail), dtype=_wire_dtype(dtype), device=device)
                    if buf.numel():
                        ops.append(dist.P2POp(dist.irecv, buf, src_rank, group=group))
                    received[k].append((buf, dtype))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if my_dst is None:
        return None
    out = {}
    for k in keys:
        pieces = [p if isinstance(p, torch.Tensor) else p[0].to(p[1]) for p in received[k]]
        if not pieces:
            dtype, tail = senders[0][2][k]
            pieces = [torch.empty((0, *tail), dtype=dtype, device=device)]
        out[k] = pad_cat(pieces)
    return out


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    # gloo has no bool send/recv
    return torch.uint8 if dtype == torch.bool else dtype


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(_wire_dtype(t.dtype))
