"""rollout/kernels.py's Triton decode attention against a plain softmax(q k^T / sqrt(D)) v, run by Triton's interpreter
on CPU (conftest sets TRITON_INTERPRET=1 without a GPU; on a GPU the same checks run the compiled kernels), and the
engine decoding through it as through SDPA."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import config as C
from rollout import kernels
from rollout.native import NativeEngine, SamplingParams
from rollout.sampling import gumbel_noise, sample_with_noise

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def slow_attention(q, k_cache, v_cache, pos):
    """Each (slot, query head) by itself in float64: softmax over positions 0..pos[b] of its key/value head."""
    batch, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            keys = k_cache[b, h // group, : int(pos[b]) + 1].double().cpu()
            values = v_cache[b, h // group, : int(pos[b]) + 1].double().cpu()
            weights = (keys @ q[b, h].double().cpu() / math.sqrt(dim)).softmax(0)
            out[b, h] = weights @ values
    return out


# (batch, query heads, kv heads, head_dim, slots, cache length, context bound): Qwen2.5-0.5B's group of 7 (padded to
# 16 rows), multi-head (group 1), head_dim 128, a bound that is not a multiple of the 64-position tile
SHAPES = [(3, 14, 2, 64, 5, 300, 256), (4, 4, 4, 16, 4, 72, 70), (2, 12, 2, 128, 2, 200, 192)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits, merge_in_kernel", [(0, True), (1, True), (3, True), (3, False)])
def test_decode_attention_matches_softmax_attention(shape, splits, merge_in_kernel):
    """Against softmax(q k^T) v in float64; the splits merged by their last program (the counters are zero again
    after) or by the second kernel."""
    batch, heads, kv_heads, dim, slots, cache_len, length = shape
    gen = torch.Generator().manual_seed(sum(shape) + splits)
    q = torch.randn(batch, heads, dim, generator=gen)
    k = torch.randn(slots, kv_heads, cache_len, dim, generator=gen)
    v = torch.randn(slots, kv_heads, cache_len, dim, generator=gen)
    pos = torch.randint(0, length, (batch,), generator=gen)
    pos[0], pos[-1] = 0, length - 1  # one position only; the whole bound
    expected = slow_attention(q, k, v, pos)
    # Past pos the cache holds whatever an earlier sequence left (here NaN): the kernel must not read it.
    for b in range(batch):
        k[b, :, int(pos[b]) + 1:] = float("nan")
        v[b, :, int(pos[b]) + 1:] = float("nan")
    kernels._COUNTERS.clear()
    got = kernels.decode_attention_impl(*(t.to(DEVICE) for t in (q, k, v, pos)), length, splits, merge_in_kernel)
    if splits > 1:  # the counters exist exactly when the kernel merged, and it left them at zero
        assert (got.device in kernels._COUNTERS) == merge_in_kernel
        assert not merge_in_kernel or not kernels._COUNTERS[got.device].any()
    # float32 throughout (IEEE products): the differences are float32 rounding of sums of ~300 terms
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_in_bfloat16():
    """The engine's dtype: bfloat16 in and out, float32 inside. Outputs are weighted means of values of size ~1, so
    the error bound is bfloat16's rounding of the output (2^-8 relative) plus the rounding of p before p v."""
    batch, heads, kv_heads, dim, slots, cache_len, length = SHAPES[0]
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*s, generator=gen).bfloat16() for s in
               ((batch, heads, dim), (slots, kv_heads, cache_len, dim), (slots, kv_heads, cache_len, dim)))
    pos = torch.tensor([0, 100, length - 1])
    got = kernels.decode_attention_impl(*(t.to(DEVICE) for t in (q, k, v, pos)), length, 2)
    assert got.dtype == torch.bfloat16
    expected = slow_attention(q, k, v, pos)
    torch.testing.assert_close(got.double().cpu(), expected, atol=2**-6, rtol=2**-7)


def test_split_count():
    # 256 programs wanted: 3 slots x 2 kv heads need 43 splits, capped by the 4 tiles of a 256-position bound
    assert kernels.split_count(3, 2, 256, 256) == 4
    # 64 slots x 2 kv heads = 128 programs: two splits make 256; a 64-position bound has one tile only
    assert kernels.split_count(64, 2, 384, 256) == 2
    assert kernels.split_count(64, 2, 64, 256) == 1
    # a batch that fills the GPU by itself is not split
    assert kernels.split_count(256, 2, 384, 264) == 1


def test_available_says_why_not():
    assert kernels.available(64, torch.device(DEVICE)) is None
    assert "power of two" in kernels.available(96, torch.device(DEVICE))
    assert "power of two" in kernels.available(8, torch.device(DEVICE))


