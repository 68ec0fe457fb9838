"""The NCCL environment: the variables comm config asks for, set before the process group starts, and the fallback to
TCP sockets on the next start after a failed NCCL init (comm.fallback_to_sockets)."""

import datetime
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("meshrl.comm")

FALLBACK_MARKER = "nccl_init_failed.json"  # in the run folder; delete it to try InfiniBand again
NAMED_ENV = (("nccl_ib_disable", "NCCL_IB_DISABLE"), ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME"),
             ("nccl_ib_hca", "NCCL_IB_HCA"), ("nccl_debug", "NCCL_DEBUG"))


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
