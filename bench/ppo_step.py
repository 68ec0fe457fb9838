"""End-to-end GRPO step: meshrl against TRL's GRPOTrainer (HF generate, and vLLM colocate), in one session.

    python bench/ppo_step.py                                   # 0.5B and 1.5B, fixed and varying lengths, all systems
    python bench/ppo_step.py --models qwen2.5-0.5b --systems meshrl --lengths fixed --profile-step 4
    python bench/ppo_step.py --models qwen2.5-0.5b --systems meshrl --lengths fixed --nproc 2   # 2 GPUs, FSDP2
    python bench/ppo_step.py --models qwen2.5-0.5b --systems meshrl --lengths fixed --defaults  # the defaults' speed
    python bench/ppo_step.py --models qwen2.5-1.5b --systems meshrl --lengths long --steps 3 --partial 0.25
    python bench/ppo_step.py --models qwen2.5-1.5b --systems trl-vllm --lengths long --steps 3  # ~1 min a step?

The work of ../shared/BENCHMARKS.md: 8 prompts x 8 samples per step, 128 random prompt tokens, up to 256 new tokens,
temperature 1, no reference model and no KL (beta 0), lr 1e-6, one optimizer step per rollout, bf16 compute, on
random-init models built from configs/models/<name>.json (weights do not change speed). Lengths:
- fixed: the only stop is the eos id, which a random model samples with probability ~1/vocab per token, so
  responses run to 256 tokens (one in ~10 steps has a sequence a little shorter, in every system alike);
- varying: a fixed set of stop ids, sized so that near-uniform sampling from a random model stops after ~100 tokens
  on average (the set is printed; the measured mean response length is in the table);
- long (issue 37's reasoning-length step): 32 prompts x 16 samples per step, 256 random prompt tokens, up to 4096
  new tokens, temperature 1; stop ids sized so that near-uniform sampling gives a geometric (long-tailed) length
  with a mean of ~1000 tokens once truncated at 4096, ~2% of the responses at the cap (stop_ids: (1 - (1 - p)^N) / p
  = mean for a stop probability p per token). "steady" leaves out the first step only here. meshrl keeps its
  default micro-batch budget (auto; the planner's pick on an H200 at 1.5B: 4 full rows, 17,408 tokens) and its
  default 256 decode slots (the 512 samples refill them as responses end). TRL + vLLM: one TRL step (what its clock
  times) is one optimizer step over the step's 512 samples, generated at once (generation_batch_size 512 =
  per_device_train_batch_size 8 x gradient_accumulation_steps 64, steps_per_generation defaulting to the latter;
  vLLM's max_num_seqs 512), then trained in 64 micro-batches of 8 with gradient checkpointing, vLLM's context
  256 + 4096 tokens and 0.3 of the GPU (trl_batch_args). TRL's HF-generate mode is not run at this shape (minutes
  per step): its row says skipped.
  With --device cpu the long shape shrinks to a smoke run (CPU_SHAPES).
Each system runs as its own process, one after the other, for --steps steps; "steady" is the median of the steps
after the first three, "first 3" their sum, "start" the seconds from process start to the first step. For meshrl
the phases come from its metrics.jsonl (timing_s/gen, old_logprobs, update_actor, reshard); TRL's steps are timed
by a TrainerCallback (TRL reports no phases). Update MFU: 6 x parameters x trained tokens / update time / peak, with
--peak-tflops (989 dense bf16 on an H200); trained tokens = prompt + response tokens of the step.
The response lengths of each run follow the table: TRL's per sample (counted by its reward function; a response is
truncated when it reaches the cap without a stop id), meshrl's from its metrics.jsonl (mean, max and
response_length/clip_ratio, the share at the cap), or per sample with --save-rollouts (run.save_rollouts: each
step's samples written to a parquet file inside the step's time).
--nproc N runs meshrl under torchrun on N processes (one GPU each, colocated, FSDP2 over the N unless the key=value
overrides say otherwise) with the same global batch: the table's tokens (update tok/s, MFU) are per GPU then. TRL runs
on one GPU whatever --nproc says.
The reward of every system is the same cheap function of the response text (tests reward speed, not quality).
TRL needs trl, datasets, dill and multiprocess importable; TRL + vLLM and meshrl's vLLM engine the vLLM bundle
(../shared/vllm). The last lines are a markdown table for bench/RESULTS.md.
--defaults runs each meshrl point a second time with the default config's micro-batch settings (no
actor.micro_batch_tokens: auto, sized from the GPU's free memory at start) and prints both s/step, the budget auto
picked and the ratio (issue 37's target: the defaults within 10% of the bench config).
--partial TAIL runs each meshrl point (the native engine) a second time with partial rollouts
(rollout.partial_tail=TAIL rollout.partial_max_staleness=1 actor.tis_cap=2.0) and prints both s/step and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One lengths mode's step: prompts x samples, prompt tokens, the response cap (new_tokens), and the mean response
    length the stop ids are sized for (None: the eos id only). warmup: the first steps "steady" leaves out.
    trl_micro_batch: TRL's per_device_train_batch_size (None: the whole step in one micro-batch)."""

    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int
    mean_len: int | None = None
    warmup: int = 3
    trl_micro_batch: int | None = None

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.samples

    @property
    def whole_step(self) -> int:
        """The step's tokens at full length (prompt + new_tokens per sample)."""
        return self.samples_per_step * (self.prompt_len + self.new_tokens)


