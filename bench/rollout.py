"""Rollout throughput: meshrl's native engine against HF `generate`, in the same process, on random-init models.

    python bench/rollout.py                       # Qwen2.5-0.5B and 1.5B shapes, 1 GPU
    python bench/rollout.py --models qwen2.5-0.5b --hf-prompts 128
    python bench/rollout.py --models qwen2.5-0.5b qwen3-0.6b --hf-prompts 64 --no-spread   # a family beside Qwen2.5
    python bench/rollout.py --models qwen2.5-1.5b qwen3-1.7b gemma-3-1b olmo2-1b qwen2.5-3b smollm3-3b phi-4-mini \
        qwen2.5-7b mistral-7b --hf-prompts 64 --no-spread                 # the families at their real shapes
    python bench/rollout.py --models qwen2.5-0.5b --top-p 0.9 --kernels torch triton   # top-p: sort against kernel
    python bench/rollout.py --models qwen2.5-0.5b --prompts 1024 --max-num-seqs 256 --hf-prompts 0   # 4x the slots
    python bench/rollout.py --models qwen2.5-1.5b --new 2048 --spread 256 4096 --hf-prompts 0 --partial 0.25
                                                  # long, ragged responses: the draining tail, and partial rollouts
    torchrun --nproc_per_node 2 bench/rollout.py --layout tp --hf-prompts 0   # one engine over 2 GPUs (TP=2)
    torchrun --nproc_per_node 2 bench/rollout.py --layout dp --hf-prompts 0   # 2 engines, half the prompts each

Models are built from configs/models/<name>.json (or a path to such a file) with random bf16 weights: weights do not
change speed. Runs per model:
- equal: --prompts random prompts of --prompt-len tokens, --new new tokens each, temperature 1, min_new_tokens =
  max_new_tokens so every response has the same length; HF `generate` (dynamic cache, SDPA) on the first
  --hf-prompts of the same prompts, same settings.
- spread: the same prompts, each with its own response length drawn uniformly from --spread LOW HIGH (forced through
  the per-prompt max_new_tokens, no stop tokens), so sequences finish at different steps. HF `generate` is not run
  here: a static batch runs every row to the longest, so its figure would be the equal run's times mean/max length.
- spread + partial (--partial TAIL): partial_stream below, the spread's lengths in a stream of calls that end at
  their tail and continue the unfinished sequences in the next call.
Each engine run is warmed up once with the same shapes first (torch.compile and CUDA-graph capture stay out of the
timed run: the engine is resident, so the timed call replays the warm-up's graphs, as a training run's rollouts after
the first do; --no-resident captures in every call). Tokens/s counts generated tokens only. The prefill
share is measured by a run with max_new_tokens = 1; per decode step = (time - prefill) / decode steps.
Under torchrun (several GPUs, or CPU processes over gloo): --layout tp shards the model's projections over the
ranks (parallel/tp.apply_tp) and runs one engine with the ranks in its tp group on all the prompts; --layout dp runs
one engine per rank on its share of the prompts (every world-th). Each timed call starts and ends at a barrier;
tokens/s counts the tokens of all ranks (dp) or of the one engine (tp). HF generate and --profile run on one process
only.
The last lines are a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel.tp import apply_tp  # noqa: E402
from rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rollout.partial import PartialRollouts  # noqa: E402
from rollout.slots import KERNEL_OPS  # noqa: E402

KERNEL_VARIANTS = {"torch": ("torch", frozenset()), "attention": ("triton", frozenset({"attention"})),
                   "triton": ("triton", KERNEL_OPS)}
COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on an H200 (../shared/BENCHMARKS.md)


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    path = Path(name) if name.endswith(".json") else ROOT / "configs" / "models" / f"{name}.json"
    fields = json.loads(path.read_text())
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


CUDA = torch.cuda.is_available()  # main() sets it from --device


def timed(fn):
    """(result, seconds, peak GiB allocated) of fn() on the current device; under torch.distributed from a barrier
    before it to one after it on every rank (the slowest rank's time)."""
    cuda = CUDA
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return result, time.perf_counter() - start, peak


def kv_bytes_per_token(config) -> int:
    """K and V of one token over every layer, bf16 (a sliding-window layer's too: at the bench's lengths, shorter
    than any window, every layer reads the whole context)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2


def floor_ms(model, batch: int, mean_context: float) -> float:
    """The memory-bound floor of one decode step: every weight read once plus the live KV cache, at copy bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = kv_bytes_per_token(model.config)
    return (weight_bytes + batch * mean_context * kv_per_token) / COPY_BANDWIDTH * 1e3


def bench_model(name: str, args, device: torch.device) -> list[dict]:
    model = build_model(name, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    rows = []
    world = dist.get_world_size() if dist.is_initialized() else 1
    share = slice(None)  # the prompts this rank's engine decodes
    tp_group = None
    if world > 1 and args.layout == "tp":
        mesh = init_device_mesh(device.type, (world,))
        apply_tp(model, mesh)
        tp_group = mesh.get_group()
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        print(f"[{name}] tp {world}: q_proj {tuple(q_proj.to_local().shape)} of {tuple(q_proj.shape)} per rank",
              flush=True)
    elif world > 1:
        share = slice(dist.get_rank(), None, world)

    def ours(engine: NativeEngine, params: SamplingParams, limits=None, label=""):
        seed = torch.Generator(device=device).manual_seed(0)
        mine = prompts[share]
        run = lambda: engine.generate(mine, params, seed, max_new_tokens=limits[share] if limits else None)
        start = time.perf_counter()
        run()  # warm-up: compiles the shapes this run meets
        print(f"[{name} {label}] warm-up {time.perf_counter() - start:.1f} s", flush=True)
        out, seconds, peak = timed(run)
        stats = dict(engine.stats)
        prefill_params = SamplingParams(max_new_tokens=1, temperature=params.temperature, top_k=params.top_k,
                                        top_p=params.top_p)
        prefill = lambda: engine.generate(mine, prefill_params, seed)
        prefill()  # warm-up: prefill-only shapes
        # the fastest of three: one slow call (0.41 s against 0.07 s, seen once on an H200) would make the decode
        # steps, the run's time less this, look several times faster than they are
        prefill_s = min(timed(prefill)[1] for _ in range(3))
        # on the device: NCCL reduces CUDA tensors only
        tokens = torch.tensor(int(out.response_mask.sum()), device=device)
        steps = torch.tensor(stats["decode_steps"], device=device)
        if world > 1 and tp_group is None:  # data parallel: every rank's engine decoded its own prompts
            dist.all_reduce(tokens)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # the slowest rank's count of steps
        tokens = int(tokens)
        step_ms = (seconds - prefill_s) / max(int(steps), 1) * 1e3
        print(f"[{name} {label}] {tokens} tokens in {seconds:.2f} s (prefill {prefill_s:.2f} s), "
              f"{step_ms:.2f} ms/step, stats {stats}", flush=True)
        return tokens, seconds, peak, prefill_s, step_ms, stats

    def slots_note(stats: dict) -> str:  # continuous batching: more sequences than slots; the ranks' layout
        note = f", {stats['slots']} slots" if stats["slots"] < len(prompts[share]) else ""
        note += f", top-k {args.top_k}" if args.top_k else ""
        note += f", top-p {args.top_p}" if args.top_p < 1 else ""
        return note + (f", {args.layout} {world}" if world > 1 else "")

    new = args.new
    cut = dict(top_k=args.top_k, top_p=args.top_p)
    equal = SamplingParams(max_new_tokens=new, temperature=1.0, min_new_tokens=new, **cut)
    mean_context = args.prompt_len + new / 2
    variant_rows = []
    if args.spread:  # the same lengths for every variant
        low, high = args.spread
        limits = torch.randint(low, high + 1, (args.prompts,), generator=gen).tolist()
    for variant in args.kernels:
        torch._dynamo.reset()  # each variant's compiled pieces are new code: no recompile limit across variants
        decode_kernels, ops = KERNEL_VARIANTS[variant]
        engine = NativeEngine(model, pad_token_id=0, cuda_graphs=not args.no_graphs, compile=not args.no_compile,
                              tp_group=tp_group,
                              fused_projections=not args.no_fused, decode_kernels=decode_kernels, kernel_ops=ops,
                              max_num_seqs=args.max_num_seqs, resident=not args.no_resident)
        engine.slots.admit_min_free = args.admit_min_free
        if args.no_prefill_graphs:
            engine.slots.pad_prefills = False
        if engine.fallback_reason is not None:
            raise SystemExit(f"{name}: the slot engine does not run this model: {engine.fallback_reason}")
        if args.profile:
            profile_decode(engine, prompts, label=variant)
            profile_prefill(engine, prompts[:8], n=8)
        tokens, seconds, peak, prefill_s, step_ms, stats = ours(engine, equal, label=f"equal, kernels {variant}")
        variant_rows.append(dict(
            model=name, run=f"equal {args.prompts}x({args.prompt_len}+{new}){slots_note(stats)}", kernels=variant,
            tokens=tokens,
            ours_s=seconds, ours_tps=tokens / seconds, peak_gib=peak, prefill_s=prefill_s, step_ms=step_ms,
            floor_ms=floor_ms(model, min(args.prompts, stats["slots"]), mean_context) if world == 1 else None,
            kv_kib=kv_bytes_per_token(model.config) / 1024,
            params_b=sum(p.numel() for p in model.parameters()) / 1e9,
            graphs=stats["graphs"]))
        if args.spread:
            spread = SamplingParams(max_new_tokens=high, temperature=1.0, **cut)
            tokens, seconds, peak, prefill_s, step_ms, stats = ours(engine, spread, limits,
                                                                    label=f"spread, kernels {variant}")
            variant_rows.append(dict(
                model=name, run=f"spread {args.prompts}x({args.prompt_len}+{low}..{high}){slots_note(stats)}",
                kernels=variant,
                tokens=tokens, ours_s=seconds, ours_tps=tokens / seconds, peak_gib=peak, prefill_s=prefill_s,
                step_ms=step_ms, graphs=stats["graphs"]))
        if args.spread and args.partial:
            got = partial_stream(engine, prompts[share], low, high, args, cut, device, gen)
            variant_rows.append(dict(
                model=name, run=f"spread {args.prompts}x({args.prompt_len}+{low}..{high}) + partial {args.partial}: "
                f"{args.partial_steps - 2} calls, {got.pop('continued'):.0f} continued per call{slots_note(stats)}",
                kernels=variant, **got))
            equal_tps = next(r["ours_tps"] for r in variant_rows
                             if r["run"].startswith("equal") and r["kernels"] == variant)
            spread_tps = variant_rows[-2]["ours_tps"]
            print(f"[{name} partial {args.partial}] {got['ours_tps']:,.0f} tokens/s: "
                  f"{got['ours_tps'] / equal_tps:.3f}x the equal run, {got['ours_tps'] / spread_tps:.3f}x the spread "
                  "run without", flush=True)

    if args.hf_prompts > 0:
        ids = torch.tensor(prompts[: args.hf_prompts], device=device)
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=args.top_k,
                      top_p=args.top_p, pad_token_id=0)
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
        out, hf_s, hf_peak = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs))
        hf_tokens = (out.shape[1] - args.prompt_len) * out.shape[0]
        print(f"[{name} hf] {hf_tokens} tokens in {hf_s:.2f} s", flush=True)
        for r in variant_rows:
            if r["run"].startswith("equal"):
                r.update(hf=f"{args.hf_prompts} prompts", hf_tps=hf_tokens / hf_s, hf_peak_gib=hf_peak)
    return rows + variant_rows


