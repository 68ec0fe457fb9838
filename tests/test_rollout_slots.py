"""The slot engine (rollout/slots.py, rollout/decoder.py) on CPU in float32: what the HF-forward path and HF
`generate` give, through slot reuse, compaction, context buckets, per-prompt limits and the KV budget.

tests/test_rollout_native.py runs its checks through the same default engine; these cover what only the slot engine
has. tests/test_rollout_cuda.py repeats the key checks with CUDA graphs and torch.compile on a GPU.
"""

import copy
import dataclasses
import weakref

import pytest
import torch
from test_rollout_native import PAD, PROMPTS, VOCAB, hf_greedy, responses, teacher_forced_logprobs, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from rollout import slots
from rollout.model_weights import LayerWeights, fill_weights, own_weights, read_weights
from rollout.native import NativeEngine, SamplingParams
from rollout.sampling import gumbel_noise, sample_with_noise


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param)


def test_picks_the_slot_path_and_falls_back_for_other_architectures(model):
    assert NativeEngine(model, PAD).slots is not None
    assert NativeEngine(model, PAD, compact_forward=False).fallback_reason == "compact_forward=False"
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    engine = NativeEngine(gpt2.eval(), PAD)
    assert engine.slots is None and "gpt2" in engine.fallback_reason
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0))
    assert out.response_ids.shape == (len(PROMPTS), 3)


def test_reads_the_parameters_in_place(model):
    weights = read_weights(model)
    params = {p.data_ptr() for p in model.parameters()}
    assert weights.embed.data_ptr() in params and weights.lm_head.data_ptr() in params
    assert all(t.data_ptr() in params for layer in weights.layers for t in layer if t is not None)


class CopiedTensors(TorchDispatchMode):
    """Records the destinations of every copy op dispatched under it."""

    def __init__(self):
        super().__init__()
        self.destinations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("_foreach_copy", "copy_")):
            self.destinations += list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("copy_all", [False, True])
def test_kept_weights_copy_only_what_is_not_the_parameters_themselves(model, copy_all):
    # A resident engine's buffers for a plain model: the stacked q/k/v and gate/up are its own and refilled every
    # call; the other fields are the parameters themselves, read anew each call, and must not be copied onto
    # themselves. Under FSDP2 (copy_all) every field is a buffer of its own.
    kept = own_weights(read_weights(model), fuse=True, copy_all=copy_all)
    views = read_weights(model)
    with CopiedTensors() as copies:
        fill_weights(kept, views)
    stacked = {"q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up", "gate_bias", "up_bias"}
    fields = [(name, t) for block in read_weights(model).layers for name, t in zip(LayerWeights._fields[:16], block)
              if t is not None and (copy_all or name in stacked)]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = len(fields) + (2 + (not tied) if copy_all else 0)  # embed, norm, lm_head
    assert len(copies.destinations) == expected
    weights = read_weights(model, fuse=True)
    for got, want in zip(kept.layers, weights.layers):
        assert torch.equal(got.qkv, want.qkv) and torch.equal(got.gate_up, want.gate_up)
        assert torch.equal(got.down, want.down) and (got.down.data_ptr() == want.down.data_ptr()) != copy_all


def test_slot_reuse_and_compaction_match_the_hf_forward_path(model):
    # 12 sequences (6 prompts x n=2) in 5 slots: finished slots are refilled, and once nothing waits the live
    # slots move to the front. Per-prompt limits make them finish at different steps.
    prompts = PROMPTS + [[30, 31], [40, 41, 42, 43, 44]]
    limits = [20, 3, 9, 17, 2, 30]
    params = SamplingParams(max_new_tokens=30, temperature=0, n=2)
    engine = NativeEngine(model, PAD, max_num_seqs=5)
    out = engine.generate(prompts, params, max_new_tokens=limits)
    expected = NativeEngine(model, PAD, compact_forward=False).generate(prompts, params, max_new_tokens=limits)
    assert engine.stats["slots"] == 5 and engine.stats["prefills"] >= 2
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.response_mask, expected.response_mask)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert out.response_mask.sum(-1).tolist() == [m for m in limits for _ in range(2)]


def test_compaction_moves_live_slots_to_the_front(monkeypatch):
    # 12 slots; after the first check only slots 0 and 11 still run, so they move to slots 0 and 1 and the batch
    # shrinks to the smallest bucket.
    qwen = tiny_model("qwen2")
    prompts = [[i + 1, i + 2] for i in range(12)]
    limits = [25] + [2] * 10 + [25]
    batches = []
    bucket = slots._batch_bucket

    def recording_bucket(needed: int, count: int) -> int:
        batches.append(bucket(needed, count))
        return batches[-1]

    monkeypatch.setattr(slots, "_batch_bucket", recording_bucket)
    params = SamplingParams(max_new_tokens=25, temperature=0)
    out = NativeEngine(qwen, PAD).generate(prompts, params, max_new_tokens=limits)
    assert 12 in batches and batches[-1] == slots.MIN_BATCH_BUCKET
    for i in (0, 11):
        assert responses(out)[i] == hf_greedy(qwen, prompts[i], 25)