SHAPES = {
    "fixed": Shape(8, 8, 128, 256),
    "varying": Shape(8, 8, 128, 256, mean_len=100),
    "long": Shape(32, 16, 256, 4096, mean_len=1000, warmup=1, trl_micro_batch=8),
}
# --device cpu, the smoke run of a tiny model: long scaled down to seconds on 2 cores; fixed and varying as on the GPU
CPU_SHAPES = {"long": Shape(4, 4, 32, 192, mean_len=48, warmup=1, trl_micro_batch=4)}
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 8, 8, 128, 256  # the fixed and varying shape (SHAPES)
MEAN_VARYING = SHAPES["varying"].mean_len
WHOLE_STEP = SHAPES["fixed"].whole_step


def shape_of(lengths: str, device: str = "cuda") -> Shape:
    return CPU_SHAPES.get(lengths, SHAPES[lengths]) if device == "cpu" else SHAPES[lengths]

REWARD_MODULE = '''
def meshrl_reward(response, ground_truth, prompt):
    return (len(response) % 17) / 17.0


def trl_reward(completions, **columns):
    return [(len(c) % 17) / 17.0 for c in completions]
'''


# ------------------------------------------------------------------------------------------------- assets
def build_assets(model_name: str, workdir: Path) -> Path:
    """A random-init bf16 model folder with a word-level tokenizer over its whole vocabulary (token i is word(i), pad
    0, eos 1); a prompt file (ids from 2 up); the reward module. Returns the model folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(model_name) if model_name.endswith(".json") else ROOT / "configs" / "models" / f"{model_name}.json"
    fields = json.loads(path.read_text())
    model_dir = workdir / f"model_{path.stem}"
    if not (model_dir / "config.json").exists():
        config = AutoConfig.for_model(**fields)
        vocab = config.vocab_size
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab)}, unk_token=word(0)))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=word(1), pad_token=word(0),
                                       unk_token=word(0))
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
        model.config.eos_token_id, model.config.pad_token_id = 1, 0
        model.save_pretrained(model_dir)
        # its own folder for meshrl and TRL: transformers would load a folder with a qwen2 config.json through
        # Qwen2Tokenizer, which does not read this vocabulary; vLLM reads the copy beside the weights (it gets and
        # returns token ids only, so its view of the text does not matter)
        fast.save_pretrained(tokenizer_dir(model_dir))
        fast.save_pretrained(model_dir)
    (workdir / "bench_reward.py").write_text(REWARD_MODULE)
    return model_dir


def prompt_file(workdir: Path, vocab: int, shape: Shape) -> Path:
    """The prompts of a shape: random ids from 2 up, shape.prompt_len each; 64 rows, or 4 steps' worth if more (the
    same 64 rows as ever for the fixed and varying shapes)."""
    import torch

    rows = max(64, 4 * shape.prompts)
    data = workdir / (f"prompts_{vocab}.jsonl" if (rows, shape.prompt_len) == (64, PROMPT_LEN)
                      else f"prompts_{vocab}_{rows}x{shape.prompt_len}.jsonl")
    if not data.exists():
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(2, vocab, (rows, shape.prompt_len), generator=gen).tolist()
        data.write_text("".join(json.dumps({"prompt": " ".join(word(i) for i in row), "ground_truth": ""}) + "\n"
                                for row in ids))
    return data


def word(i: int) -> str:
    """Token i's text: fixed width, so that no token (eos, pad: matched anywhere in a text) is part of another."""
    return f"t{i:06d}"


def tokenizer_dir(model_dir: Path) -> Path:
    return model_dir.parent / f"tokenizer_{model_dir.name}"


def stop_probability(mean: float, new_tokens: int) -> float:
    """The per-token stop probability p whose geometric length, truncated at new_tokens, has mean `mean`:
    E[min(G, N)] = sum_{k<N} (1 - p)^k = (1 - (1 - p)^N) / p, solved by bisection."""
    lo, hi = 1e-9, 0.5
    for _ in range(100):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if truncated_mean(p, new_tokens) > mean else (lo, p)
    return p


