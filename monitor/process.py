"""The run's process: its run folder's lock, its age, torch.profiler over a block, and libraries kept quiet on the
console."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings

import torch


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
