"""What the first rollouts of a process cost: the e2e step's generation (8 prompts x 8 samples, 128 + 256 tokens),
called --calls times in one fresh process per variant, on a random-init model (configs/models/<name>.json).

    python bench/warmup.py                              # every variant, qwen2.5-0.5b
    python bench/warmup.py --variants default --lengths varying

Variants (each in its own process, so each pays its own compile):
- default: the engine as configured by default (torch.compile of the decode pieces, CUDA graphs, SDPA without
  cuDNN: rollout.api.ATTENTION_BACKENDS);
- cudnn: cuDNN's attention allowed too (the engine before it was left out; it builds an execution plan for every
  new attention shape);
- dynamic: the decode pieces compiled with dynamic=True (one compile with symbolic shapes instead of one per shape,
  then a recompile when dynamo sees a second shape);
- no-compile: CUDA graphs of the eager decode step;
- eager-prefill: the default with the prefill's blocks left eager (slots.COMPILE_PREFILL off): less to compile in
  the first rollout, a prefill of more launches in every rollout (see the prefill seconds per call).
Lengths: fixed (every response 256 tokens) or varying (stop ids drawn so the mean is ~100, as bench/ppo_step.py).
Each process gets empty Inductor and Triton caches (a machine's first run; --warm-cache shares the machine's).
Prints seconds per call, dynamo's compile time and its recompiles, and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("default", "cudnn", "dynamic", "no-compile", "eager-prefill")


def one_variant(model_name: str, variant: str, lengths: str, calls: int) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    import rollout.api as api
    import rollout.slots as slots
    from bench.rollout import build_model
    from rollout.native import NativeEngine, SamplingParams

    began = time.perf_counter()
    if variant == "cudnn":
        api.ATTENTION_BACKENDS.insert(0, SDPBackend.CUDNN_ATTENTION)
    if variant == "dynamic":
        slots.COMPILE_DYNAMIC = True
    if variant == "eager-prefill":
        slots.COMPILE_PREFILL = False
    model = build_model(model_name, torch.device("cuda"))
    engine = NativeEngine(model, pad_token_id=0, compile=variant != "no-compile")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    stops = []
    if lengths == "varying":
        sys.path.insert(0, str(ROOT / "bench"))
        from ppo_step import stop_ids

        stops = stop_ids(vocab)
    seconds, counts, prefill_s = [], [], []
    for call in range(calls):
        prompts = torch.randint(2, vocab, (8, 128), generator=gen).tolist()
        params = SamplingParams(n=8, max_new_tokens=256, temperature=1.0, stop_token_ids=tuple(stops))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params, torch.Generator(device="cuda").manual_seed(call))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        counts.append(int(out.response_mask.sum()))
        prefill_s.append(engine.stats.get("prefill_s"))
    from torch._dynamo.utils import counters

    return {"variant": variant, "lengths": lengths, "calls_s": seconds, "tokens": counts, "prefill_s": prefill_s,
            "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else None,
            "frames": dict(counters["frames"]), "total_s": time.perf_counter() - began,
            "compile_times": torch._dynamo.utils.compile_times(repr="str")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--lengths", nargs="+", default=["fixed", "varying"], choices=["fixed", "varying"])
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--warm-cache", action="store_true", help="use the machine's compile caches (a later run)")
    ap.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_variant(args.model, args.one[0], args.one[1], args.calls)), flush=True)
        return
    rows = []
    for lengths in args.lengths:
        for variant in args.variants:
            env = dict(os.environ)
            if not args.warm_cache:
                cold = f"/tmp/warmup_cache_{os.getpid()}_{variant}_{lengths}"
                env.update(TORCHINDUCTOR_CACHE_DIR=f"{cold}/inductor", TRITON_CACHE_DIR=f"{cold}/triton")
            proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--calls", str(args.calls),
                                   "--one", variant, lengths], cwd=ROOT, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(f"{variant} {lengths}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(line[0][7:])
            print(f"== {variant} {lengths}: calls {[round(s, 2) for s in r['calls_s']]} s, prefill "
                  f"{[round(s, 4) for s in r['prefill_s']]} s, tokens {r['tokens']}, recompiles {r['recompiles']}\n"
                  f"{r['compile_times']}", flush=True)
            rows.append(r)
    print("| lengths | variant | call 1 s | call 2 s | call 3 s | later calls s | dynamo recompiles |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        c = r["calls_s"]
        later = ", ".join(f"{x:.2f}" for x in c[3:]) or "-"
        cells = [f"{x:.2f}" for x in (c + [float("nan")] * 3)[:3]]
        print(f"| {r['lengths']} | {r['variant']} | " + " | ".join(cells) + f" | {later} | {r['recompiles']} |")


if __name__ == "__main__":
    main()