def all_reduce_sum(value: int, device: torch.device) -> int:
    t = torch.tensor(value, device=device)
    dist.all_reduce(t)
    return int(t)


def partial_stream(engine: NativeEngine, prompts: list[list[int]], low: int, high: int, args, cut: dict,
                   device: torch.device, gen: torch.Generator) -> dict:
    """--partial TAIL: a training run's rollouts with partial rollouts, --partial-steps calls in a row, through
    rollout/partial.PartialRollouts as the trainer uses it (one sample per prompt here). Each call takes every prompt
    afresh with its own length drawn from [low, high] (its budget: forced, as the spread run's, since nothing stops
    a random model) and, first, what the call before left unfinished (prefilled again, the rest of its budget as its
    limit; those at --partial-staleness calls of age among the call's first sequences). Each call returns once fewer
    than TAIL of the slots still decode (SamplingParams.tail_share). Tokens/s over the calls after the first two
    (which meet the new shapes: compiles and captures)."""
    carry = PartialRollouts(1, high, args.partial_staleness)
    seed = torch.Generator(device=device).manual_seed(0)
    tokens = seconds = prefill_s = decode_s = decode_steps = continued = 0
    peak = 0.0
    for step in range(args.partial_steps):
        targets = torch.randint(low, high + 1, (len(prompts),), generator=gen).tolist()
        call = carry.call(list(enumerate(prompts)), step, limits=targets)
        params = SamplingParams(max_new_tokens=high, temperature=1.0, tail_share=args.partial,
                                finish_first=call.finish_first, **cut)
        out, took, call_peak = timed(partial(engine.generate, call.prompts, params, seed, max_new_tokens=call.limits))
        lengths = out.response_mask.sum(-1).tolist()
        _, counts = carry.collect(call, out, step)
        stats = engine.stats
        print(f"[partial {args.partial}] call {step}: {len(call.prompts)} sequences ({counts['continued']:.0f} "
              f"continued, {call.finish_first} to end), {sum(lengths)} tokens in {took:.2f} s, "
              f"{counts['unfinished']:.0f} left unfinished; prefill {stats['prefill_s']:.3f} s, decode "
              f"{stats['decode_s']:.3f} s in {stats['decode_steps']} steps", flush=True)
        if step >= 2:
            tokens += sum(lengths)
            seconds += took
            prefill_s += stats["prefill_s"]
            decode_s += stats["decode_s"]
            decode_steps += stats["decode_steps"]
            continued += counts["continued"]
            peak = max(peak, call_peak)
    if dist.is_initialized() and engine.tp_group is None:  # data parallel: every rank's engine decoded its own
        tokens = int(all_reduce_sum(tokens, device))
    timed_calls = max(args.partial_steps - 2, 1)
    return dict(tokens=tokens, ours_s=seconds, ours_tps=tokens / max(seconds, 1e-9), peak_gib=peak,
                prefill_s=prefill_s / timed_calls, step_ms=decode_s / max(decode_steps, 1) * 1e3,
                continued=continued / timed_calls, graphs=engine.stats["graphs"])


