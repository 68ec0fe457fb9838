"""The training side of the families in rollout/families.py: packed micro-batches (block-causal attention from the
position ids) give the padded forward's log-probs, loss and gradients for each, so roles/modeling.py packs them.
Tensor parallelism of the families with their own TP layouts (OLMo 2, Phi-3): tests/test_families_tp.py."""

from __future__ import annotations

import pytest
from test_modeling import assert_packing_changes_nothing, random_batch
from test_rollout_families import FAMILIES, tiny_model

from roles.micro_batches import micro_batches
from roles.modeling import packable


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_micro_batches_give_the_padded_ones(name):
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    batch = random_batch(prompts, responses, seed=5)  # token ids below 97: the tiny models' vocabulary is 96
    batch["input_ids"] = batch["input_ids"] % 96
    batch["response_ids"] = batch["response_ids"] % 96
    (mb,) = micro_batches(batch, token_budget=10_000, group=None)
    assert packable(tiny_model(name))
    assert_packing_changes_nothing(lambda: tiny_model(name), mb, atol=1e-5)

