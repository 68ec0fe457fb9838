"""The training-side batch layout: length-grouped micro-batches, the logits window, joining outputs back in order."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from algo.losses import logprobs_from_logits
from batch import batch_size
from roles.micro_batches import (
    WIDTH_MULTIPLE,
    balanced_groups,
    greedy_runs,
    join_rows,
    length_groups,
    micro_batches,
    pack_rows,
    token_groups,
)
from roles.modeling import (
    at_response,
    disable_dropout,
    forward,
    last_token_values,
    packed_rows,
    response_logits,
    response_values,
)
from roles.update_loop import grad_norm_and_clip


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def random_batch(prompt_lens: list[int], response_lens: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """The rollout layout (batch.py): prompt then response, right-padded; response-aligned [B, R] tensors."""
    gen = torch.Generator().manual_seed(seed)
    n, width, r = len(prompt_lens), max(p + q for p, q in zip(prompt_lens, response_lens)), max(response_lens)
    ids = torch.zeros(n, width, dtype=torch.long)
    response_ids = torch.zeros(n, r, dtype=torch.long)
    mask = torch.zeros(n, r, dtype=torch.bool)
    for i, (p, q) in enumerate(zip(prompt_lens, response_lens)):
        row = torch.randint(1, 97, (p + q,), generator=gen)
        ids[i, : p + q] = row
        response_ids[i, :q] = row[p:]
        mask[i, :q] = True
    return {"input_ids": ids, "prompt_len": torch.tensor(prompt_lens), "response_len": torch.tensor(response_lens),
            "response_ids": response_ids, "response_mask": mask,
            "advantages": torch.randn(n, r, generator=gen) * mask}


def best_contiguous_cost(lengths: list[int], parts: int) -> int:
    """The slow, obvious answer: every way of cutting the longest-first order into at most `parts` runs; the
    smallest possible cost of the costliest run (rows x its longest)."""
    ordered = sorted(lengths, reverse=True)
    n, best = len(ordered), None
    for k in range(1, min(parts, n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            cost = max((hi - lo) * ordered[lo] for lo, hi in zip(bounds, bounds[1:]))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_length_groups_cover_every_sample_with_the_least_padding(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 8))]
    parts = rng.randint(1, 5)
    groups = length_groups(lengths, parts)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) == min(parts, len(lengths))
    cost = max(len(g) * max(lengths[i] for i in g) for g in groups)
    assert cost <= best_contiguous_cost(lengths, parts)


def test_greedy_runs_respect_the_budget():
    lengths = [30, 10, 10, 25, 5, 50]
    runs = greedy_runs(lengths, 60)
    assert sorted(i for r in runs for i in r) == list(range(6))
    for r in runs:  # a sample longer than the budget is alone; otherwise rows x longest <= budget
        assert len(r) == 1 or len(r) * max(lengths[i] for i in r) <= 60


def test_micro_batches_group_by_length_and_join_back_in_order():
    prompts, responses = [3, 5, 2, 4, 6, 3, 2, 5], [20, 2, 30, 3, 25, 1, 4, 28]
    batch = random_batch(prompts, responses)
    full = [p + q for p, q in zip(prompts, responses)]
    rounded = [-(-x // WIDTH_MULTIPLE) * WIDTH_MULTIPLE for x in full]
    budget = 3 * 48
    micro = micro_batches(batch, token_budget=budget, group=None)
    assert len(micro) == len(greedy_runs(rounded, budget))
    seen = sorted(int(i) for mb in micro for i in mb["row_index"] if i >= 0)
    assert seen == list(range(8))
    # similar lengths together: the micro-batches are runs of the longest-first order
    spans = sorted(([rounded[i] for i in mb["row_index"].tolist()] for mb in micro), key=max, reverse=True)
    for longer, shorter in zip(spans, spans[1:]):
        assert min(longer) >= max(shorter)
    for mb in micro:
        rows = mb["row_index"].tolist()
        assert mb["input_ids"].shape[1] == max(rounded[i] for i in rows)
        assert len(rows) * mb["input_ids"].shape[1] <= budget
        assert torch.equal(mb["lengths_host"], torch.tensor([[prompts[i], full[i]] for i in rows]))
    # less padding than the same number of consecutive slices of the batch, as the micro-batches were cut before
    padded = sum(batch_size(mb) * mb["input_ids"].shape[1] for mb in micro)
    bounds = [(8 * j) // len(micro) for j in range(len(micro) + 1)]
    consecutive = sum((hi - lo) * max(rounded[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))
    assert padded < consecutive
    # outputs come back to their rows: each micro-batch returns its row indices as values
    parts = [mb["row_index"].float()[:, None].expand(-1, mb["response_mask"].shape[1]) for mb in micro]
    joined = join_rows(parts, micro, batch)
    expected = torch.arange(8).float()[:, None] * batch["response_mask"]
    assert torch.equal(joined, expected)


def test_response_logits_equal_the_full_forward_and_keep_only_the_window():
    model = tiny_lm()
    head_positions = []
    model.lm_head.register_forward_hook(lambda m, i, o: head_positions.append(i[0].shape[1]))
    for prompts in ([4, 4, 4], [4, 7, 2]):  # equal prompts (exactly the response positions) and unequal ones
        batch = random_batch(prompts, [6, 3, 5], seed=len(set(prompts)))
        (mb,) = micro_batches(batch, token_budget=10_000, group=None)
        head_positions.clear()
        full = at_response(forward(model, mb), mb)
        assert head_positions == [mb["input_ids"].shape[1]]
        head_positions.clear()
        window = response_logits(model, mb)
        # the head sees the positions from the shortest prompt's last token on, not the whole width; with equal
        # prompts only the R positions that predict a response token
        r = mb["response_mask"].shape[1]
        assert head_positions == [r if len(set(prompts)) == 1 else mb["input_ids"].shape[1] - min(prompts) + 1]
        assert window.shape == (3, r, 97)
        mask = mb["response_mask"]
        torch.testing.assert_close(window[mask], full[mask], rtol=1e-5, atol=1e-5)


def test_grouped_windowed_micro_batches_give_the_loss_and_gradients_of_one_padded_forward():
    """The old path (one forward of the whole right-padded batch, logits at every position, gathered) and the
    new one (length-grouped micro-batches, widths rounded, the logits window, outputs joined back) must train
    the same: equal per-token log-probs, equal loss, equal gradients."""
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 10]
    batch = random_batch(prompts, responses, seed=3)
    mask = batch["response_mask"]
    tokens = mask.sum()

    def loss_of(logp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return -(logp * adv * m).sum() / tokens

    reference = tiny_lm(seed=1)  # an explicit padding mask here; the roles' forwards pass none (right padding)
    padding = (torch.arange(batch["input_ids"].shape[1])[None] < (batch["prompt_len"] + batch["response_len"])[:, None])
    logits = reference(input_ids=batch["input_ids"], attention_mask=padding.long(), use_cache=False).logits
    logp_ref = logprobs_from_logits(at_response(logits, batch), batch["response_ids"])
    loss_ref = loss_of(logp_ref, batch["advantages"], mask)
    loss_ref.backward()

    model = tiny_lm(seed=1)
    micro = micro_batches(batch, token_budget=2 * WIDTH_MULTIPLE, group=None)
    assert len(micro) > 1
    assert any((mb["lengths_host"][:, 1] < mb["input_ids"].shape[1]).any() for mb in micro)  # padded rows
    total, parts = 0.0, []
    for mb in micro:
        logp = logprobs_from_logits(response_logits(model, mb), mb["response_ids"])
        loss = loss_of(logp, mb["advantages"], mb["response_mask"])
        loss.backward()
        total += float(loss.detach())
        parts.append(logp.detach())
    torch.testing.assert_close(join_rows(parts, micro, batch), logp_ref.detach() * mask, rtol=1e-5, atol=1e-6)
    assert total == pytest.approx(float(loss_ref.detach()), rel=1e-5, abs=1e-7)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e6])
def test_grad_norm_and_clip_against_the_obvious_loop(max_norm):
    model = tiny_lm()
    batch = random_batch([3, 5], [4, 2])
    logp = logprobs_from_logits(at_response(forward(model, batch), batch), batch["response_ids"])
    (-(logp * batch["response_mask"]).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    expected = sum(float(g.double().pow(2).sum()) for g in before) ** 0.5
    norm = grad_norm_and_clip(model, max_norm)
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    scale = min(1.0, max_norm / (expected + 1e-6)) if max_norm > 0 else 1.0
    for g, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-5, atol=1e-9)


def test_a_non_finite_gradient_norm_leaves_the_gradients_alone():
    model = tiny_lm()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.lm_head.weight.grad[0, 0] = float("inf")
    norm = grad_norm_and_clip(model, 1.0)
    assert not torch.isfinite(norm)
    assert float(model.model.norm.weight.grad[0]) == 1.0


def test_pack_rows_first_fit_decreasing():
    # by hand, capacity 8, longest first: 5 -> row 0 (3 left); 4 -> row 1 (4 left); 3 -> row 0 (0 left);
    # 3 -> row 1 (1 left); 2 fits nowhere -> row 2; a sample longer than the capacity is a row by itself
    assert pack_rows([5, 4, 3, 3, 2], 8) == [[0, 2], [1, 3], [4]]
    assert pack_rows([9, 1], 8) == [[0], [1]]
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 12))]
        rows = pack_rows(lengths, 40)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= 40 for r in rows)


def test_packed_rows_keep_each_sample_whole_and_point_at_its_response():
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    (mb,) = micro_batches(random_batch(prompts, responses, seed=3), token_budget=10_000, group=None)
    packed = packed_rows(mb)
    assert packed is not None
    rows, cap = packed.source.shape
    assert rows * cap <= 0.9 * mb["input_ids"].numel()
    flat_ids = mb["input_ids"].reshape(-1)
    packed_ids = torch.where(packed.source >= 0, flat_ids[packed.source.clamp(min=0)], -1).reshape(-1)
    positions = packed.position_ids.reshape(-1)
    gather = packed.gather.view(len(prompts), -1)
    width = mb["input_ids"].shape[1]
    order = mb["row_index"].tolist()
    for j, i in enumerate(order):
        start = int(gather[j, 0]) - (prompts[i] - 1)
        full = prompts[i] + responses[i]
        # the sample's tokens in order at positions 0..full-1, then something else (the next sample or padding)
        assert packed_ids[start:start + full].tolist() == flat_ids[j * width:j * width + full].tolist()
        assert positions[start:start + full].tolist() == list(range(full))
        assert start + full == len(positions) or positions[start + full] == 0
        # each gathered position is followed by the response token it predicts
        for t in range(responses[i]):
            assert packed_ids[int(gather[j, t]) + 1] == mb["response_ids"][j, t]
    # equal lengths: nothing to save, the padded forward stays
    (even,) = micro_batches(random_batch([4] * 4, [12] * 4), token_budget=10_000, group=None)
    assert packed_rows(even) is None


def assert_packing_changes_nothing(make_model, mb: dict, atol: float = 1e-6) -> None:
    """A packed forward of micro-batch `mb` (block-causal attention from the position ids, logits only at response
    positions) against its padded forward, each on a fresh model from `make_model()`: equal log-probs, loss and
    gradients (absolute tolerance `atol` on the log-probs and gradients, a tenth of it on the loss), and the LM head
    sees B x R rows."""
    results = []
    for pack in (False, True):
        model = make_model()
        head_rows = []
        model.lm_head.register_forward_hook(lambda m, i, o, seen=head_rows: seen.append(i[0].shape[:2]))
        logp = logprobs_from_logits(response_logits(model, mb, pack=pack), mb["response_ids"])
        m = mb["response_mask"]
        loss = -(logp * mb["advantages"] * m).sum() / m.sum()
        loss.backward()
        results.append((logp.detach() * m, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if pack:
            assert head_rows == [(1, m.shape[0] * m.shape[1])]
    (logp_a, loss_a, grads_a), (logp_b, loss_b, grads_b) = results
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=atol)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=atol / 10)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_micro_batches_give_the_loss_and_gradients_of_the_padded_ones(family):
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    (mb,) = micro_batches(random_batch(prompts, responses, seed=5), token_budget=10_000, group=None)
    assert_packing_changes_nothing(lambda: tiny_lm(seed=2) if family == "qwen2" else tiny_llama(seed=2), mb)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_packed_values_give_the_values_and_gradients_of_the_padded_ones():
    """The critic's path: a token-classification value head read at the response positions, packed against padded."""
    from transformers import AutoModelForTokenClassification

    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    (mb,) = micro_batches(random_batch(prompts, responses, seed=6), token_budget=10_000, group=None)
    assert packed_rows(mb) is not None
    results = []
    for pack in (False, True):
        torch.manual_seed(3)
        config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1)
        model = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").eval()
        values = response_values(model, mb, pack=pack)
        m = mb["response_mask"]
        ((values - mb["advantages"]).pow(2) * m).sum().backward()
        results.append((values.detach() * m, {n: p.grad for n, p in model.named_parameters()}))
    (v_a, g_a), (v_b, g_b) = results
    torch.testing.assert_close(v_b, v_a, rtol=1e-5, atol=1e-6)
    for name, g in g_a.items():
        torch.testing.assert_close(g_b[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_reward_scores_are_the_padded_ones_at_each_last_token():
    """The reward model's path (roles/reward.py): a one-label head read at each sample's last token, packed against
    padded, and against a loop that scores each sample alone."""
    from transformers import AutoModelForTokenClassification

    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6], [12, 2, 15, 7, 1, 9, 12, 30]
    batch = random_batch(prompts, responses, seed=7)
    (mb,) = micro_batches(batch, token_budget=10_000, group=None, packed=True)
    assert packed_rows(mb) is not None
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1)
    model = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        padded, packed = last_token_values(model, mb), last_token_values(model, mb, pack=True)
        alone = []
        for i in mb["row_index"].tolist():
            n = int(batch["prompt_len"][i] + batch["response_len"][i])
            alone.append(float(model(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0, n - 1, 0]))
    want = torch.tensor(alone)
    torch.testing.assert_close(padded, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, want, rtol=1e-5, atol=1e-5)