def truncated_mean(p: float, new_tokens: int) -> float:
    """Mean response length when each token stops with probability p (the stop token counted), capped at new_tokens."""
    return (1 - (1 - p) ** new_tokens) / p


def stop_ids(vocab: int, mean: float = MEAN_VARYING, new_tokens: int = NEW_TOKENS) -> list[int]:
    """k ids such that stopping with probability p = k / vocab per token (near-uniform sampling from a random model)
    gives a mean length of `mean` when truncated at new_tokens: (1 - (1 - p)^N) / p = mean; a share (1 - p)^N of the
    responses reaches the cap."""
    k = max(1, round(stop_probability(mean, new_tokens) * vocab))
    step = vocab // k
    return [2 + i * step for i in range(k)]  # spread over the vocabulary, never pad or eos


def shape_stop_ids(vocab: int, shape: Shape) -> list[int]:
    return stop_ids(vocab, shape.mean_len, shape.new_tokens) if shape.mean_len else []


def describe_stops(vocab: int, shape: Shape) -> str:
    """The stop set and what a uniform model would do with it (the measured lengths are in the report)."""
    ids = shape_stop_ids(vocab, shape)
    if not ids:
        return "stop: eos only"
    p = len(ids) / vocab
    return (f"stop: eos + {len(ids)} ids of {vocab} (p {p:.2e}/token): uniform sampling would give a mean of "
            f"{truncated_mean(p, shape.new_tokens):.0f} tokens, {(1 - p) ** shape.new_tokens:.1%} at the cap of "
            f"{shape.new_tokens}")


def length_summary(lengths: list[int], truncated: list[bool]) -> dict:
    """Per-sample response lengths: count, mean, p50, p90, max, and the share truncated at the cap."""
    ordered = sorted(lengths)
    if not ordered:
        return {}

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"n": len(ordered), "mean": statistics.mean(ordered), "p50": quantile(0.5), "p90": quantile(0.9),
            "max": float(ordered[-1]), "truncated": sum(truncated) / len(truncated) if truncated else None}


