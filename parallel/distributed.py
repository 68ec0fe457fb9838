"""Process-group start-up for `torchrun` (any world size) and for plain `python` (a world of one)."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment, or a world of one."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(backend: str = "auto", timeout_s: int = 600, device: str = "auto") -> DistInfo:
    """Start the default process group: NCCL on GPU, gloo on CPU, unless `backend` says otherwise.

    Under torchrun the rendezvous comes from the environment; under plain `python` a world of one uses an
    in-memory store, so no port is opened.
    """
    rank, world_size, local_rank = env_world()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("distributed.backend=nccl needs GPUs; use gloo (or auto) on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            kwargs = {"device_id": dev} if backend == "nccl" else {}
            dist.init_process_group(backend, timeout=timeout, store=_attempt_store(world_size, rank, timeout),
                                    rank=rank, world_size=world_size, **kwargs)
        else:
            if world_size != 1:
                raise ValueError(f"WORLD_SIZE={world_size} without MASTER_ADDR: launch with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    give_new_groups(timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def give_new_groups(timeout: datetime.timedelta) -> None:
    """Make `timeout` the default of every process group created from now on in this process.

    torch gives a group created without a timeout its own defaults (30 min on gloo, 10 on NCCL), not the default
    group's, and DeviceMesh creates its axis groups so; it offers no public setting for them. c10d reads these two
    module defaults at each group's creation, so rebinding them gives the pool, I/O, pair, data-parallel and mesh
    groups (and vLLM's) distributed.timeout_s: a rank that stops taking part fails its peers in that time, not 30 min.
    """
    from torch.distributed import distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if hasattr(c10d, name):
            setattr(c10d, name, timeout)


def _attempt_store(world_size: int, rank: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this torchrun attempt.

    After `torchrun --max-restarts` restarts the workers, the default env:// store of torch 2.13 hands the new
    processes the previous attempt's connection keys and the process group fails to connect ("Connection refused",
    pytorch/pytorch#167288); a prefix per TORCHELASTIC_RESTART_COUNT keeps the attempts apart.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return dist.PrefixStore(f"meshrl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Leave after the process group is gone, with `code` as the exit status.

    With torch 2.13's gloo about one exit in ten aborts during interpreter shutdown ("terminate called without an
    active exception"), which would turn a finished run into a failed one under torchrun; skipping the interpreter's
    shutdown keeps the exit status true. Call only after everything is written and closed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on `group` must live: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def anyone(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of `group` (the world by default) when `flag` is true on some rank: how ranks agree to
    stop together rather than leave the others waiting in their next collective."""
    value = torch.tensor([float(flag)], device=comm_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reducer(group: dist.ProcessGroup | None):
    """`reduce(t, op)` for algo/: `t` all-reduced over `group` with op "sum", "max" or "min", returned on t's device
    and dtype (a copy; `t` is left alone). A group of one (or None) returns a copy of `t` without communicating."""

    def reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = t.detach().clone()
        if group is None or dist.get_world_size(group) == 1:
            return out
        wire = out.to(comm_device(group), torch.float64 if out.is_floating_point() else out.dtype)
        dist.all_reduce(wire, op=_OPS[op], group=group)
        return wire.to(t.device, t.dtype)

    return reduce
