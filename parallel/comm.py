"""Communication: the NCCL environment and its sockets fallback, a start-up all-reduce bandwidth check, gradient-sync
frequency, compressed all-reduce of replicated gradients (DDP comm hooks, and the dp_replicate axis of HSDP),
periodic parameter averaging across replicas, a one-step-stale (overlapped) replica all-reduce, and the time spent
in collectives.

Nothing here knows what PPO is. `comm_cfg` is config.CommConfig throughout.

Bytes are counted as what one rank puts on the wire under the usual cost model of each collective (NCCL's ring /
pairwise algorithms): all-reduce of B bytes over n ranks 2(n-1)/n*B, all-to-all (n-1)/n*B, all-gather of b bytes per
rank (n-1)*b. That is the quantity compression shrinks; it is not what a profiler sees on a particular topology.
"""

import contextlib
import datetime
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("meshrl.comm")

FALLBACK_MARKER = "nccl_init_failed.json"  # in the run folder; delete it to try InfiniBand again
NAMED_ENV = (("nccl_ib_disable", "NCCL_IB_DISABLE"), ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME"),
             ("nccl_ib_hca", "NCCL_IB_HCA"), ("nccl_debug", "NCCL_DEBUG"))


# ---------------------------------------------------------------------------------------------------------------
# NCCL environment and the fallback to sockets