# ------------------------------------------------------------------------------------------------- meshrl
def run_meshrl(model_dir: Path, workdir: Path, lengths: str, steps: int, name: str, extra: list[str],
               profile_step: int | None, device: str, nproc: int = 1, save_rollouts: bool = False) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shape = shape_of(lengths, device)
    data = prompt_file(workdir, vocab, shape)
    run_name = f"{name}_{model_dir.name}_{lengths}_{nproc}_{zlib.crc32(' '.join(extra).encode()):08x}"
    # a run of the same name left by an earlier, interrupted call (its checkpoint on the signal) would stop this one:
    # removed, unless a live process holds its lock (another call of this bench on the same --workdir)
    run_dir = workdir / "runs" / run_name
    if run_dir.exists():
        sys.path.insert(0, str(ROOT))
        from monitor import lock_run_dir

        lock, holder = lock_run_dir(str(run_dir))
        if lock is None:
            return {"error": f"{run_dir} is in use ({holder}): another call of this bench on the same --workdir?"}
        shutil.rmtree(run_dir)
        lock.close()
    overrides = [
        f"model.path={model_dir}", f"model.tokenizer_path={tokenizer_dir(model_dir)}", f"data.train_path={data}",
        "data.eval_path=null", f"data.batch_size={shape.prompts}", f"data.max_prompt_len={shape.prompt_len}",
        f"rollout.n={shape.samples}", f"rollout.max_new_tokens={shape.new_tokens}",
        "rollout.temperature=1.0", "algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false",
        "algorithm.kl.in_loss=false", "actor.optim.lr=1e-6", "actor.ppo_epochs=1", "actor.mini_batch_size=0",
        f"run.total_steps={steps}", "run.eval_every=0", "run.log_every=1", f"run.name={run_name}",
        f"run.output_dir={workdir / 'runs'}", f"run.device={device}", "checkpoint.save_every=0",
        "checkpoint.save_final=false",  # the bench times steps: no checkpoint (34 GiB at 3B) after them
        "checkpoint.resume=never",
        "reward.num_workers=1", "data.shuffle=false",
    ]
    if shape.mean_len:
        overrides.append("rollout.stop_token_ids=" + json.dumps(shape_stop_ids(vocab, shape)))
    if profile_step is not None:
        overrides.append(f"run.profile_step={profile_step}")
    if save_rollouts:  # each step's samples to runs/NAME/rollouts/step_N.parquet: per-sample response lengths
        overrides.append("run.save_rollouts=true")
    config = workdir / "bench_ppo_step.yaml"
    config.write_text("reward:\n  functions:\n    - spec: bench_reward:meshrl_reward\n")
    env = dict(os.environ, PYTHONPATH=f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    began = time.time()
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    mine = {e.split("=", 1)[0].strip() for e in extra}  # train_ppo.py refuses a key given twice: extra wins here
    overrides = [o for o in overrides if o.split("=", 1)[0] not in mine]
    cmd = [*launcher, str(ROOT / "train_ppo.py"), "--config", str(config), *overrides, *extra]
    print(f"meshrl config: {config.name} (reward bench_reward:meshrl_reward) " + " ".join(overrides + extra),
          flush=True)
    # the run's output goes to a file as it runs: a run its caller cuts short leaves what it printed
    log = workdir / "runs" / f"{run_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True)
    output = log.read_text(errors="replace")
    for line in output.splitlines():  # run.compile_cache: what was loaded before the first step, what saved
        if "compile cache:" in line:
            print(line, flush=True)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {output[-3000:]}"}
    lines = [json.loads(x) for x in (workdir / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "timing_s/step" in r]
    out = {"steps": [r["timing_s/step"] for r in rows], "total_s": time.time() - began,
           "response_len": statistics.mean(r["response_length/mean"] for r in rows),
           "tokens": statistics.mean(r["perf/throughput"] * r["timing_s/step"] for r in rows)}
    # gen_*: the native engine's parts of gen
    for phase in ("gen", "gen_prefill", "gen_capture", "gen_decode", "old_logprobs", "update_actor", "reshard",
                  "reward", "adv"):
        # a phase the run has not (old_logprobs with actor.old_logprobs=auto on this one-step update) is None
        out[phase] = [r.get(f"timing_s/{phase}", 0.0) for r in rows] \
            if any(f"timing_s/{phase}" in r for r in rows) else None
    out["start_s"] = rows[0].get("timing_s/startup") if rows else None
    out["memory_gb"] = max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows)
    # the rollout's log-probs against the actor's teacher-forced ones: a rollout on stale weights would show here
    diffs = [r["rollout/logprob_diff_max"] for r in rows if r.get("rollout/logprob_diff_max") is not None]
    out["logprob_diff_max"] = max(diffs) if diffs else None
    # NVML, sampled during the steps (absent without pynvml): the whole device, NCCL and the engine's cache included
    util = [r["perf/gpu_util"] for r in rows[1:] if r.get("perf/gpu_util") is not None]
    out["gpu_util"] = statistics.mean(util) if util else None
    out["gpu_memory_used_gb"] = max((r.get("perf/gpu_memory_used_gb") or 0.0 for r in rows), default=None)
    # for comparing layouts and comm options (issue 15): the step's share in collectives, split placement's transfers,
    # and the loss, which an option must leave within the CPU tests' tolerance of the plain run's
    for key in ("perf/comm_fraction", "timing_s/transfer", "actor/pg_loss"):
        values = [r.get(key) for r in rows]
        out[key.split("/")[1]] = values if any(v is not None for v in values) else None
    out["run_dir"] = str(workdir / "runs" / run_name)
    out["warmup"] = shape.warmup
    out["length_dist"] = meshrl_lengths(rows, run_dir if save_rollouts else None, shape, vocab)
    # the budget the run trained with (config.yaml is the resolved config: auto's pick)
    import yaml

    saved = yaml.safe_load((workdir / "runs" / run_name / "config.yaml").read_text())
    out["micro_batch_tokens"] = saved["actor"]["micro_batch_tokens"]
    return out


def meshrl_lengths(rows: list[dict], run_dir: Path | None, shape: Shape, vocab: int) -> dict:
    """The response-length distribution of a meshrl run: per sample from runs/NAME/rollouts/step_N.parquet when the
    run saved its rollouts (run_dir given), else from metrics.jsonl's response_length/{mean,max} and clip_ratio (the
    share of responses >= max_new_tokens long) over the steps; p50 / p90 need the per-sample lengths."""
    files = sorted((run_dir / "rollouts").glob("step_*.parquet")) if run_dir else []
    if files:
        import pyarrow.parquet as pq

        stops = {1, *shape_stop_ids(vocab, shape)}
        ids = [r for f in files for r in pq.read_table(f, columns=["response_ids"]).column(0).to_pylist()]
        return length_summary([len(r) for r in ids],
                              [len(r) >= shape.new_tokens and r[-1] not in stops for r in ids if r])
    rows = [r for r in rows if "response_length/mean" in r]
    if not rows:
        return {}
    clip = [r["response_length/clip_ratio"] for r in rows if r.get("response_length/clip_ratio") is not None]
    return {"n": None, "steps": len(rows), "mean": statistics.mean(r["response_length/mean"] for r in rows),
            "p50": None, "p90": None, "max": max(r.get("response_length/max", 0.0) for r in rows),
            "truncated": statistics.mean(clip) if clip else None}


# ------------------------------------------------------------------------------------------------- TRL
def trl_step_clock(t0: float, label: str | None = None, log: str | None = None):
    """(times, first, callback): a TrainerCallback timing each TRL step into `times` (synchronised on CUDA) and putting
    the seconds from t0 to the first step into `first`; with `label` it prints each step's time and peak memory; with
    `log` it appends each step's seconds to that file as it ends (a run cut short by a timeout keeps its steps)."""
    import torch
    from transformers import TrainerCallback

    times: list[float] = []
    first: list[float] = []
    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.began = time.perf_counter()
            if not first:
                first.append(time.time() - t0)

        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.began)
            if log:
                with open(log, "a") as f:
                    f.write(f"{times[-1]}\n")
            if label:
                print(f"[{label}] step {len(times)}: {times[-1]:.2f} s, peak "
                      f"{torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.2f} GiB", flush=True)

    return times, first, Clock()


