"""The start-up all-reduce bandwidth check (comm.bandwidth_check, metric comm/allreduce_busbw_gbps); bench/
comm_bandwidth.py runs it standalone."""

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("meshrl.comm")

DEFAULT_SIZES = (1 << 20, 1 << 26, 1 << 28)
CPU_MAX_BYTES = 1 << 24  # gloo on CPU: larger sizes only make the start-up slow


def busbw_gbps(nbytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: 2(n-1)/n * bytes / time, in GB/s (1e9 bytes)."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9 if seconds > 0 else 0.0


def allreduce_bandwidth(group: dist.ProcessGroup | None, device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES,
                        warmup: int = 2, iters: int = 5) -> dict[int, tuple[float, float]]:
    """{bytes: (seconds per all-reduce, bus bandwidth GB/s)} of float32 all-reduces over `group`; every rank of the
    group calls it and gets the same numbers (the slowest rank's time). On CPU, sizes above 16 MiB become one of 16 MiB.
    A group of one rank has no bandwidth: {}."""
    n = dist.get_world_size(group)
    if n < 2:
        return {}
    if device.type == "cpu" and max(sizes) > CPU_MAX_BYTES:
        sizes = [s for s in sizes if s < CPU_MAX_BYTES] + [CPU_MAX_BYTES]
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(x, group=group)
        _sync(device)
        dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        seconds = float(elapsed)
        out[nbytes] = (seconds, busbw_gbps(nbytes, seconds, n))
    return out


def bandwidth_check(layout, device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES) -> dict[str, float]:
    """Time all-reduces over the data-parallel group of every pool (the group gradients are averaged over), all pools
    at once. Returns this rank's metrics: comm/allreduce_busbw_gbps (the pool's largest size) and the same under
    comm/allreduce_busbw_gbps/<pool>; the first rank of each pool logs a line per size."""
    pool = layout.my_pool
    table = allreduce_bandwidth(pool.dp_group, device, sizes)
    if not table:
        return {}
    if layout.rank == pool.ranks[0]:
        for nbytes, (seconds, bw) in table.items():
            log.info("comm: pool %s all-reduce %s over %d ranks: %.3f ms, bus bandwidth %.1f GB/s", pool.name,
                     _human(nbytes), pool.dp_size, seconds * 1e3, bw)
    top = table[max(table)][1]
    return {"comm/allreduce_busbw_gbps": top, f"comm/allreduce_busbw_gbps/{pool.name}": top}


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
