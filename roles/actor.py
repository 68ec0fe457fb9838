"""The actor: the policy being trained. Owns its model, optimizer and LR schedule, and the rollout engine that
generates with the same parameters in place."""

from __future__ import annotations

import torch

from algo.advantages import as_bool_mask
from algo.losses import aggregate, kl, logprobs_and_entropy, logprobs_from_logits, policy_loss
from algo.rollout_correction import correction_weights
from batch import Batch
from config import fixed_budget
from parallel.fsdp import shard_model
from parallel.layout import Pool
from roles.lora import apply_lora
from roles.micro_batches import join_rows, micro_batches
from roles.modeling import disable_dropout, load_causal_lm, packable, response_logits
from roles.update_loop import ReplicaSync, UpdateMetrics, lr_factor, make_optimizer, train_mini_batches
from rollout.native import NativeEngine, RolloutOutput, SamplingParams, fallback_reason


def native_engine_options(r) -> dict:
    """NativeEngine's options from config.RolloutConfig (None: the engine's defaults)."""
    if r is None:
        return {}
    return dict(max_num_seqs=r.max_num_seqs, kv_cache_tokens=r.kv_cache_tokens,
                gpu_memory_utilization=r.gpu_memory_utilization, max_prefill_tokens=r.max_prefill_tokens,
                cuda_graphs=r.cuda_graphs, compile=r.compile, compact_forward=r.compact_forward,
                fused_projections=r.fused_projections, decode_kernels=r.decode_kernels, resident=r.resident)