def profile_decode(engine: NativeEngine, prompts: list[list[int]], steps: int = 32, label: str = "") -> None:
    """Print the GPU time of one decode step by kernel, from eager (graph-free) steps under the profiler: the
    difference between a run of steps + 2 tokens and one of 2 tokens, so prefill and set-up cancel out."""
    graphs = engine.slots.cuda_graphs
    engine.slots.cuda_graphs = False
    per_kernel = {}
    for sign, new in ((1, steps + 2), (-1, 2)):
        params = SamplingParams(max_new_tokens=new, temperature=1.0, min_new_tokens=new)
        engine.generate(prompts, params)  # warm-up
        activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else None
        with torch.profiler.profile(activities=[activity or torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, params)
        for event in prof.key_averages():
            if event.self_device_time_total > 0:
                time_us, count = per_kernel.get(event.key, (0.0, 0))
                per_kernel[event.key] = (time_us + sign * event.self_device_time_total, count + sign * event.count)
    engine.slots.cuda_graphs = graphs
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    total = sum(t for t, _ in per_kernel.values()) / steps
    launches = sum(c for _, c in per_kernel.values()) / steps
    print(f"decode step ({label}), GPU time by kernel (eager, {steps} steps): {total / 1e3:.3f} ms in {launches:.0f} "
          "kernels")
    for key, (time_us, count) in rows[:25]:
        print(f"  {time_us / steps:8.1f} us  x{count / steps:5.1f}  {key[:110]}")


def profile_prefill(engine: NativeEngine, prompts: list[list[int]], n: int) -> None:
    """Print one prefill's wall time and GPU time by kernel (the e2e step's shape: 8 prompts x 8 samples), from a
    call with max_new_tokens 1 (prefill and the first token only) under the profiler."""
    params = SamplingParams(max_new_tokens=1, temperature=1.0, n=n)
    engine.generate(prompts, params)  # warm-up
    _, seconds, _ = timed(lambda: engine.generate(prompts, params))
    activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else None
    with torch.profiler.profile(activities=[activity or torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, params)
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows)
    print(f"prefill of {len(prompts)} prompts x {n}: {seconds * 1e3:.2f} ms wall, {total / 1e3:.2f} ms GPU in "
          f"{sum(e.count for e in rows)} kernels, engine stats {engine.stats}")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"  {e.self_device_time_total:8.1f} us  x{e.count:4d}  {e.key[:110]}")


