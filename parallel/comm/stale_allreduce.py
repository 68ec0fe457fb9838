"""The one-step-stale gradient all-reduce across replicas (comm.stale_allreduce): step t's all-reduce overlaps step
t+1's forward and backward."""

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.comm.wire import allreduce_bytes


class StaleAllReduce:
    """Average the gradients over the replicas one optimizer step late, so that the all-reduce runs during the next
    step's forward and backward instead of between the last backward and the optimizer step.

    `exchange(model)` once per optimizer step, after the last backward and before clipping: it copies this step's
    local gradients (DTensor shards: to_local) into float32 buckets of at most `bucket_numel` elements, divides them
    by the group size and starts an async all-reduce of each bucket, then overwrites the gradients with the average
    of the previous step's gradients, waiting for that all-reduce (it has had a whole step to finish). Step t >= 2 so
    applies exactly the synchronous average of step t-1's gradients (the same divide-then-sum as allreduce_replicas
    with method "none"); every replica receives the same bits, so the replicas stay identical. The first step has
    nothing earlier: it waits for its own all-reduce and applies it (staleness 0), and that average is applied again,
    as the stale one, by step 2. The last step's average is never applied: that is the price of the staleness.

    The model's gradients must not be reduced over the replicas (FSDP2 over dp_shard alone, as for
    allreduce_replicas). The set of parameters with gradients is fixed at the first exchange (every replica sends the
    same buckets in the same order each step). A non-finite gradient travels inside the average: the step that
    computed it applies the previous, finite average, and the next step sees non-finite gradients on every replica at
    once, so a trainer that skips non-finite steps skips that one, one step late, on all replicas alike. Memory: two
    float32 copies of the local gradients (one in flight, one being applied).

    A checkpoint keeps the average not applied yet (`state_dict`, after `flush`); the first exchange after
    `load_state_dict` installs it as the stale one, as the uninterrupted run would have.
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_numel: int = 1 << 25):
        self.group = group or dist.group.WORLD
        self.bucket_numel = bucket_numel
        self.params: list[nn.Parameter] | None = None  # fixed at the first exchange
        self.param_index: list[int] = []  # their positions in model.parameters(), to check a restored average
        self.bounds: list[tuple[int, int]] = []  # buckets as [lo, hi) ranges of self.params
        self.buffers: list[list[torch.Tensor]] = []  # two sets of flat buckets: slot 0 and slot 1
        self.inflight: tuple[int, list[dist.Work]] | None = None  # (slot, its all-reduces)
        self.ready: int | None = None  # a slot holding a finished average not yet applied as the stale one
        self.restored: dict | None = None  # from load_state_dict, installed at the next exchange
        self.bytes = 0.0

    @torch.no_grad()
    def exchange(self, model: nn.Module) -> int:
        """Send this step's gradients, install the previous step's average in their place; returns the staleness
        (in optimizer steps) of the gradients now installed: 1, or 0 when nothing earlier was pending."""
        local = self._local_grads(model)
        if self.restored is not None:
            self._restore(self.restored)
        held = self.inflight[0] if self.inflight is not None else self.ready
        slot = 1 - held if held is not None else 0
        n = self.group.size()
        works = []
        for (lo, hi), flat in zip(self.bounds, self.buffers[slot]):
            torch.cat([t.reshape(-1).float() for t in local[lo:hi]], out=flat)
            flat.div_(n)
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.bytes += allreduce_bytes(flat.numel() * flat.element_size(), n)
        if held is None:  # the first step: apply this step's own average
            for w in works:
                w.wait()
            self.inflight, self.ready = None, slot
            self._install(local, slot)
            return 0
        if self.inflight is not None:
            for w in self.inflight[1]:
                w.wait()
        self._install(local, held)
        self.inflight, self.ready = (slot, works), None
        return 1

    def flush(self) -> None:
        """Wait for the all-reduce in flight, if any, keeping its average for the next exchange (so training goes on
        as if nothing happened). Issues no collective: safe on any subset of ranks, any number of times. Call it
        before saving a checkpoint and before the process group is destroyed."""
        if self.inflight is not None:
            slot, works = self.inflight
            for w in works:
                w.wait()
            self.inflight, self.ready = None, slot

    def state_dict(self) -> dict:
        """The average not applied yet, for a checkpoint (calls `flush`, so no collective): {"average": its flat
        float32 buckets on CPU, or None when nothing is pending, "bounds": the buckets as [lo, hi) ranges of
        "params", the positions in model.parameters() of the parameters with gradients}."""
        if self.restored is not None:  # loaded, not installed yet: still the pending average
            return {"average": [t.clone() for t in self.restored["average"]],
                    "bounds": [list(b) for b in self.restored["bounds"]], "params": list(self.restored["params"])}
        self.flush()
        average = (None if self.ready is None
                   else [flat.detach().to("cpu", torch.float32, copy=True) for flat in self.buffers[self.ready]])
        return {"average": average, "bounds": [[lo, hi] for lo, hi in self.bounds], "params": list(self.param_index)}

    def load_state_dict(self, state: dict) -> None:
        """Make `state_dict`'s pending average the one the next exchange installs (staleness 1), in place of anything
        pending here; with "average" None the next exchange is a first step (staleness 0). The next exchange checks
        the model's buckets against the saved ones first (ValueError naming both)."""
        missing = [key for key in ("average", "bounds", "params") if key not in state]
        if missing:
            raise ValueError(f"StaleAllReduce.load_state_dict: missing {', '.join(missing)} (got {sorted(state)})")
        average = state["average"]
        if average is not None and not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in average):
            raise ValueError("StaleAllReduce.load_state_dict: 'average' must be a list of 1-D tensors or None")
        self.flush()
        self.ready = None
        self.restored = None if average is None else {
            "average": [t.detach().to("cpu", torch.float32, copy=True) for t in average],
            "bounds": [[int(lo), int(hi)] for lo, hi in state["bounds"]], "params": [int(i) for i in state["params"]]}

    def _restore(self, state: dict) -> None:
        """Put a restored average into slot 0 as the finished, not yet applied one."""
        planned = [flat.numel() for flat in self.buffers[0]]
        sizes = [t.numel() for t in state["average"]]
        if sizes != planned:
            raise ValueError(f"StaleAllReduce.load_state_dict: the restored average has buckets of {sizes} elements, "
                             f"the model's plan {planned} (another model or bucket_numel?)")
        bounds = [[lo, hi] for lo, hi in self.bounds]
        if state["params"] != self.param_index or state["bounds"] != bounds:
            raise ValueError(f"StaleAllReduce.load_state_dict: the restored average is of parameters "
                             f"{state['params']} (buckets {state['bounds']}), the model's gradients are of "
                             f"{self.param_index} (buckets {bounds})")
        for flat, saved in zip(self.buffers[0], state["average"]):
            flat.copy_(saved)
        self.inflight, self.ready, self.restored = None, 0, None

    def pop_bytes(self) -> float:
        """Bytes this rank sent since the last call (comm/grad_bytes per step)."""
        out, self.bytes = self.bytes, 0.0
        return out

    def _local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        with_grad = [p for p in model.parameters() if p.grad is not None]
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in with_grad]
        if self.params is None:
            self.param_index = [i for i, p in enumerate(model.parameters()) if p.grad is not None]
            self._plan(with_grad, local)
        elif len(with_grad) != len(self.params) or any(a is not b for a, b in zip(with_grad, self.params)):
            raise RuntimeError("comm.stale_allreduce: the parameters with gradients changed since the first step "
                               f"({len(self.params)} then, {len(with_grad)} now); the stale all-reduce needs the "
                               "same set every step (mark unused parameters requires_grad=False)")
        return local

    def _plan(self, params: list[nn.Parameter], local: list[torch.Tensor]) -> None:
        self.params = params
        sizes = [t.numel() for t in local]
        lo, total = 0, 0
        for i, numel in enumerate(sizes):
            if total and total + numel > self.bucket_numel:
                self.bounds.append((lo, i))
                lo, total = i, 0
            total += numel
        self.bounds.append((lo, len(params)))
        device = local[0].device if local else torch.device("cpu")  # the gradients' (CPU under cpu_offload)
        self.buffers = [[torch.empty(sum(sizes[lo:hi]), dtype=torch.float32, device=device)
                         for lo, hi in self.bounds] for _ in range(2)]

    def _install(self, local: list[torch.Tensor], slot: int) -> None:
        for (lo, hi), flat in zip(self.bounds, self.buffers[slot]):
            offset = 0
            for t in local[lo:hi]:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
