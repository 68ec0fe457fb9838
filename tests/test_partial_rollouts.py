"""Partial rollouts (rollout/partial.py, issue 37): a call that ends at its tail, the unfinished samples continued in
the next call. On CPU in float32: a continued sample equals an uninterrupted one under an unchanged policy (greedy:
token for token; sampled: its log-probs are the model's), the staleness bound, the checkpoint state, per-prompt
sample counts on both engine paths, the config checks; and train_ppo.py runs with it (1 process, resume exact;
2 ranks under torchrun, every group trained once)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_checkpoint import comparable
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)
from transformers import AutoModelForCausalLM, Qwen2Config

import config as C
from conftest import explain, run_python, torchrun
from rollout.native import NativeEngine, SamplingParams
from rollout.partial import PartialRollouts

VOCAB, PAD, STOPS, MAX_NEW, N = 64, 0, (3, 17), 100, 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config).eval()


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 12, (count,), generator=g)]


def responses(out) -> list[list[int]]:
    return [row[:n] for row, n in zip(out.response_ids.tolist(), out.response_mask.sum(-1).tolist())]


def run_steps(engine, partial: PartialRollouts, fresh_by_step: list[list[list[int]]], params, seed: int = 0):
    """Calls at steps 0, 1, ... with each step's fresh prompts (indices numbered across steps), then steps without
    fresh prompts until nothing is carried. Returns {index: group} of every trained group, and each step's counts."""
    trained, counts, index, step = {}, [], 0, 0
    while step < len(fresh_by_step) or partial.carried:
        fresh = fresh_by_step[step] if step < len(fresh_by_step) else []
        call = partial.call([(index + i, p) for i, p in enumerate(fresh)], step)
        index += len(fresh)
        out = engine.generate(call.prompts, dataclasses.replace(params, finish_first=call.finish_first),
                              torch.Generator().manual_seed(seed + step), max_new_tokens=call.limits,
                              samples=call.samples)
        done, stats = partial.collect(call, out, step)
        for group in done:
            assert group.index not in trained
            trained[group.index] = (group, step)
        counts.append(stats)
        step += 1
    return trained, counts


def test_the_engine_returns_at_its_tail_and_marks_the_unfinished(model):
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    params = SamplingParams(MAX_NEW, temperature=1.0, n=N, stop_token_ids=STOPS, tail_share=0.5)
    out = engine.generate(prompts(6, seed=1), params, torch.Generator().manual_seed(1))
    lengths, rows = out.response_mask.sum(-1).tolist(), responses(out)
    cut = out.unfinished.tolist()
    assert 0 < sum(cut) < 0.5 * engine.stats["slots"], (cut, lengths)
    for row, length, unfinished in zip(rows, lengths, cut):
        ended = row[-1] in STOPS or length == MAX_NEW
        assert ended != unfinished, (row, length, unfinished)  # every sequence ended, or is marked
    # without tail_share every sequence ends, and the output has no marks
    whole = engine.generate(prompts(6, seed=1), dataclasses.replace(params, tail_share=0.0),
                            torch.Generator().manual_seed(1))
    assert whole.unfinished is None and all(r[-1] in STOPS or len(r) == MAX_NEW for r in responses(whole))


def test_the_tail_is_a_share_of_the_calls_sequences_on_a_kept_run_with_more_slots(model):
    params = SamplingParams(MAX_NEW, temperature=1.0, n=N, stop_token_ids=STOPS, tail_share=0.4)
    batch = prompts(4, seed=6)
    fresh = NativeEngine(model, PAD, max_num_seqs=16)
    alone = fresh.generate(batch, params, torch.Generator().manual_seed(3))
    kept = NativeEngine(model, PAD, max_num_seqs=16)
    kept.generate(prompts(16, seed=7), params, torch.Generator().manual_seed(4))  # a bigger call first: 16 slots
    after = kept.generate(batch, params, torch.Generator().manual_seed(3))
    assert kept.stats["new_run"] == 0 and kept.stats["slots"] == 16 and fresh.stats["slots"] == 8
    assert after.unfinished.tolist() == alone.unfinished.tolist() and 0 < int(alone.unfinished.sum())
    assert responses(after) == responses(alone)


