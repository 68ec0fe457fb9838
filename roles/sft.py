"""Supervised fine-tuning of a causal LM on prompt/response pairs (cross-entropy on the response tokens): the loop
train_sft.py runs on its pool and the quickstart runs for its warm start; and the HF export of a trained sharded
model that train_sft.py and train_rm.py share."""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from parallel.layout import Pool
from roles.modeling import grad_norm_and_clip
from tasks.data import render_prompts


def encode_pairs(records: list[dict], tokenizer, chat_template: bool | None = None,
                 system_prompt: str | None = None) -> list[tuple[list[int], int]]:
    """(prompt + response + eos token ids, prompt length) per pair. Prompts are encoded as train_ppo.py encodes
    its own (tasks.data.render_prompts with data.chat_template and data.system_prompt: chat messages templated with
    the generation prompt; text as is, or templated with chat_template=True)."""
    _, prompts = render_prompts([{"prompt": r["prompt"], "where": r.get("where", f"record {i}")}
                                 for i, r in enumerate(records)], tokenizer, chat_template, system_prompt)
    out = []
    for r, prompt in zip(records, prompts):
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
    return model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device),
                 use_cache=False).loss


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


def save_hf(model, tokenizer, output_dir: str, rank: int, auto_class=AutoModelForCausalLM) -> None:
    """Gather the full (unsharded) weights to rank 0 and write an HF folder there: a fresh `auto_class` model of the
    same config (the FSDP-wrapped class would name itself in the config's architectures), the weights, the tokenizer.
    Every rank calls (the gather is a collective)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        fresh = auto_class.from_config(model.config, dtype=torch.float32)
        fresh.load_state_dict(state)
        fresh.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
