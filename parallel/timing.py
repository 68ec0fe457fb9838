"""Seconds of named blocks of work on a device, without a host sync where the work runs (rollout phases, collectives).
"""

import contextlib
import time

import torch


class DeviceClock:
    """Seconds of named blocks of work: on CUDA the device time between two events recorded around each block on the
    current stream, read by `pop` (which waits for the events: call it where the work has synchronised anyway); on
    CPU, or for host work that launches nothing on the stream (host=True), the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, host: bool = False):
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            began = time.perf_counter()
            try:
                yield
            finally:
                self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - began

    def pop(self) -> dict[str, float]:
        """Seconds per name since the last pop (names never timed are absent)."""
        totals, self._totals = self._totals, {}
        for name, start, end in self._events:
            end.synchronize()
            totals[name] = totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._events = []
        return totals
