"""The critic: a value model (causal-LM backbone + a scalar head per token) trained on the GAE returns."""

from __future__ import annotations

import torch

from algo.advantages import as_bool_mask
from algo.losses import value_loss
from batch import Batch, batch_size, select
from parallel.comm import set_grad_sync, sync_now
from parallel.fsdp import shard_model
from parallel.layout import Pool
from roles.modeling import (
    ReplicaSync,
    add_metric,
    all_reduce_sum,
    at_response,
    forward,
    grad_norm_and_clip,
    join_rows,
    load_value_model,
    lr_factor,
    make_optimizer,
    mean_metrics,
    micro_batches,
    mini_batch_count,
)


class Critic:
    def __init__(self, path: str, cfg, pool: Pool, device: torch.device, total_steps: int,
                 trust_remote_code: bool = False, comm_cfg=None):
        """cfg: config.CriticConfig. `path` may be a causal-LM checkpoint (fresh value head) or a critic's."""
        self.cfg, self.pool, self.device, self.total_steps = cfg, pool, device, total_steps
        self.grad_sync_every = comm_cfg.grad_sync_every if comm_cfg is not None else 1
        self.replicas = ReplicaSync(comm_cfg, pool)
        self.model = shard_model(load_value_model(path, trust_remote_code).to(device), pool, cfg.fsdp,
                                 replicate=self.replicas.replicated_by_fsdp)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.step_count = 0

    def _values(self, mb: Batch) -> torch.Tensor:
        return at_response(forward(self.model, mb).squeeze(-1), mb).float()

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """[B, R] V(s_t): the value of the state before each response token."""
        self.model.eval()
        return join_rows([self._values(mb) for mb in micro_batches(batch, self.cfg.micro_batch_tokens,
                                                                 self.pool.dp_group)], batch)

    def update(self, batch: Batch, generator: torch.Generator | None = None) -> dict[str, float]:
        """Clipped value loss on `returns`, around the rollout-time `values`."""
        cfg, group = self.cfg, self.pool.dp_group
        lr = cfg.optim.lr * lr_factor(self.step_count, cfg.optim, self.total_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        sums: dict[str, tuple[float, float]] = {}
        n_mini = mini_batch_count(batch_size(batch), cfg.mini_batch_size, group)
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch_size(batch), generator=generator)
            for chunk in torch.tensor_split(order, n_mini):
                mini = select(batch, chunk.to(batch["response_mask"].device))
                tokens = all_reduce_sum(as_bool_mask(mini["response_mask"], mini["response_mask"].shape).sum(), group)
                loss_sum = 0.0
                micro = micro_batches(mini, cfg.micro_batch_tokens, group)
                for i, mb in enumerate(micro):
                    set_grad_sync(self.model, sync_now(i, len(micro), self.grad_sync_every))
                    loss, metrics = value_loss(self._values(mb), mb["values"], mb["returns"], mb["response_mask"],
                                               cfg.value_clip, global_tokens=tokens)
                    (loss * self.pool.dp_size).backward()
                    loss_sum += loss.item()
                    add_metric(sums, "critic/vf_clipfrac", float(metrics["vf_clipfrac"]))
                add_metric(sums, "critic/vf_loss", loss_sum)
                self.replicas.after_backward(self.model)
                norm = grad_norm_and_clip(self.model, cfg.optim.grad_clip)
                if torch.isfinite(norm):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                add_metric(sums, "critic/grad_norm", norm.item())
                for k, v in self.replicas.after_step(self.model, loss_sum).items():
                    add_metric(sums, k.replace("comm/", "comm/critic/"), v)
        self.step_count += 1
        return {**mean_metrics(sums), "critic/lr": lr}
