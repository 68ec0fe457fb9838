"""Supervised fine-tuning on prompt/response pairs (loss on the response tokens), with the same FSDP2 path as PPO.

    python train_sft.py --config configs/sft.yaml            # or under torchrun
Saves an HF folder (config, safetensors, tokenizer) at sft.output_dir that a PPO config's model.path can name.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

import config as C
from parallel.distributed import env_world, exit_process, init_distributed, shutdown
from parallel.fsdp import shard_model
from parallel.layout import Pool, build_layout
from roles.modeling import grad_norm_and_clip, load_causal_lm
from tasks.data import load_sft_records


def encode_pairs(records: list[dict], tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + response + eos token ids, prompt length) per pair."""
    out = []
    for r in records:
        prompt = tokenizer(r["prompt"])["input_ids"]
        response = tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + response, len(prompt)))
    return out


def sft_loss(model, pairs: list[tuple[list[int], int]], device) -> torch.Tensor:
    """Mean cross-entropy over the response tokens of `pairs` (right-padded)."""
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    attn = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (seq, plen) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, plen : len(seq)] = torch.tensor(seq[plen:])
        attn[i, : len(seq)] = 1
    return model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss


def sft_train(model, pairs, steps: int, lr: float, batch_size: int, seed: int, device,
              pool: Pool | None = None, log_every: int = 50) -> list[float]:
    """AdamW on random batches of `pairs`; each data-parallel rank of `pool` takes its slice of every batch."""
    dp_rank, dp_size = (pool.dp_rank, pool.dp_size) if pool is not None else (0, 1)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        picked = torch.randint(0, len(pairs), (batch_size,), generator=gen).tolist()
        mine = picked[dp_rank::dp_size] or picked[:1]
        loss = sft_loss(model, [pairs[i] for i in mine], device)
        loss.backward()
        grad_norm_and_clip(model, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1) and dp_rank == 0:
            print(f"sft step {step}/{steps} loss {loss.item():.4f}", flush=True)
    return losses


def save_hf(model, tokenizer, output_dir: str, rank: int) -> None:
    """Gather the full (unsharded) weights to rank 0 and write an HF folder there."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        fresh.load_state_dict(state)
        fresh.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)


def main(argv: list[str]) -> int:
    from train_ppo import quiet_libraries

    quiet_libraries()
    rank, world, _ = env_world()
    cfg = C.parse_or_exit(argv, world, rank, check=C.check_sft)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device)
    try:
        records = load_sft_records(cfg.sft.train_path, cfg.sft.prompt_key, cfg.sft.response_key)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    except (ValueError, OSError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    layout = build_layout([C.PoolConfig("all", world, ["actor"], cfg.placement.tp, cfg.placement.dp_replicate)],
                          info.device.type)
    pool = layout.pools[0]
    torch.manual_seed(cfg.run.seed)
    model = shard_model(load_causal_lm(cfg.model.path, cfg.model.trust_remote_code).to(info.device), pool,
                        cfg.actor.fsdp)
    sft_train(model, encode_pairs(records, tokenizer), cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size, cfg.run.seed,
              info.device, pool)
    save_hf(model, tokenizer, cfg.sft.output_dir, rank)
    dist.barrier()
    if rank == 0:
        print(f"saved {cfg.sft.output_dir}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
