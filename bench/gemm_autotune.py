"""The decode step's GEMM shapes (Qwen2.5 0.5B and 1.5B, fused q/k/v and gate/up) on a GPU: cuBLAS (F.linear, what
the engine runs) against what torch.compile's max-autotune picks for the same shape (Inductor times its Triton GEMM
templates against cuBLAS and keeps the fastest by its own timing). Both timed as CUDA-graph replays
(triton.testing.do_bench_cudagraph); the outputs compared.

    python3 bench/gemm_autotune.py [--rows 64 256]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

SHAPES = {  # hidden, query width, key/value width, MLP width
    "qwen2.5-0.5b": (896, 896, 128, 4864),
    "qwen2.5-1.5b": (1536, 1536, 256, 8960),
}


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    print("| model | GEMM | M x N x K | cuBLAS us | max-autotune us | cuBLAS / autotuned | autotune s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, (hidden, q, kv, inter) in SHAPES.items():
        gemms = {"qkv (bias)": (q + 2 * kv, hidden, True), "o": (hidden, q, False),
                 "gate_up": (2 * inter, hidden, False), "down": (hidden, inter, False)}
        for m in args.rows:
            for name, (n, k, bias) in gemms.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
                torch._dynamo.reset()
                tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
                start = time.perf_counter()
                out = tuned(x, w, b)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-2, atol=5e-2)
                ours = do_bench_cudagraph(partial(F.linear, x, w, b)) * 1e3
                theirs = do_bench_cudagraph(partial(tuned, x, w, b)) * 1e3
                print(f"| {model} | {name} | {m} x {n} x {k} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x | "
                      f"{seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