def trl_worker(spec: dict) -> None:
    """One TRL GRPOTrainer run in this process; writes its step times to spec["out"]."""
    t0 = time.time()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    sys.path.insert(0, spec["workdir"])
    import bench_reward
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    times, first, clock = trl_step_clock(t0, log=spec["out"] + ".steps")
    cuda = torch.cuda.is_available()

    vocab = spec["vocab"]
    shape = Shape(**spec["shape"])
    stops = spec["stop_ids"]
    gen_kwargs = {}
    if stops:
        gen_kwargs = {"stop_token_ids": stops} if spec["vllm"] else {"eos_token_id": stops}
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_out"), temperature=1.0,
        beta=0.0, learning_rate=1e-6, bf16=cuda, use_cpu=not cuda, max_steps=spec["steps"], logging_steps=1,
        report_to=[],
        save_strategy="no", use_vllm=spec["vllm"], vllm_mode="colocate",
        vllm_enable_sleep_mode=False, generation_kwargs=gen_kwargs or None, dataloader_num_workers=0, seed=0,
        **trl_batch_args(shape),
    )
    data = load_dataset("json", data_files=spec["data"], split="train")
    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    # every sample's length, and whether it reached the cap without a stop: TRL's own completions/clipped_ratio counts
    # a response ending on one of the bench's stop ids (not the model's eos) as clipped
    seen: list[tuple[int, bool]] = []
    ends = {1, *stops}

    def trl_reward(completions, completion_ids=None, **columns):
        seen.extend((len(c), len(c) >= shape.new_tokens and c[-1] not in ends) for c in completion_ids or [] if c)
        return bench_reward.trl_reward(completions, **columns)

    trainer = GRPOTrainer(model=spec["model"], reward_funcs=trl_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    trainer.train()
    history = trainer.state.log_history
    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    logged = {key: [h[key] for h in history if key in h] for key in
              ("completions/mean_length", "completions/max_length", "completions/min_length",
               "completions/clipped_ratio", "completions/mean_terminated_length")}
    Path(spec["out"]).write_text(json.dumps({"steps": times, "start_s": first[0] if first else None,
                                             "response_len": statistics.mean(lengths) if lengths else None,
                                             "vocab": vocab, "warmup": shape.warmup, "trl_logged": logged,
                                             "length_dist": length_summary([n for n, _ in seen],
                                                                           [t for _, t in seen])}))


def trl_batch_args(shape: Shape) -> dict:
    """GRPOConfig's batch, length and memory arguments for a shape. TRL 1.16: one optimizer step (one "step" of its
    trainer, what the bench times) takes gradient_accumulation_steps micro-batches of per_device_train_batch_size
    samples; generation_batch_size defaults to per_device_train_batch_size x processes x steps_per_generation and
    steps_per_generation to gradient_accumulation_steps, so each step generates the whole step's samples at once
    (prompts x num_generations) and then trains on them in micro-batches; vLLM colocate runs with max_num_seqs equal
    to that generation batch. fixed / varying: the 64 samples in one micro-batch (TRL's default gradient
    checkpointing, on, and the whole context left to vLLM to infer); long: micro-batches of shape.trl_micro_batch,
    gradient checkpointing on, vLLM's context prompt + response."""
    micro = shape.trl_micro_batch or shape.samples_per_step
    assert shape.samples_per_step % micro == 0, (shape, micro)
    args = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=shape.samples_per_step // micro,
                num_generations=shape.samples, max_completion_length=shape.new_tokens,
                vllm_gpu_memory_utilization=0.3)
    if shape.trl_micro_batch:
        args.update(gradient_checkpointing=True, vllm_max_model_length=shape.prompt_len + shape.new_tokens)
    return args


