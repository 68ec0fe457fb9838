"""Run monitoring on the logging rank: `metrics.jsonl` (one line per step), TensorBoard scalars and text, optionally
Prometheus gauges and Weights & Biases, and a console line per step. Other ranks send their metrics to rank 0 with
`gather_metrics`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm


def lock_run_dir(run_dir: str):
    """Take the run folder's lock (`run.lock`, an advisory flock the OS releases when the process ends, so a dead
    run leaves no stale lock). Returns (the open lock file, None), or (None, who holds it) when another live process
    does."""
    os.makedirs(run_dir, exist_ok=True)
    handle = open(os.path.join(run_dir, "run.lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return None, holder
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return handle, None


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


@contextlib.contextmanager
def profiled(on: bool, run_dir: str, name: str, top: int = 60):
    """torch.profiler over the block when `on` (CPU, and CUDA where there is a GPU): `profile_<name>.txt` (the
    operators and kernels by total device time, else CPU time) and `profile_<name>.json` (a Chrome / Perfetto
    trace) in run_dir. A no-op otherwise."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(run_dir, exist_ok=True)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    with open(os.path.join(run_dir, f"profile_{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=90))
    prof.export_chrome_trace(os.path.join(run_dir, f"profile_{name}.json"))


def quiet_libraries() -> None:
    """Keep the console to our own lines: no per-model load reports or progress bars from transformers, and no
    FSDP2 warning about view outputs (the roles never modify model outputs in place)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def gather_metrics(local: dict[str, float]) -> dict[str, float]:
    """Every rank calls; rank 0 gets each key averaged over the ranks that reported it (others get {})."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    if dist.get_rank() != 0:
        return {}
    sums: dict[str, list[float]] = {}
    for metrics in everyone:
        for k, v in metrics.items():
            sums.setdefault(k, []).append(float(v))
    return {k: (sum(v) if k.startswith(SUMMED) else sum(v) / len(v)) for k, v in sorted(sums.items())}


def eval_sums(scores: list[float], lengths: list[int], prompt_index: list[int], sources: list) -> dict:
    """One rank's eval sums: per data source ("" for all; a source only when the records have the column), the
    samples' score and length sums, how many scored >= 1, and per prompt whether any of its samples did (pass@n)."""
    sums: dict = {}
    for score, length, index, source in zip(scores, lengths, prompt_index, sources):
        for key in {"", source} - {None}:
            entry = sums.setdefault(key, {"n": 0, "score": 0.0, "length": 0.0, "correct": 0, "passed": {}})
            entry["n"] += 1
            entry["score"] += score
            entry["length"] += length
            entry["correct"] += score >= 1.0
            entry["passed"][index] = entry["passed"].get(index, False) or score >= 1.0
    return sums


def eval_metrics(shares: list[dict], n: int) -> dict[str, float]:
    """eval/score/mean (mean@n), eval/accuracy (share of samples scoring >= 1), eval/response_length/mean, with
    rollout.eval_n > 1 eval/pass@n (share of prompts with a sample scoring >= 1), and the same per data source as
    eval/<source>/...; from every rank's eval_sums (a prompt's samples are all on one rank)."""
    out: dict[str, float] = {}
    for key in sorted({k for share in shares for k in share}):
        parts = [share[key] for share in shares if key in share]
        count = sum(p["n"] for p in parts)
        prompts = [passed for p in parts for passed in p["passed"].values()]
        prefix = f"eval/{key}/" if key else "eval/"
        out[f"{prefix}score/mean"] = sum(p["score"] for p in parts) / count
        out[f"{prefix}accuracy"] = sum(p["correct"] for p in parts) / count
        if not key:
            out["eval/response_length/mean"] = sum(p["length"] for p in parts) / count
        if n > 1:
            out[f"{prefix}pass@{n}"] = sum(prompts) / len(prompts)
    return out


