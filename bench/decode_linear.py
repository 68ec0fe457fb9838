"""The decode step's GEMMs alone, one GPU: rollout/kernels.gate_up_silu against cuBLAS + torch.compile, and the
q/k/v GEMM with its bias in cuBLAS's epilogue or added after.

    python bench/decode_linear.py                         # Qwen2.5-0.5B and 1.5B shapes, 16..256 rows
    python bench/decode_linear.py --sweep                 # also every tile setting, to check mlp_tiles's pick

Shapes from configs/models/<name>.json. MLP: gate/up stacked [2 I, hidden]; "compiled" is what the engine ran before
(torch.compile of F.linear then silu(gate) * up: a cuBLAS GEMM and one fused pointwise kernel). q/k/v: stacked
[(H + 2 KVH) D, hidden] with its bias, F.linear(x, w, b) against F.linear(x, w) + b under torch.compile. Times are
CUDA-graph replays (triton.testing.do_bench_cudagraph, median), launch overhead out as in the engine's graphs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout import kernels  # noqa: E402


def silu_mul(x, w):
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_then_bias(x, w, b):
    return F.linear(x, w) + b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    from triton.testing import do_bench_cudagraph as bench

    dev = torch.device("cuda")
    programs = kernels._programs(dev)
    compiled_mlp = torch.compile(silu_mul, dynamic=False)
    compiled_bias = torch.compile(linear_then_bias, dynamic=False)
    lines = []
    for name in args.models:
        c = json.loads((ROOT / "configs" / "models" / f"{name}.json").read_text())
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        qkv_rows = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * (hidden // c["num_attention_heads"])
        w = torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device=dev) * 0.02
        wq = torch.randn(qkv_rows, hidden, dtype=torch.bfloat16, device=dev) * 0.02
        bq = torch.randn(qkv_rows, dtype=torch.bfloat16, device=dev)
        for m in args.rows:
            x = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev)
            ref = silu_mul(x, w).float()
            err = ((kernels.gate_up_silu_impl(x, w).float() - ref).abs().max() / ref.abs().max()).item()
            t_compiled = bench(lambda x=x, w=w: compiled_mlp(x, w)) * 1e3
            picked = kernels.mlp_tiles(m, inter, programs)
            t_kernel = bench(lambda x=x, w=w: kernels.gate_up_silu_impl(x, w)) * 1e3
            best = (t_kernel, picked)
            if args.sweep:
                for bn, bk, stages in itertools.product((16, 32, 64, 128), (32, 64, 128), (3, 4)):
                    tiles = kernels.MLPTiles(picked.block_m, bn, bk, 4, stages)
                    try:
                        t = bench(lambda x=x, w=w, tiles=tiles: kernels.gate_up_silu_impl(x, w, tiles)) * 1e3
                    except Exception as e:  # a tile the GPU cannot hold
                        print(f"  {tuple(tiles)}: {type(e).__name__}", flush=True)
                        continue
                    print(f"  {name} M={m} {tuple(tiles)}: {t:.2f} us", flush=True)
                    best = min(best, (t, tiles), key=lambda p: p[0])
            t_bias = bench(lambda x=x, wq=wq, bq=bq: F.linear(x, wq, bq)) * 1e3
            t_after = bench(lambda x=x, wq=wq, bq=bq: compiled_bias(x, wq, bq)) * 1e3
            t_nobias = bench(lambda x=x, wq=wq: F.linear(x, wq)) * 1e3
            row = dict(model=name, m=m, mlp_compiled_us=t_compiled, mlp_kernel_us=t_kernel, tiles=list(picked),
                       best_us=best[0], best=list(best[1]), rel_err=err, qkv_bias_us=t_bias,
                       qkv_bias_after_us=t_after, qkv_no_bias_us=t_nobias)
            print(json.dumps(row), flush=True)
            lines.append(f"| {name} | {m} | {t_compiled:.2f} | {t_kernel:.2f} | {t_compiled / t_kernel:.2f}x | "
                         f"{best[0]:.2f} {tuple(best[1])[1:3]} | {t_bias:.2f} | {t_after:.2f} | {t_nobias:.2f} |")
    print("| model | rows | gate/up GEMM + SiLU x up, compiled us | gate_up_silu us | ratio | best tile us (N, K) | "
          "q/k/v with bias us | bias added after us | no bias us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