class Actor:
    def __init__(self, path: str, cfg, pool: Pool, device: torch.device, pad_token_id: int, total_steps: int,
                 trust_remote_code: bool = False, comm_cfg=None, rollout_cfg=None):
        """cfg: config.ActorConfig; rollout_cfg: config.RolloutConfig (the engine and its sizes and switches).
        micro_batch_tokens=auto, which train_ppo.py sizes before building the roles, is the fixed budget here."""
        cfg = fixed_budget(cfg)
        self.cfg, self.pool, self.device, self.total_steps = cfg, pool, device, total_steps
        self.grad_sync_every = comm_cfg.grad_sync_every if comm_cfg is not None else 1
        self.replicas = ReplicaSync(comm_cfg, pool)
        r = rollout_cfg
        model = disable_dropout(load_causal_lm(path, trust_remote_code)).to(device)
        # LoRA (actor.lora): the adapters train, the base stays frozen in param_dtype; None: the whole model trains
        self.lora = apply_lora(model, cfg.lora, cfg.fsdp.param_dtype)
        if self.lora is not None:
            model = self.lora.model
        # the native engine's fallback decodes through the HF blocks with a KV cache, on which compiled blocks would
        # recompile block by block: they stay eager then
        hf_decode = (r is None or r.engine == "native") and \
            fallback_reason(model, r is None or r.compact_forward) is not None
        self.model = shard_model(model, pool, cfg.fsdp, replicate=self.replicas.replicated_by_fsdp,
                                 compile=not hf_decode)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.pack = cfg.pack_sequences and packable(self.model)  # micro-batches cut by real tokens, forwards packed
        self.lr_scale = 1.0  # guard rails back the learning rate off through this
        self.step_count = 0
        self.skips_in_a_row = 0  # optimizer steps skipped for a non-finite loss or gradient norm
        self.engine = None  # the vLLM engines are built beside the roles, on every rank (train_ppo.py)
        if r is None or r.engine == "native":
            tp_group = pool.mesh.get_group("tp") if pool.tp > 1 else None
            options = native_engine_options(r)
            options["reshard_after_forward"] = cfg.fsdp.reshard_after_forward
            self.engine = NativeEngine(self.model, pad_token_id, lockstep_group=pool.dp_group, tp_group=tp_group,
                                       **options)

    @property
    def stats(self) -> dict[str, float]:
        """The native engine's of the last generate call (what rollout/world.py reads of an engine)."""
        return self.engine.stats

    def generate(self, prompts: list[list[int]], params: SamplingParams, generator=None, **options) -> RolloutOutput:
        """Responses from the native engine on the actor's parameters in place (engine.stats["reshard_s"]: its
        unshard / reshard time). With LoRA the engine reads the base weights with the adapters merged in. options:
        NativeEngine.generate's per-prompt max_new_tokens and samples."""
        if self.lora is None:
            return self.engine.generate(prompts, params, generator, **options)
        with self.lora.merged(self.cfg.fsdp.reshard_after_forward):
            return self.engine.generate(prompts, params, generator, **options)

    @torch.no_grad()
    def log_probs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under the current weights (teacher-forced)."""
        self.model.eval()
        micro = micro_batches(batch, self.cfg.micro_batch_tokens, self.pool.dp_group, self.pack)
        out = [logprobs_from_logits(response_logits(self.model, mb, self.pack), mb["response_ids"], temperature)
               for mb in micro]
        return join_rows(out, micro, batch)

    def current_lr(self) -> float:
        return self.cfg.optim.lr * lr_factor(self.step_count, self.cfg.optim, self.total_steps) * self.lr_scale

    def update(self, batch: Batch, temperature: float, kl_loss_coef: float = 0.0, kl_kind: str = "low_var_kl",
               max_response_len: int | None = None, generator: torch.Generator | None = None) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches on this rank's samples. Needs advantages (and ref_logprobs
        when kl_loss_coef > 0). Losses are normalised by global counts over the dp group, so
        the update does not depend on how samples are split over micro-batches or ranks; so are the metrics
        (roles.update_loop.UpdateMetrics), the same on every rank. A batch empty on every rank (filters dropped
        everything) trains nothing and says so in actor/empty_batch.

        old_logprobs: the sampling policy's; a batch without them must be trained in one optimizer step (checked),
        whose forward runs the sampling weights: its log-probs, detached, stand in (config.old_logprobs_pass), and
        rollout/logprob_diff_max (the engine's log-probs against them) is measured here."""
        cfg = self.cfg
        on_policy = "old_logprobs" not in batch
        lr = self.current_lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        metrics = UpdateMetrics()
        rc = cfg.rollout_correction
        # actor.tis_cap is the short form of token weights truncated at it
        weight, cap = ("token", cfg.tis_cap) if cfg.tis_cap is not None else (rc.weight, rc.weight_cap)
        corrections = (weight, cap, rc.mask, rc.mask_low, rc.mask_high)
        correcting = weight != "off" or rc.mask != "off"

        def micro_loss(mb: Batch, tokens: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
            # one pass over the [b, R, V] logits gives both; the entropy's gradient only with a bonus
            logp, token_entropy = logprobs_and_entropy(response_logits(self.model, mb, self.pack),
                                                       mb["response_ids"], temperature)
            m = mb["response_mask"]
            n_tokens = as_bool_mask(m, m.shape).sum()
            if on_policy:
                old = logp.detach()
                if "rollout_logprobs" in mb:
                    gap = (old - mb["rollout_logprobs"]).abs() * m
                    metrics.maximum("rollout/logprob_diff_max", gap.max() if gap.numel() else gap.new_zeros(()))
            else:
                old = mb["old_logprobs"]
            norms = dict(global_tokens=tokens, global_seqs=seqs, max_response_len=max_response_len)
            weights = None
            if "rollout_logprobs" in mb:  # the engine/trainer mismatch, measured on every step; corrected on request
                weights, mismatch = correction_weights(old, mb["rollout_logprobs"], m, *corrections)
                for k, v in mismatch.items():
                    if k.endswith("_max"):
                        metrics.maximum(f"rollout_corr/{k}", v)
                    else:
                        metrics.token_mean(f"rollout_corr/{k}", v, n_tokens)
                weights = weights if correcting else None
            pg, parts = policy_loss(logp, old, mb["advantages"], m, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                    cfg.loss_agg, objective=cfg.policy_loss, weights=weights, **norms)
            ent = aggregate(token_entropy if cfg.entropy_coef > 0 else token_entropy.detach(), m, cfg.loss_agg,
                            **norms)
            loss = pg - cfg.entropy_coef * ent
            if kl_loss_coef > 0:
                kl_term = aggregate(kl(logp, mb["ref_logprobs"], kl_kind), m, cfg.loss_agg, **norms)
                loss = loss + kl_loss_coef * kl_term
                metrics.share("actor/kl_loss", kl_term)
            metrics.share("actor/pg_loss", pg)
            metrics.share("actor/entropy", ent)
            for k, v in parts.items():
                metrics.token_mean(f"actor/{k}", v, n_tokens)
            return loss

        taken = train_mini_batches(self.model, self.optimizer, self.replicas, batch, cfg, self.pool,
                                   self.grad_sync_every, generator, micro_loss, metrics, "actor", packed=self.pack,
                                   one_step=on_policy)
        for ok in taken:
            self.skips_in_a_row = 0 if ok else self.skips_in_a_row + 1
        self.step_count += 1
        out = metrics.result(self.pool.dp_group, len(taken))
        out.update({"actor/lr": lr, "actor/skipped_steps": float(taken.count(False)),
                    "actor/empty_batch": float(not taken)})
        return out
