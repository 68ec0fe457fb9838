"""The slot engine on a GPU, with its decode steps in CUDA graphs and its pieces under torch.compile (the defaults),
on float32 tiny models: the same outputs as the HF-forward path and teacher forcing. Skipped without CUDA (CI has
none; run on a GPU machine)."""

import pytest
import torch
from test_rollout_native import PAD, PROMPTS, responses, tiny_model

from rollout.native import NativeEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS_6 = PROMPTS + [[30, 31], [40, 41, 42, 43, 44]]
LIMITS = [20, 3, 9, 17, 2, 30]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param).cuda()


def teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device="cuda")).logits[0].float()
    predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    return predicting.log_softmax(-1).gather(-1, torch.tensor(response, device="cuda")[:, None]).squeeze(-1)


def test_graphs_greedy_matches_the_hf_forward_path(model):
    # 12 sequences in 10 slots: graph replays through slot reuse, then compaction into the 8-slot bucket.
    params = SamplingParams(max_new_tokens=30, temperature=0, n=2, stop_token_ids=(11,), min_new_tokens=1)
    engine = NativeEngine(model, PAD, max_num_seqs=10)
    out = engine.generate(PROMPTS_6, params, max_new_tokens=LIMITS)
    expected = NativeEngine(model, PAD, compact_forward=False).generate(PROMPTS_6, params, max_new_tokens=LIMITS)
    assert engine.stats["graphs"] >= 1 and engine.stats["prefills"] >= 2
    assert torch.equal(out.response_ids, expected.response_ids)
    assert torch.equal(out.response_mask, expected.response_mask)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=0)


def test_graphs_sampled_logprobs_match_teacher_forcing(model):
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9, n=3, stop_token_ids=(7, 9),
                            min_new_tokens=2)
    out = NativeEngine(model, PAD, max_num_seqs=7).generate(PROMPTS, params, torch.Generator("cuda").manual_seed(3))
    for i, (prompt, response) in enumerate(zip(out.prompt_ids, responses(out))):
        expected = teacher_forced(model, prompt, response, 0.7)
        torch.testing.assert_close(out.logprobs[i, : len(response)], expected, atol=1e-4, rtol=0)


def test_graphs_and_eager_draw_the_same_samples(model):
    params = SamplingParams(max_new_tokens=20, temperature=1.0, n=2)
    seed = lambda: torch.Generator("cuda").manual_seed(5)
    # 3 slots for 8 sequences: prefills of 1-2 prompts and 2-3 rows, each replayed from its bucket's graph
    engine = NativeEngine(model, PAD, max_num_seqs=3)
    engine.slots.admit_min_free = 1
    fast = engine.generate(PROMPTS, params, seed())
    assert engine.stats["prefill_graphs"] >= 2 and engine.stats["prefills_padded"] == engine.stats["prefills"] >= 3
    eager = NativeEngine(model, PAD, cuda_graphs=False, compile=False).generate(PROMPTS, params, seed())
    assert torch.equal(fast.response_ids, eager.response_ids)
    torch.testing.assert_close(fast.logprobs, eager.logprobs, atol=1e-4, rtol=0)


def test_graphs_and_compile_decode_through_the_kernels_as_through_torch():
    """The default GPU path (torch.compile, CUDA graphs) with rollout/kernels.py's Triton kernels against the PyTorch
    ones: a head_dim-16 model (the tiny models above have 8, which the kernels refuse), 40 sequences in 12 slots,
    temperature 1.1, stop tokens before min_new_tokens banned: the same tokens, log-probs within float32 rounding."""
    from test_rollout_kernels import head16_model

    model = head16_model()
    prompts = [[5 + i % 40, 6, 7, 8 + i % 3][: 2 + i % 3] for i in range(20)]
    params = SamplingParams(max_new_tokens=30, temperature=1.1, n=2, stop_token_ids=(11,), min_new_tokens=3)
    outs = {}
    for kernels_ in ("triton", "torch"):
        engine = NativeEngine(model, PAD, max_num_seqs=12, decode_kernels=kernels_)
        outs[kernels_] = engine.generate(prompts, params, torch.Generator("cuda").manual_seed(4))
        assert engine.stats["kernel_attention"] == (kernels_ == "triton") and engine.stats["graphs"] >= 1
    assert torch.equal(outs["triton"].response_ids, outs["torch"].response_ids)
    torch.testing.assert_close(outs["triton"].logprobs, outs["torch"].logprobs, atol=1e-5, rtol=0)