def head16_model(layers: int = 2, kv_heads: int = 2) -> torch.nn.Module:
    """A tiny Qwen2 with head_dim 16 (the kernel's smallest) and 4 query heads."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config).eval().to(DEVICE)


def decode_both(model, prompts, params, limits=None, slots=12):
    """(outputs, stats) of the engine with decode_kernels "triton" and "torch", the same seed."""
    outs, stats = {}, {}
    for kernels_ in ("triton", "torch"):
        engine = NativeEngine(model, 0, max_num_seqs=slots, decode_kernels=kernels_, compile=False)
        outs[kernels_] = engine.generate(prompts, params, torch.Generator(DEVICE).manual_seed(3), max_new_tokens=limits)
        stats[kernels_] = dict(engine.stats)
    assert stats["triton"]["kernel_attention"] == stats["triton"]["kernel_sampling"] == 1
    assert stats["torch"]["kernel_attention"] == stats["torch"]["kernel_sampling"] == 0
    assert torch.equal(outs["triton"].response_ids, outs["torch"].response_ids)
    torch.testing.assert_close(outs["triton"].logprobs, outs["torch"].logprobs, atol=1e-5, rtol=0)
    return outs["torch"], stats["torch"]


def test_engine_decodes_through_the_kernels_as_through_torch():
    """12 sequences in 12 slots, sampled at temperature 1.1: the same tokens and log-probs with
    decode_kernels="triton" as with "torch", over what the engine does to the kernels: a 130-token prompt that stops
    after 4 tokens, whose freed slot stays in the batch while the others need only the 128-position context bucket
    (its pos is past `length`); three stopping at 20, after which the eight live slots move into the 8-slot bucket;
    2-3 attention splits. Then stop tokens, banned before min_new_tokens, in a short run."""
    model = head16_model(layers=1, kv_heads=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (130,), generator=gen).tolist()] + [[5 + i, 6, 7] for i in range(11)]
    out, stats = decode_both(model, prompts, SamplingParams(max_new_tokens=40, temperature=1.1),
                             limits=[4] + [40] * 8 + [20] * 3)
    assert out.response_mask.sum(1).tolist() == [4] + [40] * 8 + [20] * 3
    assert stats["decode_steps"] == 39  # 16 + 16 (no compaction: 11 live need the 12-slot bucket) + 7 in 8 slots
    out, _ = decode_both(model, prompts[1:], SamplingParams(max_new_tokens=12, temperature=1.1,
                                                            stop_token_ids=(11, 12, 13), min_new_tokens=3))
    lengths = out.response_mask.sum(1)
    ends = out.response_ids[torch.arange(len(lengths)), lengths - 1]
    stopped = (lengths < 12) & torch.isin(ends, torch.tensor([11, 12, 13], device=ends.device))
    assert bool(stopped.any()) and bool((lengths[stopped] >= 3).all())


def test_engine_refuses_an_unknown_or_impossible_attention():
    model = head16_model()
    with pytest.raises(ValueError, match="decode_kernels must be one of"):
        NativeEngine(model, 0, decode_kernels="cuda")
    odd = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=96,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1)).eval().to(DEVICE)
    with pytest.raises(ValueError, match="head_dim 24 is not a power of two"):
        NativeEngine(odd, 0, decode_kernels="triton").generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("chunks", [0, 1, 3])
@pytest.mark.parametrize("ban", [False, True])
def test_sample_tokens_draws_as_the_pytorch_form(temperature, chunks, ban):
    """The same tokens as sampling.sample_with_noise with the same counter-based noise (ties have probability ~0 in
    float32 logits of this spread) and its log-probs, bfloat16 logits of a vocabulary that is not a multiple of the
    tile; with `ban`, the stop tokens of the rows still under min_new_tokens are never picked."""
    rows, vocab = 6, 5000
    gen = torch.Generator().manual_seed(int(temperature * 10) + chunks)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
    stop = torch.zeros(vocab, dtype=torch.bool)
    # each row's favourite tokens are stop tokens: banning must change the pick
    stop[logits.float().argmax(-1)] = True
    stop[[7, 4999]] = True
    banned_rows = torch.tensor([True, False, True, True, False, True])
    seed = torch.tensor([12345], dtype=torch.int32)
    keys, steps = torch.arange(rows) * 3, torch.arange(rows) + 40
    banned = banned_rows[:, None] & stop[None, :] if ban else None
    noise = gumbel_noise(seed, keys, steps, vocab) if temperature > 0 else None
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, 0, 1.0, banned, noise)
    args = [t.to(DEVICE) for t in (logits, seed, keys, steps)]
    tokens, logprobs = kernels.sample_tokens_impl(args[0], temperature, *args[1:],
                                                  stop.to(DEVICE) if ban else None,
                                                  banned_rows.to(DEVICE) if ban else None, chunks)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=1e-5, rtol=1e-5)
    if ban:
        assert not (stop[tokens.cpu()] & banned_rows).any()
        if temperature == 0:  # greedy: the rows not banned take their favourite, a stop token
            assert stop[tokens.cpu()][~banned_rows].all()


def test_sample_chunks():
    # 64 rows want 4 chunks for 256 programs; 151936 tokens are 75 tiles of 2048
    assert kernels.sample_chunks(64, 151936, 256) == 4
    assert kernels.sample_chunks(1, 151936, 256) == 75
    assert kernels.sample_chunks(256, 151936, 264) == 2
    # the engine's count on an H200 (132 SMs): 2112 programs for 256 rows, 9 chunks of 9 tiles (the last one 2.2)
    assert kernels.sample_chunks(256, 151936, 132 * kernels.SAMPLE_PROGRAMS_PER_SM) == 9
    assert kernels._whole_tiles(151936, 9, kernels.BLOCK_V) == (9 * 2048, 9)
    assert kernels.sample_chunks(8, 1000, 256) == 1


@pytest.mark.parametrize("overrides, needle", [
    (["run.device=cpu"], "rollout.decode_kernels=triton: the kernels run on GPUs; with run.device=cpu use auto or "
                         "torch"),
    (["rollout.compact_forward=false"], "rollout.decode_kernels=triton needs rollout.compact_forward=true"),
    pytest.param([], "this machine has no CUDA GPU (run.device=auto picks the CPU)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_triton_kernels_config_mistakes(overrides, needle):
    cfg = C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                               "rollout.decode_kernels=triton", *overrides])
    with pytest.raises(C.ConfigError) as err:
        C.check_ppo(cfg, 1)
    assert needle in str(err.value)
    C.check_ppo(C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                                     "rollout.decode_kernels=torch", *overrides]), 1)


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_greedy_ties_pick_the_first_token_as_argmax(chunks):
    """Equal best logits inside a tile, across tiles and across chunks, and a row of equal logits: the lowest token
    id wins, as torch.argmax."""
    vocab = 5000
    logits = torch.zeros(4, vocab)
    logits[0, [2047, 2049]] = 5.0
    logits[1, [100, 4000]] = 5.0
    logits[2, [2048, 4999]] = 5.0
    seed, zeros = torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    tokens, logprobs = kernels.sample_tokens_impl(logits.to(DEVICE), 0.0, seed, zeros, zeros, None, None, chunks)
    assert tokens.tolist() == [2047, 100, 2048, 0]
    torch.testing.assert_close(logprobs.cpu(), logits.log_softmax(-1)[torch.arange(4), tokens.cpu()])


def test_the_operators_pass_opcheck():
    """Schemas, fake (meta) implementations and autograd registration as torch.compile sees them."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=gen)
    k, v = torch.randn(4, 2, 80, 16, generator=gen), torch.randn(4, 2, 80, 16, generator=gen)
    pos = torch.tensor([0, 40, 79])
    torch.library.opcheck(kernels.decode_attention, (*(t.to(DEVICE) for t in (q, k, v, pos)), 80))
    logits = torch.randn(3, 300, generator=gen).to(DEVICE)
    seed, keys = torch.tensor([7], dtype=torch.int32).to(DEVICE), torch.arange(3).to(DEVICE)
    stop, banned = torch.zeros(300, dtype=torch.bool).to(DEVICE), torch.tensor([True, False, True]).to(DEVICE)
    torch.library.opcheck(kernels.sample_tokens, (logits, 0.8, seed, keys, keys, stop, banned))
    torch.library.opcheck(kernels.sample_tokens, (logits, 0.0, seed, keys, keys, None, None))


