"""LoRA GRPO step on one GPU (issue 39): meshrl with `actor.lora` beside TRL's GRPOTrainer with the same peft LoRA
(HF generate, and vLLM colocate), meshrl's LoRA on its embedded vLLM engine, full fine-tuning beside LoRA (peak
memory), and the cost of the merge the native engine decodes with.

    python bench/lora_step.py --models qwen2.5-7b --systems meshrl-lora trl-lora -- actor.micro_batch_tokens=8192
    python bench/lora_step.py --models qwen2.5-7b --systems meshrl-lora meshrl-lora-vllm trl-vllm-lora --steps 5 \
        --trl-steps 5 --json lora7b_vllm.json -- actor.micro_batch_tokens=8192     # vLLM: the ../shared/vllm bundle
    python bench/lora_step.py --report a.json b.json            # one table of results saved with --json
    python bench/lora_step.py --models qwen2.5-0.5b qwen2.5-1.5b --systems meshrl-full meshrl-lora
    python bench/lora_step.py --merge qwen2.5-7b            # the merge per rollout, timed alone
    python bench/lora_step.py --models qwen2.5-7b --plan    # the planner's figures for the same runs (CPU, no weights)
    python bench/lora_step.py --device cpu --models tiny.json --systems meshrl-lora --steps 2   # CPU smoke

The work is bench/ppo_step.py's fixed shape (8 prompts x 8 samples, 128 prompt tokens, 256 new tokens, fixed
lengths, beta 0, one optimizer step per rollout, random bf16 weights from configs/models/<name>.json); its functions
run meshrl (train_ppo.py in its own process), build the prompts and give TRL's batch arguments. The model folder is
written from weights made on the GPU (a 7B model's random init on the CPU takes minutes). LoRA: rank --rank, alpha
2 x rank, dropout 0, every linear layer of the decoder blocks (meshrl's `all-linear`, peft's "all-linear"), in every
LoRA system.
- meshrl-full / meshrl-lora: the whole model trains / actor.lora.rank=--rank; actor.micro_batch_tokens as
  ppo_step.py's default (the whole step in one forward) unless a key=value override says otherwise. Peak GiB is
  torch.cuda.max_memory_allocated over the run (perf/max_memory_allocated_gb), device GiB NVML's used memory
  (perf/gpu_memory_used_gb, the largest sample).
- meshrl-lora-vllm: meshrl-lora with rollout.engine=vllm rollout.gpu_memory_utilization=VLLM_SHARE (0.3, as
  ppo_step.py's meshrl-vllm): one embedded vLLM engine in the actor's process, colocated, sleeping between rollouts
  (rollout.vllm_sleep_level 1, the default), sent the merged weights (B @ A x scaling added to the gathered base)
  at every sync under the plain model's names.
- trl-lora: TRL's GRPOTrainer with peft_config=LoraConfig(...), generation through HF `generate` (use_vllm=False),
  TRL's defaults otherwise (gradient checkpointing on, per_device_train_batch_size 64 = the step in one batch,
  ppo_step.trl_batch_args of the fixed shape); peak GiB = torch.cuda.max_memory_allocated at the end of training.
- trl-vllm-lora: trl-lora's run with use_vllm=True, vllm_mode="colocate" (ppo_step.py's trl-vllm settings: no sleep
  mode, vLLM's context inferred from the model config), vllm_gpu_memory_utilization=VLLM_SHARE. TRL 1.16 syncs a
  peft model into its vLLM before each generation by merge_adapter(), the base weights read under their plain names
  (peft's prefix and `.base_layer` dropped, the lora_ tensors skipped), then unmerge_adapter(). vLLM's weights and
  KV cache go through PyTorch's allocator here (no sleep mode), so its peak GiB includes the engine's share; device
  GiB is the largest total - free (torch.cuda.mem_get_info) seen at a step's end.
- With --device cpu the vLLM systems are skipped (vLLM needs a GPU; their rows say so); the others run as a smoke.
- --merge NAME: the model in float32 on the GPU, peft LoRA applied by roles/lora.apply_lora (base cast to bf16),
  FSDP2 on one rank as parallel/fsdp.shard_model does it; then, timed with CUDA syncs: the unshard + reshard alone
  (what a rollout without LoRA pays), and `Adapters.merged()` entered and left (unshard, B @ A added in float32 into
  every adapted weight, reshard): the difference is the merge's cost per rollout.
The last lines are markdown tables for bench/RESULTS.md; the step table's ratios are meshrl-lora's, trl-vllm-lora's
and trl-lora's steady s/step over the row's (above 1: the row is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load_ppo_step():
    """bench/ppo_step.py as a module (bench/ is no package, and bench/rollout.py would shadow the rollout package if
    bench/ were on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ppo_step", ROOT / "bench" / "ppo_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ps = _load_ppo_step()

STEP_TOKENS = ps.PROMPTS * ps.SAMPLES * (ps.PROMPT_LEN + ps.NEW_TOKENS)
SYSTEMS = ["meshrl-full", "meshrl-lora", "meshrl-lora-vllm", "trl-lora", "trl-vllm-lora"]
VLLM_SYSTEMS = {"meshrl-lora-vllm", "trl-vllm-lora"}
# vLLM's share of the GPU in both vLLM systems (ppo_step.py's meshrl-vllm and trl-vllm use it too). At the 7B shape on
# a 141 GB H200: 0.3 x 139.8 GiB = 42 GiB holds vLLM's bf16 copy (14.2 GiB) and ~25 GiB of KV cache and graphs, far
# more than the step's 64 x 384 tokens need (1.3 GiB at 56 KiB/token), and leaves ~98 GiB to training, whose peak
# was 47.6 GiB allocated for trl-lora (HF generate's cache included) and 67.9 GiB for meshrl-lora with its native
# engine (micro-batch 8192); TRL keeps vLLM resident while it trains (no sleep mode), meshrl's engine sleeps.
VLLM_SHARE = 0.3
VLLM_OVERRIDES = ["rollout.engine=vllm", f"rollout.gpu_memory_utilization={VLLM_SHARE}"]
CPU_SKIP = "vLLM runs on GPUs only (rollout.engine=vllm / TRL's use_vllm)"


def meshrl_overrides(system: str, rank: int, extra: list[str], step_tokens: int | None = STEP_TOKENS) -> list[str]:
    """The key=value overrides of a meshrl system's run: the bench's micro-batch budget (the whole step, None: none),
    the LoRA of the -lora systems, vLLM for -vllm; a key in `extra` wins over the bench's and comes last."""
    out = [f"actor.micro_batch_tokens={step_tokens}"] if step_tokens else []
    if system in ("meshrl-lora", "meshrl-lora-vllm"):
        out += [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}"]
    if system == "meshrl-lora-vllm":
        out += VLLM_OVERRIDES
    mine = {e.split("=", 1)[0].strip() for e in extra}
    return [o for o in out if o.split("=", 1)[0] not in mine] + list(extra)


def config_path(name: str) -> Path:
    return Path(name) if name.endswith(".json") else ROOT / "configs" / "models" / f"{name}.json"


def build_assets(name: str, workdir: Path, device: str) -> Path:
    """ppo_step.build_assets' folder (model, word-level tokenizer, prompts, reward module), the weights made on
    `device` (random init on a GPU: seconds at 7B)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    path = config_path(name)
    model_dir = workdir / f"model_{path.stem}"
    if not (model_dir / "config.json").exists():
        began = time.time()
        config = AutoConfig.for_model(**json.loads(path.read_text()))
        vocab = config.vocab_size
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
        model.config.eos_token_id, model.config.pad_token_id = 1, 0
        model.save_pretrained(model_dir)
        del model
        tok = Tokenizer(models.WordLevel({ps.word(i): i for i in range(vocab)}, unk_token=ps.word(0)))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ps.word(1), pad_token=ps.word(0),
                                       unk_token=ps.word(0))
        fast.save_pretrained(ps.tokenizer_dir(model_dir))
        fast.save_pretrained(model_dir)
        print(f"[{name}] model folder written in {time.time() - began:.0f} s", flush=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    data = workdir / f"prompts_{vocab}.jsonl"
    if not data.exists():
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(2, vocab, (64, ps.PROMPT_LEN), generator=gen).tolist()
        data.write_text("".join(json.dumps({"prompt": " ".join(ps.word(i) for i in row), "ground_truth": ""}) + "\n"
                                for row in ids))
    (workdir / "bench_reward.py").write_text(ps.REWARD_MODULE)
    return model_dir


# ------------------------------------------------------------------------------------------------- TRL + peft
def trl_args(vllm: bool, device: str = "cuda") -> dict:
    """GRPOConfig's run arguments beside the output folder and cpu/bf16 flags: ppo_step.trl_batch_args of the fixed
    shape (the 64 samples in one micro-batch, TRL's default gradient checkpointing), ppo_step.py's trl settings (lr,
    beta, temperature, no sleep mode), HF generate or vLLM colocate with VLLM_SHARE of the GPU."""
    batch = ps.trl_batch_args(ps.shape_of("fixed", device))
    batch["vllm_gpu_memory_utilization"] = VLLM_SHARE
    return dict(temperature=1.0, beta=0.0, learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no",
                use_vllm=vllm, vllm_mode="colocate", vllm_enable_sleep_mode=False, dataloader_num_workers=0, seed=0,
                **batch)


def trl_worker(spec: dict) -> None:
    """One TRL GRPOTrainer run with a peft LoRA in this process, generating with HF generate or (spec["vllm"]) vLLM
    colocate; writes step times and peak memory to spec["out"]."""
    t0 = time.time()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29518")):
        os.environ.setdefault(key, value)
    sys.path.insert(0, spec["workdir"])
    import bench_reward
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    label = "trl-vllm-lora" if spec["vllm"] else "trl-lora"
    times, first, clock = ps.trl_step_clock(t0, label, log=spec["out"] + ".steps")
    cuda = torch.cuda.is_available()
    device_used: list[float] = []  # the whole device's used GiB at each step's end (vLLM's share included)

    class DeviceUsed(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                free, total = torch.cuda.mem_get_info()
                device_used.append((total - free) / 2**30)

    name = "trl_vllm_lora_out" if spec["vllm"] else "trl_lora_out"
    args = GRPOConfig(output_dir=str(Path(spec["workdir"]) / name), bf16=cuda, use_cpu=not cuda,
                      max_steps=spec["steps"], **trl_args(spec["vllm"], "cuda" if cuda else "cpu"))
    rank = spec["rank"]
    peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM", bias="none")
    data = load_dataset("json", data_files=spec["data"], split="train")
    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=bench_reward.trl_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[clock, DeviceUsed()], peft_config=peft_config)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    Path(spec["out"]).write_text(json.dumps({
        "steps": times, "start_s": first[0] if first else None,
        "response_len": statistics.mean(lengths) if lengths else None,
        "memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "trainable": trainable,
        "gpu_memory_used_gb": max(device_used) if device_used else None,
        "gradient_checkpointing": args.gradient_checkpointing, "use_vllm": spec["vllm"],
        "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization if spec["vllm"] else None}))


def run_trl(model_dir: Path, workdir: Path, steps: int, rank: int, vllm: bool = False,
            timeout_s: float | None = None) -> dict:
    """TRL's run in its own process; past timeout_s it is stopped and the steps it ended are its result (more than 3
    of them: ps.cut_short)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out = workdir / f"trl_{'vllm_' if vllm else ''}lora_{model_dir.name}.json"
    steps_log = Path(f"{out}.steps")
    for stale in (out, steps_log):
        stale.unlink(missing_ok=True)
    spec = {"workdir": str(workdir), "model": str(model_dir), "tokenizer": str(ps.tokenizer_dir(model_dir)),
            "data": str(workdir / f"prompts_{vocab}.jsonl"), "steps": steps, "rank": rank, "vllm": vllm,
            "out": str(out)}
    print(f"TRL GRPOConfig: {trl_args(vllm)}", flush=True)
    began = time.time()
    try:
        proc = ps.run_group([sys.executable, __file__, "--trl-worker", json.dumps(spec)], timeout_s, cwd=ROOT,
                            stdout=None, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return ps.cut_short(steps_log, timeout_s, steps, 3)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads(out.read_text())
    result["total_s"] = time.time() - began
    return result


# ------------------------------------------------------------------------------------------------- the merge
def time_merge(name: str, rank: int, repeats: int = 5) -> dict:
    """Seconds per rollout of the unshard + reshard alone and of Adapters.merged() entered and left, on one rank
    with FSDP2 as the actor has it (parallel/fsdp.shard_model's layout, no compile)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from config import LoraConfig
    from parallel.tp import decoder_layers
    from roles.lora import apply_lora

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29519")):
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    config = AutoConfig.for_model(**json.loads(config_path(name).read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    adapters = apply_lora(model, LoraConfig(rank=rank, alpha=2 * rank), "bfloat16")
    model = adapters.model
    for layer in adapters.lora_layers():  # peft starts B at zero: a merge of zeros would hide nothing, but be fair
        for b in layer.lora_B.values():
            torch.nn.init.normal_(b.weight, std=0.02)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    adapted = len(adapters.lora_layers())
    lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def gather_only():
        for handle in [m.unshard(async_op=True) for m in fsdp]:
            handle.wait()
        sync()
        for m in fsdp:
            m.reshard()

    def merge():
        with adapters.merged(reshard_after_forward=True):
            sync()

    out = {"model": name, "rank": rank, "adapted_layers": adapted, "lora_params": lora_params}
    for label, fn in (("gather_s", gather_only), ("merged_s", merge), ("gather_s_again", gather_only)):
        fn()  # warm-up
        sync()
        runs = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            sync()
            runs.append(time.perf_counter() - began)
        out[label] = statistics.median(runs)
    out["merge_s"] = out["merged_s"] - min(out["gather_s"], out["gather_s_again"])
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out), flush=True)
    return out


# ------------------------------------------------------------------------------------------------- the planner
def plan(name: str, system: str, rank: int, extra: list[str]) -> str:
    """The planner's peak line for a meshrl system's run of this bench (train_ppo.py --plan, the same overrides)."""
    cfg = Path("/tmp/lora_step_plan.yaml")
    cfg.write_text("reward:\n  functions:\n    - spec: bench_reward:meshrl_reward\n")
    overrides = [f"model.path={config_path(name)}", "data.train_path=/tmp/none.jsonl", f"data.batch_size={ps.PROMPTS}",
                 f"data.max_prompt_len={ps.PROMPT_LEN}", f"rollout.n={ps.SAMPLES}",
                 f"rollout.max_new_tokens={ps.NEW_TOKENS}", "algorithm.adv_estimator=grpo",
                 "algorithm.kl.in_reward=false", "algorithm.kl.in_loss=false", "actor.mini_batch_size=0"]
    overrides += meshrl_overrides(system, rank, extra)
    proc = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--config", str(cfg), "--plan",
                           "--gpu-memory", "139.8", *overrides], cwd=ROOT, capture_output=True, text=True)
    lines = [x.strip() for x in proc.stdout.splitlines() if x.strip().startswith("peak ")]
    return lines[0] if lines else f"(planner exit {proc.returncode}: {proc.stderr[-300:]})"


# ------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b"])
    ap.add_argument("--systems", nargs="+", default=["meshrl-lora", "trl-lora"], choices=SYSTEMS)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trl-steps", type=int, default=5)
    ap.add_argument("--trl-timeout", type=float, default=None,
                    help="seconds a TRL run may take; past them it is stopped and the steps it ended are reported")
    ap.add_argument("--workdir", default="/tmp/lora_step")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run with a tiny model (vLLM systems skipped)")
    ap.add_argument("--merge", nargs="*", default=None, metavar="NAME", help="time the merge on these models")
    ap.add_argument("--plan", action="store_true", help="print the planner's peaks for the runs and exit")
    ap.add_argument("--json", default=None, help="also write every result here")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the table of results saved with --json (several calls, one table) and exit")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="key=value overrides for meshrl's runs (after --)")
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    if args.report:
        report([r for f in args.report for r in json.loads(Path(f).read_text())])
        return
    if args.plan:
        for model in args.models:
            for system in args.systems:
                if system.startswith("meshrl"):
                    print(f"| {model} | {system} | {' '.join(args.extra) or '-'} | "
                          f"{plan(model, system, args.rank, args.extra)} |")
        return
    if args.merge is not None:
        rows = [time_merge(m, args.rank) for m in args.merge]
        print("| model | rank | adapted layers | LoRA params | unshard + reshard s | merged() s | merge s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['model']} | {r['rank']} | {r['adapted_layers']} | {r['lora_params'] / 1e6:.1f}M | "
                  f"{min(r['gather_s'], r['gather_s_again']):.3f} | {r['merged_s']:.3f} | {r['merge_s']:.3f} |")
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models:
        runnable = [s for s in args.systems if not (args.device == "cpu" and s in VLLM_SYSTEMS)]
        model_dir = build_assets(model, workdir, args.device) if runnable else None
        params = ps.param_count(model_dir) if model_dir else None
        for system in args.systems:
            print(f"== {system} {model}", flush=True)
            if system not in runnable:
                r = {"skipped": CPU_SKIP}
                if system.startswith("meshrl"):
                    r["overrides"] = meshrl_overrides(system, args.rank, args.extra)
                print(f"== {system} {model}: skipped on --device cpu: {CPU_SKIP}", flush=True)
            elif system.startswith("meshrl"):
                rank = args.rank if system != "meshrl-full" else 0
                extra = meshrl_overrides(system, rank, args.extra)
                r = ps.run_meshrl(model_dir, workdir, "fixed", args.steps, system, extra, None, args.device)
                r["overrides"] = extra
            else:
                r = run_trl(model_dir, workdir, args.trl_steps, args.rank, vllm=system == "trl-vllm-lora",
                            timeout_s=args.trl_timeout)
            r.update(system=system, model=model, params=params)
            if "skipped" not in r:
                print(r.get("error") or json.dumps({k: v for k, v in r.items() if k not in ("pg_loss",)}), flush=True)
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results)


PEERS = ("meshrl-lora", "trl-vllm-lora", "trl-lora")  # the step table's ratio columns, in this order


def report(results: list[dict]) -> None:
    """The step table: one row a run; "vs X" = X's steady s/step over the row's (same model; above 1: faster)."""
    print("| model | system | overrides | steady s/step | first 3 s | start s | gen s | update s | sync s | peak GiB "
          "(max_memory_allocated) | device GiB | " + " | ".join(f"vs {p}" for p in PEERS) + " |")
    print("|" + " --- |" * (11 + len(PEERS)))
    ok = [r for r in results if "error" not in r and "skipped" not in r and r.get("steps")]
    peers = {(r["model"], r["system"]): ps.steady(r["steps"]) for r in ok if r["system"] in PEERS}
    blank = " |" * (7 + len(PEERS))  # the cells after the 4th
    for r in results:
        over = " ".join(o for o in r.get("overrides", []) if not o.startswith("actor.lora.alpha")) or "-"
        if "skipped" in r:
            print(f"| {r['model']} | {r['system']} | {over} | skipped: {r['skipped']} |{blank}")
            continue
        if "error" in r or not r.get("steps"):  # the error's own line (the last stderr lines are often exit warnings)
            lines = [x for x in r.get("error", "no steps").splitlines() if "Error" in x] or \
                r.get("error", "no steps").splitlines()[-1:]
            print(f"| {r['model']} | {r['system']} | {over} | failed: {lines[-1][-160:] if lines else '?'} |{blank}")
            continue
        s = ps.steady(r["steps"])
        over += f" ({r['cut']})" if r.get("cut") else ""
        gen, upd, sync = (f"{ps.steady(r[k]):.3f}" if r.get(k) else "-" for k in ("gen", "update_actor", "reshard"))
        start = f"{r['start_s']:.0f}" if r.get("start_s") else "-"
        mem = f"{r['memory_gb']:.2f}" if r.get("memory_gb") is not None else "-"
        dev = f"{r['gpu_memory_used_gb']:.1f}" if r.get("gpu_memory_used_gb") else "-"
        ratios = [f"{peers[(r['model'], p)] / s:.2f}x" if (r["model"], p) in peers else "-" for p in PEERS]
        print(f"| {r['model']} | {r['system']} | {over} | {s:.3f} | {sum(r['steps'][:3]):.1f} | {start} | {gen} | "
              f"{upd} | {sync} | {mem} | {dev} | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