def test_with_prefill_graphs_a_free_slot_is_refilled_at_once():
    # 16 slots, 18 sequences: the first 16 with limits [2, 40 x 15], then 2 with limit 5. After round 1 (16 steps)
    # one slot is free. Prefills replayed from graphs: it is refilled at once (prefill 2), and again after round 2
    # (prefill 3), whose 5-token sequences fit in rounds 2 and 3 (16, 7 steps): 3 prefills, 39 steps. Launched op by
    # op, admission waits for an eighth of the slots (2): both wait for the long ones (rounds 2, 3), then a round of
    # 4 steps: 2 prefills, 43 steps.
    prompts, limits = [[i + 1, i + 2] for i in range(18)], [2] + [40] * 15 + [5] * 2
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    model = tiny_model("qwen2").cuda()
    for pad_prefills, prefills, steps in ((None, 3, 16 + 16 + 7), (False, 2, 16 + 16 + 7 + 4)):
        engine = NativeEngine(model, PAD, max_num_seqs=16)
        engine.slots.pad_prefills = pad_prefills
        engine.generate(prompts, params, torch.Generator("cuda").manual_seed(2), max_new_tokens=limits)
        assert (engine.stats["prefills"], engine.stats["decode_steps"]) == (prefills, steps)
        assert engine.stats["prefills_padded"] == (prefills if pad_prefills is None else 0)


def test_a_call_that_only_prefills_captures_no_decode_graph_and_times_its_phases(model):
    # max_new_tokens 1: every slot finishes at its prefill, so there is no decode step to capture (a graph was
    # captured for zero steps before), only the prefill's; the phase clock reads the prefill's device time from CUDA
    # events.
    engine = NativeEngine(model, PAD)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, temperature=0), torch.Generator("cuda"))
    assert out.response_mask.sum().item() == len(PROMPTS)
    assert engine.stats["graphs"] == 0 and engine.stats["decode_steps"] == 0 and engine.stats["prefill_graphs"] == 1
    assert engine.stats["prefill_s"] > 0
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0))
    assert engine.stats["graphs"] >= 1 and engine.stats["capture_s"] > 0 and engine.stats["decode_s"] > 0


def test_a_resident_engine_replays_its_graphs_on_the_new_weights():
    # The default engine keeps its cache, graphs and weight buffers: the second call of the same shapes captures
    # nothing, and after the parameters change in place its graphs decode with the new values (the buffers are
    # refilled, not rebound): what a fresh engine gives on the changed model.
    from test_rollout_kernels import head16_model

    model = head16_model()
    prompts = [[5 + i % 40, 6, 7, 8 + i % 3][: 2 + i % 3] for i in range(12)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=2, stop_token_ids=(11,))
    seed = lambda: torch.Generator("cuda").manual_seed(6)
    kept = NativeEngine(model, PAD, max_num_seqs=16)
    first = kept.generate(prompts, params, seed())
    assert kept.stats["new_run"] == 1 and kept.stats["graphs"] >= 1
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    second = kept.generate(prompts, params, seed())
    # the new weights draw other stop tokens, so the admissions may group other prompts: a new prefill shape
    # captures its graph, nothing else does
    assert kept.stats["new_run"] == 0 and kept.stats["graphs"] == 0
    assert kept.stats["capture_s"] == 0 or kept.stats["prefill_graphs"] > 0
    assert kept.stats["prefills_padded"] == kept.stats["prefills"] > 0
    expected = NativeEngine(model, PAD, max_num_seqs=16, resident=False).generate(prompts, params, seed())
    assert not torch.allclose(second.logprobs, first.logprobs)
    assert torch.equal(second.response_ids, expected.response_ids)
    torch.testing.assert_close(second.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_a_cache_the_gpu_share_cuts_short_is_not_kept():
    # A share (gpu_memory_utilization) that leaves room for 2.5 slots of the 12 sequences: 2 slots, and the cache,
    # which fills the share, lives for this call only; the same engine with room for all 12 keeps its run.
    from test_rollout_kernels import head16_model

    from rollout.model_weights import read_weights

    model = head16_model()
    prompts = PROMPTS[:3] * 2  # 6 prompts x n=2: 12 sequences
    params = SamplingParams(max_new_tokens=200, temperature=0, n=2)
    slot_len = -(-(max(len(p) for p in prompts) + 200) // 8) * 8
    w = read_weights(model, fuse=True)
    per_slot = slot_len * 2 * len(w.layers) * w.kv_heads * w.head_dim * w.embed.element_size()
    stacked = sum(t.numel() * t.element_size() for b in w.layers for t in (b.qkv, b.qkv_bias, b.gate_up)
                  if t is not None)  # the resident engine's own buffers, allocated before it sizes the cache
    engine = NativeEngine(model, PAD, max_num_seqs=12)
    activations = engine.slots._activation_bytes(w)
    del w
    share = torch.cuda.memory_allocated() + stacked + activations + 2.5 * per_slot
    engine.slots.gpu_memory_utilization = share / torch.cuda.mem_get_info()[1]
    cut = engine.generate(prompts, params)
    assert engine.stats["slots"] == 2 and engine.slots._run is None
    engine.slots.gpu_memory_utilization = 0.9
    whole = engine.generate(prompts, params)
    assert engine.stats["slots"] == 12 and engine.stats["new_run"] == 1 and engine.slots._run is not None
    assert torch.equal(cut.response_ids, whole.response_ids)