def test_greedy_continued_samples_equal_uninterrupted_ones_token_for_token(model):
    batch = prompts(10, seed=4)
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    greedy = SamplingParams(MAX_NEW, temperature=0.0, n=N, stop_token_ids=STOPS)
    whole = engine.generate(batch, greedy, None)
    partial = PartialRollouts(N, MAX_NEW, max_staleness=1)
    trained, counts = run_steps(engine, partial, [batch], dataclasses.replace(greedy, tail_share=0.75))
    assert sum(c["continued"] for c in counts) > 0, counts  # the test continues some samples
    assert sorted(trained) == list(range(len(batch)))
    expected_tokens, lengths = whole.response_ids, whole.response_mask.sum(-1)
    for index, (group, _) in trained.items():
        for k, sample in enumerate(group.samples):
            row = index * N + k
            assert sample.tokens.tolist() == expected_tokens[row, : lengths[row]].tolist()
            torch.testing.assert_close(sample.logprobs, whole.logprobs[row, : lengths[row]], atol=1e-5, rtol=0)


def test_sampled_continued_samples_carry_the_models_log_probs(model):
    batch = prompts(6, seed=3)
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    params = SamplingParams(MAX_NEW, temperature=0.7, n=N, stop_token_ids=STOPS, tail_share=0.5)
    trained, counts = run_steps(engine, PartialRollouts(N, MAX_NEW, max_staleness=1), [batch], params)
    assert sum(c["continued"] for c in counts) > 0, counts
    for group, _ in trained.values():
        for sample in group.samples:
            ids = torch.tensor([group.prompt + sample.tokens.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(group.prompt) - 1 : -1].float() / 0.7
            expected = logits.log_softmax(-1).gather(-1, sample.tokens[:, None])[:, 0]
            torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=0)
            assert sample.tokens[-1].item() in STOPS or len(sample.tokens) == MAX_NEW  # trained samples ended


def test_a_prompts_own_budget_holds_across_the_carry_and_a_checkpoint(model):
    """Fresh prompts with budgets of their own (call(..., limits)): with no stop id every sample runs to exactly its
    prompt's budget, also the samples cut at a tail, carried through a checkpoint's state and continued."""
    batch, budgets = prompts(6, seed=5), [6, 12, 24, 36, 48, 60]
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    params = SamplingParams(MAX_NEW, temperature=1.0, n=N, tail_share=0.5)
    first = PartialRollouts(N, MAX_NEW, max_staleness=2)
    with pytest.raises(ValueError, match="2 limits for 6 fresh prompts"):
        first.call(list(enumerate(batch)), 0, limits=budgets[:2])
    call = first.call(list(enumerate(batch)), 0, limits=budgets)
    assert call.limits == budgets
    out = engine.generate(call.prompts, params, torch.Generator().manual_seed(0), max_new_tokens=call.limits,
                          samples=call.samples)
    done, _ = first.collect(call, out, 0)
    assert first.carried, "the test continues some samples"
    partial = PartialRollouts(N, MAX_NEW, max_staleness=2)
    partial.load_state_dict(first.state_dict())
    trained, step = {g.index: g for g in done}, 1
    while partial.carried:
        call = partial.call([], step)
        out = engine.generate(call.prompts, dataclasses.replace(params, finish_first=call.finish_first),
                              torch.Generator().manual_seed(step), max_new_tokens=call.limits, samples=call.samples)
        trained.update({g.index: g for g in partial.collect(call, out, step)[0]})
        step += 1
    assert sorted(trained) == list(range(len(batch)))
    assert {i: [len(s.tokens) for s in g.samples] for i, g in trained.items()} == \
        {i: [budget] * N for i, budget in enumerate(budgets)}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_sample_spans_more_policies_than_the_bound(model, max_staleness):
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    params = SamplingParams(MAX_NEW, temperature=1.0, n=N, stop_token_ids=STOPS, tail_share=0.75)
    fresh = [prompts(4, seed=10 + s) for s in range(5)]
    trained, counts = run_steps(engine, PartialRollouts(N, MAX_NEW, max_staleness), fresh, params)
    assert sorted(trained) == list(range(20)), "every group trains once"
    ages = [step - s.born for group, step in trained.values() for s in group.samples]
    assert max(ages) <= max_staleness and 1 in ages, ages
    # a group trains in the step its last sample ends; every one of its samples had ended by then
    groups_in = [4] * 5 + [0] * (len(counts) - 5)
    carried = 0
    for step, c in enumerate(counts):
        trained_now = sum(1 for _, s in trained.values() if s == step)
        carried = carried + groups_in[step] - trained_now
        assert c["carried_groups"] == carried


