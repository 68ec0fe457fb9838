"""Supervised fine-tuning on prompt/response pairs (loss on the response tokens), with the same FSDP2 path as PPO.

    python train_sft.py --config configs/sft.yaml            # or under torchrun
Saves an HF folder (config, safetensors, tokenizer) at sft.output_dir that a PPO config's model.path can name; with
actor.lora, a peft adapter folder there that a PPO config's actor.lora.init_path can name (model.path the same base).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import config as C
from monitor import quiet_libraries
from parallel.distributed import env_world, exit_process, init_distributed, shutdown
from parallel.fsdp import shard_model
from parallel.layout import build_layout
from roles.lora import apply_lora, save_adapter_folder
from roles.modeling import load_causal_lm
from roles.sft import encode_pairs, save_hf, sft_train
from tasks.data import load_sft_records


def main(argv: list[str]) -> int:
    quiet_libraries()
    rank, world, _ = env_world()
    cfg = C.parse_or_exit(argv, world, rank, check=C.check_sft)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device)
    try:
        records = load_sft_records(cfg.sft.train_path, cfg.sft.prompt_key, cfg.sft.response_key)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        pairs = encode_pairs(records, tokenizer, cfg.data.chat_template, cfg.data.system_prompt)
    except (ValueError, OSError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    layout = build_layout([C.PoolConfig("all", world, ["actor"], cfg.placement.tp, cfg.placement.dp_replicate)],
                          info.device.type)
    pool = layout.pools[0]
    torch.manual_seed(cfg.run.seed)
    model = load_causal_lm(cfg.model.path, cfg.model.trust_remote_code).to(info.device)
    # actor.lora: the adapters train (their folder is saved, for a PPO run's actor.lora.init_path)
    adapters = apply_lora(model, cfg.actor.lora, cfg.actor.fsdp.param_dtype)
    model = shard_model(adapters.model if adapters is not None else model, pool, cfg.actor.fsdp)
    sft_train(model, pairs, cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size, cfg.run.seed,
              info.device, pool)
    if adapters is not None:
        save_adapter_folder(adapters, cfg.model.path, cfg.actor.lora, tokenizer, cfg.sft.output_dir, rank,
                            cfg.model.trust_remote_code)
    else:
        save_hf(model, tokenizer, cfg.sft.output_dir, rank)
    dist.barrier()
    if rank == 0:
        print(f"saved {cfg.sft.output_dir}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
