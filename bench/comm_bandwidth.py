"""All-reduce bus bandwidth over the whole world: the start-up check of parallel/comm/bandwidth.py, run standalone.

    torchrun --standalone --nproc_per_node 2 bench/comm_bandwidth.py            # NCCL on GPUs, gloo on CPU
    torchrun ... bench/comm_bandwidth.py --sizes 1M,64M,1G --iters 20

Rank 0 prints one table row per size: the time of one float32 all-reduce (the slowest rank's mean over --iters after
--warmup), the algorithm bandwidth (bytes / time) and nccl-tests' bus bandwidth 2(n-1)/n * bytes / time, in GB/s
(1e9) and GiB/s. On CPU, sizes above 16 MiB become one of 16 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.comm import DEFAULT_SIZES, allreduce_bandwidth  # noqa: E402
from parallel.distributed import exit_process, init_distributed  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = ",".join(f"{s >> 20}M" for s in DEFAULT_SIZES) + ",1G"
    parser.add_argument("--sizes", default=default, help=f"bytes per all-reduce, e.g. 1M,64M,1G (default {default})")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    info = init_distributed()
    sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
    table = allreduce_bandwidth(None, info.device, sizes, args.warmup, args.iters)
    if info.rank == 0:
        where = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "CPU"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if info.backend == "nccl" else "-"
        print(f"all-reduce float32 over {info.world_size} ranks, backend {info.backend} (NCCL {nccl}), {where}, "
              f"torch {torch.__version__}, warmup {args.warmup}, iters {args.iters}")
        print(f"| {'size':>8} | {'time ms':>9} | {'algbw GB/s':>10} | {'busbw GB/s':>10} | {'busbw GiB/s':>11} |")
        print(f"| {'-' * 8} | {'-' * 9} | {'-' * 10} | {'-' * 10} | {'-' * 11} |")
        for nbytes, (seconds, busbw) in table.items():
            size = f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 \
                else f"{nbytes >> 10} KiB"
            print(f"| {size:>8} | {seconds * 1e3:9.3f} | {nbytes / seconds / 1e9:10.1f} | {busbw:10.1f} | "
                  f"{busbw * 1e9 / 2**30:11.1f} |", flush=True)
        if table:
            print(f"comm/allreduce_busbw_gbps {table[max(table)][1]:.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)
