"""The decode step's sampling kernel alone on a GPU: microseconds per call of rollout/sample_kernels.sample_tokens_impl
over bfloat16 logits [rows, 151936] (Qwen2.5's vocabulary) at the engine's batch sizes, for several chunk counts (the
programs per row), against the PyTorch form of the same draw (rollout/sampling.sample_with_noise) and, with
--baseline FILE, another version of the kernel: rollout/sample_kernels.py, or rollout/kernels.py before the sampling
kernel moved out of it (say `git show REV:rollout/kernels.py > old_kernels.py`).
CUDA-graph replays timed by triton.testing.do_bench_cudagraph; every variant's tokens checked against the PyTorch
form's.

    python3 bench/sample_kernel.py [--rows 64 256] [--chunks 0 4 8 16] [--baseline old_kernels.py]
    python3 bench/sample_kernel.py --top-p 0.9 --chunks 0    # top-p: the kernel's rounds against the sort
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
from functools import partial

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from rollout import sample_kernels  # noqa: E402
from rollout.sampling import gumbel_noise, sample_with_noise  # noqa: E402

VOCAB = 151936


def load_baseline(path: str):
    """Another kernels.py as a module; its operators renamed so they do not clash with ours."""
    source = pathlib.Path(path).read_text().replace('"meshrl::', '"baseline::')
    spec = importlib.util.spec_from_loader("baseline_kernels", loader=None)
    module = importlib.util.module_from_spec(spec)
    # Triton reads a jitted function's source from its file: write the renamed copy beside the original
    copy = pathlib.Path(path).with_name("_baseline_kernels.py")
    copy.write_text(source)
    module.__file__ = str(copy)
    exec(compile(source, str(copy), "exec"), module.__dict__)
    return module


def torch_form(logits, temperature, seed, keys, steps, top_k=0, top_p=1.0):
    noise = gumbel_noise(seed, keys, steps, logits.shape[1]) if temperature > 0 else None
    return sample_with_noise(logits, temperature, top_k, top_p, None, noise)


def sample_inputs(rows: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """bfloat16 logits [rows, vocab] (a spread of ~3 per token, seeded by rows) and the noise's seed, keys, steps."""
    gen = torch.Generator(device).manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen, device=device) * 3).bfloat16()
    seed = torch.tensor([123], dtype=torch.int32, device=device)
    return logits, seed, torch.arange(rows, device=device), torch.full((rows,), 7, device=device)


def bench_rows(rows: int, args, baseline, device) -> None:
    from triton.testing import do_bench_cudagraph

    logits, seed, keys, steps = sample_inputs(rows, VOCAB, device)
    inputs = (logits, args.temperature, seed, keys, steps)
    # only when set: a --baseline kernels.py from before top-k / top-p takes no such arguments
    cut = {name: value for name, value, off in (("top_k", args.top_k, 0), ("top_p", args.top_p, 1.0)) if value != off}
    want = torch_form(*inputs, **cut)[0]
    base_us = do_bench_cudagraph(partial(torch_form, *inputs, **cut), rep=200) * 1e3
    print(f"| {rows} | PyTorch form | - | {base_us:.1f} | 1.00x |", flush=True)
    for label, module in [("this tree", sample_kernels)] + ([("baseline", baseline)] if baseline else []):
        for chunks in args.chunks:
            fn = partial(module.sample_tokens_impl, *inputs, None, None, chunks, **cut)
            same = "" if torch.equal(fn()[0], want) else " (TOKENS DIFFER)"
            # the kernel's own count (an older kernels.py: two programs per SM)
            programs = module._programs(device) * getattr(module, "SAMPLE_PROGRAMS_PER_SM", 2) // 2
            shown = f"{chunks}" if chunks else f"{module.sample_chunks(rows, VOCAB, programs)} (auto)"
            us = do_bench_cudagraph(fn, rep=200) * 1e3
            print(f"| {rows} | {label}{same} | {shown} | {us:.1f} | {base_us / us:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4, 8, 16],
                        help="chunks per row (0: the kernel's own count)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--baseline", help="another rollout/kernels.py to time beside this one")
    args = parser.parse_args()
    device = torch.device("cuda")
    baseline = load_baseline(args.baseline) if args.baseline else None
    print("| rows | variant | chunks | us per call | vs PyTorch form |")
    print("| --- | --- | --- | --- | --- |")
    for rows in args.rows:
        bench_rows(rows, args, baseline, device)


if __name__ == "__main__":
    main()
