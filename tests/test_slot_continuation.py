"""A generate call that continues the last one (SamplingParams.continues, multi-turn episodes): the slot engine
prefills only what each prompt adds to a sequence its slot still holds, and samples what a fresh engine sampling the
whole prompts samples (CPU, float32, random-init models of several families: sliding windows, q/k norms, fused
weights, partial rotary)."""

from __future__ import annotations

import dataclasses

import pytest
import test_rollout_families as families
import test_rollout_native as native
import torch

from rollout import slots
from rollout.episodes import ObservationTokens, run_episodes
from rollout.native import NativeEngine, SamplingParams
from tasks.char_tokenizer import build_char_tokenizer
from tasks.environments import EnvironmentPool
from tasks.tiny_model import build_tiny_causal_lm

MODELS = {"qwen2": lambda: native.tiny_model("qwen2"),
          **{name: (lambda name=name: families.tiny_model(name)) for name in
             ("qwen3", "mistral-window", "gemma3", "gemma2", "olmo2", "phi3")}}
MAX_NEW = 12
CONTEXT = 120  # every sequence of both calls fits; the families' models allow 128 positions


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def responses(out) -> list[list[int]]:
    return [row[:length] for row, length in zip(out.response_ids.tolist(), out.response_mask.sum(-1).tolist())]


def test_a_continuing_call_samples_what_a_fresh_engine_samples_from_the_whole_prompts(model):
    vocab = model.config.vocab_size
    engine = NativeEngine(model, native.PAD, max_num_seqs=16)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=(4,), context_tokens=CONTEXT)
    first_prompts = random_prompts([18, 20, 25], vocab, seed=1)
    # 4 samples each (a later call has fewer sequences, as an episode's later turns): sample 0 goes on below
    first = engine.generate(first_prompts, dataclasses.replace(params, n=4), torch.Generator().manual_seed(1))
    turns = responses(first)[::4]
    # Each episode's history goes on with an observation; the order changes (slots are found by their tokens), a
    # prompt shares its first 16 tokens with a held sequence and then differs (not continued), one is new.
    observations = [[7, 8, 9], [7] * 11, [9, 8] * 7]  # of other lengths: the continuations are padded
    histories = [p + t + o for p, t, o in zip(first_prompts, turns, observations)]
    diverging = first_prompts[1][:16] + [3] * 6
    prompts = [histories[2], diverging, histories[0], random_prompts([17], vocab, seed=2)[0], histories[1]]
    assert diverging[:17] != (first_prompts[1] + turns[1])[:17]
    then = dataclasses.replace(params, n=2, continues=True)
    out = engine.generate(prompts, then, torch.Generator().manual_seed(2))
    assert engine.stats["new_run"] == 0 and engine.stats["continued"] == 3  # the first sample of each history
    assert engine.stats["continued_tokens"] == sum(len(h) - len(o) - 1 for h, o in zip(histories, observations))

    fresh = NativeEngine(model, native.PAD, max_num_seqs=16, resident=False)
    expected = fresh.generate(prompts, dataclasses.replace(then, continues=False), torch.Generator().manual_seed(2))
    assert fresh.stats["continued"] == 0
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.response_mask, expected.response_mask)
    # the same sums in another order (the history read from the cache, the rest computed): float32 rounding
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_continuing_is_asked_for_and_needs_the_slots_kept(model):
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, context_tokens=CONTEXT)
    first_prompts = random_prompts([20, 22], vocab, seed=3)
    for resident, continues, expected in ((True, False, 0), (False, True, 0), (True, True, 2)):
        engine = NativeEngine(model, native.PAD, max_num_seqs=4, resident=resident)
        turns = responses(engine.generate(first_prompts, params))
        prompts = [p + t + [5] for p, t in zip(first_prompts, turns)]
        engine.generate(prompts, dataclasses.replace(params, continues=continues))
        assert engine.stats["continued"] == expected, (resident, continues)
    # without room for the whole episode (context_tokens), the longer second call needs a new run: nothing kept
    engine = NativeEngine(model, native.PAD, max_num_seqs=4)
    short = dataclasses.replace(params, context_tokens=0)
    turns = responses(engine.generate(first_prompts, short))
    engine.generate([p + t + [5] for p, t in zip(first_prompts, turns)], dataclasses.replace(short, continues=True))
    assert engine.stats["new_run"] == 1 and engine.stats["continued"] == 0


@pytest.mark.parametrize("name", ["mistral-window", "gemma3", "gemma2"])
def test_a_short_continuation_beside_a_long_one_at_the_end_of_its_slot(name):
    # Row A continues 2 tokens at the end of its slot, row B 40 tokens: A's padding reaches far past the slot's end
    # and past the sliding window (8). Padding neither writes the cache nor attends to nothing (soft-capped
    # attention would turn an empty row into NaN keys in the slot); a later call that continues nothing decodes
    # from the same slots as a fresh engine does.
    model = families.tiny_model(name)
    vocab = model.config.vocab_size
    engine = NativeEngine(model, native.PAD, max_num_seqs=4)
    params = SamplingParams(max_new_tokens=8, temperature=0, context_tokens=128)
    first_prompts = random_prompts([108, 40], vocab, seed=6)
    turns = responses(engine.generate(first_prompts, params, max_new_tokens=[8, 8]))
    histories = [first_prompts[0] + turns[0] + [5], first_prompts[1] + turns[1] + [6] * 39]
    out = engine.generate(histories, dataclasses.replace(params, continues=True), max_new_tokens=[3, 8])
    assert engine.stats["continued"] == 2
    fresh = NativeEngine(model, native.PAD, max_num_seqs=4, resident=False)
    expected = fresh.generate(histories, params, max_new_tokens=[3, 8])
    assert torch.equal(out.response_ids, expected.response_ids)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert all(torch.isfinite(k).all() for k in engine.slots._run.k)
    again = random_prompts([30, 31], vocab, seed=7)
    torch.testing.assert_close(engine.generate(again, params).logprobs, fresh.generate(again, params).logprobs,
                               atol=1e-5, rtol=0)


