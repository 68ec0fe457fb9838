"""Gradient-sync frequency (comm.grad_sync_every): which micro-batches reduce gradients, and the switch that turns
reduction off for the others on FSDP2 and DDP."""

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def sync_now(micro_index: int, n_micro: int, every: int) -> bool:
    """Whether micro-batch `micro_index` (0-based, of `n_micro` in one optimizer step) reduces gradients: the last of
    each group of `every`, and always the last of the step (the optimizer must see reduced gradients)."""
    return (micro_index + 1) % max(every, 1) == 0 or micro_index == n_micro - 1


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward: FSDP2 (reduce-scatter, and the HSDP all-reduce;
    unreduced gradients accumulate unsharded until the next sync), DDP (its no_sync flag), a plain module (no-op)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = enabled
