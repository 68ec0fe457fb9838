"""Placement: which ranks form which pool, which roles a pool hosts, and the DeviceMesh of each pool.

A pool is a contiguous range of ranks with one mesh of axes (dp_replicate, dp_shard, tp), tp fastest so that
tensor-parallel peers are neighbours (same node, NVLink). Every rank builds every pool's mesh and groups in the same
order, as torch.distributed requires; a rank outside a pool holds that pool's objects but never runs its code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

MESH_AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass
class Pool:
    name: str
    index: int
    ranks: tuple[int, ...]
    roles: tuple[str, ...]
    dp_replicate: int
    dp_shard: int
    tp: int
    mesh: DeviceMesh
    group: dist.ProcessGroup | None = None  # all ranks of the pool; None outside
    io_group: dist.ProcessGroup | None = None  # the same ranks over gloo: checkpoint I/O, also from a background thread
    # this rank's view; None / -1 when the rank is outside the pool
    dp_group: dist.ProcessGroup | None = None  # dp_replicate x dp_shard flattened: ranks that see different data
    dp_rank: int = -1
    tp_rank: int = -1

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def has(self, rank: int) -> bool:
        return rank in self.ranks

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel index of a global rank of this pool (its tp peers share it)."""
        return self.ranks.index(rank) // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return self.ranks.index(rank) % self.tp

    def dp_leaders(self) -> list[int]:
        """One global rank per data-parallel index (tp rank 0), in dp order."""
        return list(self.ranks[:: self.tp])


@dataclass
class Layout:
    rank: int
    world_size: int
    pools: list[Pool]
    pair_groups: dict[tuple[int, int], dist.ProcessGroup | None] = field(default_factory=dict)

    def pool_of(self, role: str) -> Pool:
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(f"no pool hosts role {role!r}")

    def hosts(self, role: str) -> bool:
        """Whether this rank runs `role`'s code."""
        return any(role in p.roles and p.has(self.rank) for p in self.pools)

    @property
    def my_pool(self) -> Pool:
        return next(p for p in self.pools if p.has(self.rank))

    @property
    def my_roles(self) -> tuple[str, ...]:
        return self.my_pool.roles

    def union_group(self, a: Pool, b: Pool) -> dist.ProcessGroup | None:
        """The group of the ranks of two pools (for batch transfer); None on ranks in neither."""
        key = (min(a.index, b.index), max(a.index, b.index))
        return self.pair_groups[key]

    def describe(self, roles=None) -> str:
        """A line per pool; with `roles`, only those of its roles (the ones the run builds) are named."""
        lines = []
        for p in self.pools:
            hosted = [r for r in p.roles if roles is None or r in roles]
            lines.append(
                f"pool {p.name}: ranks {p.ranks[0]}-{p.ranks[-1]} roles {','.join(hosted) or '-'} "
                f"mesh dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp}"
            )
        return "\n".join(lines)


def build_layout(pool_specs, device_type: str) -> Layout:
    """Build every pool's mesh and groups. `pool_specs`: objects with name, size, roles, tp, dp_replicate
    (config.PoolConfig), whose sizes add up to the world size (checked by config.check_world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert sum(s.size for s in pool_specs) == world, "pool sizes must add up to the world size"
    pools: list[Pool] = []
    start = 0
    for index, spec in enumerate(pool_specs):
        ranks = tuple(range(start, start + spec.size))
        start += spec.size
        dp_shard = spec.size // (spec.tp * spec.dp_replicate)
        grid = torch.tensor(ranks).view(spec.dp_replicate, dp_shard, spec.tp)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=MESH_AXES)
        pool = Pool(spec.name or f"pool{index}", index, ranks, tuple(spec.roles), spec.dp_replicate, dp_shard,
                    spec.tp, mesh)
        whole = dist.new_group(list(ranks))
        io = dist.new_group(list(ranks), backend="gloo")
        pool.group, pool.io_group = (whole, io) if rank in ranks else (None, None)
        # flattened data-parallel groups, one per tp index; new_group is collective over the world
        for t in range(spec.tp):
            members = grid[:, :, t].flatten().tolist()
            group = dist.new_group(members)
            if rank in members:
                pool.dp_group, pool.dp_rank, pool.tp_rank = group, members.index(rank), t
        pools.append(pool)
    layout = Layout(rank, world, pools)
    for a, b in itertools.combinations(range(len(pools)), 2):
        members = sorted(pools[a].ranks + pools[b].ranks)
        group = dist.new_group(members)
        layout.pair_groups[(a, b)] = group if rank in members else None
    return layout
