"""Launch settings of the decode step's two Triton kernels (rollout/kernels.py), timed one by one on a GPU: for the
attention kernel the positions' tile (BLOCK_T), warps, pipeline stages and programs per SM (how far the positions are
split); for the sampling kernel the vocabulary tile (BLOCK_V), warps and programs per SM. Each setting is set on the
module, timed by CUDA-graph replays (triton.testing.do_bench_cudagraph) at the benchmarks' shapes, and its outputs
checked against the module's defaults (attention within bfloat16 rounding; sampling: tokens equal, log-probs within
1e-4). Prints one markdown row per setting with the registers and spills of its compiled kernel, the defaults' row
first. What it does not cover: the sampling kernel is timed at temperature 1 without banned tokens only (the greedy
and the banned-token paths take the same settings untimed); the replays do not flush the L2 cache, so the logits
(19 MB at 64 rows) stay in it between replays, as in the decode step, where the LM head has just written them.

    python3 bench/kernel_sweep.py [--kernels attention sampling] [--batches 64 256]

--device cpu runs a few settings through Triton's interpreter on tiny shapes (a check of this script, no timing worth
reading).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import sys
import time
from functools import partial

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root: bench/rollout.py must not shadow the rollout package

ATTENTION = {"BLOCK_T": [32, 64, 128], "ATTENTION_WARPS": [2, 4, 8], "ATTENTION_STAGES": [2, 3],
             "ATTENTION_PROGRAMS_PER_SM": [2, 4, 8]}
SAMPLING = {"BLOCK_V": [512, 1024, 2048, 4096], "SAMPLE_WARPS": [4, 8, 16], "SAMPLE_PROGRAMS_PER_SM": [4, 8, 16]}


def settings(space: dict, cpu: bool):
    """Every combination of the space (on CPU the first two values of each name), as dicts."""
    names = list(space)
    values = [space[n][:2] if cpu else space[n] for n in names]
    return [dict(zip(names, combo)) for combo in itertools.product(*values)]


def timed(call, cuda: bool) -> float:
    if cuda:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(call, rep=100) * 1e3
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def forget_compiled(kernel) -> None:
    """Drop a jitted kernel's compiled variants from memory, so that the next call loads (or compiles) the one it
    uses anew and registers() reports that one (Triton's on-disk cache keeps a reload short)."""
    for device in (getattr(kernel, "device_caches", None) or {}).values():
        device[0].clear()


def registers(kernel) -> str:
    """'registers / spills' of the variant the last call used, after forget_compiled ('-': none, e.g. interpreted)."""
    variants = [k for device in (getattr(kernel, "device_caches", None) or {}).values() for k in device[0].values()]
    if not variants:
        return "-"
    return f"{getattr(variants[-1], 'n_regs', '?')} / {getattr(variants[-1], 'n_spills', '?')}"


def sweep(kernels, kernel, space: dict, make_call, check, label: str, cuda: bool) -> None:
    """Time make_call() under every setting of `space` set on the module (restored after), the defaults first;
    kernel: the module's jitted kernel whose compiled variant each row reports."""
    defaults = {name: getattr(kernels, name) for name in space}
    want = make_call()()
    rows = []
    for setting in [defaults] + [s for s in settings(space, not cuda) if s != defaults]:
        for name, value in setting.items():
            setattr(kernels, name, value)
        forget_compiled(kernel)
        try:
            call = make_call()
            ok = "yes" if check(call(), want) else "NO"
            regs = registers(kernel)
            us = timed(call, cuda)
            rows.append((us, setting, ok, regs))
        except Exception as error:  # a setting Triton cannot compile (too many registers or shared memory)
            rows.append((float("inf"), setting, f"failed: {type(error).__name__}", "-"))
        finally:
            for name, value in defaults.items():
                setattr(kernels, name, value)
    base = rows[0][0]
    for i, (us, setting, ok, regs) in enumerate(rows):
        shown = " ".join(f"{k}={v}" for k, v in setting.items())
        mark = " (defaults)" if i == 0 else ""
        print(f"| {label} | {shown}{mark} | {us:.1f} | {base / us:.2f}x | {regs} | {ok} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=["attention", "sampling"], choices=["attention", "sampling"])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before rollout.kernels is imported
    import torch
    from attention_kernel import MODELS, inputs
    from sample_kernel import VOCAB, sample_inputs

    from rollout import kernels, sample_kernels

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batches = args.batches if cuda else [3]
    print("| shape | setting | us per call | defaults / this | registers / spills | same |")
    print("| --- | --- | --- | --- | --- | --- |")
    if "attention" in args.kernels:
        for name, heads, kv_heads, dim, _layers in MODELS if cuda else [("tiny", 4, 2, 16, 2)]:
            for batch in batches:
                q, k, v, k_cache, v_cache, pos, cos, sin, length = inputs(
                    batch, heads, kv_heads, dim, device, torch.Generator(device).manual_seed(batch))

                def make_call(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, pos=pos, cos=cos, sin=sin,
                              length=length):
                    # the cache write is idempotent (the same k, v at pos), so the replays can share the caches
                    return partial(kernels.decode_attention_impl, q, k, v, k_cache, v_cache, pos, cos, sin, length)

                sweep(kernels, kernels._attend_split, ATTENTION, make_call,
                      lambda out, want: torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2),
                      f"attention {name} x {batch}", cuda)
    if "sampling" in args.kernels:
        vocab = VOCAB if cuda else 5000
        for rows in batches:
            logits, seed, keys, steps = sample_inputs(rows, vocab, device)

            def make_call(logits=logits, seed=seed, keys=keys, steps=steps):
                return partial(sample_kernels.sample_tokens_impl, logits, 1.0, seed, keys, steps, None, None)

            sweep(sample_kernels, sample_kernels._sample_chunk, SAMPLING, make_call,
                  lambda out, want: torch.equal(out[0], want[0]) and torch.allclose(out[1], want[1], atol=1e-4),
                  f"sampling {rows} x {vocab}", cuda)


if __name__ == "__main__":
    main()