# counters add up over ranks (each counted by one rank: tp peers do not repeat them); everything else is a mean,
# and the step's statistics are already global (the same on every rank that reports them)
SUMMED = ("reward_fn/errors", "reward_fn/timeouts")


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """`wandb`: the keyword arguments of WandbRun (project, entity, name, config), or None for no W&B."""

    def __init__(self, run_dir: str, tensorboard: bool = True, prometheus_port: int | None = None,
                 wandb: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.prometheus = PrometheusGauges(prometheus_port) if prometheus_port is not None else None
        self.wandb = WandbRun(run_dir, **wandb) if wandb is not None else None
        self.run_dir = run_dir
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=run_dir)
        self.start = time.time()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.prometheus is not None:
            self.prometheus.set({"step": step, **metrics})
        if self.wandb is not None:
            self.wandb.log(step, clean)

    def truncate_after(self, step: int) -> None:
        """On resume from checkpoint `step`: forget what was logged after it (metrics.jsonl, eval_samples.jsonl),
        so every step appears once. A line a kill cut in half is dropped with a warning."""
        self.jsonl.close()
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            path = os.path.join(self.run_dir, name)
            if not os.path.exists(path):
                continue
            kept = []
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        logging.getLogger("meshrl").warning("%s line %d is not complete JSON (a write cut short); "
                                                            "dropped", path, number)
                        continue
                    if record["step"] <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
            with open(path, "w") as f:
                f.writelines(kept)
        self.jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(log_dir=self.run_dir, purge_step=step + 1)

    def samples(self, step: int, rows: list[dict]) -> None:
        """Every eval prompt's response and score, one JSON line per eval step (eval_samples.jsonl)."""
        with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "samples": rows}) + "\n")
        if self.wandb is not None:
            self.wandb.samples(step, rows)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, text, step)

    def console(self, step: int, total: int, metrics: dict[str, float], eta_s: float | None = None) -> None:
        """One line per log_every steps (also in Slurm logs, where the progress bar is off), with the time left."""
        keys = ("reward/score/mean", "eval/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl",
                "response_length/mean", "timing_s/step", "perf/throughput")
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
        if eta_s is not None:
            minutes, seconds = divmod(int(round(eta_s)), 60)
            parts.append(f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
        tqdm.write(f"step {step}/{total} " + " ".join(parts))

    def progress(self, start: int, total: int) -> tqdm:
        """A progress bar over the steps (stderr, only on a terminal: logs stay clean)."""
        return tqdm(total=total, initial=start, desc="steps", unit="step", dynamic_ncols=True,
                    disable=not sys.stderr.isatty())

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


class WandbRun:
    """run.wandb: the step metrics, the resolved config and the eval samples (a table per eval) in Weights & Biases.
    WANDB_MODE=offline writes them under runs/NAME/wandb for a later `wandb sync`. One W&B run per meshrl run: its
    id is kept in runs/NAME/wandb_id and a resume goes on in it (W&B keeps the first value it got for a step, so the
    steps between a checkpoint and a crash show the lost attempt's values there; metrics.jsonl has the resumed ones)."""

    def __init__(self, run_dir: str, project: str, name: str, config: dict, entity: str | None = None):
        import uuid

        import wandb  # optional: config.check_ppo refuses run.wandb=true without it

        id_file = os.path.join(run_dir, "wandb_id")
        if os.path.exists(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, name=name, id=run_id, resume="allow", dir=run_dir,
                              config=config)
        self.last_step = self.run.step - 1 if self.run.resumed else -1

    def log(self, step: int, metrics: dict) -> None:
        # the start-up eval and step 1 share nothing but their step numbers; W&B refuses a step below its last one
        if step < self.last_step:
            return
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        self.last_step = step

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows and step >= self.last_step:
            table = self.wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self.run.log({"eval/samples": table}, step=step)
            self.last_step = step

    def close(self) -> None:
        self.run.finish()


class PrometheusGauges:
    """The latest value of every step metric as a Prometheus gauge, served over HTTP by prometheus_client:
    `reward/score/mean` becomes `meshrl_reward_score_mean`; `meshrl_step` is the step they belong to."""

    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, start_http_server  # optional: only when a port is set

        self.registry = CollectorRegistry()
        self.server, _ = start_http_server(port, registry=self.registry)
        self.gauges: dict = {}

    def set(self, metrics: dict[str, float]) -> None:
        from prometheus_client import Gauge

        for key, value in metrics.items():
            name = "meshrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, f"meshrl metric {key}", registry=self.registry)
            self.gauges[name].set(float(value) if value is not None else math.nan)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