def test_the_carry_survives_a_checkpoint(model):
    batch = prompts(6, seed=4)
    engine = NativeEngine(model, PAD, max_num_seqs=8)
    greedy = SamplingParams(MAX_NEW, temperature=0.0, n=N, stop_token_ids=STOPS, tail_share=0.5)
    first = PartialRollouts(N, MAX_NEW, max_staleness=1)
    call = first.call(list(enumerate(batch)), 0)
    out = engine.generate(call.prompts, greedy, None, max_new_tokens=call.limits, samples=call.samples)
    first.collect(call, out, 0)
    assert first.carried
    again = PartialRollouts(N, MAX_NEW, max_staleness=1)
    again.load_state_dict(first.state_dict())
    ends = []
    for partial in (first, again):
        call = partial.call([], 1)
        out = engine.generate(call.prompts, dataclasses.replace(greedy, finish_first=call.finish_first), None,
                              max_new_tokens=call.limits, samples=call.samples)
        done, _ = partial.collect(call, out, 1)
        ends.append([(g.index, [s.tokens.tolist() for s in g.samples], [s.born for s in g.samples]) for g in done])
    assert ends[0] == ends[1] and ends[0]


@pytest.mark.parametrize("compact_forward", [True, False])
def test_per_prompt_sample_counts(model, compact_forward):
    batch = prompts(3, seed=5)
    engine = NativeEngine(model, PAD, max_num_seqs=4, compact_forward=compact_forward)
    greedy = SamplingParams(20, temperature=0.0, n=1, stop_token_ids=STOPS)
    out = engine.generate(batch, greedy, None, max_new_tokens=[20, 7, 12], samples=[1, 3, 2])
    alone = [responses(engine.generate([p], greedy, None, max_new_tokens=[m]))[0]
             for p, m in zip(batch, [20, 7, 12])]
    assert out.prompt_ids == [batch[0]] + [batch[1]] * 3 + [batch[2]] * 2
    assert responses(out) == [alone[0]] + [alone[1]] * 3 + [alone[2]] * 2
    with pytest.raises(ValueError, match="samples must give a count"):
        engine.generate(batch, greedy, None, samples=[1, 0, 2])


def test_config_checks_name_what_partial_rollouts_need(assets, tmp_path):  # noqa: F811
    def check(**rollout):
        actor = rollout.pop("actor", {})
        path = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", rollout=rollout, actor=actor,
                            algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}})
        C.check_ppo(C.load_config(path), world_size=1)

    with pytest.raises(C.ConfigError, match="actor.tis_cap"):
        check(partial_tail=0.25)
    with pytest.raises(C.ConfigError, match="rollout.engine=native"):
        check(partial_tail=0.25, engine="vllm", actor={"tis_cap": 2.0})
    with pytest.raises(C.ConfigError, match="episodes are not continued"):
        check(partial_tail=0.25, tools=["tests.user_envs:add"], actor={"tis_cap": 2.0})
    with pytest.raises(C.ConfigError, match="rollout.partial_max_staleness"):
        check(partial_tail=0.25, partial_max_staleness=0, actor={"tis_cap": 2.0})
    check(partial_tail=0.25, actor={"tis_cap": 2.0})


PARTIAL = dict(rollout={"n": 4, "max_new_tokens": 40, "max_num_seqs": 8, "partial_tail": 0.5},
               data={"max_prompt_len": 8, "batch_size": 8},
               algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}},
               actor={"tis_cap": 2.0, "ppo_epochs": 1, "mini_batch_size": 0})


