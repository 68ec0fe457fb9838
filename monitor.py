"""Run monitoring on the logging rank: `metrics.jsonl` (one line per step), TensorBoard scalars and text, optionally
Prometheus gauges and Weights & Biases, and a console line per step. Other ranks send their metrics to rank 0 with
`gather_metrics`."""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import logging
import math
import os
import re
import resource
import sys
import threading
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
    return {k: (sum(v) if k.startswith(SUMMED) else max(v) if k in MAXED else sum(v) / len(v))
            for k, v in sorted(sums.items())}


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


# counters add up over ranks (each counted by one rank: tp peers do not repeat them); memory is the fullest rank's;
# everything else is a mean, and the step's statistics are already global (the same on every rank)
SUMMED = ("reward_fn/errors", "reward_fn/timeouts")
MAXED = ("perf/memory_fraction", "perf/gpu_memory_used_gb", "perf/max_memory_allocated_gb")


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class GpuSampler:
    """perf/gpu_util (mean of the samples, 0-1) and perf/gpu_memory_used_gb (their max; the device as NVML sees it,
    other processes and memory outside PyTorch's allocator included) of this rank's GPU, read every `period_s` by a
    background thread while the step runs, so its busy and its idle phases both count. `read`: () -> (utilisation
    0-1, bytes used), e.g. `nvml_reader(device)`; None (no GPU, no NVML): no samples and no metrics."""

    def __init__(self, read, period_s: float):
        self.read, self.period_s = read, period_s
        self.samples: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None
        if read is not None:
            self.thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                sample = self.read()
            except Exception as e:  # NVML gone (driver reset, lost device): monitoring stops, training goes on
                logging.getLogger("meshrl").warning("GPU monitoring stopped: %s", e)
                return
            with self.lock:
                self.samples.append(sample)
            self.stopped.wait(self.period_s)

    def pop(self) -> dict[str, float]:
        """The samples since the last pop as metrics ({} when there are none)."""
        with self.lock:
            samples, self.samples = self.samples, []
        if not samples:
            return {}
        return {"perf/gpu_util": sum(u for u, _ in samples) / len(samples),
                "perf/gpu_memory_used_gb": max(m for _, m in samples) / 2**30}  # GiB, as perf/max_memory_allocated_gb

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def nvml_reader(device: torch.device):
    """() -> (utilisation 0-1, bytes used) of `device` through NVML (torch.cuda's pynvml calls), or None without a
    GPU or without NVML (said once in the log)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.utilization(device)
        torch.cuda.device_memory_used(device)
    except Exception as e:  # pynvml missing, or a driver without NVML
        logging.getLogger("meshrl").info("GPU utilisation metrics off: %s", e)
        return None
    return lambda: (torch.cuda.utilization(device) / 100.0, float(torch.cuda.device_memory_used(device)))


# name: (metric, "min" or "max", health config key, what to say, what to try)
HEALTH = {
    "throughput": ("perf/throughput", "min", "min_throughput", "throughput {value:.4g} tokens/s per rank",
                   "look at timing_s/* for the slow phase (bench/RESULTS.md has the expected figures)"),
    "gpu_util": ("perf/gpu_util", "min", "min_gpu_util", "GPU utilisation {value:.0%}",
                 "larger micro_batch_tokens or rollout batches; timing_s/* shows what waits"),
    "comm": ("perf/comm_fraction", "max", "max_comm_fraction", "time in collectives is {value:.0%} of the step",
             "comm.grad_sync_every, comm.compression or a larger micro_batch_tokens"),
    "memory": ("perf/memory_fraction", "max", "max_memory_fraction", "peak device memory is {value:.0%} of the device",
               "fsdp.cpu_offload, activation_checkpointing or a smaller micro_batch_tokens"),
    "reshard": ("timing_s/reshard", "max", "max_reshard_s", "moving the actor's weights into the engine took "
                "{value:.1f} s", "more ranks in the actor pool, or rollout.engine=native"),
}


class HealthWarnings:
    """The health thresholds (config `health`) over each step's merged metrics: a warning when one is crossed, again
    only after the metric went back, and health/<name> (1 while crossed, 0 otherwise) for every threshold whose
    metric the step has, so metrics.jsonl, TensorBoard and Prometheus show them and run_summary counts them."""

    def __init__(self, health_cfg):
        self.limits = {name: getattr(health_cfg, key) for name, (_, _, key, _, _) in HEALTH.items()}
        self.active: set[str] = set()

    def check(self, metrics: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, (metric, side, key, what, fix) in HEALTH.items():
            limit, value = self.limits[name], metrics.get(metric)
            if limit is None or value is None:
                continue
            crossed = value < limit if side == "min" else value > limit
            out[f"health/{name}"] = float(crossed)
            if crossed and name not in self.active:
                logging.getLogger("meshrl").warning("health: %s (health.%s=%g): consider %s",
                                                    what.format(value=value), key, limit, fix)
            (self.active.add if crossed else self.active.discard)(name)
        return out


def _json_lines(path: str) -> list[tuple[str, dict]]:
    """(line, record) for every complete JSON line of `path`; a line a kill cut short is dropped with a warning."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((line, json.loads(line)))
            except json.JSONDecodeError:
                logging.getLogger("meshrl").warning("%s line %d is not complete JSON (a write cut short); dropped",
                                                    path, number)
    return out


