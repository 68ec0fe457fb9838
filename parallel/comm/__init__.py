"""Communication, one concern per module:

- nccl_env: the NCCL environment and its fallback to sockets after a failed init;
- bandwidth: the start-up all-reduce bandwidth check;
- grad_sync: gradient-sync frequency (which micro-batches reduce gradients);
- wire: the bytes-on-the-wire cost model the byte counters use;
- compression: compressed all-reduce of replicated gradients (DDP comm hooks, and the dp_replicate axis of HSDP);
- param_averaging: periodic parameter averaging across replicas (local SGD);
- stale_allreduce: the one-step-stale (overlapped) replica all-reduce;
- usage: the time spent in collectives, peak device memory, and the warnings about both.

Nothing here knows what PPO is. `comm_cfg` is config.CommConfig throughout. Every public name is importable from
`parallel.comm` itself.
"""

from parallel.comm.bandwidth import CPU_MAX_BYTES, DEFAULT_SIZES, allreduce_bandwidth, bandwidth_check, busbw_gbps
from parallel.comm.compression import GradCompression, allreduce_replicas, compression_hook, register_compression
from parallel.comm.grad_sync import set_grad_sync, sync_now
from parallel.comm.nccl_env import (
    FALLBACK_MARKER,
    NAMED_ENV,
    apply_comm_env,
    comm_env,
    init_with_fallback,
    parse_env_entries,
    write_fallback_marker,
)
from parallel.comm.param_averaging import ReplicaAverager
from parallel.comm.stale_allreduce import StaleAllReduce
from parallel.comm.usage import CommTimer, device_memory_fraction
from parallel.comm.wire import allreduce_bytes

__all__ = [
    "CPU_MAX_BYTES", "DEFAULT_SIZES", "FALLBACK_MARKER", "NAMED_ENV", "CommTimer", "GradCompression", "ReplicaAverager",
    "StaleAllReduce", "allreduce_bandwidth", "allreduce_bytes", "allreduce_replicas", "apply_comm_env",
    "bandwidth_check", "busbw_gbps", "comm_env", "compression_hook", "device_memory_fraction", "init_with_fallback",
    "parse_env_entries", "register_compression", "set_grad_sync", "sync_now", "write_fallback_marker",
]
