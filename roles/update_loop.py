"""The update side the trained roles share: AdamW and its learning-rate schedule, gradient clipping, the actor's and
critic's loop of epochs x mini-batches x micro-batches, its metrics reduced over the dp group, and how gradients
cross the pool's replicas."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.attention import sdpa_kernel

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
from roles.micro_batches import micro_batches
from rollout.api import ATTENTION_BACKENDS


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