def test_balanced_groups_even_out_the_token_sums():
    # by hand, longest first into the lightest group: 9 -> a (9), 7 -> b (7), 5 -> b (12), 4 -> a (13),
    # 2 -> b (14), 1 -> a (14)
    assert balanced_groups([5, 9, 1, 7, 2, 4], 2) == [[1, 5, 2], [3, 0, 4]]
    assert balanced_groups([3, 3], 4) == [[0], [1]]
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(2, 20))]
        parts = rng.randint(1, 5)
        groups = balanced_groups(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert max(sums) - min(sums) <= max(lengths)


def test_token_groups_hold_the_budget_and_fill_the_parts():
    # first-fit decreasing into 10 tokens, longest first: 9 -> A, 7 -> B, 5 -> C, 4 -> C (A and B too full),
    # 2 -> B, 1 -> A: A = 9 + 1, B = 7 + 2, C = 5 + 4; asked for 4 parts, the fullest (A, 10 tokens) is halved
    assert token_groups([5, 9, 1, 7, 2, 4], 10) == [[1, 2], [3, 4], [0, 5]]
    assert token_groups([5, 9, 1, 7, 2, 4], 10, 4) == [[1], [2], [3, 4], [0, 5]]
    assert token_groups([12, 3], 10) == [[0], [1]]  # a sample longer than the budget is a group by itself
    rng = random.Random(2)
    for _ in range(50):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 15))]
        budget, parts = rng.randint(20, 80), rng.randint(1, 6)
        groups = token_groups(lengths, budget, parts)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)
        assert len(groups) >= min(parts, len(lengths))


