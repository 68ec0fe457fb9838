"""Compressed all-reduce of replicated gradients (comm.compression): bf16, fp16, int8 and top-k with error feedback,
as a DDP comm hook and, for the dp_replicate axis of HSDP, as an explicit all-reduce of the gradients once per step.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from parallel.comm.wire import allreduce_bytes


class GradCompression:
    """A DDP comm hook's state: the method, the group, top-k error-feedback residuals, and the bytes sent.

    bf16 / fp16 delegate to PyTorch's hooks (cast, all-reduce, cast back). int8 and topk are ours:
    - int8: each rank cuts its bucket into n chunks quantised to int8 with one float32 scale per chunk (max |x| /
      127), an all-to-all gives rank r every rank's chunk r, which it averages in float32, re-quantises and
      all-gathers: ~4x fewer bytes than float32 (plus 8 bytes of scales per chunk).
    - topk: each rank sends the `topk_ratio` fraction of its bucket (gradient + residual) largest in magnitude as
      (float32 value, int32 index) pairs by all-gather; the rest stays in the residual (error feedback) and is added
      to the next step's gradient. Bytes against a float32 all-reduce: 1 / (n * ratio), i.e. the int32 index doubles
      each kept element, and an all-gather grows with n where an all-reduce does not.
    int8 runs its all-to-all inside the hook (blocking; no overlap with the rest of the backward); the other methods
    return the collective's future.
    """

    METHODS = ("none", "bf16", "fp16", "int8", "topk")

    def __init__(self, method: str = "none", group: dist.ProcessGroup | None = None, topk_ratio: float = 0.01,
                 error_feedback: bool = True):
        if method not in self.METHODS:
            raise ValueError(f"comm.compression={method!r}: must be one of {', '.join(self.METHODS)}")
        if not 0 < topk_ratio <= 1:
            raise ValueError(f"comm.topk_ratio={topk_ratio}: must be in (0, 1]")
        self.method, self.group = method, group or dist.group.WORLD
        self.topk_ratio, self.error_feedback = topk_ratio, error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.restored = False  # residuals from load_state_dict, not yet checked against allreduce_replicas' buckets
        self.bytes = 0.0

    def pop_bytes(self) -> float:
        """Bytes this rank sent since the last call (comm/grad_bytes per step)."""
        out, self.bytes = self.bytes, 0.0
        return out

    def state_dict(self) -> dict:
        """This rank's top-k error-feedback residuals, for a checkpoint: {"residuals": {bucket index: [N] float32
        tensor on CPU}}; empty for the other methods, without error feedback, and before the first step."""
        return {"residuals": {i: r.detach().to("cpu", torch.float32, copy=True)
                              for i, r in sorted(self.residuals.items())}}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s residuals. Each moves to its bucket's device at the bucket's next top-k all-reduce;
        the next allreduce_replicas first checks that the model's buckets are the saved ones (ValueError naming the
        bucket count or the bucket and both sizes otherwise: another model or bucket_numel). Under a DDP hook a
        residual whose size no longer matches its bucket is dropped, as after DDP's own bucket rebuild."""
        residuals = state.get("residuals") if isinstance(state, dict) else None
        if not isinstance(residuals, dict) or not all(
                isinstance(i, int) and isinstance(r, torch.Tensor) and r.dim() == 1 for i, r in residuals.items()):
            raise ValueError("GradCompression.load_state_dict: expected {'residuals': {bucket index: 1-D tensor}}, "
                             f"got {type(state).__name__} with keys {sorted(state) if isinstance(state, dict) else []}")
        if self.residuals:
            self._check_buckets(residuals, {i: r.numel() for i, r in self.residuals.items()})
        self.residuals = {i: r.detach().to(torch.float32, copy=True) for i, r in residuals.items()}
        self.restored = bool(self.residuals)

    def _check_buckets(self, residuals: dict[int, torch.Tensor], sizes: dict[int, int]) -> None:
        """ValueError unless `residuals` are one per bucket of `sizes` ({bucket index: numel}), each of its size."""
        if residuals.keys() != sizes.keys():
            raise ValueError(f"GradCompression.load_state_dict: top-k residuals for {len(residuals)} buckets "
                             f"{sorted(residuals)}, but the model has {len(sizes)} buckets {sorted(sizes)}")
        for i, r in sorted(residuals.items()):
            if r.numel() != sizes[i]:
                raise ValueError(f"GradCompression.load_state_dict: the top-k residual of bucket {i} has {r.numel()} "
                                 f"elements, the model's bucket {i} has {sizes[i]} (another model or bucket_numel?)")