def read_metrics_file(run_dir: str) -> list[dict]:
    """metrics.jsonl's complete lines (a non-finite value is null there)."""
    return [record for _, record in _json_lines(os.path.join(run_dir, "metrics.jsonl"))]


def run_summary(rows: list[dict]) -> dict:
    """The run report from metrics.jsonl's rows (so a resumed run's covers every step): steps, the seconds of each
    phase summed over the steps with their share of the step time, mean tokens/s, peak memory, the eval score at
    the start and at the last eval, skipped optimizer steps, reward-function errors and timeouts, and per health
    threshold the steps at which it was crossed (a warning each)."""
    steps = [r for r in rows if r["step"] > 0]

    def values(key: str) -> list[float]:  # the finite values the steps logged under `key`
        return [r[key] for r in steps if r.get(key) is not None]

    def total(key: str) -> float:
        return sum(values(key))

    step_s = total("timing_s/step")
    phases = sorted({k for r in steps for k in r if k.startswith("timing_s/")} - {"timing_s/step", "timing_s/startup"})
    evals = [r for r in rows if r.get("eval/score/mean") is not None]
    warnings_at: dict[str, list[int]] = {}
    for name in HEALTH:
        before = 0.0
        for r in steps:
            now = r.get(f"health/{name}") or 0.0
            if now and not before:
                warnings_at.setdefault(name, []).append(r["step"])
            before = now
    peaks = {k: max(values(k), default=None) for k in ("perf/max_memory_allocated_gb", "perf/gpu_memory_used_gb")}
    throughput = values("perf/throughput")
    return {
        "steps": len(steps),
        "last_step": steps[-1]["step"] if steps else 0,
        "step_s": step_s,
        "startup_s": total("timing_s/startup"),
        "phases_s": {k.removeprefix("timing_s/"): total(k) for k in phases},
        "phase_share": {k.removeprefix("timing_s/"): (total(k) / step_s if step_s else None) for k in phases},
        "tokens_per_s_per_rank": sum(throughput) / len(throughput) if throughput else None,
        "peak_memory_gb": peaks["perf/max_memory_allocated_gb"],
        "peak_gpu_memory_used_gb": peaks["perf/gpu_memory_used_gb"],
        "eval_before": evals[0]["eval/score/mean"] if evals and evals[0]["step"] == 0 else None,
        "eval_after": evals[-1]["eval/score/mean"] if evals and evals[-1]["step"] > 0 else None,
        "skipped_steps": total("actor/skipped_steps"),
        "reward_fn_errors": total("reward_fn/errors"),
        "reward_fn_timeouts": total("reward_fn/timeouts"),
        "warnings": warnings_at,
    }


