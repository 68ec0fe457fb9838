"""Model-side helpers shared by the roles: loading HF models, the batch layout, micro-batches, per-token outputs.

The batch layout (see batch.py): `input_ids` [B, L] holds each sample's prompt then its response, right-padded;
`prompt_len`, `response_len` [B]; response-aligned tensors (`response_ids`, `response_mask`, log-probs, values,
advantages) are [B, R], token t of row b sitting at position prompt_len[b] + t of `input_ids`.

The forwards pass no attention mask: the models are causal and the rows right-padded, so a real token never attends
to padding, and without a mask the positions are 0.. as with one. Only the padding's own outputs differ, and those
are never read (masked out, or not gathered). SDPA then takes its causal kernel, and compiled blocks
(parallel/fsdp.compile_blocks) meet one layout fewer.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.attention import sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from algo.advantages import as_bool_mask
from batch import Batch, batch_size, fit_width, select
from parallel.comm import (
    GradCompression,
    ReplicaAverager,
    StaleAllReduce,
    allreduce_replicas,
    set_grad_sync,
    sync_now,
)
from parallel.distributed import comm_device, reducer
from rollout.api import ATTENTION_BACKENDS

FULL_WIDTH_KEYS = ("input_ids", "attention_mask")  # [B, L]; every other 2-D key is response-aligned [B, R]


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


WIDTH_MULTIPLE = 16  # micro-batch widths are rounded up to this: fewer distinct shapes, tensor-core friendly


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


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, the lengths of a row summing to at most `capacity` (a longer
    sample is a row by itself)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


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
    cap = _round_up(max(sum(full[i] for i in row) for row in rows), WIDTH_MULTIPLE)
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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def trim(batch: Batch, full: int, resp: int) -> Batch:
    """Cut or right-pad the full-width keys to `full` columns and the response-aligned ones to `resp`."""
    return {k: (fit_width(v, full) if k in FULL_WIDTH_KEYS else fit_width(v, resp)) if v.dim() >= 2 else v
            for k, v in batch.items()}


def dummy_row(batch: Batch) -> Batch:
    """One all-padding sample with the batch's keys: a rank with no samples still joins the sharded forwards."""
    out = {}
    for k, v in batch.items():
        shape = (1, 1, *v.shape[2:]) if v.dim() >= 2 else (1, *v.shape[1:])
        out[k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
    out["prompt_len"] = torch.ones_like(out["prompt_len"])
    out["lengths_host"] = torch.tensor([[1, 1]])
    out["row_index"] = torch.full((1,), -1, dtype=torch.long)
    return out


def greedy_runs(lengths: list[int], budget: int) -> list[list[int]]:
    """Samples sorted longest first, cut into contiguous runs of at most `budget` padded tokens (rows x the run's
    longest; a longer sample is a run by itself). Returns sample indices per run."""
    runs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if runs and (len(runs[-1]) + 1) * lengths[runs[-1][0]] <= budget:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def length_groups(lengths: list[int], parts: int) -> list[list[int]]:
    """Split samples into at most `parts` groups of similar lengths with the least padding: sorted longest first,
    cut into contiguous runs whose padded size (rows x longest) is at most the smallest budget that needs no more
    than `parts` runs (binary search). Then, while fewer than `parts` groups exist, the costliest group with two
    rows or more is halved, so every rank does real work in every micro-batch. Returns sample indices per group."""
    if not lengths:
        return []
    lo, hi = max(lengths), len(lengths) * max(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(greedy_runs(lengths, mid)) > parts else (lo, mid)
    return _split_until(greedy_runs(lengths, lo), parts, cost=lambda g: len(g) * lengths[g[0]],
                        halve=lambda g: [g[: len(g) // 2], g[len(g) // 2:]])


def _split_until(groups: list[list[int]], parts: int, cost, halve) -> list[list[int]]:
    """While fewer than `parts` groups exist, the costliest group of two samples or more is replaced by its two
    halves (halve(group) -> [first, second]), so every rank does real work in every micro-batch."""
    while len(groups) < parts:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        g = max(splittable, key=cost)
        at = groups.index(g)
        groups[at:at + 1] = halve(g)
    return groups


def balanced_groups(lengths: list[int], parts: int) -> list[list[int]]:
    """Longest first, each sample into the group with the fewest tokens so far (LPT): `parts` groups (fewer when
    there are fewer samples) whose token sums differ by at most the longest sample. Returns sample indices."""
    groups: list[list[int]] = [[] for _ in range(min(parts, len(lengths)))]
    sums = [0] * len(groups)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = min(range(len(groups)), key=lambda g: sums[g])
        groups[g].append(i)
        sums[g] += lengths[i]
    return groups


def token_groups(lengths: list[int], budget: int, parts: int | None = None) -> list[list[int]]:
    """Samples in groups of at most `budget` tokens (first-fit decreasing, pack_rows; a longer sample is a group by
    itself), then, while fewer than `parts` groups exist, the one with the most tokens (two samples or more) is
    halved by balanced_groups. Returns sample indices."""
    return _split_until(pack_rows(lengths, budget), parts or 0, cost=lambda g: sum(lengths[i] for i in g),
                        halve=lambda g: [[g[j] for j in half] for half in balanced_groups([lengths[i] for i in g], 2)])


def micro_batches(batch: Batch, token_budget: int, group: dist.ProcessGroup | None,
                  packed: bool = False) -> list[Batch]:
    """Split a rank's samples into micro-batches of at most ~token_budget tokens.

    Padded (packed=False): the count is the one a budget of token_budget padded tokens needs (rows x longest, samples
    sorted by length), and within it the samples are grouped by length with the least padding (length_groups).
    packed=True (the forwards will pack, response_logits / response_values with pack): groups of at most
    token_budget real tokens, lengths mixed (token_groups: first-fit decreasing), which is what packing wants; a
    packed forward then holds those tokens plus the padding at the ends of its rows. Either way the count is the
    largest over the ranks
    of `group` (the data-parallel group): every rank runs the same number of forwards, because each forward of an
    FSDP model is a collective; a rank with fewer samples than micro-batches gets all-padding rows. Widths are
    rounded up to WIDTH_MULTIPLE. Each micro-batch carries `row_index` (its rows' indices in `batch`, -1 for padding
    rows; join_rows puts outputs back in order) and `lengths_host` ([b, 2] prompt and full lengths on the host, for
    the logits window, the attention mask and packing).
    One host sync: the lengths.
    """
    n = batch_size(batch)
    lengths = torch.stack([batch["prompt_len"], batch["response_len"]]).cpu() if n else torch.zeros(2, 0)
    host = torch.stack([lengths[0], lengths[0] + lengths[1]], 1).long()  # [n, 2]: prompt and full length
    full = host[:, 1].tolist()
    rounded = [_round_up(x, WIDTH_MULTIPLE) for x in full]
    budget = max(token_budget, 1)
    needed = len(token_groups(full, budget)) if packed else len(greedy_runs(rounded, budget))
    count = torch.tensor([float(max(1, needed))])
    if group is not None and dist.get_world_size(group) > 1:
        count = count.to(comm_device(group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    count = int(count)
    out = []
    by_length = sorted(range(n), key=lambda i: -full[i])  # ties of the rounded widths: the longest first
    grouping = length_groups([rounded[i] for i in by_length], count) if not packed else \
        token_groups([full[i] for i in by_length], budget, count)
    for members in grouping:
        rows = [by_length[j] for j in members]
        index = torch.tensor(sorted(rows), dtype=torch.long)
        width = max(rounded[i] for i in rows)
        resp = max(int(lengths[1, index].max()), 1)
        mb = trim(select(batch, index.to(batch["prompt_len"].device)), width, resp)
        mb["lengths_host"] = host[index]
        mb["row_index"] = index
        out.append(mb)
    # padding rows go last (see join_rows)
    return out + [dummy_row(batch)] * (count - len(out))


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.detach().clone().float()
    if group is not None and dist.get_world_size(group) > 1:
        x = x.to(comm_device(group))
        dist.all_reduce(x, group=group)
    return x


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (sharded DTensors included), then scale them to at most max_norm.

    Gradients are grouped by mesh and placements (TP + FSDP parameters live on different meshes, which one
    multi-tensor call cannot mix): per group one multi-tensor norm and one reduction of the group's DTensor norm to
    a plain tensor, then one multi-tensor scale. A non-finite norm leaves the gradients untouched: the caller skips
    that optimizer step. Returns a 0-dim float32 tensor on the gradients' device.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            key = (g.device, g.dtype, getattr(g, "device_mesh", None), tuple(getattr(g, "placements", ())))
            groups.setdefault(key, []).append(g)
    squares = []
    for grads in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares.append(norm.square())
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    norm = torch.stack([sq.to(device) for sq in squares]).sum().sqrt()
    if max_norm > 0:
        # no host sync: a non-finite norm gives a coefficient of 1 (gradients untouched, the step is skipped)
        coef = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        for grads in groups.values():
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].device, local[0].dtype))
    return norm


def make_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW (config.OptimConfig); the learning rate is set before each update from `lr_factor`."""
    params = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel (one launch for all parameters) where every parameter is on the GPU and on one mesh
    # (TP + FSDP parameters live on two meshes: the default multi-tensor path handles those)
    fused = bool(params) and all(p.device.type == "cuda" for p in params) and \
        len({getattr(p, "device_mesh", None) for p in params}) == 1
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, fused=fused or None)


def lr_factor(step: int, optim_cfg, total_steps: int) -> float:
    """Warmup (linear from 0) then constant, or cosine down to min_lr_ratio at total_steps."""
    if optim_cfg.warmup_steps and step < optim_cfg.warmup_steps:
        return (step + 1) / optim_cfg.warmup_steps
    if optim_cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - optim_cfg.warmup_steps)
    progress = min(1.0, (step - optim_cfg.warmup_steps) / span)
    return optim_cfg.min_lr_ratio + (1 - optim_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def mini_batch_count(local_n: int, mini_batch_size: int, group) -> int:
    """Optimizer steps per epoch: the same on every dp rank (each step ends in a gradient collective).

    ceil(total samples / mini_batch_size) (1 when mini_batch_size is 0), at most the largest rank's sample count:
    each rank splits its own samples into that many mini-batches, so no global mini-batch is empty. 0 when no rank
    has a sample: there is nothing to update.
    """
    reduce = reducer(group)
    count = torch.tensor(float(local_n))
    total, biggest = int(reduce(count, "sum")), int(reduce(count, "max"))
    if total == 0:
        return 0
    wanted = 1 if mini_batch_size <= 0 else math.ceil(total / mini_batch_size)
    return min(wanted, biggest)


def join_rows(parts: list[torch.Tensor], micro: list[Batch], batch: Batch) -> torch.Tensor:
    """Per-micro-batch [b, r] outputs back to [B, R] in the batch's row order (micro-batches from micro_batches;
    padding rows dropped), zero beyond each response."""
    n, width = batch_size(batch), batch["response_mask"].shape[1]
    out = torch.zeros((n, width), dtype=torch.float32, device=batch["response_mask"].device)
    covered = 0
    for p, mb in zip(parts, micro):
        real = mb["row_index"] >= 0
        if not bool(real.any()):
            continue
        rows, cols = mb["row_index"][real], min(p.shape[1], width)
        out[rows.to(out.device), :cols] = p[real.to(p.device), :cols].float()
        covered += int(real.sum())
    assert covered == n, "micro-batch outputs do not cover the batch"
    return out * as_bool_mask(batch["response_mask"], batch["response_mask"].shape)


def join_values(parts: list[torch.Tensor], micro: list[Batch], n: int) -> torch.Tensor:
    """Per-micro-batch [b] outputs back to [n] in the batch's row order (padding rows dropped)."""
    out = torch.zeros(n, dtype=torch.float32, device=parts[0].device if parts else None)
    for p, mb in zip(parts, micro):
        real = mb["row_index"] >= 0
        out[mb["row_index"][real].to(out.device)] = p[real.to(p.device)].float()
    return out


class UpdateMetrics:
    """Metrics of one update (epochs x mini-batches x micro-batches), reduced over the dp group once at the end, so
    they are the values of the whole batch, the same on every rank and for any split over ranks or micro-batches:

    - share(key, t): a micro-batch's part of a global mean (a loss normalised by the mini-batch's global counts):
      summed over micro-batches and ranks, which gives each mini-batch's value, then averaged over the optimizer steps;
    - token_mean(key, mean, tokens): a mean over a micro-batch's `tokens` valid tokens: weighted by them over
      micro-batches and ranks (all-padding micro-batches weigh nothing);
    - same(key, value): a value every rank already agrees on (the gradient norm), averaged over the optimizer steps;
    - maximum(key, value): the largest over micro-batches and ranks.
    Values stay tensors until `result`: no host sync inside the micro-batch loop.
    """

    def __init__(self):
        self.shares: dict[str, torch.Tensor] = {}
        self.weighted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.same_values: dict[str, list[float]] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def share(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.shares[key] = self.shares[key] + value if key in self.shares else value

    def token_mean(self, key: str, mean: torch.Tensor, tokens: torch.Tensor) -> None:
        total, weight = mean.detach().float() * tokens, tokens.float()
        if key in self.weighted:
            total, weight = total + self.weighted[key][0], weight + self.weighted[key][1]
        self.weighted[key] = (total, weight)

    def same(self, key: str, value: float) -> None:
        self.same_values.setdefault(key, []).append(float(value))

    def maximum(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.maxima[key] = torch.maximum(self.maxima[key], value) if key in self.maxima else value

    def result(self, group, steps: int) -> dict[str, float]:
        """Every dp rank calls (one all-reduce, two with maxima, with the same keys on every rank)."""
        shares, weighted = sorted(self.shares), sorted(self.weighted)
        parts = [self.shares[k].reshape(1) for k in shares]
        parts += [torch.stack(self.weighted[k]).reshape(2) for k in weighted]
        out = {k: sum(v) / len(v) for k, v in self.same_values.items()}
        if self.maxima:
            keys = sorted(self.maxima)
            top = reducer(group)(torch.stack([self.maxima[k].cpu() for k in keys]), "max")
            out.update({k: float(v) for k, v in zip(keys, top)})
        if not parts:
            return out
        flat = all_reduce_sum(torch.cat([p.cpu() for p in parts]), group).cpu()
        for i, k in enumerate(shares):
            out[k] = float(flat[i]) / max(steps, 1)
        for j, k in enumerate(weighted):
            total, weight = flat[len(shares) + 2 * j], flat[len(shares) + 2 * j + 1]
            out[k] = float(total / weight) if weight > 0 else 0.0
        return out


class ReplicaSync:
    """How a trained role's gradients cross the pool's dp_replicate axis (config.CommConfig).

    - default: FSDP2's own HSDP all-reduce (`replicated_by_fsdp` True);
    - comm.compression (bf16, fp16, int8, topk): FSDP2 stops at dp_shard and `after_backward` averages the gradients
      over the replicas with parallel.comm.allreduce_replicas, counting the bytes (comm/grad_bytes);
    - comm.param_averaging: no gradient exchange across replicas; parameters averaged every k optimizer steps
      (parallel.comm.ReplicaAverager, comm/sync_period);
    - comm.stale_allreduce: FSDP2 stops at dp_shard; `after_backward` starts this step's all-reduce over the replicas
      and puts the previous step's average in place of the gradients (parallel.comm.StaleAllReduce; comm/staleness,
      comm/grad_bytes). An all-reduce stays in flight between optimizer steps: `flush()` waits for it.
    Without a replicate axis (dp_replicate = 1) there is nothing to compress or average: the default applies.
    """

    def __init__(self, comm_cfg, pool):
        self.mode, self.state, self.averager, self.stale = "fsdp", None, None, None
        self.staleness = 0
        if comm_cfg is None or pool.dp_replicate == 1:
            return
        group = pool.mesh.get_group("dp_replicate")
        if comm_cfg.param_averaging:
            self.mode = "average"
            self.averager = ReplicaAverager(group, comm_cfg.averaging_k_min, comm_cfg.averaging_k_max)
        elif comm_cfg.compression != "none":
            self.mode = "compress"
            self.state = GradCompression(comm_cfg.compression, group, comm_cfg.topk_ratio, comm_cfg.error_feedback)
        elif comm_cfg.stale_allreduce:
            self.mode = "stale"
            self.stale = StaleAllReduce(group)

    @property
    def replicated_by_fsdp(self) -> bool:
        return self.mode == "fsdp"

    def after_backward(self, model: nn.Module) -> None:
        """Once per optimizer step, after the last micro-batch's backward, before clipping."""
        if self.mode == "compress":
            allreduce_replicas(model, self.state)
        elif self.mode == "stale":
            self.staleness = self.stale.exchange(model)

    def after_step(self, model: nn.Module, loss: float) -> dict[str, float]:
        if self.mode == "average":
            return self.averager.step(model, loss)
        if self.mode == "compress":
            return {"comm/grad_bytes": self.state.pop_bytes()}
        if self.mode == "stale":
            return {"comm/staleness": float(self.staleness), "comm/grad_bytes": self.stale.pop_bytes()}
        return {}

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly: the stale average not yet applied, the top-k error-feedback
        residuals, the averaging period (per rank; {} for FSDP's own all-reduce)."""
        part = self.stale or self.state or self.averager
        return {"mode": self.mode, "state": part.state_dict() if part is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.mode:
            logging.getLogger("meshrl").warning(
                "the checkpoint joined replicas by %r, this run by %r (comm.compression / param_averaging / "
                "stale_allreduce changed): that state starts afresh", state.get("mode"), self.mode)
            return
        part = self.stale or self.state or self.averager
        if part is not None:
            part.load_state_dict(state["state"])

    def flush(self) -> None:
        """Wait for a stale all-reduce still in flight (its average stays for the next step, so training goes on
        unchanged). Local, no collective; a no-op in the other modes. The trainer calls it before a checkpoint and
        before the process group goes away."""
        if self.stale is not None:
            self.stale.flush()


def train_mini_batches(model: nn.Module, optimizer: torch.optim.Optimizer, replicas: ReplicaSync, batch: Batch,
                       cfg, pool, grad_sync_every: int, generator: torch.Generator | None, micro_loss,
                       metrics: UpdateMetrics, prefix: str, comm_prefix: str = "comm/", packed: bool = False,
                       one_step: bool = False) -> list[bool]:
    """The update loop the actor and critic share: `cfg.ppo_epochs` x mini-batches (the same count on every dp
    rank) x token-budget micro-batches, one optimizer step per mini-batch.

    micro_loss(mb, tokens, seqs) returns a micro-batch's loss, normalised by the mini-batch's global counts of
    response tokens and sequences over the dp group (so micro-batch losses add up to the mini-batch's), and records
    its own metrics. Gradients are reduced every `grad_sync_every` micro-batches, joined across replicas by
    `replicas`, clipped to cfg.optim.grad_clip; a non-finite norm skips the step. Records `<prefix>/grad_norm` and
    the replicas' metrics (comm/ renamed to `comm_prefix`). Returns, per optimizer step, whether it was taken: an
    empty list when no dp rank has a sample (nothing is computed then, no collective of the model runs).
    cfg: config.ActorConfig or config.CriticConfig. packed: micro_loss packs its forwards, so the micro-batches
    are cut by real tokens (micro_batches). one_step: micro_loss relies on the weights not moving during the update
    (old log-probs from its own forward): more than one optimizer step raises ValueError before any is taken.
    """
    group = pool.dp_group
    n_mini = mini_batch_count(batch_size(batch), cfg.mini_batch_size, group)
    taken: list[bool] = []
    if n_mini == 0:
        return taken
    if one_step and n_mini * cfg.ppo_epochs > 1:
        raise ValueError(f"{prefix}: a batch without old log-probs trains in one optimizer step, but ppo_epochs="
                         f"{cfg.ppo_epochs} x {n_mini} mini-batches make {n_mini * cfg.ppo_epochs}")
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(batch_size(batch), generator=generator)
        for chunk in torch.tensor_split(order, n_mini):
            mini = select(batch, chunk.to(batch["response_mask"].device))
            mask = as_bool_mask(mini["response_mask"], mini["response_mask"].shape)
            counts = all_reduce_sum(torch.stack([mask.sum(), mask.any(-1).sum()]), group).to(mask.device)
            tokens, seqs = counts[0].clamp(min=1), counts[1].clamp(min=1)
            micro = micro_batches(mini, cfg.micro_batch_tokens, group, packed)
            mini_loss = torch.zeros((), device=mask.device)
            for i, mb in enumerate(micro):
                set_grad_sync(model, sync_now(i, len(micro), grad_sync_every))
                loss = micro_loss(mb, tokens, seqs)
                # FSDP averages gradients over the dp ranks; the losses are already global sums. The attention
                # backends again: activation checkpointing recomputes the forward inside backward
                with sdpa_kernel(ATTENTION_BACKENDS):
                    (loss * pool.dp_size).backward()
                mini_loss = mini_loss + loss.detach()
            replicas.after_backward(model)
            norm = grad_norm_and_clip(model, cfg.optim.grad_clip)
            taken.append(bool(torch.isfinite(norm)))
            if taken[-1]:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics.same(f"{prefix}/grad_norm", norm.item())
            for k, v in replicas.after_step(model, mini_loss).items():
                metrics.same(k.replace("comm/", comm_prefix), v)
    return taken
