"""meshrl entry point: `python train_ppo.py --config X` (a world of one) or `torchrun ... train_ppo.py --config X`.

Until the PPO loop lands, this runs the foundation smoke: every pool loads its model, shards it (TP, FSDP2), and
takes a few forward/backward/optimizer steps on random tokens, printing the loss per pool.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import config as C
from parallel.distributed import env_world, init_distributed, shutdown
from parallel.fsdp import shard_model
from parallel.layout import build_layout


def load_model(cfg: C.Config) -> torch.nn.Module:
    arch = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(
        cfg.model.path, config=arch, torch_dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code
    )


def main(argv: list[str]) -> int:
    rank, world, _ = env_world()
    cfg = C.parse_or_exit(argv, world, rank)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device)
    layout = build_layout(C.pools_of(cfg, info.world_size), info.device.type)
    if info.rank == 0:
        print(layout.describe(), flush=True)
    pool = layout.my_pool
    torch.manual_seed(cfg.run.seed)
    model = load_model(cfg).to(info.device)
    model = shard_model(model, pool, cfg.fsdp)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(cfg.run.seed + pool.dp_rank)
    for step in range(cfg.smoke.steps):
        ids = torch.randint(0, vocab, (cfg.smoke.batch_size, cfg.smoke.seq_len), generator=gen).to(info.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG, group=pool.dp_group)
        if pool.dp_rank == 0 and pool.tp_rank == 0:
            print(f"pool {pool.name} step {step} loss {loss.item():.4f}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
