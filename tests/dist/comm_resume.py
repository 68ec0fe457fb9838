"""Checkpointable comm state (state_dict / load_state_dict of parallel/comm/compression.GradCompression,
param_averaging.ReplicaAverager and stale_allreduce.StaleAllReduce) under torchrun, 2 gloo processes, one replica
each: N steps of a small MLP uninterrupted give bit for bit the parameters and per-step records of K steps, a
checkpoint through torch.save / torch.load(weights_only=True), fresh model, optimizer and comm object, and the other
N - K steps; the same resume without the comm state's load_state_dict differs (so the check sees the state), and a
restored state meets a model with other buckets with a ValueError naming both. Launched by tests/test_comm.py; prints
'PASS <check>'."""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from parallel.comm import GradCompression, ReplicaAverager, StaleAllReduce, allreduce_replicas
from parallel.distributed import init_distributed
from tests.dist.report import run_worker, say

STEPS = 60
BUCKET = 100  # elements: the MLP's 161 parameters make two buckets, [128] and [16 + 16 + 1]
TOPK_RATIO = 0.1


def mlp(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every replica
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s samples of this replica, the same whether or not the run was interrupted: x [16, 8], y [16, 1]."""
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(16, 8, generator=gen)
    return x, torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(16, 1, generator=gen)


def new_comm(mode: str):
    if mode == "topk":
        return GradCompression("topk", None, topk_ratio=TOPK_RATIO)
    if mode == "average":
        return ReplicaAverager(None, k_min=1, k_max=8, slow=0.02, fast=0.05)
    return StaleAllReduce(None, bucket_numel=BUCKET)


def train(mode: str, rank: int, model: nn.Module, opt, comm, steps: range) -> list:
    """SGD with momentum; per step a record of what the step saw: the loss, and the staleness installed or the
    averager's metrics and state."""
    records = []
    for step in steps:
        x, y = batch(rank, step)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        record = [loss.item()]
        if mode == "topk":
            allreduce_replicas(model, comm, bucket_numel=BUCKET)
        elif mode == "stale":
            record.append(comm.exchange(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "average":
            record += [*comm.step(model, loss.item()).values(), *comm.state_dict().values()]  # k, since, ...
        records.append(record)
    return records


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def resume(mode: str, rank: int, at: int, load: bool) -> tuple[list, list[torch.Tensor], dict]:
    """Steps [0, at), a checkpoint, fresh objects, then steps [at, STEPS); with load=False the fresh comm object
    does not get its state back. Returns the records, the final parameters and the comm state as saved."""
    model, opt = fresh()
    comm = new_comm(mode)
    records = train(mode, rank, model, opt, comm, range(at))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comm": comm.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = fresh()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    comm = new_comm(mode)
    if load:
        comm.load_state_dict(ckpt["comm"])
    records += train(mode, rank, model, opt, comm, range(at, STEPS))
    return records, [p.detach().clone() for p in model.parameters()], ckpt["comm"]


def same(a: tuple[list, list[torch.Tensor]], b: tuple[list, list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1], strict=True))


def check_resume(mode: str, rank: int) -> dict:
    model, opt = fresh()
    comm = new_comm(mode)
    records = train(mode, rank, model, opt, comm, range(STEPS))
    whole = (records, [p.detach().clone() for p in model.parameters()])
    if mode == "average":  # resume mid-period with an adapted k, so that every field of the state matters
        at = 1 + next(i for i, r in enumerate(records) if r[3] > 1 and r[4] > 0 and i >= STEPS // 3)
    else:
        at = STEPS // 2
    records, params, state = resume(mode, rank, at, load=True)
    assert same((records, params), whole), f"{mode}: the resumed run differs from the uninterrupted one"
    assert not same(resume(mode, rank, at, load=False)[:2], whole), f"{mode}: a resume without the state is the same"
    return state


def check_buckets(mode: str, state: dict) -> None:
    """The state of the 161-parameter MLP against one with 121 (buckets [96] and [25] where they were [128], [33])."""
    other = mlp(hidden=12)
    x, y = batch(0, 0)
    (other(x) - y).pow(2).mean().backward()
    comm = new_comm(mode)
    comm.load_state_dict(state)
    try:
        if mode == "topk":
            allreduce_replicas(other, comm, bucket_numel=BUCKET)
        else:
            comm.exchange(other)
    except ValueError as e:
        want = ("128", "96") if mode == "topk" else ("[128, 33]", "[96, 25]")
        assert all(w in str(e) for w in want), e
    else:
        raise AssertionError(f"{mode}: a state of other buckets was accepted")


def main():
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    assert info.world_size == 2, "run with --nproc_per_node 2"
    rank = info.rank
    state = check_resume("topk", rank)
    assert sorted(state["residuals"]) == [0, 1] and [r.numel() for r in state["residuals"].values()] == [128, 33]
    check_buckets("topk", state)
    say(f"rank {rank} PASS resume_topk")
    state = check_resume("average", rank)
    assert state["k"] > 1 and state["since"] > 0 and state["rounds"] > 0, state
    say(f"rank {rank} PASS resume_averager k={state['k']} since={state['since']} rounds={state['rounds']}")
    state = check_resume("stale", rank)
    assert [t.numel() for t in state["average"]] == [128, 33] and state["params"] == [0, 1, 2, 3], state
    check_buckets("stale", state)
    say(f"rank {rank} PASS resume_stale")


if __name__ == "__main__":
    run_worker(main)