def test_decode_attention_needs_a_context_length():
    q, k = torch.zeros(1, 2, 16), torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="length must be >= 1"):
        kernels.decode_attention_impl(q, k, k, torch.zeros(1, dtype=torch.long), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (concurrent programs)")
def test_the_in_kernel_merge_agrees_with_the_merge_kernel_on_a_gpu():
    """The last-program merge relies on the GPU's memory ordering (the interpreter runs programs one at a time): many
    calls over shapes with 2-8 splits give what the second kernel gives, every time."""
    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, dim, length in [(64, 14, 2, 64, 384), (8, 12, 2, 128, 512), (3, 16, 8, 64, 256)]:
        q = torch.randn(batch, heads, dim, generator=gen).bfloat16().cuda()
        k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen).bfloat16().cuda() for _ in range(2))
        pos = torch.randint(0, length, (batch,), generator=gen).cuda()
        for splits in (2, 5, kernels.MERGE_IN_KERNEL_MAX_SPLITS):
            want = kernels.decode_attention_impl(q, k, v, pos, length, splits, merge_in_kernel=False).float()
            for _ in range(50):
                got = kernels.decode_attention_impl(q, k, v, pos, length, splits, merge_in_kernel=True).float()
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            assert not kernels._COUNTERS[q.device].any()