def compression_hook(state: GradCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook dispatching on state.method; register with `register_compression`. (No postponed annotations
    in this file: DDP checks this signature's annotations at registration.)"""
    n = state.group.size()
    flat = bucket.buffer()
    if state.method == "none":
        state.bytes += allreduce_bytes(flat.numel() * flat.element_size(), n)
        return default_hooks.allreduce_hook(state.group, bucket)
    if state.method in ("bf16", "fp16"):
        state.bytes += allreduce_bytes(flat.numel() * 2, n)
        hook = default_hooks.bf16_compress_hook if state.method == "bf16" else default_hooks.fp16_compress_hook
        return hook(state.group, bucket)
    if state.method == "int8":
        return _int8_allreduce(state, flat, n)
    return _topk_allreduce(state, bucket.index(), flat, n)


def register_compression(ddp_model: nn.parallel.DistributedDataParallel, method: str,
                         group: dist.ProcessGroup | None = None, topk_ratio: float = 0.01,
                         error_feedback: bool = True) -> GradCompression:
    """Install the compression hook on a DDP-wrapped module; the returned state counts bytes (pop_bytes)."""
    state = GradCompression(method, group if group is not None else ddp_model.process_group, topk_ratio,
                            error_feedback)
    ddp_model.register_comm_hook(state, compression_hook)
    return state


def allreduce_replicas(model: nn.Module, state: GradCompression, bucket_numel: int = 1 << 25) -> None:
    """Average the gradients of a model over the replicas (state.group: the pool's dp_replicate group) with
    state.method, in place, one bucket of at most `bucket_numel` local elements at a time (blocking).

    For HSDP with compression. torch 2.13's FSDP2 issues its HSDP all-reduce itself, in MixedPrecisionPolicy's
    reduce_dtype (which also sets the reduce-scatter's), and `set_all_reduce_hook` only sees that all-reduce's
    output; nothing can change what it sends. So shard the model over dp_shard alone (FSDP2 then reduce-scatters
    inside the replica and stops there) and call this once per optimizer step, after the last backward and before
    clipping. Also works on unsharded (replicated) modules. Buckets keep their index across steps for top-k's
    error feedback, as long as the set of parameters with gradients does not change.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    buckets: list[list[torch.Tensor]] = []
    size = bucket_numel
    for t in local:
        if size + t.numel() > bucket_numel and size > 0:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    if state.restored:
        if state.method == "topk" and state.error_feedback:
            state._check_buckets(state.residuals, {i: sum(t.numel() for t in b) for i, b in enumerate(buckets)})
        state.restored = False
    n = state.group.size()
    for index, bucket in enumerate(buckets):
        flat = torch.cat([t.reshape(-1).float() for t in bucket])
        _average(state, index, flat, n).wait()
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _average(state: GradCompression, index: int, flat: torch.Tensor, n: int) -> torch.futures.Future[torch.Tensor]:
    """The group average of a float32 `flat` [N] by state.method, written into `flat` (the future's value)."""
    if state.method == "int8":
        return _int8_allreduce(state, flat, n)
    if state.method == "topk":
        return _topk_allreduce(state, index, flat, n)
    wire = {"none": flat.dtype, "bf16": torch.bfloat16, "fp16": torch.float16}[state.method]
    send = flat.to(wire).div_(n)  # divide first: a float16 sum of n gradients may overflow where the mean does not
    state.bytes += allreduce_bytes(send.numel() * send.element_size(), n)
    work = dist.all_reduce(send, group=state.group, async_op=True)
    return work.get_future().then(lambda _: flat.copy_(send))


def _int8_allreduce(state: GradCompression, flat: torch.Tensor, n: int) -> torch.futures.Future[torch.Tensor]:
    """Average `flat` [N] over the group in two int8 phases (reduce-scatter by all-to-all, then all-gather)."""
    numel = flat.numel()
    chunk = math.ceil(numel / n)
    x = torch.zeros(n * chunk, dtype=torch.float32, device=flat.device)
    x[:numel] = flat
    send = _pack_int8(x.view(n, chunk))  # [n, chunk + 4]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=state.group)
    mine = _unpack_int8(recv, chunk).mean(0)  # [chunk]: this rank's chunk, averaged over the ranks
    part = _pack_int8(mine[None])[0]
    gathered = torch.empty(n * (chunk + 4), dtype=torch.int8, device=flat.device)
    state.bytes += (n - 1) / n * send.numel() + (n - 1) * part.numel()
    work = dist.all_gather_single(gathered, part, group=state.group, async_op=True)

    def finish(_):
        flat.copy_(_unpack_int8(gathered.view(n, chunk + 4), chunk).flatten()[:numel])
        return flat

    return work.get_future().then(finish)


def _pack_int8(x: torch.Tensor) -> torch.Tensor:
    """[m, c] float -> [m, c + 4] int8: each row quantised with its own scale, the float32 scale in the last 4 bytes."""
    scale = (x.abs().amax(1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.float().view(torch.int8)], dim=1)


def _unpack_int8(packed: torch.Tensor, chunk: int) -> torch.Tensor:
    scale = packed[:, chunk:].contiguous().view(torch.float32)  # [m, 1]
    return packed[:, :chunk].float() * scale


def _topk_allreduce(state: GradCompression, index: int, flat: torch.Tensor,
                    n: int) -> torch.futures.Future[torch.Tensor]:
    """Average the top-k of every rank's `flat` [N] (dense result; the unsent rest goes to the residual)."""
    numel = flat.numel()
    x = flat.float()
    residual = state.residuals.get(index)
    if state.error_feedback and residual is not None and residual.numel() == numel:
        # DDP rebuilds its buckets after the first step: a residual of another size is dropped
        x = x + residual.to(x.device)  # on CPU after load_state_dict
    k = max(1, math.ceil(state.topk_ratio * numel))
    idx = x.abs().topk(k, sorted=False).indices
    values = x[idx]
    if state.error_feedback:
        rest = x.clone()
        rest[idx] = 0
        state.residuals[index] = rest
    # one all-gather of (value bits, index) pairs, both 4 bytes
    packed = torch.cat([values.contiguous().view(torch.int32), idx.to(torch.int32)])
    gathered = torch.empty(n * 2 * k, dtype=torch.int32, device=flat.device)
    state.bytes += (n - 1) * packed.numel() * 4
    work = dist.all_gather_single(gathered, packed, group=state.group, async_op=True)

    def finish(_):
        gathered_ = gathered.view(n, 2 * k)
        vals = gathered_[:, :k].contiguous().view(torch.float32).flatten()
        where = gathered_[:, k:].flatten().long()
        dense = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        dense.index_add_(0, where, vals)
        flat.copy_(dense / n)
        return flat

    return work.get_future().then(finish)
