"""The fallback to sockets across a torchrun restart (parallel/comm/nccl_env.py), 2 gloo processes, --max-restarts 1.

The first start stands in for NCCL on a broken InfiniBand fabric with a process-group start that really fails (a
store client for a port nobody serves); init_with_fallback leaves the marker, torchrun restarts the workers, and
apply_comm_env must then set NCCL_IB_DISABLE=1, with which the start here succeeds (as sockets would). Launched by
tests/test_comm.py with the run folder as argument; prints 'PASS <check>'."""

from __future__ import annotations

import datetime
import logging
import os
import sys

import torch.distributed as dist

from config import CommConfig
from parallel.comm import apply_comm_env, init_with_fallback
from parallel.distributed import env_world, exit_process, init_distributed
from tests.dist.report import say

DEAD_PORT = 1  # privileged and unserved: every connection is refused until the timeout


def main():
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    run_dir = sys.argv[1]
    rank, world, _ = env_world()
    comm = CommConfig(nccl_debug="WARN", extra_env=["MESHRL_TEST_FLAG=on"])
    applied = apply_comm_env(comm, run_dir, rank)
    assert os.environ["NCCL_DEBUG"] == "WARN" and os.environ["MESHRL_TEST_FLAG"] == "on", applied

    def broken_fabric():
        store = dist.TCPStore("127.0.0.1", DEAD_PORT, world, is_master=False,
                              timeout=datetime.timedelta(seconds=2))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    ib_off = os.environ.get("NCCL_IB_DISABLE") == "1"
    init_fn = (lambda: init_distributed("gloo", 60, "cpu")) if ib_off else broken_fabric
    info = init_with_fallback(init_fn, comm, run_dir, rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    assert restart == 1 and applied.get("NCCL_IB_DISABLE") == "1", (restart, applied)
    dist.barrier()
    say(f"rank {info.rank} PASS fallback restart={restart}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)