def table(rows: list[dict]) -> str:
    head = ("| model | run | kernels | tokens | ours tok/s | HF generate tok/s | ratio | ours peak GiB | HF peak GiB "
            "| prefill s | ms/decode step | floor ms/step | step / floor | params B | KV KiB/token | graphs |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        hf, floor = r.get("hf_tps"), r.get("floor_ms")
        cells = [
            r["model"], r["run"], r["kernels"], str(r["tokens"]), f"{r['ours_tps']:,.0f}",
            f"{hf:,.0f} ({r['hf']})" if hf else "not run",
            f"{r['ours_tps'] / hf:.1f}x" if hf else "-",
            f"{r['peak_gib']:.2f}",
            f"{r['hf_peak_gib']:.2f}" if hf else "-",
            f"{r['prefill_s']:.3f}", f"{r['step_ms']:.2f}",
            f"{floor:.2f}" if floor else "-",
            f"{r['step_ms'] / floor:.2f}x" if floor else "-",
            f"{r['params_b']:.2f}" if r.get("params_b") else "-",
            f"{r['kv_kib']:.0f}" if r.get("kv_kib") else "-",
            str(r["graphs"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--hf-prompts", type=int, default=256, help="prompts for HF generate; 0 skips it")
    parser.add_argument("--spread", type=int, nargs=2, default=[32, 512], metavar=("LOW", "HIGH"))
    parser.add_argument("--no-spread", dest="spread", action="store_const", const=None)
    parser.add_argument("--top-k", type=int, default=0, help="sampling's top-k (0: off), every run")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling's top-p (1: off), every run")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="slots (rollout.max_num_seqs): with more prompts, finished sequences free slots for "
                             "waiting ones (continuous batching)")
    parser.add_argument("--admit-min-free", type=int, default=None,
                        help="with sequences decoding, admit waiting ones only when this many slots are free "
                             "(default: the engine's: with prefill graphs the samples per prompt, else an eighth of "
                             "the slots)")
    parser.add_argument("--partial", type=float, default=None, metavar="TAIL",
                        help="after the spread run, a stream of calls with partial rollouts ending at this share of "
                             "the slots (rollout.partial_tail); tokens/s against the equal and spread runs")
    parser.add_argument("--partial-steps", type=int, default=6, help="--partial: calls in the stream (2 warm up)")
    parser.add_argument("--partial-staleness", type=int, default=1,
                        help="--partial: calls a continued sequence may span before it must end "
                             "(rollout.partial_max_staleness)")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-prefill-graphs", action="store_true",
                        help="launch every prefill op by op (by default a small one replays a CUDA graph)")
    parser.add_argument("--no-fused", action="store_true",
                        help="separate q/k/v and gate/up GEMMs (rollout.fused_projections false)")
    parser.add_argument("--no-resident", action="store_true",
                        help="a new cache and graphs in every call (rollout.resident false): the timed call captures")
    parser.add_argument("--profile", action="store_true", help="print a decode step's GPU time by kernel first")
    parser.add_argument("--kernels", nargs="+", default=["triton"], choices=list(KERNEL_VARIANTS),
                        help="decode kernels, one engine run each: torch (SDPA, sampling.py), attention (the Triton "
                             "attention only), triton (attention and sampling: the default where Triton runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layout", choices=["tp", "dp"], default="tp",
                        help="under torchrun: one engine over the ranks (tp) or one per rank (dp)")
    args = parser.parse_args()
    device = torch.device(args.device)
    global CUDA
    CUDA = device.type == "cuda"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if args.hf_prompts or args.profile:
            parser.error("under torchrun pass --hf-prompts 0 and no --profile (they run on one process)")
        if args.prompts < int(os.environ["WORLD_SIZE"]):
            parser.error(f"--prompts {args.prompts}: fewer than the {os.environ['WORLD_SIZE']} ranks")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if dist.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows = []
    for model in args.models:
        try:
            rows += bench_model(model, args, device)
        except (Exception, SystemExit) as err:  # one model's failure (a fallback, an error) leaves the others' rows
            if len(args.models) == 1:
                raise
            print(f"[{model}] FAILED: {type(err).__name__}: {err}", flush=True)
            import traceback

            traceback.print_exc()
        gc.collect()  # the last model's engine and weights (reference cycles) before the next model's peak
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model's cache blocks, before the next model's peak is measured
    print(table(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
