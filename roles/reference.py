"""The reference policy: a frozen copy of the initial actor, for the KL penalty."""

from __future__ import annotations

import torch

from algo.losses import logprobs_from_logits
from batch import Batch
from config import FIXED_MICRO_BATCH_TOKENS
from parallel.fsdp import shard_model
from parallel.layout import Pool
from roles.micro_batches import join_rows, micro_batches
from roles.modeling import load_causal_lm, packable, response_logits


class Reference:
    def __init__(self, path: str, cfg, pool: Pool, device: torch.device, micro_batch_tokens: int,
                 trust_remote_code: bool = False, pack_sequences: bool = False):
        """cfg: config.ReferenceConfig; micro_batch_tokens and pack_sequences: the actor's (roles.micro_batches; auto
        unsized is the fixed budget)."""
        self.pool, self.micro_batch_tokens = pool, FIXED_MICRO_BATCH_TOKENS if micro_batch_tokens == "auto" else \
            micro_batch_tokens
        model = load_causal_lm(path, trust_remote_code).to(device).eval().requires_grad_(False)
        self.model = shard_model(model, pool, cfg.fsdp, train=False)
        self.pack = pack_sequences and packable(self.model)

    @torch.no_grad()
    def log_probs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under the reference policy."""
        out = []
        micro = micro_batches(batch, self.micro_batch_tokens, self.pool.dp_group, self.pack)
        for mb in micro:
            out.append(logprobs_from_logits(response_logits(self.model, mb, self.pack), mb["response_ids"],
                                            temperature))
        return join_rows(out, micro, batch)
