"""This rank's device readings (peak memory, GPU utilisation and memory sampled through NVML while a step runs) and the
health thresholds over a step's metrics (a warning when one is crossed, health/<name>)."""

from __future__ import annotations

import logging
import resource
import threading

import torch


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