def test_long_context_uses_several_context_buckets():
    # 100 prompt tokens + 40 new: the first steps read 128 cache positions, the later ones all 144 of the slot.
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    llama = AutoModelForCausalLM.from_config(config).eval()
    prompts = [torch.randint(1, VOCAB, (100,)).tolist(), [5, 6, 7]]
    out = NativeEngine(llama, PAD).generate(prompts, SamplingParams(max_new_tokens=40, temperature=0))
    for prompt, response in zip(prompts, responses(out)):
        assert response == hf_greedy(llama, prompt, 40)
        torch.testing.assert_close(out.logprobs[prompts.index(prompt), :40],
                                   teacher_forced_logprobs(llama, prompt, response, 1.0), atol=1e-4, rtol=0)


def test_per_prompt_limits_with_stops_and_min_new_tokens(model):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=tuple(range(1, VOCAB, 3)),
                            min_new_tokens=3, n=3)
    limits = [12, 4, 1, 7]
    out = NativeEngine(model, PAD).generate(PROMPTS, params, torch.Generator().manual_seed(5), max_new_tokens=limits)
    for i, row in enumerate(responses(out)):
        limit = limits[i // 3]
        assert 1 <= len(row) <= limit
        assert len(row) >= min(3, limit) and not set(row[: min(3, limit) - 1]) & set(params.stop_token_ids)
        assert len(row) == limit or row[-1] in params.stop_token_ids
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 4 prompts"):
        NativeEngine(model, PAD).generate(PROMPTS, params, max_new_tokens=[3])
    with pytest.raises(ValueError, match=r"max_new_tokens \[13\] outside"):
        NativeEngine(model, PAD).generate(PROMPTS, params, max_new_tokens=[1, 2, 3, 13])


def test_kv_budget(model):
    params = SamplingParams(max_new_tokens=10, temperature=0)
    # The longest sequence needs 7 + 10 = 17 positions; a slot rounds that up to 24.
    with pytest.raises(ValueError, match="KV cache budget of 16 tokens.*cannot hold one sequence of 17 tokens"):
        NativeEngine(model, PAD, kv_cache_tokens=16).generate(PROMPTS, params)
    single = NativeEngine(model, PAD, kv_cache_tokens=24)
    out = single.generate(PROMPTS, params)
    assert single.stats["slots"] == 1
    assert torch.equal(out.response_ids, NativeEngine(model, PAD).generate(PROMPTS, params).response_ids)
    for kwargs, match in [({"max_num_seqs": 0}, "max_num_seqs"), ({"kv_cache_tokens": 0}, "kv_cache_tokens"),
                          ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                          ({"max_prefill_tokens": 0}, "max_prefill_tokens")]:
        with pytest.raises(ValueError, match=match):
            NativeEngine(model, PAD, **kwargs)


def test_small_prefill_chunks_give_the_same_samples(model):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, n=2)
    seed = lambda: torch.Generator().manual_seed(11)
    chunked = NativeEngine(model, PAD, max_prefill_tokens=5)
    a = chunked.generate(PROMPTS, params, seed())
    b = NativeEngine(model, PAD).generate(PROMPTS, params, seed())
    assert chunked.stats["prefills"] == 4
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_prefills_padded_to_their_graph_buckets_give_the_same_samples(model):
    # What a graphed prefill runs (CUDA replays it; pad_prefills pads on CPU too). 5 prompts of up to 7 tokens x 2
    # samples in 10 slots of 7 + 56 -> 64 positions: one prefill padded in every dimension, 5 -> 6 prompts (one of
    # padding only), width 7 -> 63 (the slot less one), 10 -> 12 rows (two repeating a (slot, prompt) pair). Then
    # x 3 samples on 7 slots, admitted in pieces (rows 7 -> 8). Stop tokens, min_new_tokens and per-prompt limits.
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2]]
    assert max(len(p) for p in prompts) == 7 and slots._prefill_shape(5, 7, 10, slot_len=64) == (6, 63, 12)
    for n, max_num_seqs, limits in ((2, 10, [6, 56, 3, 9, 11]), (3, 7, [6, 14, 3, 9, 11])):
        params = SamplingParams(max_new_tokens=max(limits), temperature=1.0, n=n, stop_token_ids=(7,),
                                min_new_tokens=2)
        seed = lambda: torch.Generator().manual_seed(21)
        plain = NativeEngine(model, PAD, max_num_seqs=max_num_seqs)
        expected = plain.generate(prompts, params, seed(), max_new_tokens=limits)
        padded = NativeEngine(model, PAD, max_num_seqs=max_num_seqs)
        padded.slots.pad_prefills = True
        padded.slots.admit_min_free = 1
        out = padded.generate(prompts, params, seed(), max_new_tokens=limits)
        assert plain.stats["prefills_padded"] == 0
        assert padded.stats["prefills_padded"] == padded.stats["prefills"] >= (1 if n == 2 else 3)
        assert torch.equal(out.response_ids, expected.response_ids)
        assert torch.equal(out.response_mask, expected.response_mask)
        torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_prefill_buckets_are_the_smallest_allowed_size():
    sizes = sorted({2**k for k in range(14)} | {3 * 2**k for k in range(13)})
    for n in range(1, 3000):
        assert slots._size_bucket(n) == min(size for size in sizes if size >= n), n
    width = slots.PREFILL_WIDTH_BUCKET
    assert slots._prefill_shape(5, width + 1, 11, slot_len=4096) == (6, 2 * width, 12)
    # the width stays below the slot's length (a compiled prefill as wide as the slot failed on a longer slot later)
    assert slots._prefill_shape(1, 10, 1, slot_len=24) == (1, 23, 1)
    assert slots._prefill_shape(1, 10, 1, slot_len=width) == (1, width - 1, 1)
    for slot_len in range(2, 3 * width):
        for prompt in range(1, slot_len):
            padded = slots._prefill_shape(1, prompt, 1, slot_len)[1]
            assert prompt <= padded < slot_len and (padded % width == 0 or padded == slot_len - 1)
    fits = slots.PREFILL_GRAPH_TOKENS // width
    assert slots._prefill_shape(fits, width, fits, slot_len=4096) == (fits, width, fits)
    assert slots._prefill_shape(fits + 1, width, 1, slot_len=4096) is None


