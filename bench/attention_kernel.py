"""The decode step's attention kernel alone: microseconds per call of rollout/kernels.decode_attention_impl (rotary
embedding of the new query and key, their cache write, attention over each slot's live positions) at the e2e step's
and the rollout bench's shapes, and with --baseline FILE the same for another version of rollout/kernels.py (say the
kernels.py of a branch or an older commit: `git show REV:rollout/kernels.py > other_kernels.py`). CUDA-graph replays
timed by triton.testing.do_bench_cudagraph; the baseline's outputs and caches are checked against this tree's.

    python3 bench/attention_kernel.py [--batches 64 256] [--baseline other_kernels.py]

--device cpu runs the same plumbing through Triton's interpreter on tiny shapes (a check of this script, no timing
worth reading).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from functools import partial

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root: bench/rollout.py must not shadow the rollout package

# (name, query heads, key/value heads, head_dim, layers) of the benchmarks' models
MODELS = [("qwen2.5-0.5b", 14, 2, 64, 24), ("qwen2.5-1.5b", 12, 2, 128, 28)]
PROMPT, NEW = 128, 256  # the benchmarks' sequences: each slot's position drawn from [PROMPT, PROMPT + NEW)


def inputs(batch: int, heads: int, kv_heads: int, dim: int, device, generator):
    """q, k, v, caches [batch, kv_heads, PROMPT + NEW, dim] bfloat16, positions, their rotary rows, the length."""
    import torch

    bf16 = dict(dtype=torch.bfloat16, device=device)
    length = PROMPT + NEW
    q = torch.randn(batch, heads, dim, generator=generator, device=device).to(**bf16)
    k, v = (torch.randn(batch, kv_heads, dim, generator=generator, device=device).to(**bf16) for _ in range(2))
    caches = [torch.randn(batch, kv_heads, length, dim, generator=generator, device=device).to(**bf16)
              for _ in range(2)]
    pos = torch.randint(PROMPT, length, (batch,), generator=generator, device=device)
    inv_freq = 1e6 ** -(torch.arange(0, dim, 2, device=device).float() / dim)
    angles = pos.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, v, *caches, pos, angles.cos().to(**bf16), angles.sin().to(**bf16), length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--baseline", help="another rollout/kernels.py to time beside this one")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before rollout.kernels is imported
    import torch
    from sample_kernel import load_baseline

    from rollout import kernels

    device = torch.device(args.device)
    baseline = load_baseline(args.baseline) if args.baseline else None
    models = MODELS if device.type == "cuda" else [("tiny", 4, 2, 16, 2)]
    batches = args.batches if device.type == "cuda" else [3]
    print("| model | batch | this tree us | baseline us | baseline / this | per step (layers) us, this tree | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, heads, kv_heads, dim, layers in models:
        for batch in batches:
            generator = torch.Generator(device).manual_seed(batch)
            args_ = inputs(batch, heads, kv_heads, dim, device, generator)
            timings, results = [], []
            for module in [kernels] + ([baseline] if baseline else []):
                q, k, v, k_cache, v_cache, pos, cos, sin, length = args_
                caches = (k_cache.clone(), v_cache.clone())
                call = partial(module.decode_attention_impl, q, k, v, *caches, pos, cos, sin, length)
                results.append((call().float(), caches))
                if device.type == "cuda":
                    from triton.testing import do_bench_cudagraph

                    timings.append(do_bench_cudagraph(call, rep=200) * 1e3)
                else:
                    start = time.perf_counter()
                    call()
                    timings.append((time.perf_counter() - start) * 1e6)
            same = "-"
            if baseline:
                (mine, my_caches), (theirs, their_caches) = results
                same = "yes" if torch.allclose(mine, theirs, atol=2e-2, rtol=2e-2) and all(
                    torch.equal(a, b) for a, b in zip(my_caches, their_caches)) else "NO"
            other = f"{timings[1]:.1f}" if baseline else "-"
            ratio = f"{timings[1] / timings[0]:.2f}x" if baseline else "-"
            print(f"| {name} | {batch} | {timings[0]:.1f} | {other} | {ratio} | {timings[0] * layers:.0f} | {same} |",
                  flush=True)


if __name__ == "__main__":
    main()
