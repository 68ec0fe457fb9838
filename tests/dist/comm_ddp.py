"""Gradient compression as DDP comm hooks (parallel/comm/compression.py), under torchrun on gloo: bytes per method
against the float32 all-reduce, the averaged gradient each method gives, and a small regression where top-k with error
feedback matches the uncompressed loss and top-k without it does not; local SGD (parallel/comm/param_averaging.py).
Launched by tests/test_comm.py; prints 'PASS <check>'."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.comm import ReplicaAverager, register_compression
from parallel.distributed import init_distributed
from tests.dist.report import run_worker, say

TOPK_RATIO = 0.05
# regression: the loss reached by top-k with error feedback may exceed the uncompressed one by this factor, and the
# loss without error feedback must exceed the one with it by at least WORSE
EF_TOLERANCE, WORSE = 1.25, 10.0
AVG_TOLERANCE = 1.5  # local SGD with k up to 8 against averaging every step


def check_bytes_and_values(rank: int, n: int) -> None:
    """One backward of a 10010-parameter linear layer per method: bytes sent and the averaged gradient."""
    torch.manual_seed(0)
    base = nn.Linear(1000, 10)
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(rank))
    grads, sent = {}, {}
    for method in ("none", "bf16", "fp16", "int8", "topk"):
        model = DDP(_copy(base), bucket_cap_mb=100)
        state = register_compression(model, method, topk_ratio=TOPK_RATIO)
        model(x).pow(2).mean().backward()
        sent[method] = state.pop_bytes()
        grads[method] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert state.pop_bytes() == 0.0
    numel = grads["none"].numel()
    assert numel == 10010
    exact = sent["none"]
    assert math.isclose(exact, 2 * (n - 1) / n * 4 * numel), exact
    ratios = {m: exact / b for m, b in sent.items()}
    assert ratios["bf16"] == ratios["fp16"] == 2.0, ratios
    assert 3.9 < ratios["int8"] <= 4.0, ratios  # 4x less the scale bytes and the padding to n chunks
    k = math.ceil(TOPK_RATIO * numel)
    assert math.isclose(ratios["topk"], numel / (n * k)), ratios  # 1 / (n * ratio): int32 index + all-gather
    ref = grads["none"]
    scale = ref.abs().max()
    for method, tol in (("bf16", 1e-2), ("fp16", 1e-3), ("int8", 2e-2)):
        err = (grads[method] - ref).abs().max() / scale
        assert err < tol, f"{method}: max error {err:.2e} of the largest gradient"
    # top-k: every rank's largest entries arrive, so the result is the average of the ranks' sparse gradients
    full = _local_grad(base, x)
    top = full.abs().topk(k).indices
    mine = torch.zeros_like(full)
    mine[top] = full[top]
    dist.all_reduce(mine)
    torch.testing.assert_close(grads["topk"], mine / n, rtol=1e-5, atol=1e-7)
    if rank == 0:
        print("ratios " + " ".join(f"{m}={r:.3f}x" for m, r in ratios.items()), flush=True)
    say(f"rank {rank} PASS bytes")


def _copy(module: nn.Module) -> nn.Module:
    out = nn.Linear(module.in_features, module.out_features)
    out.load_state_dict(module.state_dict())
    return out


def _local_grad(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model = _copy(base)
    model(x).pow(2).mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def problem(d: int = 64):
    """y = x.w* where half the features are 5x smaller than the others: (scales, w*, eval x, eval y)."""
    gen = torch.Generator().manual_seed(1234)
    scales = torch.ones(d)
    scales[d // 2 :] = 0.2
    w_star = torch.randn(d, generator=gen)
    x_eval = torch.randn(2048, d, generator=gen) * scales
    return scales, w_star, x_eval, x_eval @ w_star


def regression(rank: int, method: str, error_feedback: bool, steps: int = 300) -> float:
    """SGD on the problem with noisy targets: the small features' gradients are smaller than the noise of the large
    ones, so top-k alone rarely sends them. Returns the final eval loss (noiseless targets; 0 is the optimum)."""
    d = 64
    scales, w_star, x_eval, y_eval = problem(d)
    torch.manual_seed(0)
    model = DDP(nn.Linear(d, 1, bias=False))
    nn.init.zeros_(model.module.weight)
    if method != "none":
        register_compression(model, method, topk_ratio=TOPK_RATIO, error_feedback=error_feedback)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    for _ in range(steps):
        x = torch.randn(16, d, generator=data) * scales
        y = x @ w_star + 0.1 * torch.randn(16, generator=data)
        loss = (model(x).squeeze(1) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((model.module(x_eval).squeeze(1) - y_eval).pow(2).mean())


def check_error_feedback(rank: int) -> None:
    dense = regression(rank, "none", True)
    with_ef = regression(rank, "topk", True)
    without = regression(rank, "topk", False)
    if rank == 0:
        print(f"regression eval loss: float32 {dense:.5f}, topk+ef {with_ef:.5f}, topk {without:.5f}", flush=True)
    assert with_ef <= dense * EF_TOLERANCE + 1e-3, (dense, with_ef)
    assert without >= WORSE * with_ef, (with_ef, without)
    say(f"rank {rank} PASS error_feedback")


def local_sgd(rank: int, k_min: int, k_max: int, steps: int = 300) -> tuple[float, list[float], int]:
    """Each rank SGD on its own samples of the problem, parameters averaged by ReplicaAverager. Returns the eval loss,
    the sync period of every step and the number of averages; checks the ranks agree right after each average."""
    d = 64
    scales, w_star, x_eval, y_eval = problem(d)
    model = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = ReplicaAverager(None, k_min, k_max)
    data = torch.Generator().manual_seed(100 + rank)
    periods = []
    for _ in range(steps):
        x = torch.randn(16, d, generator=data) * scales
        y = x @ w_star + 0.1 * torch.randn(16, generator=data)
        loss = (model(x).squeeze(1) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out = averager.step(model, loss.item())
        periods.append(out["comm/sync_period"])
        if out["comm/averaged"]:
            w = model.weight.detach().clone()
            dist.broadcast(w, 0)
            assert torch.equal(w, model.weight), "replicas differ right after an average"
    with torch.no_grad():
        return float((model(x_eval).squeeze(1) - y_eval).pow(2).mean()), periods, averager.rounds


def check_averaging(rank: int) -> None:
    every_step, periods_1, rounds_1 = local_sgd(rank, 1, 1)
    adaptive, periods, rounds = local_sgd(rank, 1, 8)
    if rank == 0:
        print(f"local SGD eval loss: k=1 {every_step:.5f} ({rounds_1} averages), adaptive k in 1..8 {adaptive:.5f} "
              f"({rounds} averages; sync period first {periods[0]:g}, last {periods[-1]:g})", flush=True)
    assert set(periods_1) == {1.0} and rounds_1 == len(periods_1)
    assert periods[0] == 1.0 and periods[-1] == 8.0 and rounds < len(periods) / 2, (rounds, periods)
    assert adaptive <= AVG_TOLERANCE * every_step + 1e-3, (every_step, adaptive)
    say(f"rank {rank} PASS averaging")


def main():
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    check_bytes_and_values(info.rank, info.world_size)
    check_error_feedback(info.rank)
    check_averaging(info.rank)


if __name__ == "__main__":
    run_worker(main)
