"""The critic: a value model (causal-LM backbone + a scalar head per token) trained on the GAE returns."""

from __future__ import annotations

import torch

from algo.advantages import as_bool_mask
from algo.losses import value_loss
from batch import Batch
from config import fixed_budget
from parallel.fsdp import shard_model
from parallel.layout import Pool
from roles.lora import apply_lora, value_head_name
from roles.micro_batches import join_rows, micro_batches
from roles.modeling import disable_dropout, load_value_model, packable, response_values
from roles.update_loop import ReplicaSync, UpdateMetrics, lr_factor, make_optimizer, train_mini_batches


class Critic:
    def __init__(self, path: str, cfg, pool: Pool, device: torch.device, total_steps: int,
                 trust_remote_code: bool = False, comm_cfg=None):
        """cfg: config.CriticConfig. `path` may be a causal-LM checkpoint (fresh value head) or a critic's.
        micro_batch_tokens=auto, which train_ppo.py sizes before building the roles, is the fixed budget here."""
        cfg = fixed_budget(cfg)
        self.cfg, self.pool, self.device, self.total_steps = cfg, pool, device, total_steps
        self.grad_sync_every = comm_cfg.grad_sync_every if comm_cfg is not None else 1
        self.replicas = ReplicaSync(comm_cfg, pool)
        model = disable_dropout(load_value_model(path, trust_remote_code)).to(device)
        # LoRA (critic.lora): the adapters and the value head train, the backbone stays frozen in param_dtype
        self.lora = apply_lora(model, cfg.lora, cfg.fsdp.param_dtype, value_head_name(model))
        if self.lora is not None:
            model = self.lora.model
        self.model = shard_model(model, pool, cfg.fsdp, replicate=self.replicas.replicated_by_fsdp)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.pack = cfg.pack_sequences and packable(self.model)  # micro-batches cut by real tokens, forwards packed
        self.step_count = 0

    def _values(self, mb: Batch) -> torch.Tensor:
        return response_values(self.model, mb, self.pack)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """[B, R] V(s_t): the value of the state before each response token."""
        self.model.eval()
        micro = micro_batches(batch, self.cfg.micro_batch_tokens, self.pool.dp_group, self.pack)
        return join_rows([self._values(mb) for mb in micro], micro, batch)

    def update(self, batch: Batch, generator: torch.Generator | None = None) -> dict[str, float]:
        """Clipped value loss on `returns`, around the rollout-time `values`."""
        cfg = self.cfg
        lr = cfg.optim.lr * lr_factor(self.step_count, cfg.optim, self.total_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        metrics = UpdateMetrics()

        def micro_loss(mb: Batch, tokens: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
            m = mb["response_mask"]
            loss, parts = value_loss(self._values(mb), mb["values"], mb["returns"], m, cfg.value_clip,
                                     global_tokens=tokens)
            metrics.share("critic/vf_loss", loss)
            metrics.token_mean("critic/vf_clipfrac", parts["vf_clipfrac"], as_bool_mask(m, m.shape).sum())
            return loss

        taken = train_mini_batches(self.model, self.optimizer, self.replicas, batch, cfg, self.pool,
                                   self.grad_sync_every, generator, micro_loss, metrics, "critic", "comm/critic/",
                                   packed=self.pack)
        self.step_count += 1
        return {**metrics.result(self.pool.dp_group, len(taken)), "critic/lr": lr,
                "critic/empty_batch": float(not taken)}