def test_every_admission_schedule_gives_the_same_samples(model):
    # 20 sequences on 6 slots, limits 1..25: waiting sequences are admitted as soon as a slot is free, or only once
    # admit_min_free slots are. Sampling is a function of (seed, sequence, step), so every schedule gives what one
    # slot per sequence gives, and every sequence runs to its own limit.
    prompts = [[i + 1, (7 * i) % (VOCAB - 1) + 1, 3] for i in range(10)]
    limits = [1, 25, 4, 17, 2, 9, 25, 12, 6, 20]
    params = SamplingParams(max_new_tokens=25, temperature=1.0, n=2)
    seed = lambda: torch.Generator().manual_seed(13)
    everyone = NativeEngine(model, PAD).generate(prompts, params, seed(), max_new_tokens=limits)
    for admit_min_free in (1, 4):
        engine = NativeEngine(model, PAD, max_num_seqs=6)
        engine.slots.admit_min_free = admit_min_free
        out = engine.generate(prompts, params, seed(), max_new_tokens=limits)
        assert engine.stats["slots"] == 6 and engine.stats["prefills"] >= 3
        assert out.response_mask.sum(-1).tolist() == [m for m in limits for _ in range(2)]
        assert torch.equal(out.response_ids, everyone.response_ids)
        torch.testing.assert_close(out.logprobs, everyone.logprobs, atol=1e-5, rtol=0)
        assert {"prefill_s", "capture_s", "decode_s"} <= engine.stats.keys()


def test_admission_waits_for_enough_free_slots():
    # 8 slots, 12 sequences: the first 8 with limits [2, 2, 2, 40 x 5], then 4 with limit 5. After round 1 (16
    # steps) three slots are free. admit_min_free 4: the 4 waiting ones wait until the long ones end (rounds of 16, 7
    # steps), then one prefill and a round of 4 steps: 2 prefills, 43 steps. admit_min_free 1: three are admitted at
    # once (their 4 steps fit in round 2), the fourth after round 2 (round 3: the long ones' last 7 steps): 3
    # prefills, 39 steps. Both give the same samples.
    engine = NativeEngine(tiny_model("qwen2"), PAD, max_num_seqs=8)
    prompts, limits = [[i + 1, i + 2] for i in range(12)], [2, 2, 2] + [40] * 5 + [5] * 4
    outputs = []
    for admit_min_free, prefills, steps in ((4, 2, 16 + 16 + 7 + 4), (1, 3, 16 + 16 + 7)):
        engine.slots.admit_min_free = admit_min_free
        outputs.append(engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0),
                                       torch.Generator().manual_seed(2), max_new_tokens=limits))
        assert (engine.stats["prefills"], engine.stats["decode_steps"]) == (prefills, steps)
        assert outputs[-1].response_mask.sum(-1).tolist() == limits
    assert torch.equal(outputs[0].response_ids, outputs[1].response_ids)