def parse_env_entries(entries: Sequence[str], where: str = "comm.extra_env") -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}; a ValueError names the malformed entry."""
    out = {}
    for i, entry in enumerate(entries):
        key, sep, value = str(entry).partition("=")
        key = key.strip()
        if not sep or not key or not (key[0].isalpha() or key[0] == "_") or not key.replace("_", "").isalnum():
            raise ValueError(f"{where}[{i}]={entry!r}: expected KEY=VALUE with KEY a variable name, "
                             "e.g. NCCL_NET_GDR_LEVEL=PHB")
        if key in out:
            raise ValueError(f"{where}[{i}]={entry!r}: {key} is set twice")
        out[key] = value
    return out


def comm_env(comm_cfg) -> dict[str, str]:
    """The variables the config asks for: the named NCCL fields, then extra_env (which may not repeat them)."""
    env = {}
    for field_name, var in NAMED_ENV:
        value = getattr(comm_cfg, field_name)
        if value is not None:
            env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    for key, value in parse_env_entries(comm_cfg.extra_env).items():
        if key in env:
            named = next(f for f, v in NAMED_ENV if v == key)
            raise ValueError(f"comm.extra_env sets {key}, which comm.{named} already sets; keep one")
        env[key] = value
    return env


def apply_comm_env(comm_cfg, run_dir: str, rank: int = 0) -> dict[str, str]:
    """Put the config's NCCL variables into os.environ; call before the process group starts (NCCL reads them when
    its communicators are created). When an earlier start of this run left the fallback marker in `run_dir` and
    comm.fallback_to_sockets is on, NCCL_IB_DISABLE=1 as well. Returns what was set; rank 0 logs it once."""
    env = comm_env(comm_cfg)
    marker = os.path.join(run_dir, FALLBACK_MARKER)
    fallback = None
    if comm_cfg.fallback_to_sockets and os.path.isfile(marker):
        with open(marker) as f:
            fallback = json.load(f)
        env["NCCL_IB_DISABLE"] = "1"
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if rank == 0:
        if fallback is not None:
            log.warning("comm: NCCL init failed on an earlier start of this run (rank %s on %s: %s); "
                        "NCCL_IB_DISABLE=1, NCCL uses TCP sockets (comm.fallback_to_sockets; delete %s to try "
                        "InfiniBand again)", fallback.get("rank"), fallback.get("host"),
                        fallback.get("error", "?")[:300], marker)
        for k, v in env.items():
            was = f" (was {before[k]})" if before[k] is not None and before[k] != v else ""
            log.info("comm: %s=%s%s", k, v, was)
    return env


def init_with_fallback(init_fn: Callable[[], object], comm_cfg, run_dir: str, rank: int = 0):
    """Run `init_fn` (which starts the process group) and, on NCCL, one tiny all-reduce so that the communicator
    really exists (NCCL may create it lazily). If that fails while InfiniBand is enabled and comm.fallback_to_sockets
    is on, write the marker that makes the next start (torchrun --max-restarts) call apply_comm_env with
    NCCL_IB_DISABLE=1, then re-raise: this start is lost either way. Returns what init_fn returns."""
    try:
        result = init_fn()
        if dist.is_initialized() and dist.get_backend() == "nccl":
            probe = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(probe)
            probe.item()
        return result
    except (RuntimeError, OSError) as e:  # DistError and its kinds derive from RuntimeError
        if comm_cfg.fallback_to_sockets and os.environ.get("NCCL_IB_DISABLE", "0") != "1":
            write_fallback_marker(run_dir, rank, e)
        raise


def write_fallback_marker(run_dir: str, rank: int, error: BaseException) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, FALLBACK_MARKER)
    record = {"rank": rank, "host": socket.gethostname(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
              "error": f"{type(error).__name__}: {error}"[:2000]}
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}"  # several ranks may fail at once: write, then rename
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    log.error("comm: process-group start failed on rank %d with InfiniBand enabled (%s); the next start will set "
              "NCCL_IB_DISABLE=1 (marker %s)", rank, record["error"][:300], path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Start-up bandwidth check


DEFAULT_SIZES = (1 << 20, 1 << 26, 1 << 28)
CPU_MAX_BYTES = 1 << 24  # gloo on CPU: larger sizes only make the start-up slow


def busbw_gbps(nbytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: 2(n-1)/n * bytes / time, in GB/s (1e9 bytes)."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9 if seconds > 0 else 0.0


def allreduce_bandwidth(group: dist.ProcessGroup | None, device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES,
                        warmup: int = 2, iters: int = 5) -> dict[int, tuple[float, float]]:
    """{bytes: (seconds per all-reduce, bus bandwidth GB/s)} of float32 all-reduces over `group`; every rank of the
    group calls it and gets the same numbers (the slowest rank's time). On CPU, sizes above 16 MiB become one of 16 MiB.
    A group of one rank has no bandwidth: {}."""
    n = dist.get_world_size(group)
    if n < 2:
        return {}
    if device.type == "cpu" and max(sizes) > CPU_MAX_BYTES:
        sizes = [s for s in sizes if s < CPU_MAX_BYTES] + [CPU_MAX_BYTES]
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(x, group=group)
        _sync(device)
        dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        seconds = float(elapsed)
        out[nbytes] = (seconds, busbw_gbps(nbytes, seconds, n))
    return out


def bandwidth_check(layout, device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES) -> dict[str, float]:
    """Time all-reduces over the data-parallel group of every pool (the group gradients are averaged over), all pools
    at once. Returns this rank's metrics: comm/allreduce_busbw_gbps (the pool's largest size) and the same under
    comm/allreduce_busbw_gbps/<pool>; the first rank of each pool logs a line per size."""
    pool = layout.my_pool
    table = allreduce_bandwidth(pool.dp_group, device, sizes)
    if not table:
        return {}
    if layout.rank == pool.ranks[0]:
        for nbytes, (seconds, bw) in table.items():
            log.info("comm: pool %s all-reduce %s over %d ranks: %.3f ms, bus bandwidth %.1f GB/s", pool.name,
                     _human(nbytes), pool.dp_size, seconds * 1e3, bw)
    top = table[max(table)][1]
    return {"comm/allreduce_busbw_gbps": top, f"comm/allreduce_busbw_gbps/{pool.name}": top}


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------------
# Gradient-sync frequency


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


# ---------------------------------------------------------------------------------------------------------------
# Compressed all-reduce of replicated gradients (DDP comm hooks)


def allreduce_bytes(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


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
        self.bytes = 0.0

    def pop_bytes(self) -> float:
        """Bytes this rank sent since the last call (comm/grad_bytes per step)."""
        out, self.bytes = self.bytes, 0.0
        return out


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
        x = x + residual  # DDP rebuilds its buckets after the first step: a residual of another size is dropped
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


# ---------------------------------------------------------------------------------------------------------------
# Periodic parameter averaging (local SGD across replicas)


class ReplicaAverager:
    """Local SGD over the replicas: each replica (dp_replicate index) steps on its own gradients, and every k
    optimizer steps the parameters are averaged over `group`; k adapts between k_min and k_max.

    The model's gradients must not be reduced over the replicas (FSDP2 over dp_shard alone, as for
    allreduce_replicas). The rule for k: each replica keeps an exponential moving average of its loss (`beta`; a
    mini-batch loss alone is too noisy to difference), averaged over the replicas on the same all-reduce as the
    parameters, and compared with its value at the previous average: a relative change per step above `fast` halves k
    (the loss moves fast, so do the replicas, and they drift apart), below `slow` doubles it (a plateau: little to
    gain from syncing often). AdaComm (Wang & Joshi 2019) argues for the opposite direction late in training, to lower
    the error floor; k_max bounds the drift either way. Every replica takes the same decision because it uses the
    averaged value. Optimizer states are not averaged, as in post-local-SGD. Parameters are averaged in float32
    buckets of at most `bucket_numel` local elements.
    """

    def __init__(self, group: dist.ProcessGroup | None, k_min: int = 1, k_max: int = 16, slow: float = 0.02,
                 fast: float = 0.1, beta: float = 0.9, bucket_numel: int = 1 << 25):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"k_min={k_min}, k_max={k_max}: need 1 <= k_min <= k_max")
        self.group = group or dist.group.WORLD
        self.k_min, self.k_max, self.slow, self.fast, self.beta = k_min, k_max, slow, fast, beta
        self.bucket_numel = bucket_numel
        self.k, self.since = k_min, 0
        self.ema: float | None = None
        self.last_loss: float | None = None
        self.rounds = 0

    @torch.no_grad()
    def step(self, model: nn.Module, loss: float) -> dict[str, float]:
        """Call after every optimizer step with this replica's loss. Returns comm/sync_period (the k in force) and
        comm/averaged (1.0 on the steps that averaged)."""
        self.since += 1
        loss = float(loss)
        self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        if self.since < self.k:
            return {"comm/sync_period": float(self.k), "comm/averaged": 0.0}
        n = self.group.size()
        params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        mean_loss = None
        for lo, hi in self._buckets(params):
            bucket = params[lo:hi]
            flat = torch.cat([t.reshape(-1).float() for t in bucket] or [torch.zeros(0)])
            last = hi == len(params)
            if last:  # the smoothed loss rides on the last bucket's all-reduce
                flat = torch.cat([flat, flat.new_tensor([self.ema])])
            flat.div_(n)
            dist.all_reduce(flat, group=self.group)
            if last:
                mean_loss = float(flat[-1])
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self._adapt(mean_loss)
        self.rounds += 1
        return {"comm/sync_period": float(self.k), "comm/averaged": 1.0}

    def _buckets(self, params: list[torch.Tensor]) -> list[tuple[int, int]]:
        bounds, lo, size = [], 0, 0
        for i, t in enumerate(params):
            if size and size + t.numel() > self.bucket_numel:
                bounds.append((lo, i))
                lo, size = i, 0
            size += t.numel()
        return [*bounds, (lo, len(params))]

    def _adapt(self, loss: float | None) -> None:
        steps, self.since = self.since, 0
        if loss is None or self.last_loss is None:
            self.last_loss = loss
            return
        rate = abs(loss - self.last_loss) / max(abs(self.last_loss), 1e-12) / steps
        if rate > self.fast:
            self.k = max(self.k_min, self.k // 2)
        elif rate < self.slow:
            self.k = min(self.k_max, self.k * 2)
        self.last_loss = loss


# ---------------------------------------------------------------------------------------------------------------
# One-step-stale gradient all-reduce across replicas


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
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_numel: int = 1 << 25):
        self.group = group or dist.group.WORLD
        self.bucket_numel = bucket_numel
        self.params: list[nn.Parameter] | None = None  # fixed at the first exchange
        self.bounds: list[tuple[int, int]] = []  # buckets as [lo, hi) ranges of self.params
        self.buffers: list[list[torch.Tensor]] = []  # two sets of flat buckets: slot 0 and slot 1
        self.inflight: tuple[int, list[dist.Work]] | None = None  # (slot, its all-reduces)
        self.ready: int | None = None  # a slot holding a finished average not yet applied as the stale one
        self.bytes = 0.0

    @torch.no_grad()
    def exchange(self, model: nn.Module) -> int:
        """Send this step's gradients, install the previous step's average in their place; returns the staleness
        (in optimizer steps) of the gradients now installed: 1, or 0 when nothing earlier was pending."""
        local = self._local_grads(model)
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

    def pop_bytes(self) -> float:
        """Bytes this rank sent since the last call (comm/grad_bytes per step)."""
        out, self.bytes = self.bytes, 0.0
        return out

    def _local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        with_grad = [p for p in model.parameters() if p.grad is not None]
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in with_grad]
        if self.params is None:
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


# ---------------------------------------------------------------------------------------------------------------
# Time in collectives


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
        self.seconds = 0.0
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "span": 0}
        self.untimed = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def span(self, kind: str = "span"):
        """Time the block as communication; on GPU by events on the current stream (no synchronisation here)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.seconds += time.perf_counter() - t0

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
        seconds = self.seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self.seconds, self._events = 0.0, []
        out = {"perf/comm_s": seconds}
        if step_seconds:
            out["perf/comm_fraction"] = seconds / step_seconds
        return out


