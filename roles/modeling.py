"""The models the roles train and score with: loading HF models, and their forwards on the batch layout (the logits
window, packed rows).

The batch layout (see batch.py): `input_ids` [B, L] holds each sample's prompt then its response, right-padded;
`prompt_len`, `response_len` [B]; response-aligned tensors (`response_ids`, `response_mask`, log-probs, values,
advantages) are [B, R], token t of row b sitting at position prompt_len[b] + t of `input_ids`.

The forwards pass no attention mask: the models are causal and the rows right-padded, so a real token never attends
to padding, and without a mask the positions are 0.. as with one. Only the padding's own outputs differ, and those
are never read (masked out, or not gathered). SDPA then takes its causal kernel, and compiled blocks
(parallel/fsdp.compile_blocks) meet one layout fewer. Micro-batches: roles/micro_batches.py; the update loop:
roles/update_loop.py.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn.attention import sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from batch import Batch
from roles.micro_batches import WIDTH_MULTIPLE, pack_rows, round_up
from rollout.api import ATTENTION_BACKENDS


def load_causal_lm(path: str, trust_remote_code: bool = False) -> nn.Module:
    """An HF causal LM in float32 (master weights; FSDP's mixed precision casts for compute)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)


def load_value_model(path: str, trust_remote_code: bool = False) -> nn.Module:
    """A per-token scalar head on a causal-LM backbone (critic), or a reward model's head read per token.

    AutoModelForTokenClassification with one label shares the parameter names (`model.*`, `score.*`) of the
    sequence-classification reward models, so one class loads both: a causal-LM checkpoint gives a fresh head,
    a reward-model checkpoint gives its trained head. Dropout is off: values must not be noisy.
    """
    arch = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    arch.num_labels = 1
    arch.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(
        path, config=arch, dtype=torch.float32, trust_remote_code=trust_remote_code
    )


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout of `model` off, in place (its nn.Dropout modules and the float rates HF attention modules read
    in train mode): PPO's ratio and the values must not carry dropout noise, and the actor's update forward, in
    train mode, must compute what its no-grad forwards do (TRL's `disable_dropout` does the same)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


def seq_len(batch: Batch) -> torch.Tensor:
    return batch["prompt_len"] + batch["response_len"]


def response_index(batch: Batch, width: int) -> torch.Tensor:
    """[B, R] positions in `input_ids` of the outputs that predict each response token (one before it)."""
    r = batch["response_mask"].shape[1]
    idx = batch["prompt_len"][:, None] - 1 + torch.arange(r, device=batch["prompt_len"].device)[None]
    return idx.clamp(max=width - 1)


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Per-position outputs [B, L, ...] (logits, values) of the model on `input_ids` (no attention mask: see the
    module's docstring)."""
    with sdpa_kernel(ATTENTION_BACKENDS):
        return model(input_ids=batch["input_ids"], use_cache=False).logits


def at_response(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Gather [B, L, ...] outputs at the positions predicting each response token -> [B, R, ...]."""
    idx = response_index(batch, outputs.shape[1])
    if outputs.dim() == 2:
        return outputs.gather(1, idx)
    return outputs.gather(1, idx[..., None].expand(-1, -1, *outputs.shape[2:]))


def _takes_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


# HF models whose mask follows packed position_ids (tests/test_modeling.py, tests/test_families_training.py)
PACKABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "smollm3", "gemma3_text", "gemma2", "phi3")
PACK_ROW_FACTOR = 2  # a packed row holds up to this many times the micro-batch's padded width
PACK_MIN_SAVING = 0.1  # pack only when the packed rows hold at least this share fewer tokens than the padded batch


class PackedRows(NamedTuple):
    """A micro-batch's samples laid end to end in shared rows (see packed_rows)."""

    source: torch.Tensor  # [rows, C] long: index into input_ids.view(-1) of each packed token, -1 for padding
    position_ids: torch.Tensor  # [rows, C] long: 0.. within each sample (and within the row's padding)
    gather: torch.Tensor  # [B * R] long: index into the [rows * C] packed positions predicting each response token
    last: torch.Tensor  # [B] long: index into the [rows * C] packed positions of each sample's last token


def packed_rows(batch: Batch) -> PackedRows | None:
    """The micro-batch's samples packed into rows of up to PACK_ROW_FACTOR x its width (pack_rows), or None when
    that saves less than PACK_MIN_SAVING of its padded tokens (e.g. every sample as long as the longest). Each
    sample keeps positions 0..len-1; a row's padding at its end is a sequence of its own. Host only (lengths_host)."""
    host = batch["lengths_host"]
    prompt, full = host[:, 0].tolist(), host[:, 1].tolist()
    b, width = batch["input_ids"].shape
    if b < 2:
        return None
    rows = pack_rows(full, PACK_ROW_FACTOR * width)
    cap = round_up(max(sum(full[i] for i in row) for row in rows), WIDTH_MULTIPLE)
    if len(rows) * cap > (1 - PACK_MIN_SAVING) * b * width:
        return None
    source = torch.full((len(rows), cap), -1, dtype=torch.long)
    position_ids = torch.empty((len(rows), cap), dtype=torch.long)
    start = [0] * b  # flat packed index of each sample's first token
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            source[r, offset:offset + full[i]] = i * width + torch.arange(full[i])
            position_ids[r, offset:offset + full[i]] = torch.arange(full[i])
            start[i] = r * cap + offset
            offset += full[i]
        position_ids[r, offset:] = torch.arange(cap - offset)
    r_width = batch["response_mask"].shape[1]
    t = torch.arange(r_width)[None, :]
    last = torch.tensor([max(f - p - 1, 0) for p, f in zip(prompt, full)])[:, None]
    # the position before each response token; past a response's end, its last one (masked out by the caller)
    gather = torch.tensor(start)[:, None] + torch.tensor(prompt)[:, None] - 1 + torch.minimum(t, last)
    ends = torch.tensor([s + max(f, 1) - 1 for s, f in zip(start, full)])
    return PackedRows(source, position_ids, gather.reshape(-1), ends)


def packable(model: nn.Module) -> bool:
    """Whether response_logits may pack this model's micro-batches: a PACKABLE_MODEL_TYPES decoder (.model.norm)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in PACKABLE_MODEL_TYPES and hasattr(getattr(model, "model", None),
                                                                                       "norm")


def _packed_outputs(model: nn.Module, batch: Batch, packed: PackedRows, at_last: bool = False) -> torch.Tensor:
    """The model's per-position outputs (logits, values) [B, R, ...] from one forward over the packed rows. HF builds
    the block-causal mask from the position ids (no attention_mask: a new sequence starts wherever the position does
    not grow by one); a forward hook on the final norm keeps only the positions in packed.gather, so the head (LM
    head, value head) sees B x R rows and no prompt position. at_last: only each sample's last token instead
    (packed.last): [B, 1, ...]."""
    ids = batch["input_ids"]
    device = ids.device
    source = packed.source.to(device)
    packed_ids = torch.where(source >= 0, ids.reshape(-1)[source.clamp(min=0)], 0)
    gather = (packed.last if at_last else packed.gather).to(device)

    def keep(module, args, output):
        return output.reshape(-1, output.shape[-1])[gather][None]

    handle = model.model.norm.register_forward_hook(keep)
    try:
        with sdpa_kernel(ATTENTION_BACKENDS):
            logits = model(input_ids=packed_ids, position_ids=packed.position_ids.to(device), use_cache=False).logits
    finally:
        handle.remove()
    return logits.view(ids.shape[0], 1 if at_last else batch["response_mask"].shape[1], -1)


def _packing(model: nn.Module, batch: Batch, pack: bool) -> PackedRows | None:
    """The micro-batch's packed layout when `pack` asks for it, the model can pack (packable) and packing pays
    (packed_rows); None: the padded forward."""
    if not (pack and "lengths_host" in batch and packable(model)):
        return None
    return packed_rows(batch)


def response_logits(model: nn.Module, batch: Batch, pack: bool = False) -> torch.Tensor:
    """A causal LM's logits [B, R, V] at the positions predicting each response token.

    Only the positions from the shortest prompt's last token on reach the LM head (HF's `logits_to_keep`): the
    [B, L, V] logits of the prompts, a third of the tokens at 128 + 256, are never computed, nor their gradient.
    pack: when the samples' lengths differ enough (packed_rows), lay them end to end in shared rows instead of
    padding each to the longest: no compute on most of the padding, and only response positions reach the LM head.
    Needs the micro-batch's host copy of the lengths (micro_batches adds it); models without `logits_to_keep`
    (remote code) project every position."""
    width = batch["input_ids"].shape[1]
    if "lengths_host" not in batch or not _takes_logits_to_keep(model):
        return at_response(forward(model, batch), batch)
    packed = _packing(model, batch, pack)
    if packed is not None:
        return _packed_outputs(model, batch, packed)
    prompts = batch["lengths_host"][:, 0]
    shortest = int(prompts.min())
    keep = width - shortest + 1
    r = batch["response_mask"].shape[1]
    if int(prompts.max()) == shortest and r <= keep:
        # every prompt equally long: exactly the R positions predicting the response tokens reach the head (a slice
        # of the [B, keep, V] logits would give them too, but its backward writes a zero-padded [B, keep, V] copy)
        positions = torch.arange(shortest - 1, shortest - 1 + r, device=batch["input_ids"].device)
        with sdpa_kernel(ATTENTION_BACKENDS):
            return model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=positions).logits
    with sdpa_kernel(ATTENTION_BACKENDS):
        # [B, keep, V]: positions width - keep ..
        logits = model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=keep).logits
    idx = (response_index(batch, width) - (width - keep)).clamp(min=0)
    return logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))


def response_values(model: nn.Module, batch: Batch, pack: bool = False) -> torch.Tensor:
    """A value model's outputs [B, R] (float32) at the positions predicting each response token (the state before
    it); pack as in response_logits."""
    packed = _packing(model, batch, pack)
    if packed is not None:
        return _packed_outputs(model, batch, packed).squeeze(-1).float()
    return at_response(forward(model, batch).squeeze(-1), batch).float()


def last_token_values(model: nn.Module, batch: Batch, pack: bool = False) -> torch.Tensor:
    """A value model's output [B] (float32) at each sample's last token (a reward model's score); pack as in
    response_logits, with only the last tokens reaching the head."""
    packed = _packing(model, batch, pack)
    if packed is not None:
        return _packed_outputs(model, batch, packed, at_last=True).reshape(-1).float()
    values = forward(model, batch).squeeze(-1).float()
    return values.gather(1, (seq_len(batch) - 1).clamp(min=0)[:, None]).squeeze(1)

