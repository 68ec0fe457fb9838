"""Shared test helpers: launching torchrun workers and entry points as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Without a GPU, Triton's interpreter runs rollout/kernels.py's kernels on CPU tensors (it must be chosen before the
# kernels are defined, i.e. before anything imports rollout/). The engine's "auto" attention never picks them on CPU.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def run_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(args: list[str], timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root; output captured."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=run_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def torchrun(script_and_args: list[str], nproc: int, timeout: int = 300, extra: list[str] = (), **env):
    """`torchrun --standalone --nproc_per_node N SCRIPT ARGS`; output captured."""
    cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra, *script_and_args]
    return run_python(cmd, timeout=timeout, **env)


def start_run_and_wait(config: str, metrics, lines: int, timeout: float = 120) -> subprocess.Popen:
    """Start `python train_ppo.py --config CONFIG` in the background and return once `metrics` (its metrics.jsonl)
    has `lines` lines, or after `timeout` seconds."""
    import time

    proc = subprocess.Popen([sys.executable, "train_ppo.py", "--config", config], cwd=ROOT, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        time.sleep(0.2)
    return proc


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture
def root() -> Path:
    return ROOT
