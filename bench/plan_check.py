"""The planner (`train_ppo.py --plan`) against what the end-to-end GRPO step (bench/ppo_step.py) really allocates.

    python3 bench/plan_check.py --models qwen2.5-0.5b qwen2.5-1.5b --steps 4

For each model: bench/ppo_step.py's meshrl run (random-init bf16 weights, 64 x (128 + 256)), then the plan of the
config.yaml that run wrote, for one rank of this GPU. Prints per model the measured peak of PyTorch's allocator
(perf/max_memory_allocated_gb), the device memory NVML saw in use (perf/gpu_memory_used_gb: CUDA context, NCCL and
allocator slack included), the plan's peak and phase, and plan / measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/plan_check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("extra", nargs="*", help="key=value overrides for the meshrl runs (and so for their plans)")
    args = ap.parse_args()
    results = Path(args.workdir) / "ppo_step.json"
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "bench" / "ppo_step.py"), "--models", *args.models, "--systems",
                    "meshrl", "--lengths", "fixed", "--steps", str(args.steps), "--workdir", args.workdir,
                    "--device", args.device, "--json", str(results), *args.extra], check=True)
    print("| model | measured peak allocated GiB | NVML in use GiB | GPU util | plan peak GiB | plan phase | "
          "plan / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in json.loads(results.read_text()):
        if "error" in r:
            print(f"| {r['model']} | failed: {r['error'][-300:]!r} | | | | | |")
            continue
        proc = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--config",
                               str(Path(r["run_dir"]) / "config.yaml"), "--plan", "--world", "1", "--json"],
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode not in (0, 1):
            print(f"| {r['model']} | plan failed: {proc.stderr[-300:]!r} | | | | | |")
            continue
        plan = json.loads(proc.stdout)
        rank = plan["ranks"][0]
        peak = rank["peak_bytes"] / 2**30
        used = r.get("gpu_memory_used_gb")
        util = r.get("gpu_util")
        print(f"| {r['model']} | {r['memory_gb']:.2f} | {used:.2f} | " if used else f"| {r['model']} | "
              f"{r['memory_gb']:.2f} | - | ", end="")
        print(f"{util:.0%} | " if util is not None else "- | ", end="")
        print(f"{peak:.2f} | {rank.get('peak_phase', '-')} | {peak / r['memory_gb']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
