"""Every group meshrl creates honours distributed.timeout_s (4 CPU processes, gloo). Launched by
tests/test_faults.py. Rank 1 stops itself with SIGSTOP; rank 0 runs one all-reduce on each group it shares with it
(the pool's group, its gloo I/O group, its DeviceMesh tp axis, the pair group of two pools), prints how long each
took to fail, then sends SIGCONT. torch's default for a group created without a timeout is 30 min on gloo: without
the fix the first one hangs."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from config import PoolConfig
from parallel.distributed import init_distributed
from parallel.layout import build_layout
from tests.dist.report import say

TIMEOUT_S = 3


def main() -> None:
    info = init_distributed("gloo", timeout_s=TIMEOUT_S, device="cpu")
    # pool "a" = ranks 0-1 as tp 2 (its tp axis is a DeviceMesh-made group of 2 of the 4 ranks), pool "b" = ranks 2-3
    layout = build_layout([PoolConfig("a", 2, ["actor"], 2, 1), PoolConfig("b", 2, ["critic"], 1, 1)], "cpu")
    store = dist.distributed_c10d._get_default_store()
    if info.rank == 1:
        store.set("stopped_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT when it is done
    if info.rank != 0:  # no collective from here on; wait (on the store, not a group) for rank 0 to finish
        deadline = time.time() + 60 * TIMEOUT_S
        while time.time() < deadline and not store.check(["done"]):
            time.sleep(0.2)
        os._exit(0)
    store.wait(["stopped_pid"])
    a = layout.pools[0]
    groups = {"pool": a.group, "io": a.io_group, "tp axis": a.mesh.get_group("tp"), "pair": layout.pair_groups[(0, 1)]}
    for name, group in groups.items():
        began = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            say(f"FAIL {name}: the all-reduce returned")
        except Exception as e:  # gloo raises RuntimeError on a timeout
            say(f"TIMEOUT {name} {time.perf_counter() - began:.1f} s {type(e).__name__}")
    store.set("done", "1")
    os.kill(int(store.get("stopped_pid")), signal.SIGCONT)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
