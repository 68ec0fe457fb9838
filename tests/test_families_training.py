"""The training side of the families in rollout/families.py: packed micro-batches (block-causal attention from the
position ids) give the padded forward's log-probs, loss and gradients for each, so roles/modeling.py packs them; the
tensor-parallel plan refuses a q/k norm over the whole projection (OLMo 2)."""

from __future__ import annotations

import pytest
import torch
from test_modeling import random_batch
from test_rollout_families import FAMILIES, tiny_model

from algo.losses import logprobs_from_logits
from parallel.tp import apply_tp
from roles.modeling import micro_batches, packable, response_logits


@pytest.mark.parametrize("name", [name for name in FAMILIES])
def test_packed_micro_batches_give_the_padded_ones(name):
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    batch = random_batch(prompts, responses, seed=5)  # token ids below 97: the tiny models' vocabulary is 96
    batch["input_ids"] = batch["input_ids"] % 96
    batch["response_ids"] = batch["response_ids"] % 96
    (mb,) = micro_batches(batch, token_budget=10_000, group=None)
    results = []
    for pack in (False, True):
        model = tiny_model(name)
        assert packable(model)
        head_rows = []
        model.lm_head.register_forward_hook(lambda m, i, o, seen=head_rows: seen.append(i[0].shape[:2]))
        logp = logprobs_from_logits(response_logits(model, mb, pack=pack), mb["response_ids"])
        m = mb["response_mask"]
        loss = -(logp * mb["advantages"] * m).sum() / m.sum()
        loss.backward()
        results.append((logp.detach() * m, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if pack:
            assert head_rows == [(1, len(prompts) * m.shape[1])]
    (logp_a, loss_a, grads_a), (logp_b, loss_b, grads_b) = results
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for param, g in grads_a.items():
        torch.testing.assert_close(grads_b[param], g, rtol=1e-4, atol=1e-5, msg=param)


def test_tensor_parallelism_refuses_a_q_k_norm_over_all_heads():
    class Mesh:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="olmo2"):
        apply_tp(tiny_model("olmo2"), Mesh())