def run_trl(model_dir: Path, workdir: Path, lengths: str, steps: int, use_vllm: bool, device: str = "cuda",
            timeout_s: float | None = None) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shape = shape_of(lengths, device)
    out = workdir / f"trl_{model_dir.name}_{lengths}_{int(use_vllm)}.json"
    steps_log = Path(f"{out}.steps")  # the worker's step times as they end
    for stale in (out, steps_log):  # an earlier call's results are not this one's
        stale.unlink(missing_ok=True)
    spec = {"workdir": str(workdir), "model": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
            "data": str(prompt_file(workdir, vocab, shape)), "shape": dataclasses.asdict(shape),
            "lengths": lengths, "steps": steps, "vllm": use_vllm, "stop_ids": shape_stop_ids(vocab, shape),
            "vocab": vocab, "out": str(out)}
    print(f"TRL GRPOConfig: {trl_batch_args(shape)}", flush=True)
    began = time.time()
    try:
        proc = run_group([sys.executable, __file__, "--trl-worker", json.dumps(spec)], timeout_s, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return cut_short(steps_log, timeout_s, steps, shape.warmup)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads(out.read_text())
    result["total_s"] = time.time() - began
    return result


def run_group(cmd: list[str], timeout_s: float | None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: past timeout_s the whole process group is killed (a TRL worker's vLLM
    processes too, which would otherwise hold the GPU for the runs after it), then TimeoutExpired is raised."""
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def cut_short(steps_log: Path, timeout_s: float, steps: int, warmup: int) -> dict:
    """A TRL run stopped at its timeout: the steps it ended (from the file its worker appends to) as its result when
    there are more than `warmup` of them (steady over the rest; "cut" says so in the report), else an error."""
    done = [float(x) for x in steps_log.read_text().split()] if steps_log.exists() else []
    cut = f"stopped at {timeout_s:.0f} s after {len(done)} of {steps} steps"
    if len(done) > warmup:
        return {"steps": done, "cut": cut, "warmup": warmup}
    return {"error": f"timed out: {cut}: {[round(x, 2) for x in done]} s"}


# ------------------------------------------------------------------------------------------------- report
def param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total


def steady(values: list[float], warmup: int = 3) -> float:
    """The median of the steps after the first `warmup` (all of them if there are no more)."""
    tail = values[warmup:] if len(values) > warmup else values
    return statistics.median(tail) if tail else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--systems", nargs="+", default=["meshrl", "trl-vllm", "trl"],
                    choices=["meshrl", "meshrl-vllm", "trl", "trl-vllm"])
    ap.add_argument("--lengths", nargs="+", default=["fixed", "varying"], choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trl-steps", type=int, default=6, help="steps of TRL's HF-generate mode (~10 s each)")
    ap.add_argument("--trl-timeout", type=float, default=None,
                    help="seconds a TRL run may take; past them it is stopped and the steps it ended are reported")
    ap.add_argument("--workdir", default="/tmp/ppo_step")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script with a tiny model")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--nproc", type=int, default=1, help="meshrl's processes (GPUs), the global batch unchanged")
    ap.add_argument("--profile-step", type=int, default=None, help="meshrl: torch.profiler over this step")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="meshrl's actor.micro_batch_tokens (default: fixed / varying the whole step's 64 x 384 tokens "
                         "in one forward, as TRL's per_device_train_batch_size=64 there; long: meshrl's default, auto)")
    ap.add_argument("--defaults", action="store_true",
                    help="also run meshrl with the default micro-batch settings (actor.micro_batch_tokens auto) and "
                         "print both s/step and their ratio")
    ap.add_argument("--partial", type=float, default=None, metavar="TAIL",
                    help="also run each meshrl point with partial rollouts (rollout.partial_tail=TAIL "
                         "rollout.partial_max_staleness=1 actor.tis_cap=2.0) and print both s/step and their ratio")
    ap.add_argument("--save-rollouts", action="store_true",
                    help="meshrl: run.save_rollouts=true, for per-sample response lengths (p50, p90) in the report")
    ap.add_argument("--json", default=None, help="also write every result here")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the table of results saved with --json (several runs, one table) and exit")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="key=value overrides for meshrl's runs")
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    if args.report:
        report([r for f in args.report for r in json.loads(Path(f).read_text())], args.peak_tflops)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models:
        model_dir = build_assets(model, workdir)
        params = param_count(model_dir)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        for lengths in args.lengths:
            shape = shape_of(lengths, args.device)
            print(f"== {lengths}: {shape.prompts} prompts x {shape.samples} samples, {shape.prompt_len} prompt "
                  f"tokens, up to {shape.new_tokens} new; {describe_stops(vocab, shape)}", flush=True)
            for system in args.systems:
                if system == "trl" and lengths == "long":
                    # HF generate decodes the 512 x 4096-token step in one padded batch: minutes per step
                    print(f"== trl {model} long: skipped (HF generate at this shape takes minutes per step)")
                    results.append(dict(skipped="HF generate: minutes per step at this shape", system=system,
                                        model=model, lengths=lengths, params=params, defaults=False))
                    continue
                if system == "trl" and (lengths == "varying" or model != args.models[0]):
                    continue  # TRL's HF-generate mode is ~7x slower than its vLLM mode: one point of reference
                # --defaults: meshrl a second time without the bench's micro-batch budget (the default config's);
                # --partial: a run with partial rollouts (the native engine's: meshrl only)
                variants = ["bench"]
                variants += ["defaults"] if args.defaults and system.startswith("meshrl") else []
                variants += ["partial"] if args.partial is not None and system == "meshrl" else []
                for variant in variants:
                    r = run_point(args, system, variant, model_dir, lengths, shape, workdir)
                    r.update(model=model, lengths=lengths, params=params, defaults=variant == "defaults",
                             partial=args.partial if variant == "partial" else None,
                             nproc=args.nproc if system.startswith("meshrl") else 1,
                             split=any(e.replace(" ", "") == "placement.mode=split" for e in args.extra))
                    if "error" in r:
                        print(r["error"], flush=True)
                    else:
                        print(json.dumps({k: v for k, v in r.items() if k != "error"}), flush=True)
                    results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, args.peak_tflops)


def partial_overrides(tail: float) -> list[str]:
    return [f"rollout.partial_tail={tail}", "rollout.partial_max_staleness=1", "actor.tis_cap=2.0"]


def run_point(args, system: str, variant: str, model_dir: Path, lengths: str, shape: Shape, workdir: Path) -> dict:
    """One system's run of one point (variant: bench, defaults or partial, see main); the result has its label."""
    defaults = variant == "defaults"
    print(f"== {system}{'' if variant == 'bench' else f' ({variant})'} {model_dir.name} {lengths}", flush=True)
    if not system.startswith("meshrl"):
        r = run_trl(model_dir, workdir, lengths, args.trl_steps if system == "trl" else args.steps,
                    system == "trl-vllm", args.device, args.trl_timeout)
        r["system"] = system
        return r
    # the bench's micro-batch budget: the whole step at the short shapes, auto (the default) at long
    budget = args.micro_batch_tokens if args.micro_batch_tokens is not None else \
        (None if lengths == "long" else shape.whole_step)
    extra = [] if defaults or budget is None else [f"actor.micro_batch_tokens={budget}"]
    extra += args.extra
    if system == "meshrl-vllm":
        extra += ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3"]
    if variant == "partial":
        extra += partial_overrides(args.partial)
    r = run_meshrl(model_dir, workdir, lengths, args.steps, system, extra, args.profile_step, args.device,
                   args.nproc, args.save_rollouts)
    notes = [f"micro-batch {budget}"] if not defaults and args.micro_batch_tokens not in (None, shape.whole_step) \
        else []
    notes += [f"defaults: micro-batch auto -> {r.get('micro_batch_tokens')}"] if defaults else []
    notes += [f"micro-batch auto -> {r.get('micro_batch_tokens')}"] if budget is None and not defaults else []
    notes += [f"partial tail {args.partial}"] if variant == "partial" else []
    notes += [f"{args.nproc} ranks"] if args.nproc > 1 else []
    r["system"] = system + (f" ({', '.join(notes + args.extra)})" if notes or args.extra else "")
    return r


def defaults_report(results: list[dict]) -> None:
    """--defaults: each meshrl point's default-config run against the bench config's run before it."""
    bench = None
    for r in results:
        if not r.get("defaults"):
            bench = r if r.get("partial") is None else bench
            continue
        if "error" in r or bench is None or "error" in bench:
            print(f"defaults {r['model']} {r['lengths']}: failed (see the log)")
            continue
        s_default, s_bench = steady(r["steps"], r.get("warmup", 3)), steady(bench["steps"], bench.get("warmup", 3))
        print(f"defaults {r['model']} {r['lengths']}: {s_default:.3f} s/step (micro-batch auto -> "
              f"{r.get('micro_batch_tokens')}) vs bench config {s_bench:.3f} s/step (micro-batch "
              f"{bench.get('micro_batch_tokens')}): {s_default / s_bench:.3f}x (target <= 1.10)")


def partial_report(results: list[dict]) -> None:
    """--partial: each meshrl point's run with partial rollouts against the bench config's run before it."""
    bench = None
    for r in results:
        if r.get("partial") is None:
            bench = r if not r.get("defaults") else bench
            continue
        if "error" in r or bench is None or "error" in bench:
            print(f"partial {r['model']} {r['lengths']}: failed (see the log)")
            continue
        s_partial, s_bench = steady(r["steps"], r.get("warmup", 3)), steady(bench["steps"], bench.get("warmup", 3))
        keys = " ".join(partial_overrides(r["partial"]))
        print(f"partial {r['model']} {r['lengths']}: {s_partial:.3f} s/step ({keys}) vs {s_bench:.3f} s/step "
              f"without: {s_partial / s_bench:.3f}x")


def lengths_report(results: list[dict]) -> None:
    """Each run's response lengths: per sample (TRL; meshrl with --save-rollouts) or from meshrl's metrics (mean,
    max and the share at the cap, over the steps)."""
    rows = [r for r in results if r.get("length_dist")]
    if not rows:
        return
    print("| model | lengths | system | samples | mean | p50 | p90 | max | truncated at the cap |")
    print("|" + " --- |" * 9)

    def cell(value, form: str = "{:.0f}") -> str:
        return "-" if value is None else form.format(value)

    for r in rows:
        d = r["length_dist"]
        n = cell(d.get("n")) if d.get("n") is not None else f"{d.get('steps')} steps (metrics)"
        print(f"| {r['model']} | {r['lengths']} | {r['system']} | {n} | {cell(d.get('mean'))} | {cell(d.get('p50'))} "
              f"| {cell(d.get('p90'))} | {cell(d.get('max'))} | {cell(d.get('truncated'), '{:.1%}')} |")


def phase_cell(result: dict, phase: str) -> str:
    """A phase's steady seconds, or "-" for a phase the run does not have."""
    return f"{steady(result[phase], result.get('warmup', 3)):.3f}" if result.get(phase) else "-"


def report(results: list[dict], peak_tflops: float) -> None:
    head = ("| model | lengths | system | steady s/step | first 3 steps s | start s | mean response | gen s | "
            "gen: prefill / capture / decode s | old logp s | update s | update MFU | update tok/s | sync s | "
            "vs TRL+vLLM |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    peers = {(r["model"], r["lengths"]): steady(r["steps"], r.get("warmup", 3)) for r in results
             if r["system"] == "trl-vllm" and "error" not in r and "skipped" not in r}
    for r in results:
        if "error" in r or "skipped" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else "failed (see the log)"
            print(f"| {r['model']} | {r['lengths']} | {r['system']} | {why} |" + " |" * 11)
            continue
        s = steady(r["steps"], r.get("warmup", 3))
        first3 = sum(r["steps"][:3])
        phases = ["-"] * 7
        if "update_actor" in r:
            upd = steady(r["update_actor"], r.get("warmup", 3))
            mfu = 6 * r["params"] * r["tokens"] / upd / (peak_tflops * 1e12)
            parts = " / ".join(phase_cell(r, f"gen_{p}") for p in ("prefill", "capture", "decode"))
            # tokens are per rank of the whole world: on split pools the update runs on the actor's ranks only
            per_gpu = ("-", "-") if r.get("split") else (f"{mfu:.1%}", f"{r['tokens'] / upd:,.0f}")
            phases = [phase_cell(r, "gen"), parts, phase_cell(r, "old_logprobs"), f"{upd:.3f}", *per_gpu,
                      phase_cell(r, "reshard")]
        peer = peers.get((r["model"], r["lengths"]))
        ratio = f"{peer / s:.2f}x" if peer and r.get("nproc", 1) == 1 else "-"  # TRL runs on one GPU
        resp = f"{r['response_len']:.0f}" if r.get("response_len") else "-"
        start = f"{r['start_s']:.0f}" if r.get("start_s") else "-"
        print(f"| {r['model']} | {r['lengths']} | {r['system']} | {s:.3f} | {first3:.1f} | {start} | {resp} | "
              + " | ".join(phases) + f" | {ratio} |")
    for r in results:
        if r.get("cut"):
            print(f"{r['model']} {r['lengths']} {r['system']}: {r['cut']} (steady over steps {r['warmup'] + 1}-"
                  f"{len(r['steps'])})")
    if any(r.get("defaults") for r in results):
        defaults_report(results)
    if any(r.get("partial") is not None for r in results):
        partial_report(results)
    lengths_report(results)


if __name__ == "__main__":
    main()
