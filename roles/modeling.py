"""Model-side helpers shared by the roles: loading HF models, the batch layout, micro-batches, per-token outputs.

The batch layout (see batch.py): `input_ids` [B, L] holds each sample's prompt then its response, right-padded;
`prompt_len`, `response_len` [B]; response-aligned tensors (`response_ids`, `response_mask`, log-probs, values,
advantages) are [B, R], token t of row b sitting at position prompt_len[b] + t of `input_ids`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from algo.advantages import as_bool_mask
from batch import Batch, batch_size, select
from parallel.comm import (
    GradCompression,
    ReplicaAverager,
    StaleAllReduce,
    allreduce_replicas,
    set_grad_sync,
    sync_now,
)
from parallel.distributed import comm_device, reducer
from parallel.transfer import balanced_bounds

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


def seq_len(batch: Batch) -> torch.Tensor:
    return batch["prompt_len"] + batch["response_len"]


def response_index(batch: Batch, width: int) -> torch.Tensor:
    """[B, R] positions in `input_ids` of the outputs that predict each response token (one before it)."""
    r = batch["response_mask"].shape[1]
    idx = batch["prompt_len"][:, None] - 1 + torch.arange(r, device=batch["prompt_len"].device)[None]
    return idx.clamp(max=width - 1)


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Per-position outputs [B, L, ...] (logits, values) of the model on `input_ids`."""
    ids = batch["input_ids"]
    mask = (torch.arange(ids.shape[1], device=ids.device)[None] < seq_len(batch)[:, None]).long()
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def at_response(outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Gather [B, L, ...] outputs at the positions predicting each response token -> [B, R, ...]."""
    idx = response_index(batch, outputs.shape[1])
    if outputs.dim() == 2:
        return outputs.gather(1, idx)
    return outputs.gather(1, idx[..., None].expand(-1, -1, *outputs.shape[2:]))


def trim(batch: Batch) -> Batch:
    """Drop padding columns beyond the longest sample of this (micro-)batch."""
    if batch_size(batch) == 0:
        return batch
    full = int(seq_len(batch).max())
    resp = max(int(batch["response_len"].max()), 1)
    return {k: (v[:, :full] if k in FULL_WIDTH_KEYS else v[:, :resp]) if v.dim() >= 2 else v for k, v in batch.items()}


def dummy_row(batch: Batch) -> Batch:
    """One all-padding sample with the batch's keys: a rank with no samples still joins the sharded forwards."""
    out = {}
    for k, v in batch.items():
        shape = (1, 1, *v.shape[2:]) if v.dim() >= 2 else (1, *v.shape[1:])
        out[k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
    out["prompt_len"] = torch.ones_like(out["prompt_len"])
    return out


def micro_batches(batch: Batch, token_budget: int, group: dist.ProcessGroup | None) -> list[Batch]:
    """Split a rank's samples into consecutive micro-batches of at most ~token_budget padded tokens.

    Every rank of `group` (the data-parallel group) gets the same number of micro-batches, because each
    forward of an FSDP model is a collective; a rank with fewer samples gets smaller ones, or all-padding rows.
    """
    n = batch_size(batch)
    width = int(seq_len(batch).max()) if n else 1
    count = torch.tensor([max(1, math.ceil(n * width / max(token_budget, 1)))])
    if group is not None and dist.get_world_size(group) > 1:
        count = count.to(comm_device(group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    bounds = balanced_bounds(n, int(count))
    out = [trim(select(batch, slice(lo, hi))) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    # padding rows go last, so the outputs of the real rows come first, in order (see join_rows)
    return out + [dummy_row(batch)] * (int(count) - len(out))


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.detach().clone().float()
    if group is not None and dist.get_world_size(group) > 1:
        x = x.to(comm_device(group))
        dist.all_reduce(x, group=group)
    return x


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (sharded DTensors included), then scale them to at most max_norm.

    Written per parameter rather than with clip_grad_norm_ because TP+FSDP parameters live on different meshes.
    A non-finite norm leaves the gradients untouched: the caller skips that optimizer step.
    """
    total = None
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        sq = g.detach().float().pow(2).sum()
        if hasattr(sq, "full_tensor"):
            sq = sq.full_tensor()
        total = sq if total is None else total + sq
    norm = total.sqrt() if total is not None else torch.zeros(())
    if max_norm > 0 and torch.isfinite(norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device) if not hasattr(g, "device_mesh") else coef.item())
    return norm


def make_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW (config.OptimConfig); the learning rate is set before each update from `lr_factor`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay)


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


def join_rows(parts: list[torch.Tensor], batch: Batch) -> torch.Tensor:
    """Concatenate per-micro-batch [b, r] outputs back to [B, R] (dropping rows added for empty ranks)."""
    n, width = batch_size(batch), batch["response_mask"].shape[1]
    out = torch.zeros((n, width), dtype=torch.float32, device=batch["response_mask"].device)
    row = 0
    for p in parts:
        take = min(p.shape[0], n - row)
        if take <= 0:
            break
        out[row : row + take, : p.shape[1]] = p[:take].float()
        row += take
    assert row == n, "micro-batch outputs do not cover the batch"
    return out * as_bool_mask(batch["response_mask"], batch["response_mask"].shape)


class UpdateMetrics:
    """Metrics of one update (epochs x mini-batches x micro-batches), reduced over the dp group once at the end, so
    they are the values of the whole batch, the same on every rank and for any split over ranks or micro-batches:

    - share(key, t): a micro-batch's part of a global mean (a loss normalised by the mini-batch's global counts):
      summed over micro-batches and ranks, which gives each mini-batch's value, then averaged over the optimizer steps;
    - token_mean(key, mean, tokens): a mean over a micro-batch's `tokens` valid tokens: weighted by them over
      micro-batches and ranks (all-padding micro-batches weigh nothing);
    - same(key, value): a value every rank already agrees on (the gradient norm), averaged over the optimizer steps.
    Values stay tensors until `result`: no host sync inside the micro-batch loop.
    """

    def __init__(self):
        self.shares: dict[str, torch.Tensor] = {}
        self.weighted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.same_values: dict[str, list[float]] = {}

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

    def result(self, group, steps: int) -> dict[str, float]:
        """Every dp rank calls (one all-reduce, with the same keys on every rank)."""
        shares, weighted = sorted(self.shares), sorted(self.weighted)
        parts = [self.shares[k].reshape(1) for k in shares]
        parts += [torch.stack(self.weighted[k]).reshape(2) for k in weighted]
        out = {k: sum(v) / len(v) for k, v in self.same_values.items()}
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
                       metrics: UpdateMetrics, prefix: str, comm_prefix: str = "comm/") -> list[bool]:
    """The update loop the actor and critic share: `cfg.ppo_epochs` x mini-batches (the same count on every dp
    rank) x token-budget micro-batches, one optimizer step per mini-batch.

    micro_loss(mb, tokens, seqs) returns a micro-batch's loss, normalised by the mini-batch's global counts of
    response tokens and sequences over the dp group (so micro-batch losses add up to the mini-batch's), and records
    its own metrics. Gradients are reduced every `grad_sync_every` micro-batches, joined across replicas by
    `replicas`, clipped to cfg.optim.grad_clip; a non-finite norm skips the step. Records `<prefix>/grad_norm` and
    the replicas' metrics (comm/ renamed to `comm_prefix`). Returns, per optimizer step, whether it was taken: an
    empty list when no dp rank has a sample (nothing is computed then, no collective of the model runs).
    cfg: config.ActorConfig or config.CriticConfig.
    """
    group = pool.dp_group
    n_mini = mini_batch_count(batch_size(batch), cfg.mini_batch_size, group)
    taken: list[bool] = []
    if n_mini == 0:
        return taken
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(batch_size(batch), generator=generator)
        for chunk in torch.tensor_split(order, n_mini):
            mini = select(batch, chunk.to(batch["response_mask"].device))
            mask = as_bool_mask(mini["response_mask"], mini["response_mask"].shape)
            counts = all_reduce_sum(torch.stack([mask.sum(), mask.any(-1).sum()]), group).to(mask.device)
            tokens, seqs = counts[0].clamp(min=1), counts[1].clamp(min=1)
            micro = micro_batches(mini, cfg.micro_batch_tokens, group)
            mini_loss = torch.zeros((), device=mask.device)
            for i, mb in enumerate(micro):
                set_grad_sync(model, sync_now(i, len(micro), grad_sync_every))
                loss = micro_loss(mb, tokens, seqs)
                # FSDP averages gradients over the dp ranks; the losses are already global sums
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