def summary_table(summary: dict) -> str:
    """The console form of run_summary."""
    def number(v, fmt="{:.4g}"):
        return "-" if v is None else fmt.format(v)

    lines = [f"run summary: {summary['steps']} steps (to step {summary['last_step']}), "
             f"{summary['step_s']:.1f} s in steps + {summary['startup_s']:.1f} s start-up",
             f"  {'phase':<16} {'seconds':>10} {'share':>7}"]
    for phase, seconds in sorted(summary["phases_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {phase:<16} {seconds:>10.2f} {number(summary['phase_share'][phase], '{:.1%}'):>7}")
    # a CPU run has no GPU reading, a run without an eval set no eval score: said so, not printed as "-" or nan
    gpu = summary["peak_gpu_memory_used_gb"]
    gpu_text = f" (GPU in use {number(gpu)} GB)" if gpu is not None else ""
    before, after = (v if v is not None and v == v else None for v in (summary["eval_before"], summary["eval_after"]))
    evaluated = "no eval" if before is None and after is None else \
        f"eval/score/mean {number(before)} -> {number(after)}"
    lines += [f"  tokens/s per rank {number(summary['tokens_per_s_per_rank'])}; peak memory "
              f"{number(summary['peak_memory_gb'])} GB{gpu_text}",
              f"  {evaluated}; skipped steps {summary['skipped_steps']:g}; reward-function errors "
              f"{summary['reward_fn_errors']:g}, timeouts {summary['reward_fn_timeouts']:g}",
              "  health warnings: " + (", ".join(f"{name} at steps {steps}" for name, steps in
                                                 summary["warnings"].items()) or "none")]
    return "\n".join(lines)


def console_defaults(metrics: dict[str, float]) -> list[str]:
    """The console line's metrics when run.console_keys is not set, by the step's estimator: with a critic (GAE) its
    value loss and explained variance beside the policy loss and KL; without (GRPO, RLOO, REINFORCE++, whose policy
    loss and one-step KL say little) each reward function's mean, the entropy, the gradient norm and the KL loss.
    Only the metrics the step has are shown."""
    head = ["reward/score/mean"]
    if "critic/vf_loss" in metrics:
        body = ["actor/pg_loss", "critic/vf_loss", "critic/vf_explained_var", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm"]
    else:  # reward/fn/<name>/mean: a function's mean (its verl extras are reward/fn/<name>/<key>/mean)
        head += sorted(k for k in metrics if k.startswith("reward/fn/") and k.endswith("/mean") and k.count("/") == 3)
        body = ["actor/entropy", "actor/grad_norm", "actor/kl_loss"]
    return [*head, "eval/score/mean", *body, "response_length/mean", "timing_s/step", "perf/throughput"]


class ProgressBar(tqdm):
    """tqdm's bar that, while shown, has the root logger's console handlers write their records through tqdm.write
    (tqdm.contrib.logging), so a log line never lands on the bar's line; closing it puts the handlers back."""

    def __init__(self, *args, **kwargs):
        self._redirect = None
        super().__init__(*args, **kwargs)
        if not self.disable:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def close(self) -> None:
        redirect, self._redirect = getattr(self, "_redirect", None), None
        if redirect is not None:
            redirect.__exit__(None, None, None)
        super().close()


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard: bool = True, prometheus_port: int | None = None,
                 console_keys: list[str] | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.prometheus = PrometheusGauges(prometheus_port) if prometheus_port is not None else None
        self.wandb: WandbRun | None = None  # open_wandb, once the run knows whether it resumes
        self.run_dir = run_dir
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        # the TensorBoard writer is made at the first write (or truncate_after): a start refused before it (a resume
        # check) leaves no event file behind
        self.tensorboard, self.tb = tensorboard, None
        self.start = time.time()
        self.console_keys = list(console_keys or [])  # run.console_keys; empty: the estimator's own (console_defaults)
        self.seen: set[str] = set()  # every metric name logged so far, for the check of console_keys
        self.keys_checked = False

    def _board(self, purge_step: int | None = None):
        """The TensorBoard writer (None without TensorBoard), made on first use."""
        if self.tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=self.run_dir, purge_step=purge_step)
        return self.tb

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self._board() is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.prometheus is not None:
            self.prometheus.set({"step": step, **metrics})
        if self.wandb is not None:
            self.wandb.log(step, clean)

    def open_wandb(self, fresh: bool, **kwargs) -> None:
        """Log to W&B too from here on (kwargs: WandbRun's project, entity, name, config)."""
        self.wandb = WandbRun(self.run_dir, fresh=fresh, **kwargs)

    def truncate_after(self, step: int) -> None:
        """On resume from checkpoint `step`: forget what was logged after it (metrics.jsonl, eval_samples.jsonl),
        so every step appears once. A line a kill cut in half is dropped with a warning."""
        self.jsonl.close()
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            path = os.path.join(self.run_dir, name)
            if not os.path.exists(path):
                continue
            kept = [line if line.endswith("\n") else line + "\n"
                    for line, record in _json_lines(path) if record["step"] <= step]
            with open(path, "w") as f:
                f.writelines(kept)
        self.jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self._board(purge_step=step + 1)

    def samples(self, step: int, rows: list[dict]) -> None:
        """Every eval prompt's response and score, one JSON line per eval step (eval_samples.jsonl)."""
        with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "samples": rows}) + "\n")
        if self.wandb is not None:
            self.wandb.samples(step, rows)

    def text(self, tag: str, text: str, step: int) -> None:
        if self._board() is not None:
            self.tb.add_text(tag, text, step)

    def console(self, step: int, total: int, metrics: dict[str, float], eta_s: float | None = None,
                keys: tuple[str, ...] | list[str] | None = None) -> None:
        """One line per log_every steps (also in Slurm logs, where the progress bar is off), with the time left.
        Its metrics: `keys`, else run.console_keys (this logger's console_keys), else the estimator's own
        (console_defaults); a configured key no step has logged by the first train step is named once in a
        warning, with the close names."""
        self.seen.update(metrics)
        if self.console_keys and step > 0 and not self.keys_checked:
            self.keys_checked = True
            unknown = [k for k in self.console_keys if k not in self.seen]
            if unknown:
                close = {k: difflib.get_close_matches(k, sorted(self.seen), n=3, cutoff=0.8) for k in unknown}
                logging.getLogger("meshrl").warning(
                    "run.console_keys: %s logged by no step so far; %s (every metric is in metrics.jsonl)",
                    ", ".join(unknown), "; ".join(f"{k}: did you mean {', '.join(c)}?" if c else f"{k}: no close name"
                                                  for k, c in close.items()))
        keys = keys or self.console_keys or console_defaults(metrics)
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
        if eta_s is not None:
            minutes, seconds = divmod(int(round(eta_s)), 60)
            parts.append(f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
        tqdm.write(f"step {step}/{total} " + " ".join(parts))

    def progress(self, start: int, total: int) -> tqdm:
        """A progress bar over the steps (stderr, only on a terminal: logs stay clean). While it is shown, the log
        records of the console handlers are written through it (above the bar, which is drawn again below them)."""
        return ProgressBar(total=total, initial=start, desc="steps", unit="step", dynamic_ncols=True,
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
    steps between a checkpoint and a crash show the lost attempt's values there; metrics.jsonl has the resumed ones).
    A fresh start (no checkpoint to resume) begins a new W&B run."""

    def __init__(self, run_dir: str, project: str, name: str, config: dict, entity: str | None = None,
                 fresh: bool = True):
        import uuid

        import wandb  # optional: config.check_ppo refuses run.wandb=true without it

        id_file = os.path.join(run_dir, "wandb_id")
        if os.path.exists(id_file) and not fresh:
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
        try:
            self.server, _ = start_http_server(port, registry=self.registry)
        except OSError as e:  # a user's choice (the port is taken, or reserved): a config error, not a crash
            raise ValueError(f"run.prometheus_port={port}: cannot serve metrics on it ({e.strerror or e}); pick a "
                             "free port, or null for no endpoint") from e
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