def check_groups(rows: list[dict], batch_size: int) -> None:
    """Every step's groups: carried = carried before + the step's prompts - the groups trained (none lost, none
    twice), no trained sample older than the bound."""
    carried = 0
    for r in rows:
        carried += batch_size - r["rollout/partial/trained_groups"]
        assert r["rollout/partial/carried_groups"] == carried, rows
        assert r["rollout/partial/staleness_max"] <= 1
    assert any(r["rollout/partial/continued"] > 0 for r in rows), rows


def test_a_partial_run_resumes_exactly(assets, tmp_path):  # noqa: F811
    whole = write_config(tmp_path / "whole.yaml", assets, tmp_path / "whole", run={"total_steps": 5}, **PARTIAL)
    proc = run_python(["train_ppo.py", "--config", whole], timeout=300)
    assert proc.returncode == 0, explain(proc)
    reference = comparable(read_metrics(tmp_path / "whole"))
    check_groups([r for r in reference if "rollout/partial/carried_groups" in r], 8)
    # 3 steps, checkpoints at 2 and 3; the last one (written after the final evaluation, which draws from the
    # sampling stream) removed, so the resume starts from step 2 as the uninterrupted run went on from it
    first = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 3},
                         checkpoint={"save_every": 2, "keep_last": 2}, **PARTIAL)
    proc = run_python(["train_ppo.py", "--config", first], timeout=300)
    assert proc.returncode == 0, explain(proc)
    shard = next((tmp_path / "runs" / "t" / "checkpoints" / "step_00000003" / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    second = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 5}, **PARTIAL)
    proc = run_python(["train_ppo.py", "--config", second], timeout=300)
    assert proc.returncode == 0 and "step_00000002 (step 2)" in proc.stderr, explain(proc)
    rows = comparable(read_metrics(tmp_path / "runs"))
    assert reference[2]["rollout/partial/carried_groups"] > 0, "the checkpoint at step 2 holds carried samples"
    assert rows[3:] == reference[3:]


def test_partial_rollouts_on_two_ranks(assets, tmp_path):  # noqa: F811
    # GRPO as above, then PPO (GAE, a critic, two epochs of two mini-batches) with a tail that cuts most samples:
    # steps in which one rank trains no group and the other does (every collective must still pair up; a metric's
    # all-reduce taken only where a rank had rows hung here)
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 4}, **PARTIAL)
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=400)
    assert proc.returncode == 0, explain(proc)
    rows = [r for r in read_metrics(tmp_path / "runs") if "rollout/partial/carried_groups" in r]
    check_groups(rows, 8)
    # resumed from its last checkpoint with the 2 ranks as one tp=2 pool: rank 1's carried samples were its own
    # prompts' and its new tp peer holds others; restored, the two peers would build different calls into one
    # tensor-parallel engine: dropped, and said
    assert rows[-1]["rollout/partial/carried_groups"] > 0, "the checkpoint holds carried samples"
    again = write_config(tmp_path / "c2.yaml", assets, tmp_path / "runs", run={"total_steps": 5},
                         placement={"tp": 2}, **PARTIAL)
    proc = torchrun(["train_ppo.py", "--config", again], nproc=2, timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, explain(proc)
    assert "carried at step 4 are dropped: the actor's layout changed" in proc.stderr, explain(proc)
    assert read_metrics(tmp_path / "runs")[-1]["rollout/partial/continued"] == 0
    ppo = write_config(tmp_path / "ppo.yaml", assets, tmp_path / "ppo", run={"total_steps": 6},
                       data={"batch_size": 2}, rollout={"n": 4, "max_new_tokens": 40, "max_num_seqs": 4,
                                                        "partial_tail": 0.9},
                       actor={"tis_cap": 2.0, "ppo_epochs": 2, "mini_batch_size": 4})
    proc = torchrun(["train_ppo.py", "--config", ppo], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = [r for r in read_metrics(tmp_path / "ppo") if "rollout/partial/carried_groups" in r]
    check_groups(rows, 2)
    assert any(r["rollout/partial/trained_groups"] == 0 for r in rows) or \
        any(r["rollout/partial/trained_groups"] % 2 for r in rows), "some step trains on one rank only"

