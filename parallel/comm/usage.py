"""What a step spends on communication and memory: seconds in collectives (CommTimer, perf/comm_fraction) and peak
device memory (perf/memory_fraction); monitor.HealthWarnings warns when either passes its health threshold.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from parallel.timing import DeviceClock


class CommTimer:
    """Seconds spent in collectives during a step, for perf/comm_fraction.

    What it counts: the collectives it is shown, i.e. FSDP2's all-gathers and reduce-scatters of the modules passed
    to `watch_fsdp` (timed around each call on the stream FSDP issues it from: CUDA events on GPU, the blocking call
    on CPU), and whatever runs inside `span()` (explicit collectives: batch transfer, metric reductions). Time
    includes waiting for slower peers. Overlapped time counts too, so the fraction is an upper bound of the time
    communication costs the step, not the exposed part. Not counted: HSDP's replicate all-reduce (FSDP2 issues it
    with no way to wrap it), DDP buckets, and all-gathers started with unshard(async_op=True) (counted in `untimed`).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "span": 0}
        self.untimed = 0
        self._clock = DeviceClock(device)

    @contextlib.contextmanager
    def span(self, kind: str = "span"):
        """Time the block as communication; on GPU by events on the current stream (no synchronisation here)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        with self._clock("comm"):
            yield

    def watch_fsdp(self, model: nn.Module) -> None:
        """Time every all-gather and reduce-scatter of the FSDP2 modules in `model` (results are unchanged: the
        wrappers call the same torch.distributed functions as FSDP2's defaults)."""
        for m in model.modules():
            # all_gather_into_tensor / reduce_scatter_tensor: the names torch 2.11 and 2.13 share
            if isinstance(m, FSDPModule) and hasattr(m, "set_custom_all_gather"):
                m.set_custom_all_gather(_TimedAllGather(self))
                m.set_custom_reduce_scatter(_TimedReduceScatter(self))

    def pop(self, step_seconds: float | None = None) -> dict[str, float]:
        """{"perf/comm_s": seconds since the last pop, "perf/comm_fraction": their share of `step_seconds` when
        given}; on GPU this waits for the recorded events (call it where the step has synchronised anyway)."""
        seconds = self._clock.pop().get("comm", 0.0)
        out = {"perf/comm_s": seconds}
        if step_seconds:
            out["perf/comm_fraction"] = seconds / step_seconds
        return out


# torch 2.13 renamed the two collectives FSDP2 calls (the old names warn there); torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TimedAllGather:
    def __init__(self, timer: CommTimer):
        self.timer = timer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if async_op:
            self.timer.untimed += 1
            return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=True)
        with self.timer.span("all_gather"):
            return _ALL_GATHER(output_tensor, input_tensor, group=group)


class _TimedReduceScatter:
    def __init__(self, timer: CommTimer):
        self.timer = timer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op:
            self.timer.untimed += 1
            return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=True)
        with self.timer.span("reduce_scatter"):
            return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group)


def device_memory_fraction(device: torch.device) -> float | None:
    """Peak reserved memory / device memory on GPU; None on CPU (no fixed budget to compare with)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return torch.cuda.max_memory_reserved(device) / total
