"""meshrl: PPO / GRPO / RLOO / REINFORCE++ on DeviceMesh pools, one SPMD program.

    python train_ppo.py --config configs/quickstart.yaml                      # a world of one, CPU or GPU
    torchrun --nproc_per_node 4 train_ppo.py --config X placement.mode=split  # pools of ranks

Every rank runs this file; the layout decides which roles it hosts. `PPOTrainer.step` (ppo/trainer.py) is the
dataflow of one step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

import checkpoint
import compile_cache
import config as C
from monitor import quiet_libraries
from parallel import comm
from parallel.distributed import env_world, exit_process, init_distributed, shutdown
from parallel.layout import build_layout
from ppo.trainer import PPOTrainer

log = logging.getLogger("meshrl")


def setup(cfg: C.Config, rank: int) -> C.Config:
    """Quickstart assets (recipes/quickstart.py: built once by rank 0 while the others wait), then the data files must
    exist."""
    if cfg.quickstart.enabled:
        if rank == 0:
            from recipes.quickstart import prepare_quickstart

            prepare_quickstart(cfg.quickstart, cfg.run.seed)
        dist.barrier()
    return cfg


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    rank, world, _ = env_world()
    if "--plan" in argv:  # the memory and placement planner: a dry run, no process group, no weights (plan/)
        import plan

        return plan.main(argv, world, rank)
    cfg = C.parse_or_exit(argv, world, rank)
    run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
    comm.apply_comm_env(cfg.comm, run_dir, rank)
    info = comm.init_with_fallback(
        lambda: init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device),
        cfg.comm, run_dir, rank)
    torch.manual_seed(cfg.run.seed)
    setup(cfg, info.rank)
    layout = build_layout(C.pools_of(cfg, info.world_size), info.device.type)
    if info.rank == 0:
        print(layout.describe(C.required_roles(cfg)), flush=True)
    cache = C.compile_cache_folder(cfg)
    if cache and info.device.type == "cuda":  # before anything compiles: what an earlier run compiled (GPU only)
        triton_said = compile_cache.use_triton_cache(cache)
        if info.rank == 0:
            log.info("%s", triton_said)
        said = compile_cache.load(compile_cache.cache_file(cache, info.rank, info.world_size, info.device))
        if info.rank == 0 or "could not" in said:
            log.info("%s", said)
    try:
        trainer = PPOTrainer(cfg, layout, info.device)
    except ValueError as e:  # bad data or reward spec: every rank hits it, before any step
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown()
        return 2
    # from here a stop signal means "save and exit"; until now (loading data and models, nothing to save) the
    # default action stops the process at once, even inside the tokenizer
    signal.signal(signal.SIGTERM, checkpoint.on_stop_signal)
    signal.signal(signal.SIGUSR1, checkpoint.on_stop_signal)
    signal.signal(signal.SIGINT, checkpoint.on_interrupt)
    try:
        result = trainer.fit()
    except (C.ConfigError, checkpoint.ResumeError) as e:  # a finished run started again, unreadable checkpoints:
        # nothing was trained or written
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.close()
        shutdown()
        return 2
    except checkpoint.SaveError as e:  # the final checkpoint could not be written (a full disk)
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.close()
        shutdown()
        return 1
    if info.rank == 0:
        before, after = result["before"], result["after"]
        if after == after:
            print(f"eval/score/mean: {before:.3f} at the start -> {after:.3f} at the end", flush=True)
        elif before == before:  # run.total_steps=0 (an evaluation of the start model), or a resume at the end
            print(f"eval/score/mean: {before:.3f} (no step trained)", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training set up its handler
        if os.environ.get("RANK", "0") == "0":
            print("interrupted: stopped at once, without saving; the last complete checkpoint is intact (a partial "
                  "one is removed at the next start)", file=sys.stderr, flush=True)
        code = 130
    exit_process(code)