def test_a_resident_engine_keeps_its_run_and_decodes_with_the_new_weights(model, monkeypatch):
    # A resident engine keeps its cache, graphs and stacked weights between calls; each call refills the weights.
    # After the parameters change in place (an optimizer step), the next call of the same shapes reuses the run and
    # gives what a fresh engine gives on the changed model, not what it gave before.
    model = copy.deepcopy(model)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, n=2, stop_token_ids=(5,))
    seed = lambda: torch.Generator().manual_seed(4)
    kept = NativeEngine(model, PAD, max_num_seqs=5)
    first = kept.generate(PROMPTS, params, seed())
    assert kept.stats["new_run"] == 1
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    second = kept.generate(PROMPTS, params, seed())
    assert kept.stats["new_run"] == 0
    fresh = NativeEngine(model, PAD, max_num_seqs=5, resident=False)
    expected = fresh.generate(PROMPTS, params, seed())
    assert fresh.slots._run is None and fresh.stats["new_run"] == 1
    assert not torch.allclose(second.logprobs, first.logprobs)
    assert torch.equal(second.response_ids, expected.response_ids)
    assert torch.equal(second.response_mask, expected.response_mask)
    torch.testing.assert_close(second.logprobs, expected.logprobs, atol=0, rtol=0)
    # Shorter prompts and fewer sequences fit the kept run; other sampling settings, more sequences or longer
    # ones build a new run.
    short = [p[:1] for p in PROMPTS]
    assert torch.equal(kept.generate(short, params, seed()).response_ids,
                       fresh.generate(short, params, seed()).response_ids)
    assert kept.stats["new_run"] == 0
    # The replaced run's memory is released before the new run is allocated (and sized), not held beside it.
    alive_at_new_run = []

    class Run(slots.SlotRun):
        def __init__(self, *args):
            alive_at_new_run.append(old_cache() is not None)
            super().__init__(*args)

    monkeypatch.setattr(slots, "SlotRun", Run)
    for prompts, changed in ((short, dataclasses.replace(params, temperature=0.5)),
                             (short, dataclasses.replace(params, n=3)), ([p * 3 for p in PROMPTS], params)):
        old_cache = weakref.ref(kept.slots._run.k[0])
        out = kept.generate(prompts, changed, seed())
        assert kept.stats["new_run"] == 1
        assert torch.equal(out.response_ids, fresh.generate(prompts, changed, seed()).response_ids)
    assert alive_at_new_run == [False] * 6  # three new runs of each engine


def test_gumbel_sampling_follows_the_truncated_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    rows = 40_000
    logits = probs.log().expand(rows, 4)
    keys, steps = torch.arange(rows) % 97, torch.arange(rows) // 97
    noise = gumbel_noise(torch.tensor([1234], dtype=torch.int32), keys, steps, 4)
    tokens, logprobs = sample_with_noise(logits, 1.0, 3, 1.0, None, noise)
    frequencies = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95, atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    # Standard Gumbel moments, and neighbouring keys and steps uncorrelated.
    big = gumbel_noise(torch.tensor([7], dtype=torch.int32), torch.arange(512), torch.zeros(512), 1024)
    assert abs(big.mean() - 0.5772) < 0.01 and abs(big.var() - torch.pi**2 / 6) < 0.03
    assert abs(torch.corrcoef(torch.stack([big[:-1].flatten(), big[1:].flatten()]))[0, 1]) < 0.01


def test_compiled_pieces_outlive_dynamos_default_recompile_limit():
    """One process meets many variants of each decode piece (engines, sampling settings); under fullgraph=True the
    variant past Dynamo's recompile limit is an error (the CUDA test of the kernels hit it, behind the other engines
    of its process). Pieces compiled by slots.compile_piece take RECOMPILE_LIMIT variants."""
    # set and put back by hand: monkeypatch's undo of an attribute of torch's config module leaves it deleted, and a
    # later test in the process that reads it fails ("recompile_limit does not exist")
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 8  # the default
    try:
        variants = [f"v{i}" for i in range(12)]  # a str argument is a constant: every value is its own variant

        def piece(x: torch.Tensor, mode: str) -> torch.Tensor:
            return x * len(mode) if mode.startswith("v") else x

        x = torch.ones(3)
        torch._dynamo.reset()
        plain = torch.compile(piece, fullgraph=True, backend="eager")
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            for mode in variants:
                plain(x, mode)
        torch._dynamo.reset()
        ours = slots.compile_piece(piece, backend="eager")
        assert [float(ours(x, mode)[0]) for mode in variants] == [float(len(mode)) for mode in variants]
        assert torch._dynamo.config.recompile_limit == slots.RECOMPILE_LIMIT
        torch._dynamo.reset()
    finally:
        torch._dynamo.config.recompile_limit = before
