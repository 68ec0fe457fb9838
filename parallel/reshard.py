"""Stream a sharded model's weights, whole and under their HF names, to a rollout engine after each update.

An inference engine (vLLM's `model.load_weights(iterable of (hf_name, tensor))`) keeps its own copy of the weights
in its own layout; after every optimizer step the trainer's FSDP2 / TP shards are gathered one tensor at a time and
handed over in buckets of bounded size, so the trainer holds at most one bucket of whole tensors beside its shards,
and nothing is written to disk.

Split placement: ranks outside the actor's pool generate too (rollout/world.py). They hold no shard, so one rank of
the actor pool sends each bucket on to them (`broadcast_buckets`): one byte buffer per bucket, its names, shapes and
dtypes sent ahead.

Buffers: HF checkpoints hold a module's `state_dict()`, i.e. its parameters and its *persistent* buffers. Llama and
Qwen2 have no persistent buffers (`rotary_emb.inv_freq` and `original_inv_freq` are non-persistent: the engine
recomputes them from the config), so for them the stream is exactly `named_parameters()`; persistent buffers of other
architectures are streamed after the parameters, as a checkpoint would store them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallel.fsdp import fsdp_modules

# FSDP1, torch's checkpoint_wrapper and torch.compile insert these anywhere in a name; DDP's `module` only leads.
_WRAPPERS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


def hf_name(name: str) -> str:
    """A parameter's name as the HF checkpoint spells it: wrapper prefixes removed.

    `module._orig_mod.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.weight`
    -> `model.layers.0.self_attn.q_proj.weight`.
    """
    parts = [part for part in name.split(".") if part not in _WRAPPERS]
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def weight_buckets(
    model: nn.Module,
    bucket_bytes: int = 256 << 20,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's full (unsharded) weights as lists of (hf_name, tensor), at most `bucket_bytes` bytes a list.

    Order: `named_parameters()` (a tied parameter once, under its first name, as HF checkpoints store it: with
    tied embeddings `lm_head.weight` is left out), then the persistent buffers. The order is the same on every rank.

    Collective: a DTensor (FSDP2 / TP / HSDP shard) is gathered with `full_tensor()` over its mesh, so every rank of
    the model's mesh must iterate to the end, in step; consuming the buckets on one rank only hangs the others.
    Each rank gets every tensor whole; the ones that do not feed the engine drop them.

    FSDP2 modules are resharded first (as FSDP2's own `state_dict()` does), so that a model left unsharded by a
    forward with reshard_after_forward=False streams its float32 master weights, not the `param_dtype` copies.

    Each tensor has the parameter's full shape (e.g. `[vocab, hidden]` for `model.embed_tokens.weight`), is detached,
    cast to `dtype` (floating-point tensors only) and moved to `device` when given; otherwise it keeps the
    parameter's dtype and lies where the gather left it (the mesh's device, also for CPU-offloaded shards) or,
    unsharded, where the parameter is. A tensor that
    needs no gather, cast or move shares storage with the parameter: copy it before the next update to keep it.
    A bucket's bytes (`numel * element_size` after the cast) are <= `bucket_bytes`, except a single tensor larger than
    the bound, which goes alone. weights: the (name, tensor) pairs to stream instead of named_weights(model), read
    after the reshard (a LoRA model's merged weights: roles/lora.Adapters.merged_weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    for module in fsdp_modules(model):
        module.reshard()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in (named_weights(model) if weights is None else weights):
        tensor = whole(tensor, dtype, device)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name(name), tensor))
        size += nbytes
    if bucket:
        yield bucket


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then persistent buffers: the entries of an HF checkpoint, tied duplicates once."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


@torch.no_grad()
def whole(tensor: torch.Tensor, dtype: torch.dtype | None, device) -> torch.Tensor:
    """The tensor whole (a DTensor gathered over its mesh: collective), detached, cast to `dtype` (floating-point
    only) and on `device` (None: where it lies)."""
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        local = tensor.to_local()
        if local.device.type != mesh.device_type:
            # CPU-offloaded shard of a GPU mesh: the gather (NCCL) needs it on the GPU
            tensor = DTensor.from_local(local.to(mesh.device_type), mesh, tensor.placements, run_check=False,
                                        shape=tensor.shape, stride=tensor.stride())
        tensor = tensor.full_tensor()
    # an integer buffer keeps its dtype: the cast is for the weights
    return tensor.detach().to(device=device, dtype=dtype if tensor.is_floating_point() else None)


_ALIGN = 16  # every tensor of a broadcast bucket starts at a multiple of this many bytes: any dtype can view it


def broadcast_buckets(buckets: Iterator[list[tuple[str, torch.Tensor]]] | None, group: dist.ProcessGroup, src: int,
                      device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Send a stream of weight buckets (`weight_buckets`) from global rank `src` to every rank of `group`.

    On `src`, `buckets` is the stream: each bucket is sent and yielded unchanged. On the other ranks `buckets` is None
    and the received buckets are yielded: the same (name, tensor) lists, the tensors views into one byte buffer per
    bucket on `device` (the group's collective device), valid until the next bucket arrives. Every rank of `group`
    must consume the stream to its end; the sender's own collectives (the gathers of `weight_buckets`) go on between
    the broadcasts, so the ranks of its pool consume theirs alongside.
    """
    sending = dist.get_rank() == src
    while True:
        bucket = next(buckets, None) if sending else None
        header: list = [None]
        if sending and bucket is not None:
            header[0] = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        dist.broadcast_object_list(header, src=src, group=group, device=device)
        if header[0] is None:  # the end of the stream
            return
        offsets, size = [], 0
        for _, shape, dtype in header[0]:
            offsets.append(size)
            size += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        if sending:
            buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            for (_, tensor), start in zip(bucket, offsets):
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[start : start + raw.numel()].copy_(raw)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=src, group=group)
        if sending:
            yield bucket
            continue
        yield [(name, buffer[start : start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape))
               for (name, shape, dtype), start in zip(header[0], offsets)]
