"""Supervised fine-tuning of a causal LM on prompt/response pairs and chat conversations (cross-entropy on the
response tokens, or on the assistant turns): the steps train_sft.py runs on its pool and the quickstart runs for its
warm start; and the HF export of a trained sharded model that train_sft.py and train_rm.py share."""

from __future__ import annotations

import math
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from parallel.distributed import reducer
from parallel.layout import Pool
from roles.update_loop import grad_norm_and_clip
from tasks.data import render_prompts


def encode_pairs(records: list[dict], tokenizer, chat_template: bool | str | None = None,
                 system_prompt: str | None = None, template_kwargs: dict | None = None
                 ) -> list[tuple[list[int], int | list[tuple[int, int]]]]:
    """(token ids, what the loss is on) per record (tasks.data.load_sft_records). A prompt/response pair (TRL's
    prompt/completion too): prompt + response + eos ids and the prompt's length (the loss is on the response and the
    eos), the prompt encoded as train_ppo.py encodes its own (tasks.data.render_prompts with data.chat_template and
    data.system_prompt: chat messages templated with the generation prompt; text as is, or templated with
    chat_template=True; template_kwargs: data.chat_template_kwargs). A conversation (`messages`):
    encode_conversation's ids and assistant spans."""
    prompt_records = [(i, r) for i, r in enumerate(records) if "messages" not in r]
    _, prompts = render_prompts([{"prompt": r["prompt"], "where": r.get("where", f"record {i}")}
                                 for i, r in prompt_records], tokenizer, chat_template, system_prompt,
                                template_kwargs=template_kwargs) \
        if prompt_records else ([], [])
    out: list = [None] * len(records)
    for (i, r), prompt in zip(prompt_records, prompts):
        response = tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out[i] = (prompt + response, len(prompt))
    for i, r in enumerate(records):
        if "messages" in r:
            out[i] = encode_conversation(r["messages"], tokenizer, chat_template, system_prompt,
                                         r.get("where", f"record {i}"), template_kwargs)
    return out


def encode_conversation(messages: list[dict], tokenizer, chat_template: bool | str | None = None,
                        system_prompt: str | None = None, where: str = "record",
                        template_kwargs: dict | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, assistant spans) of a chat conversation (TRL's `messages` format), the loss on the assistant turns only
    (TRL's assistant_only_loss; its default trains every token). Each assistant turn is the text the template adds for
    it after the conversation before it with the generation prompt, i.e. what train_ppo.py would have the model
    generate there; the text between turns is encoded as train_ppo.py encodes a templated prompt. Messages after the
    last assistant turn are dropped. ValueError naming `where` when the template renders an earlier part of the
    conversation otherwise than as the start of a later one (a template that rewrites earlier turns, e.g. drops their
    reasoning): give such data as prompt/completion records."""
    from tasks.data import NO_TEMPLATE, chat_template_text

    if chat_template is False:
        raise ValueError(f"{where}: a conversation (messages) needs a chat template, but data.chat_template=false")
    template = chat_template_text(chat_template) if isinstance(chat_template, str) else None
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: the record is a conversation (messages) but the tokenizer has no chat template; "
                         f"{NO_TEMPLATE.replace(', or give prompts as text', '')}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(f"{where}: a conversation needs an assistant message after some other message (roles "
                         f"{[m['role'] for m in messages]}); the loss is on the assistant messages")

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], chat_template=template, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **(template_kwargs or {}))
        except Exception as e:  # the template's own checks (raise_exception): an unknown role, a bad order
            raise ValueError(f"{where}: the chat template refused this conversation (roles "
                             f"{[m['role'] for m in messages]}): {e}") from e

    full = render(turns[-1] + 1, False)
    cuts = []  # (start, end) of each assistant turn in the text
    for k in turns:
        before, through = render(k, True), render(k + 1, False)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise ValueError(f"{where}: the chat template does not render this conversation's turns as the start of "
                             f"the whole (it rewrites earlier turns), so the assistant turn {k} has no place of its "
                             "own; give the conversation as prompt/completion records")
        cuts.append((len(before), len(through)))
    ids, spans, at = [], [], 0
    for start, end in cuts:
        for piece, trained in ((full[at:start], False), (full[start:end], True)):
            encoded = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            if trained:
                spans.append((len(ids), len(ids) + len(encoded)))
            ids += encoded
        at = end
    return ids, spans


def _spans(trained: int | list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    return [(trained, length)] if isinstance(trained, int) else trained


def _padded(pairs: list, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    attn = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        for start, end in _spans(trained, len(seq)):
            labels[i, start:end] = torch.tensor(seq[start:end])
        attn[i, : len(seq)] = 1
    return ids.to(device), attn.to(device), labels.to(device)


def sft_loss(model, pairs: list, device) -> torch.Tensor:
    """Mean cross-entropy over the trained tokens of `pairs` (encode_pairs' output; right-padded)."""
    ids, attn, labels = _padded(pairs, device)
    return model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss


def sft_step(model, optimizer, pairs: list, batch_size: int, generator: torch.Generator, device,
             pool: Pool | None = None) -> tuple[float, float]:
    """One AdamW step on `batch_size` pairs drawn at random by `generator` (the same draw on every rank: each
    data-parallel rank of `pool` takes its slice); returns (this rank's loss, the gradient norm before clipping at
    1)."""
    dp_rank, dp_size = (pool.dp_rank, pool.dp_size) if pool is not None else (0, 1)
    picked = torch.randint(0, len(pairs), (batch_size,), generator=generator).tolist()
    mine = picked[dp_rank::dp_size] or picked[:1]
    loss = sft_loss(model, [pairs[i] for i in mine], device)
    loss.backward()
    norm = grad_norm_and_clip(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), float(norm)


def sft_train(model, pairs, steps: int, lr: float, batch_size: int, seed: int, device,
              pool: Pool | None = None, log_every: int = 50) -> list[float]:
    """AdamW at a constant lr on random batches of `pairs` (the quickstart's warm start; train_sft.py runs
    sft_step itself, with its schedule, metrics and checkpoints)."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        loss, _ = sft_step(model, optim, pairs, batch_size, gen, device, pool)
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1) and (pool is None or pool.dp_rank == 0):
            print(f"sft step {step}/{steps} loss {loss:.4f}", flush=True)
    return losses


@torch.no_grad()
def sft_eval_loss(model, pairs: list, batch_size: int, device, pool: Pool | None = None) -> float:
    """Mean cross-entropy per trained token over all of `pairs` (every rank calls: each data-parallel rank takes
    every dp_size-th pair, and all run the same number of forwards, a sharded model's forward being a collective)."""
    dp_rank, dp_size = (pool.dp_rank, pool.dp_size) if pool is not None else (0, 1)
    mine = pairs[dp_rank::dp_size]
    chunks = math.ceil(math.ceil(len(pairs) / dp_size) / batch_size)
    sums = torch.zeros(2, dtype=torch.float64)
    model.eval()
    for c in range(chunks):
        part = mine[c * batch_size : (c + 1) * batch_size]
        ids, attn, labels = _padded(part or pairs[:1], device)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
        if part:
            tokens = int((labels[:, 1:] != -100).sum())
            sums += torch.tensor([float(loss) * tokens, tokens], dtype=torch.float64)
    model.train()
    if pool is not None:
        sums = reducer(pool.dp_group)(sums)
    return float(sums[0] / sums[1].clamp(min=1))


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
