"""Reward-model training on preference pairs: the Bradley-Terry loss, the score of a sequence (the head's output at
its last token, where roles/reward.py reads a reward model in PPO), held-out metrics, and the loop train_rm.py runs on
its pool."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from transformers import AutoConfig, AutoModelForTokenClassification

from parallel.distributed import reducer
from parallel.layout import Pool
from roles.sft import encode_pairs
from roles.update_loop import grad_norm_and_clip, lr_factor
from rollout.api import ATTENTION_BACKENDS
from tasks.data import MAX_CHARS_PER_TOKEN, PromptSampler, shard_indices, text_chars

log = logging.getLogger("meshrl")

Pair = tuple[list[int], list[int], float]  # chosen ids, rejected ids (each prompt + response + eos), margin


def load_reward_model(path: str, pad_token_id: int, trust_remote_code: bool = False) -> nn.Module:
    """The model train_rm.py trains, in float32: HF's token classification with one label, no bias and no dropout
    (a causal-LM folder gets a fresh head), its config given the pad id.

    Not the sequence-classification class it is saved as (save_hf; the weights are named alike, `model.*` and
    `score.weight`): that one outputs the score pooled at the last token that is not the pad id, which is not the last
    token when the tokenizer pads with its eos, and FSDP2 re-gathers the root's parameters for backward only through
    the root's outputs, so per-token scores taken from inside would find them freed. The per-token output is also what
    roles/reward.py reads (load_value_model; token_classification_bias false makes it build this head)."""
    arch = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    arch.num_labels = 1
    arch.pad_token_id = pad_token_id
    arch.classifier_dropout = 0.0
    arch.token_classification_bias = False
    model = AutoModelForTokenClassification.from_pretrained(path, config=arch, dtype=torch.float32,
                                                            trust_remote_code=trust_remote_code)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"{path}: {type(model).__name__} has no `score` head; reward-model training supports the "
                         "HF decoder families whose classification heads are named so (Llama, Qwen2, ...)")
    return model


def encode_preferences(records: list[dict], tokenizer, max_len: int, chat_template: bool | None = None,
                       system_prompt: str | None = None) -> tuple[list[Pair], int, list[str]]:
    """(chosen ids, rejected ids, margin) per record: each side is prompt + response + eos as roles/sft.encode_pairs
    builds it (prompts templated as train_ppo.py's are: data.chat_template, data.system_prompt), i.e. the tokens PPO
    later scores. Returns the pairs, how many were dropped with a side longer than max_len tokens (a side of more
    than max_len * MAX_CHARS_PER_TOKEN characters is not tokenised), and `where (why)` of each pair dropped for having
    no signal: chosen the same as rejected, or a response that tokenises to nothing."""
    limit = max_len * MAX_CHARS_PER_TOKEN
    fit = [{**r, "where": r.get("where", f"pair {i}")} for i, r in enumerate(records)
           if text_chars(r["prompt"]) + max(len(r["chosen"]), len(r["rejected"])) <= limit]
    template = dict(chat_template=chat_template, system_prompt=system_prompt)
    chosen, rejected = (encode_pairs([{"prompt": r["prompt"], "response": r[side], "where": r["where"]} for r in fit],
                                     tokenizer, **template) for side in ("chosen", "rejected"))
    pairs, no_signal, too_long = [], [], len(records) - len(fit)
    for (c, c_prompt), (r, r_prompt), rec in zip(chosen, rejected, fit):
        empty = [side for side, ids, p in (("chosen", c, c_prompt), ("rejected", r, r_prompt)) if len(ids) - p <= 1]
        if c == r or empty:  # only the eos after the prompt, or both sides alike: the loss is log 2 whatever the model
            why = f"the {empty[0]} response has no tokens" if empty else "chosen and rejected are the same" if \
                rec["chosen"] == rec["rejected"] else "chosen and rejected tokenise alike"
            no_signal.append(f"{rec['where']} ({why})")
        elif max(len(c), len(r)) > max_len:
            too_long += 1
        else:
            pairs.append((c, r, rec["margin"]))
    return pairs, too_long, no_signal


def hold_out(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a random `fraction` of the records (at least one when fraction > 0) held out, seeded."""
    count = max(1, round(len(records) * fraction)) if fraction > 0 else 0
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Per-pair loss [P] = -log sigmoid(chosen - rejected - margin) from scores and margins [P]: the negative
    log-likelihood of the preference under Bradley-Terry, the margin asking for a wider gap (Llama 2's reward model)."""
    return -F.logsigmoid(chosen - rejected - margin)


def sequence_scores(model: nn.Module, seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    """Scores [N] (float32): the head's output at each sequence's last token, from one right-padded forward; where
    roles/reward.py reads a reward model in PPO (the last token of prompt + response)."""
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.full((len(seqs), int(lengths.max())), model.config.pad_token_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with sdpa_kernel(ATTENTION_BACKENDS):
        per_token = model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
    per_token = per_token.squeeze(-1).float()  # [N, L]
    return per_token.gather(1, (lengths - 1).to(per_token.device)[:, None]).squeeze(1)


def pair_scores(model: nn.Module, pairs: list[Pair], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected scores [P] of `pairs`, both sides in one forward."""
    scores = sequence_scores(model, [p[0] for p in pairs] + [p[1] for p in pairs], device)
    return scores[: len(pairs)], scores[len(pairs):]


def pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """[4] float64 on the CPU: pairs, loss sum, pairs ranked right (chosen > rejected), score-gap sum. Sums, so that a
    reduction over ranks gives the metrics of the whole set whatever its split."""
    gap = (chosen - rejected).detach().double().cpu()
    loss = bradley_terry_loss(chosen.detach(), rejected.detach(), margin).double().cpu()
    return torch.stack([torch.tensor(float(len(gap)), dtype=torch.float64), loss.sum(), (gap > 0).double().sum(),
                        gap.sum()])


def metrics_of(sums: torch.Tensor, prefix: str) -> dict[str, float]:
    n = float(sums[0])
    return {f"{prefix}/loss": float(sums[1]) / n, f"{prefix}/accuracy": float(sums[2]) / n,
            f"{prefix}/margin/mean": float(sums[3]) / n}


def margins(pairs: list[Pair], device: torch.device) -> torch.Tensor:
    return torch.tensor([p[2] for p in pairs], dtype=torch.float32, device=device)


@torch.no_grad()
def evaluate(model: nn.Module, pairs: list[Pair], batch_size: int, device: torch.device, pool: Pool
             ) -> dict[str, float]:
    """eval/loss, eval/accuracy (share of pairs with chosen > rejected), eval/margin/mean (chosen - rejected) over all
    `pairs`. Each dp rank scores every dp_size-th pair in chunks of batch_size / dp_size, all ranks the same number
    of forwards (each is a collective of the sharded model); the sums are reduced over the pool, so the metrics are
    the same on any number of ranks."""
    mine = pairs[pool.dp_rank :: pool.dp_size]
    chunk = max(1, batch_size // pool.dp_size)
    rounds = math.ceil(math.ceil(len(pairs) / pool.dp_size) / chunk)
    sums = torch.zeros(4, dtype=torch.float64)
    model.eval()
    for k in range(rounds):
        part = mine[k * chunk : (k + 1) * chunk]
        chosen, rejected = pair_scores(model, part or pairs[:1], device)  # a rank out of pairs still takes part
        if part:
            sums += pair_sums(chosen, rejected, margins(part, chosen.device))
    model.train()
    return {**metrics_of(reducer(pool.dp_group)(sums), "eval"), "eval/pairs": float(len(pairs))}


def train_reward_model(model: nn.Module, train: list[Pair], held_out: list[Pair], cfg, seed: int,
                       device: torch.device, pool: Pool, emit: Callable[[int, dict], None]) -> dict[str, float]:
    """AdamW on batches of cfg.batch_size pairs drawn epoch by epoch (tasks.data.PromptSampler: the same batches for
    any number of ranks), each dp rank its block, the loss the batch's mean. emit(step, metrics) on every rank after
    every step: rm/loss, rm/accuracy, rm/margin/mean of the batch, rm/grad_norm, rm/lr (cfg.lr through warmup and
    schedule, roles.update_loop.lr_factor), and the held-out metrics at step 0,
    every cfg.eval_every steps and at the end (none without held-out pairs). Returns the last held-out metrics.
    cfg: config.RMConfig."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    sampler = PromptSampler(len(train), cfg.batch_size, seed=seed)
    reduce = reducer(pool.dp_group)
    last = evaluate(model, held_out, cfg.batch_size, device, pool) if held_out else {}
    if last:
        emit(0, last)
    model.train()
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * lr_factor(step - 1, cfg, cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        mine = [train[i] for i in shard_indices(sampler.next_batch(), pool.dp_rank, pool.dp_size)]
        # every rank holds batch_size / dp pairs, so every rank runs the same number of micro-batches (each forward
        # of the sharded model is a collective)
        size = cfg.micro_batch_pairs or len(mine)
        sums = None
        for start in range(0, len(mine), size):
            part = mine[start : start + size]
            chosen, rejected = pair_scores(model, part, device)
            margin = margins(part, chosen.device)
            # this part's share of the batch mean; FSDP averages the gradients over the dp ranks, hence x dp_size.
            # The attention backends again: activation checkpointing recomputes the forward inside backward
            loss = bradley_terry_loss(chosen, rejected, margin).sum() / cfg.batch_size * pool.dp_size
            with sdpa_kernel(ATTENTION_BACKENDS):
                loss.backward()
            part_sums = pair_sums(chosen.detach(), rejected.detach(), margin)
            sums = part_sums if sums is None else sums + part_sums
        norm = grad_norm_and_clip(model, 1.0)
        if torch.isfinite(norm):
            optimizer.step()
        else:
            log.warning("rm step %d: non-finite gradient norm, update skipped", step)
        optimizer.zero_grad(set_to_none=True)
        metrics = {**metrics_of(reduce(sums), "rm"), "rm/grad_norm": float(norm), "rm/lr": lr}
        if held_out and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            last = evaluate(model, held_out, cfg.batch_size, device, pool)
            metrics.update(last)
        emit(step, metrics)
    return last
