"""Gradient-sync frequency on FSDP2 (parallel/comm/grad_sync.py) under torchrun, 4 gloo processes: accumulating
micro-batches without reduce-scatter / all-reduce gives the gradients of syncing every micro-batch, for FSDP over 4
ranks and HSDP 2x2, with the collectives counted by CommTimer (parallel/comm/usage.py); compressed replicate all-reduce
for HSDP (parallel/comm/compression.py); and the start-up bandwidth check on split pools (parallel/comm/bandwidth.py).
Launched by tests/test_comm.py; prints 'PASS <check>'."""

from __future__ import annotations

import copy
import dataclasses

import torch
from foundation import pools, tiny_qwen2  # tests/dist is the script's folder, so on sys.path

from config import FSDPConfig
from parallel.comm import CommTimer, GradCompression, allreduce_replicas, bandwidth_check, set_grad_sync, sync_now
from parallel.distributed import init_distributed
from parallel.fsdp import fsdp_modules, shard_model
from parallel.layout import build_layout
from tests.dist.report import run_worker, say

N_MICRO = 4


def accumulate(model, micro: list[torch.Tensor], every: int) -> dict[str, torch.Tensor]:
    """Backward over the micro-batches, reducing gradients per sync_now; the gradients after full_tensor."""
    model.zero_grad(set_to_none=True)
    for i, ids in enumerate(micro):
        set_grad_sync(model, sync_now(i, len(micro), every))
        (model(input_ids=ids, labels=ids).loss / len(micro)).backward()
    set_grad_sync(model, True)
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def check_grad_sync(rank: int, name: str, spec) -> None:
    layout = build_layout(pools(spec), "cpu")
    pool = layout.my_pool
    base = tiny_qwen2()
    gen = torch.Generator().manual_seed(10 + pool.dp_rank)  # every dp index its own data
    micro = [torch.randint(0, 96, (2, 12), generator=gen) for _ in range(N_MICRO)]
    results, reduce_scatters = {}, {}
    for every in (1, 2, 4):
        model = shard_model(copy.deepcopy(base), pool, FSDPConfig(param_dtype="float32"))
        timer = CommTimer(torch.device("cpu"))
        timer.watch_fsdp(model)
        results[every] = accumulate(model, micro, every)
        reduce_scatters[every] = timer.calls["reduce_scatter"]
        timed = timer.pop(step_seconds=100.0)
        assert 0 < timed["perf/comm_s"] < 100 and timed["perf/comm_fraction"] == timed["perf/comm_s"] / 100, timed
        assert timer.pop() == {"perf/comm_s": 0.0}
        assert timer.calls["all_gather"] > 0 and timer.untimed == 0
    # the timing wrappers leave the results alone: FSDP2's own collectives give the same gradients
    plain = accumulate(shard_model(copy.deepcopy(base), pool, FSDPConfig(param_dtype="float32")), micro, 1)
    for key, g in plain.items():
        assert torch.equal(g, results[1][key]), key
    groups = len(fsdp_modules(model))  # one reduce-scatter per FSDP module per sync
    assert reduce_scatters == {1: N_MICRO * groups, 2: 2 * groups, 4: groups}, (reduce_scatters, groups)
    for every in (2, 4):
        for key, g in results[every].items():
            torch.testing.assert_close(g, results[1][key], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, key=key, every=every: f"{name} every={every} {key}: {m}")
    say(f"rank {rank} PASS grad_sync_{name} reduce_scatters={reduce_scatters}")


def check_replica_compression(rank: int) -> None:
    """HSDP 2x2 with our replicate all-reduce: FSDP2 over dp_shard only, then allreduce_replicas over dp_replicate.
    Uncompressed it equals FSDP2's own HSDP; compressed it is close, with the bytes of each method."""
    layout = build_layout(pools(("all", 4, ["actor"], 1, 2)), "cpu")
    pool = layout.my_pool
    base = tiny_qwen2()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(20 + pool.dp_rank))
    fsdp_cfg = FSDPConfig(param_dtype="float32")

    def grads(model):
        model(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad.full_tensor() for name, p in model.named_parameters()}

    ref = grads(shard_model(copy.deepcopy(base), pool, fsdp_cfg))
    scale = max(g.abs().max() for g in ref.values())
    inside = dataclasses.replace(pool, dp_replicate=1)  # the same mesh; FSDP2 on its dp_shard axis alone
    sent = {}
    for method, tol in (("none", 1e-6), ("bf16", 1e-2), ("int8", 2e-2)):
        model = shard_model(copy.deepcopy(base), inside, fsdp_cfg)
        state = GradCompression(method, pool.mesh.get_group("dp_replicate"))
        model(input_ids=ids, labels=ids).loss.backward()
        allreduce_replicas(model, state, bucket_numel=4096)  # several buckets
        sent[method] = state.pop_bytes()
        for name, p in model.named_parameters():
            err = (p.grad.full_tensor() - ref[name]).abs().max() / scale
            assert err <= tol, f"{method} {name}: error {err:.2e} of the largest gradient"
    assert sent["none"] == 2 * sent["bf16"] and 3.9 < sent["none"] / sent["int8"] <= 4.0, sent
    say(f"rank {rank} PASS replica_compression bytes={sent}")


def check_bandwidth(rank: int) -> None:
    layout = build_layout(pools(("a", 2, ["actor"], 1, 1), ("b", 1, ["critic"], 1, 1),
                                ("c", 1, ["reward"], 1, 1)), "cpu")
    metrics = bandwidth_check(layout, torch.device("cpu"), sizes=(1 << 16, 1 << 20, 1 << 30))
    if rank < 2:
        assert set(metrics) == {"comm/allreduce_busbw_gbps", "comm/allreduce_busbw_gbps/a"}, metrics
        assert metrics["comm/allreduce_busbw_gbps"] > 0
    else:
        assert metrics == {}, metrics  # a pool of one rank has nothing to measure
    say(f"rank {rank} PASS bandwidth {metrics}")


def main():
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    assert info.world_size == 4, "run with --nproc_per_node 4"
    check_grad_sync(info.rank, "fsdp4", ("all", 4, ["actor"], 1, 1))
    check_grad_sync(info.rank, "hsdp", ("all", 4, ["actor"], 1, 2))
    check_replica_compression(info.rank)
    check_bandwidth(info.rank)


if __name__ == "__main__":
    run_worker(main)