def test_packed_micro_batches_split_by_real_tokens_and_train_as_one_padded_forward():
    """micro_batches(packed=True): micro-batches of at most `budget` real tokens (lengths mixed), fewer than padding
    needs; each forward packed; the summed loss and the gradients equal one padded forward of the whole batch."""
    prompts, responses = [3, 9, 2, 5, 4, 6, 4, 6, 3, 2], [12, 2, 15, 7, 1, 9, 12, 30, 3, 20]
    batch = random_batch(prompts, responses, seed=7)
    mask = batch["response_mask"]
    tokens = mask.sum()
    full = [p + r for p, r in zip(prompts, responses)]
    budget = 64
    micro = micro_batches(batch, token_budget=budget, group=None, packed=True)
    assert len(micro) == len(token_groups(full, budget)) == 3  # 155 tokens, groups of <= 64
    assert len(micro_batches(batch, token_budget=budget, group=None)) > len(micro)
    assert all(sum(full[i] for i in mb["row_index"].tolist()) <= budget for mb in micro)

    reference = tiny_lm(seed=4)
    logp_ref = logprobs_from_logits(at_response(forward(reference, batch), batch), batch["response_ids"])
    loss_ref = -(logp_ref * batch["advantages"] * mask).sum() / tokens
    loss_ref.backward()
    model = tiny_lm(seed=4)
    total, parts, packs = 0.0, [], 0
    for mb in micro:
        packs += packed_rows(mb) is not None
        logp = logprobs_from_logits(response_logits(model, mb, pack=True), mb["response_ids"])
        loss = -(logp * mb["advantages"] * mb["response_mask"]).sum() / tokens
        loss.backward()
        total += float(loss.detach())
        parts.append(logp.detach())
    assert packs >= 1
    torch.testing.assert_close(join_rows(parts, micro, batch), logp_ref.detach() * mask, rtol=1e-5, atol=1e-6)
    assert total == pytest.approx(float(loss_ref.detach()), rel=1e-5, abs=1e-7)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_disable_dropout_makes_train_mode_compute_what_eval_mode_does(arch):
    """The actor and critic train with dropout off (roles/modeling.disable_dropout): the update's train-mode forward
    then gives the no-grad forward's log-probs, which the on-policy old log-probs rely on. Qwen2 reads a float
    attention rate, GPT-2 has nn.Dropout modules; both at 0.5 here."""
    torch.manual_seed(0)
    if arch == "qwen2":
        config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
    else:
        config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.5,
                            embd_pdrop=0.5, attn_pdrop=0.5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    want = model.eval()(input_ids=ids).logits
    assert not torch.allclose(model.train()(input_ids=ids).logits, want), "the test model must have dropout"
    assert disable_dropout(model) is model
    torch.testing.assert_close(model.train()(input_ids=ids).logits, want, rtol=0, atol=0)