class _TimedAllGather:
    def __init__(self, timer: CommTimer):
        self.timer = timer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if async_op:
            self.timer.untimed += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        with self.timer.span("all_gather"):
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)


class _TimedReduceScatter:
    def __init__(self, timer: CommTimer):
        self.timer = timer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op:
            self.timer.untimed += 1
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=True)
        with self.timer.span("reduce_scatter"):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)


# ---------------------------------------------------------------------------------------------------------------
# Warnings


def device_memory_fraction(device: torch.device) -> float | None:
    """Peak reserved memory / device memory on GPU; None on CPU (no fixed budget to compare with)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return torch.cuda.max_memory_reserved(device) / total


class UsageWarnings:
    """Warn when perf/comm_fraction passes comm.comm_fraction_warn or peak device memory passes
    comm.memory_fraction_warn; each warns once, and again only after it has gone back under its threshold."""

    def __init__(self, comm_cfg):
        self.limits = {"comm": comm_cfg.comm_fraction_warn, "memory": comm_cfg.memory_fraction_warn}
        self.active: set[str] = set()

    def check(self, comm_fraction: float | None, memory_fraction: float | None) -> list[str]:
        """Returns (and logs) the new warnings of this step."""
        out = []
        for kind, value in (("comm", comm_fraction), ("memory", memory_fraction)):
            if value is None:
                continue
            limit = self.limits[kind]
            if value > limit and kind not in self.active:
                self.active.add(kind)
                what = ("time in collectives is {:.0%} of the step (comm.comm_fraction_warn={:g}): consider "
                        "comm.grad_sync_every, comm.compression or a larger micro_batch_tokens"
                        if kind == "comm" else
                        "peak device memory is {:.0%} of the device (comm.memory_fraction_warn={:g}): consider "
                        "fsdp.cpu_offload, activation_checkpointing or a smaller micro_batch_tokens")
                out.append(what.format(value, limit))
                log.warning("comm: %s", out[-1])
            elif value <= limit:
                self.active.discard(kind)
        return out