def test_slots_overwritten_or_moved_are_not_continued():
    # 16 sequences in 16 slots: 12 end after 3 tokens, then the 4 long ones move from slots 12-15 to slots 0-3
    # (a smaller batch bucket serves them), over what slots 0-3 held. The finished short sequences of slots 4-11
    # and the long ones are continued; the ones whose slots were written over are prefilled again.
    qwen = native.tiny_model("qwen2")
    engine = NativeEngine(qwen, native.PAD, max_num_seqs=16)
    prompts = random_prompts(list(range(16, 32)), native.VOCAB, seed=4)
    limits = [3] * 12 + [20] * 4
    params = SamplingParams(max_new_tokens=20, temperature=0, context_tokens=64)
    out = engine.generate(prompts, params, max_new_tokens=limits)
    run = engine.slots._run
    held = run.held()
    assert sorted(run.finished_at.items()) == [(s, 12 + s) for s in range(4)] + [(s, s) for s in range(4, 12)]
    for slot, tokens in held.items():
        seq = run.finished_at[slot]
        assert tokens == prompts[seq] + responses(out)[seq][:-1]
    later = [prompts[s] + responses(out)[s] + [7] for s in range(16)]
    again = engine.generate(later, dataclasses.replace(params, continues=True), max_new_tokens=[4] * 16)
    assert engine.stats["continued"] == 12
    expected = NativeEngine(qwen, native.PAD, max_num_seqs=16, resident=False).generate(later, params,
                                                                                        max_new_tokens=[4] * 16)
    assert torch.equal(again.response_ids, expected.response_ids)
    torch.testing.assert_close(again.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_a_call_that_fails_leaves_nothing_to_continue():
    # a call that raises after it wrote slots (here: a prompt id outside the vocabulary, at the embedding) must
    # not let the next call trust what the call before it left
    qwen = native.tiny_model("qwen2")
    engine = NativeEngine(qwen, native.PAD, max_num_seqs=4)
    params = SamplingParams(max_new_tokens=6, temperature=0, context_tokens=64)
    prompts = random_prompts([20, 24], native.VOCAB, seed=8)
    turns = responses(engine.generate(prompts, params))
    with pytest.raises(IndexError):
        engine.generate([list(range(3, 23)), [native.VOCAB + 5] * 20], params)
    engine.generate([p + t + [5] for p, t in zip(prompts, turns)], dataclasses.replace(params, continues=True))
    assert engine.stats["continued"] == 0


def test_episodes_continue_their_turns_in_the_native_engine():
    # run_episodes on the native engine with environments in a worker: every turn after the first continues its
    # episodes' slots, and the episodes are token for token what an engine prefilling every history again gives.
    tokenizer = build_char_tokenizer("0123456789+=ab")
    model = build_tiny_causal_lm(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    observe = ObservationTokens(tokenizer, chat=False, stop_ids=(tokenizer.eos_token_id,))
    prompts = [tokenizer(text)["input_ids"] for text in ("12345678901234+9=", "98765432109876+1=")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, stop_token_ids=(tokenizer.eos_token_id,))

    def play(pool, resident: bool):
        engine = NativeEngine(model, tokenizer.pad_token_id, max_num_seqs=8, resident=resident)
        continued = []

        def generate(turn_prompts, turn_params):
            out = engine.generate(turn_prompts, turn_params, torch.Generator().manual_seed(len(continued)))
            continued.append(engine.stats["continued"])
            return out

        episodes = run_episodes(generate, prompts, [{"mode": "ok", "length": 4}] * 2, pool, observe, params,
                                max_turns=4, max_tokens=48, reward_mode="sum", decode=tokenizer.decode,
                                any_running=bool)
        return episodes, continued

    with EnvironmentPool("environment", ["tests.user_envs:scripted"], num_workers=1) as pool:
        kept, continued = play(pool, True)
        again, none = play(pool, False)
    turns = kept.sums["episode/turns"]
    assert sum(continued) == turns - 4 and continued[0] == 0 and none == [0] * len(none)  # every turn but the first
    assert turns > 4 and again.sums["episode/turns"] == turns
    assert torch.equal(kept.output.response_ids, again.output.response_ids)
    assert torch.equal(kept.output.response_mask, again.output.response_mask)
    torch.testing.assert_close(kept.output.logprobs, again.output.logprobs, atol=1e-5, rtol=0)


assert slots.MIN_CONTINUED_TOKENS <= 16  # the shortest held sequences above
