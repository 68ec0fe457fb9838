"""rollout/kernels.py's Triton decode attention against a plain softmax(q k^T / sqrt(D)) v, run by Triton's interpreter
on CPU (conftest sets TRITON_INTERPRET=1 without a GPU; on a GPU the same checks run the compiled kernels), and the
engine decoding through it as through SDPA."""

import dataclasses
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import config as C
from rollout import kernels, sample_kernels
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


def rotary(pos, dim, dtype):
    """cos, sin [B, dim] at positions pos in the rotate-half layout (HF's tables, base 10000)."""
    inv_freq = 10000.0 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = pos.double()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin):
    """x [B, heads, D] rotated by rows of cos, sin [B, D], element by element in float64: x_d cos_d - x_(d+D/2) sin_d
    for the first half, x_d cos_d + x_(d-D/2) sin_d for the second."""
    half = x.shape[-1] // 2
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    partner = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + partner * sin


def new_token(shape, gen, dtype=torch.float32):
    """Random q [B, H, D], new k, v [B, KVH, D], caches [S, KVH, T, D] with NaN from pos[b] on (the kernel must read
    only positions before pos[b] from the cache), pos [B] with 0 and length - 1 among them, and the rotary rows."""
    batch, heads, kv_heads, dim, slots, cache_len, length = shape
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(slots, kv_heads, cache_len, dim, generator=gen).to(dtype) for _ in range(2))
    pos = torch.randint(0, length, (batch,), generator=gen)
    pos[0], pos[-1] = 0, length - 1  # one position only; the whole bound
    for b in range(batch):
        k_cache[b, :, int(pos[b]):] = float("nan")
        v_cache[b, :, int(pos[b]):] = float("nan")
    return q, k, v, k_cache, v_cache, pos, *rotary(pos, dim, dtype)


def expected_step(q, k, v, k_cache, v_cache, pos, cos, sin):
    """(attention output [B, H, D] float64, k_cache, v_cache after the step): q and k rotated and rounded to their
    dtype, k and v written at pos, softmax attention over positions 0..pos[b]."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rows = torch.arange(q.shape[0])
    k_cache[rows, :, pos] = rotate(k, cos, sin).to(k.dtype)
    v_cache[rows, :, pos] = v
    return slow_attention(rotate(q, cos, sin).to(q.dtype), k_cache, v_cache, pos), k_cache, v_cache


# (batch, query heads, kv heads, head_dim, slots, cache length, context bound): Qwen2.5-0.5B's group of 7 (padded to
# 16 rows), multi-head (group 1), head_dim 128, a bound that is not a multiple of the 64-position tile
SHAPES = [(3, 14, 2, 64, 5, 300, 256), (4, 4, 4, 16, 4, 72, 70), (2, 12, 2, 128, 2, 200, 192)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits, merge_in_kernel", [(0, True), (1, True), (3, True), (3, False)])
def test_decode_attention_matches_softmax_attention(shape, splits, merge_in_kernel):
    """Against rotary embedding, cache write and softmax(q k^T) v in float64; the splits merged by their last program
    (the counters are zero again after) or by the second kernel. The caches hold the rotated new key and the new value
    at pos afterwards and are unchanged elsewhere (the slots past the batch included)."""
    gen = torch.Generator().manual_seed(sum(shape) + splits)
    step = new_token(shape, gen)
    expected, k_after, v_after = expected_step(*step)
    q, k, v, k_cache, v_cache, pos, cos, sin = (t.to(DEVICE) for t in step)
    kernels._COUNTERS.clear()
    got = kernels.decode_attention_impl(q, k, v, k_cache, v_cache, pos, cos, sin, shape[-1], splits, merge_in_kernel)
    if splits > 1:  # the counters exist exactly when the kernel merged, and it left them at zero
        assert (got.device in kernels._COUNTERS) == merge_in_kernel
        assert not merge_in_kernel or not kernels._COUNTERS[got.device].any()
    # float32 throughout (IEEE products): the differences are float32 rounding of sums of ~300 terms
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.cpu(), k_after, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_after, atol=0, rtol=0, equal_nan=True)


def test_decode_attention_takes_views_of_a_fused_projection():
    """q, k, v as the decode step passes them: views of one [B, (H + 2 KVH) D] projection output (row stride past D),
    with the same result as contiguous copies."""
    shape = SHAPES[0]
    batch, heads, kv_heads, dim = shape[:4]
    gen = torch.Generator().manual_seed(5)
    q, k, v, k_cache, v_cache, pos, cos, sin = (t.to(DEVICE) for t in new_token(shape, gen))
    fused = torch.cat([t.reshape(batch, -1) for t in (q, k, v)], dim=1)
    views = [t.view(batch, -1, dim) for t in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)]
    assert views[1].stride(0) == (heads + 2 * kv_heads) * dim
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = [kernels.decode_attention_impl(*qkv, *cache, pos, cos, sin, shape[-1])
            for qkv, cache in ((views, caches[0]), ((q, k, v), caches[1]))]
    assert torch.equal(outs[0], outs[1])
    for mine, theirs in zip(caches[0], caches[1]):
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())


def test_a_slot_past_the_context_bound_attends_to_its_prefix_and_still_writes():
    """A finished slot still in the decode batch may sit at pos >= length rounded up to whole splits: the last split
    writes its rotated key and value at pos, and its output is attention over the positions the splits cover (its
    output is unused; what matters is that nothing else changes and nothing is read past the bound)."""
    batch, heads, kv_heads, dim, slots, cache_len, length = 3, 4, 2, 16, 3, 200, 70
    gen = torch.Generator().manual_seed(11)
    q, k, v = new_token((batch, heads, kv_heads, dim, slots, cache_len, length), gen)[:3]
    k_cache, v_cache = (torch.randn(slots, kv_heads, cache_len, dim, generator=gen) for _ in range(2))
    pos = torch.tensor([5, 150, 69])
    cos, sin = rotary(pos, dim, torch.float32)
    for b in range(batch):
        k_cache[b, :, int(pos[b]):] = float("nan")
        v_cache[b, :, int(pos[b]):] = float("nan")
    for splits in (1, 2):
        split_len, splits = kernels._whole_tiles(length, splits, kernels.BLOCK_T)
        covered = split_len * splits  # 128 positions: slot 1's pos 150 is past them
        want, k_after, v_after = expected_step(q, k, v, k_cache, v_cache, pos, cos, sin)
        prefix = torch.tensor([0, covered - 1, 0])  # slot 1 over positions 0..covered-1, all cached
        want[1] = slow_attention(rotate(q, cos, sin).float(), k_after, v_after, prefix)[1]
        caches = [t.clone().to(DEVICE) for t in (k_cache, v_cache)]
        got = kernels.decode_attention_impl(*(t.to(DEVICE) for t in (q, k, v)), *caches,
                                            *(t.to(DEVICE) for t in (pos, cos, sin)), length, splits)
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0].cpu(), k_after, atol=1e-6, rtol=1e-6, equal_nan=True)
        torch.testing.assert_close(caches[1].cpu(), v_after, atol=0, rtol=0, equal_nan=True)


def test_compiled_decode_attention_writes_the_caches():
    """Under torch.compile (AOT autograd functionalises the operator's cache writes, as Inductor sees them) the
    caches passed in hold the new key and value afterwards, as in eager mode, and the outputs agree."""
    shape = SHAPES[0]
    step = [t.nan_to_num().to(DEVICE) for t in new_token(shape, torch.Generator().manual_seed(9))]

    def layer_piece(q, k, v, k_cache, v_cache, pos, cos, sin):
        return kernels.decode_attention(q * 2, k, v, k_cache, v_cache, pos, cos, sin, shape[-1]) + 1

    torch._dynamo.reset()
    eager_step = [t.clone() for t in step]
    compiled_step = [t.clone() for t in step]
    want = layer_piece(*eager_step)
    got = torch.compile(layer_piece, fullgraph=True, backend="aot_eager")(*compiled_step)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert torch.equal(compiled_step[3], eager_step[3]) and torch.equal(compiled_step[4], eager_step[4])
    assert not torch.equal(compiled_step[3], step[3])  # the new keys were written


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor on CPU needs a C++ compiler")
def test_inductor_writes_the_caches_in_place():
    """Inductor (the engine's compiled decode step) calls the operator on the caches it was given: no copy of a
    whole cache per layer (a clone before the call, or a copy back after it, would be one), the q/k/v views of the
    fused projection passed as they are, and the caches written as in eager mode."""
    from torch._inductor.utils import run_and_get_code

    shape = SHAPES[0]
    batch, heads, kv_heads, dim = shape[:4]
    q, k, v, k_cache, v_cache, pos, cos, sin = (t.nan_to_num().to(DEVICE) for t in
                                                new_token(shape, torch.Generator().manual_seed(3)))
    fused = torch.cat([t.reshape(batch, -1) for t in (q, k, v)], dim=1)

    def piece(fused, k_cache, v_cache, pos, cos, sin):
        split = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        q, k, v = (t.view(batch, -1, dim) for t in split)
        return kernels.decode_attention(q, k, v, k_cache, v_cache, pos, cos, sin, shape[-1]) * 2

    eager = [k_cache.clone(), v_cache.clone()]
    want = piece(fused, *eager, pos, cos, sin)
    torch._dynamo.reset()
    compiled = [k_cache.clone(), v_cache.clone()]
    got, codes = run_and_get_code(torch.compile(piece, fullgraph=True), fused, *compiled, pos, cos, sin)
    torch._dynamo.reset()
    code = "\n".join(codes)
    assert "meshrl.decode_attention" in code and "clone" not in code and "copy_" not in code, code
    assert torch.equal(got, want)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def test_decode_attention_in_bfloat16():
    """The engine's dtype: bfloat16 in and out, float32 inside. Outputs are weighted means of values of size ~1, so
    the error bound is bfloat16's rounding of the output (2^-8 relative) plus the rounding of p before p v; the
    rotated key in the cache is the float64 rotation rounded once to bfloat16 (ties aside: one bfloat16 step)."""
    shape = SHAPES[0]
    gen = torch.Generator().manual_seed(7)
    step = new_token(shape, gen, torch.bfloat16)
    expected, k_after, _ = expected_step(*step)
    q, k, v, k_cache, v_cache, pos, cos, sin = (t.to(DEVICE) for t in step)
    got = kernels.decode_attention_impl(q, k, v, k_cache, v_cache, pos, cos, sin, shape[-1], 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double().cpu(), expected, atol=2**-6, rtol=2**-7)
    torch.testing.assert_close(k_cache.cpu().float(), k_after.float(), atol=2**-7, rtol=2**-7, equal_nan=True)


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


@pytest.mark.parametrize("top_k, top_p", [(10, 1.0), (0, 0.5), (20, 0.8)])
def test_engine_samples_top_k_and_top_p_through_the_kernel_as_through_torch(top_k, top_p):
    """The kernel's top-k floor and nucleus rounds in the engine: the same tokens and log-probs as the PyTorch
    sampler's sort, stop tokens banned before min_new_tokens among them."""
    model = head16_model(layers=1, kv_heads=1)
    params = SamplingParams(max_new_tokens=10, temperature=1.3, top_k=top_k, top_p=top_p, stop_token_ids=(11, 12),
                            min_new_tokens=2)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    out, _ = decode_both(model, prompts, params)
    assert bool((out.response_mask.sum(1) >= 2).all())
    # the cut is at work: without it the same seed draws other tokens
    uncut = NativeEngine(model, 0, max_num_seqs=12, decode_kernels="triton", compile=False).generate(
        prompts, dataclasses.replace(params, top_k=0, top_p=1.0), torch.Generator(DEVICE).manual_seed(3))
    assert not torch.equal(uncut.response_ids, out.response_ids)


def test_engine_refuses_an_unknown_or_impossible_attention():
    model = head16_model()
    with pytest.raises(ValueError, match="decode_kernels must be one of"):
        NativeEngine(model, 0, decode_kernels="cuda")
    odd = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=96,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1)).eval().to(DEVICE)
    with pytest.raises(ValueError, match="head_dim 24 is not a power of two"):
        NativeEngine(odd, 0, decode_kernels="triton").generate([[1, 2]], SamplingParams(max_new_tokens=2))


def logprob_tolerance(logits: torch.Tensor, temperature: float) -> float:
    """Log-probs of the kernel against the PyTorch form's, in natural units: each side rounds the scaled logits x =
    logits / T to float32 (the kernel x log2(e) / T, its scale rounded too) and its normaliser max + log(sum) (the
    kernel's also x ln 2 at the end): about six roundings of 2^-24 max |x| in all; 8 of them, plus 1e-5 for the
    sums' roundings."""
    finite = logits.float()[torch.isfinite(logits.float())]
    scaled = finite.abs().max().item() / (temperature if temperature > 0 else 1.0)
    return 1e-5 + 8 * 2.0**-24 * scaled


@pytest.mark.parametrize("temperature", [0.0, 0.05, 0.7, 1.0])
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
    tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, *args[1:],
                                                  stop.to(DEVICE) if ban else None,
                                                  banned_rows.to(DEVICE) if ban else None, chunks)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)
    if ban:
        assert not (stop[tokens.cpu()] & banned_rows).any()
        if temperature == 0:  # greedy: the rows not banned take their favourite, a stop token
            assert stop[tokens.cpu()][~banned_rows].all()


@pytest.mark.parametrize("top_k, top_p", [(50, 1.0), (0, 0.9), (0, 0.2), (300, 0.6)])
@pytest.mark.parametrize("chunks, dtype", [(0, torch.bfloat16), (3, torch.bfloat16), (3, torch.float32)])
@pytest.mark.parametrize("ban", [False, True])
def test_sample_tokens_with_top_k_and_top_p_draws_as_the_pytorch_form(top_k, top_p, chunks, dtype, ban):
    """With top-k and top-p: the tokens of sampling.sample_with_noise (its sort, the same noise) and the untruncated
    log-probs. Logits of a spread of 1 (a flat distribution: a nucleus of top_p 0.2 holds ~700 of 5000 tokens, and
    most rows' first pick lies outside it, so the rounds are exercised), in bfloat16 many of them tied."""
    rows, vocab, temperature = 8, 5000, 0.8
    gen = torch.Generator().manual_seed(top_k + int(top_p * 10) + chunks)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    stop = torch.zeros(vocab, dtype=torch.bool)
    stop[logits.float().argmax(-1)] = True
    banned_rows = torch.tensor([True, False] * 4)
    seed = torch.tensor([777], dtype=torch.int32)
    keys, steps = torch.arange(rows), torch.arange(rows) + 3
    banned = banned_rows[:, None] & stop[None, :] if ban else None
    noise = gumbel_noise(seed, keys, steps, vocab)
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, top_k, top_p, banned, noise)
    untruncated = sample_with_noise(logits, temperature, 0, 1.0, banned, noise)[0]
    if top_p < 0.5:
        assert (untruncated != want_tokens).sum() >= rows // 2  # the first picks mostly lie outside the nucleus
    args = [t.to(DEVICE) for t in (logits, seed, keys, steps)]
    tokens, logprobs = sample_kernels.sample_tokens_impl(
        args[0], temperature, *args[1:], stop.to(DEVICE) if ban else None, banned_rows.to(DEVICE) if ban else None,
        chunks, top_k=top_k, top_p=top_p)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)


@pytest.mark.parametrize("top_k", [0, 40])
def test_top_p_under_a_banned_token_far_above_the_rest(top_k):
    """top-p at temperature 0.05 in rows whose argmax, a stop token banned before min_new_tokens, lies 20 logits (400
    nats at this temperature) above every other token: the nucleus is taken over the tokens that may be picked, whose
    masses measured against the banned maximum would all underflow to 0 (every pick then looked outside the nucleus
    and the draw climbed to the best allowed token)."""
    rows, vocab, temperature = 6, 3000, 0.05
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen) * 0.05
    top = logits.argmax(-1)
    logits[torch.arange(rows), top] = 20.0
    stop = torch.zeros(vocab, dtype=torch.bool)
    stop[top] = True
    banned_rows = torch.ones(rows, dtype=torch.bool)
    seed = torch.tensor([9], dtype=torch.int32)
    keys = torch.arange(rows)
    noise = gumbel_noise(seed, keys, keys, vocab)
    banned = banned_rows[:, None] & stop[None, :]
    want, want_logprobs = sample_with_noise(logits, temperature, top_k, 0.9, banned, noise)
    greedy = sample_with_noise(logits, 0.0, 0, 1.0, banned, None)[0]
    assert (want != greedy).sum() >= rows // 2  # the nucleus holds more than the best allowed token
    args = [t.to(DEVICE) for t in (logits, seed, keys)]
    tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, args[1], args[2], args[2],
                                                         stop.to(DEVICE), banned_rows.to(DEVICE), 2, top_k=top_k,
                                                         top_p=0.9)
    assert torch.equal(tokens.cpu(), want)
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)


def test_the_nucleus_rounds_bound_the_chance_of_a_draw_left_outside(monkeypatch):
    """After n rounds a row holds its (n + 1)-th candidate, outside the nucleus when the first n + 1 all were: for a
    flat distribution (each pick's mass above uniform below the last's) with probability P(Poisson(ln 1/top_p) >=
    n + 1). nucleus_rounds(top_p) is the fewest rounds that bring this below 1e-9; and on 200 rows of a nearly flat
    distribution, the share of rows whose draw after n rounds is not the nucleus's (the sorted form's) follows that
    probability (within 4 standard deviations of a binomial). Three programs take the rounds' items in turn."""
    def outside(n, rate):
        return 1 - sum(math.exp(-rate) * rate**i / math.factorial(i) for i in range(n + 1))

    for top_p in (0.99, 0.9, 0.5, 0.05):
        n, rate = sample_kernels.nucleus_rounds(top_p), math.log(1 / top_p)
        assert outside(n, rate) < 1e-9 <= outside(n - 1, rate)
    monkeypatch.setattr(sample_kernels, "_programs", lambda device, per_sm=2: 3)
    rows, vocab, top_p = 200, 500, 0.2
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 0.01).to(DEVICE)
    seed = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    keys = torch.arange(rows, device=DEVICE)
    noise = gumbel_noise(seed.cpu(), keys.cpu(), keys.cpu(), vocab)
    want = sample_with_noise(logits.cpu(), 1.0, 0, top_p, None, noise)[0]
    full = sample_kernels.sample_tokens_impl(logits, 1.0, seed, keys, keys, None, None, top_p=top_p)[0].cpu()
    assert torch.equal(full, want)
    for n in (0, 1, 2):
        tokens = sample_kernels.sample_tokens_impl(logits, 1.0, seed, keys, keys, None, None, top_p=top_p, rounds=n)[0]
        share, p = (tokens.cpu() != want).float().mean().item(), outside(n, math.log(1 / top_p))
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / rows), (n, share, p)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
@pytest.mark.parametrize("chunks", [1, 3])
def test_sample_tokens_over_minus_inf_logits_and_at_a_low_temperature(temperature, chunks):
    """-inf logits (a masked vocabulary) never picked and adding nothing to the log-softmax: a row whose first 2048
    tokens (with 3 chunks, the whole first chunk) are -inf, one with every other token -inf, one with a single finite
    token; at temperature 0.05 the scores spread over ~400, so most 2^(x - max) underflow to 0 in float32: the
    draw (compared as ratios of those exponentials) and the log-probs still as the PyTorch form's."""
    rows, vocab = 4, 5000
    gen = torch.Generator().manual_seed(chunks)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
    logits[0, :2048] = float("-inf")
    logits[1, ::2] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 3333] = 1.0
    seed = torch.tensor([7], dtype=torch.int32)
    keys, steps = torch.arange(rows), torch.full((rows,), 3)
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, 0, 1.0, None,
                                                   gumbel_noise(seed, keys, steps, vocab))
    args = [t.to(DEVICE) for t in (logits, seed, keys, steps)]
    tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, *args[1:], None, None, chunks)
    assert torch.equal(tokens.cpu(), want_tokens)
    assert tokens[2].item() == 3333 and logprobs[2].item() == 0.0
    assert torch.isfinite(logits[torch.arange(rows), tokens.cpu()]).all()
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_a_banned_token_far_above_the_rest_does_not_hide_the_best_allowed_one(temperature):
    """A banned stop token 10 above the best allowed token, which sits in the same lane of the kernel's tile (one
    BLOCK_V later) and 40 above every other token: at temperature 0.05 the two are 200 apart (e^-200 is 0 in
    float32), yet the draw is the allowed one, as the PyTorch form's (no noise value bridges 40 / 0.05)."""
    vocab, stop_token = 5000, 7
    best = stop_token + sample_kernels.BLOCK_V
    logits = torch.full((1, vocab), -40.0)
    logits[0, stop_token], logits[0, best] = 10.0, 0.0
    logits = logits.bfloat16()
    stop = torch.zeros(vocab, dtype=torch.bool)
    stop[stop_token] = True
    seed, keys, steps = torch.tensor([1], dtype=torch.int32), torch.zeros(1, dtype=torch.long), torch.zeros(1)
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, 0, 1.0, stop[None, :],
                                                   gumbel_noise(seed, keys, steps, vocab))
    assert want_tokens.item() == best
    args = [t.to(DEVICE) for t in (logits, seed, keys, steps, stop, torch.ones(1, dtype=torch.bool))]
    tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, *args[1:4], args[4], args[5], 1)
    assert tokens.item() == best
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)


@pytest.mark.parametrize("vocab", [300, 2048])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_tokens_over_a_vocabulary_below_one_tile_and_of_whole_tiles(vocab, temperature):
    """The kernel's two loops (whole tiles unmasked, then the vocabulary's last partial tile): a vocabulary smaller
    than one tile (the masked tile only) and one of exactly two tiles of 1024 (no partial tile), as the PyTorch
    form draws, with 1 and 2 chunks."""
    rows = 5
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).bfloat16()
    seed, keys, steps = torch.tensor([3], dtype=torch.int32), torch.arange(rows), torch.full((rows,), 9)
    noise = gumbel_noise(seed, keys, steps, vocab) if temperature > 0 else None
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, 0, 1.0, None, noise)
    for chunks in (1, 2):
        args = [t.to(DEVICE) for t in (logits, seed, keys, steps)]
        tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, *args[1:], None, None, chunks)
        assert torch.equal(tokens.cpu(), want_tokens)
        torch.testing.assert_close(logprobs.cpu(), want_logprobs, atol=logprob_tolerance(logits, temperature), rtol=0)


def test_greedy_tells_neighbouring_float32_logits_apart():
    """float32 logits one step apart whose products with log2(e) round to one float32 (the kernel's base-2 x would
    tie them): greedy picks the larger, as torch.argmax, in either order."""
    scale = torch.tensor(math.log2(math.e))
    low = torch.tensor(1.5)
    while low * scale != torch.nextafter(low, torch.tensor(2.0)) * scale:  # about every other pair above 1.39
        low = torch.nextafter(low, torch.tensor(2.0))
    high = torch.nextafter(low, torch.tensor(2.0))
    logits = torch.full((2, 3000), -1.0)
    logits[0, 100], logits[0, 2500] = low, high
    logits[1, 100], logits[1, 2500] = high, low
    seed, keys, steps = torch.tensor([0], dtype=torch.int32), torch.arange(2), torch.zeros(2, dtype=torch.long)
    tokens, _ = sample_kernels.sample_tokens_impl(logits.to(DEVICE), 0.0, seed.to(DEVICE), keys.to(DEVICE),
                                                  steps.to(DEVICE), None, None, 1)
    assert tokens.tolist() == [2500, 100] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_logit_or_a_row_of_minus_inf_gives_a_nan_logprob(temperature):
    """Degenerate rows are not hidden: a row holding one NaN logit (a diverged policy) and a row of -inf logits only
    get NaN log-probs, as PyTorch's log-softmax gives; the other rows' draws are untouched."""
    rows, vocab = 3, 3000
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    logits[0, 1234] = float("nan")
    logits[1] = float("-inf")
    seed, keys, steps = torch.tensor([3], dtype=torch.int32), torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    noise = gumbel_noise(seed, keys, steps, vocab) if temperature > 0 else None
    want_tokens, want_logprobs = sample_with_noise(logits, temperature, 0, 1.0, None, noise)
    assert want_logprobs[:2].isnan().all()
    args = [t.to(DEVICE) for t in (logits, seed, keys, steps)]
    tokens, logprobs = sample_kernels.sample_tokens_impl(args[0], temperature, *args[1:], None, None, 2)
    assert logprobs[:2].isnan().all()
    assert tokens[2].item() == want_tokens[2].item()
    torch.testing.assert_close(logprobs[2:].cpu(), want_logprobs[2:], atol=logprob_tolerance(logits[2:], temperature),
                               rtol=0)


if kernels.triton is not None:
    tl = kernels.tl

    @kernels.triton.jit
    def _exponential_of(U, OUT, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + i, sample_kernels._exponential(tl.load(U + i, mask=i < n, other=0.5), ASM), mask=i < n)


def test_the_kernels_exponential_is_the_exact_one_within_a_few_ulp():
    """The sampling kernel's E = -log2(u) (series near u = 1, lg2.approx on a GPU), whose -log is the Gumbel noise
    (up to a constant), against float64 on the grid sampling.gumbel_noise draws from: the 4096 points nearest 1 (the
    noise's largest values, where E is tiny), the points around the series' switch at 7/8, the lowest and a random
    sample. A relative error d of E is an error d in the noise. Bound, relative: the series (w = 1 - u <= 1/8)
    truncated after w^7/7, < w^7 / 8 * 8/7 = 6.8e-8, and its seven float32 roundings, each 2^-24 = 6e-8 weighted
    by a power of w (~2.3 of them in all): 1.4e-7; lg2.approx (u < 7/8) 2^-22 = 2.4e-7 absolute in
    E >= log2(8/7) = 0.193: 1.24e-6, and its float32 rounding: 1.3e-6; 1.5e-6 for both."""
    top = 2**23
    sample = torch.randint(0, top, (1 << 16,), generator=torch.Generator().manual_seed(0))
    switch = 7 * top // 8
    bins = torch.cat([torch.arange(top - 4096, top), torch.arange(switch - 2048, switch + 2048),
                      torch.arange(0, 2048), sample])
    uniform = (bins.double() + 0.5) * 2.0**-23
    out = torch.empty(len(bins), dtype=torch.float32, device=DEVICE)
    _exponential_of[(kernels._ceil_div(len(bins), 1024),)](uniform.float().to(DEVICE), out, len(bins), BLOCK=1024,
                                                           ASM=sample_kernels._ptx(torch.device(DEVICE)))
    exact = -torch.log2(uniform)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=1.5e-6, atol=0)


def test_sample_chunks():
    # 64 rows want 4 chunks for 256 programs; one row as many as its tiles (fewer than 256 of them)
    assert kernels._part_count(151936, 1024, 64, 256) == 4
    assert kernels._part_count(151936, 1024, 1, 256) == 149
    assert kernels._part_count(151936, 2048, 1, 256) == 75
    assert kernels._part_count(151936, 1024, 256, 264) == 2
    # 1056 programs (8 per SM on 132 SMs) for 256 rows: 5 chunks of 30 whole tiles of 1024 (the last one 28.4)
    assert kernels._part_count(151936, 1024, 256, 1056) == 5
    assert kernels._whole_tiles(151936, 5, 1024) == (30 * 1024, 5)
    assert kernels._whole_tiles(151936, 9, 2048) == (9 * 2048, 9)
    # sample_chunks is that count at the kernel's tile
    assert sample_kernels.sample_chunks(256, 151936, 1056) == kernels._part_count(151936, sample_kernels.BLOCK_V, 256,
                                                                                  1056)
    assert sample_kernels.sample_chunks(8, 1000, 256) == 1


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
    tokens, logprobs = sample_kernels.sample_tokens_impl(logits.to(DEVICE), 0.0, seed, zeros, zeros, None, None, chunks)
    assert tokens.tolist() == [2047, 100, 2048, 0]
    torch.testing.assert_close(logprobs.cpu(), logits.log_softmax(-1)[torch.arange(4), tokens.cpu()])


def test_the_operators_pass_opcheck():
    """Schemas, fake (meta) implementations and autograd registration as torch.compile sees them."""
    gen = torch.Generator().manual_seed(0)
    step = new_token((3, 4, 2, 16, 4, 80, 80), gen)
    torch.library.opcheck(kernels.decode_attention, (*(t.nan_to_num().to(DEVICE) for t in step), 80))
    logits = torch.randn(3, 300, generator=gen).to(DEVICE)
    seed, keys = torch.tensor([7], dtype=torch.int32).to(DEVICE), torch.arange(3).to(DEVICE)
    stop, banned = torch.zeros(300, dtype=torch.bool).to(DEVICE), torch.tensor([True, False, True]).to(DEVICE)
    torch.library.opcheck(sample_kernels.sample_tokens, (logits, 0.8, seed, keys, keys, stop, banned))
    torch.library.opcheck(sample_kernels.sample_tokens, (logits, 0.0, seed, keys, keys, None, None))
    torch.library.opcheck(sample_kernels.sample_tokens, (logits, 0.8, seed, keys, keys, stop, banned, 20, 0.7))


def test_decode_attention_needs_a_context_length():
    q, k, cache, rows = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 8, 16), torch.zeros(1, 16)
    with pytest.raises(ValueError, match="length must be >= 1"):
        kernels.decode_attention_impl(q, k, k, cache, cache, torch.zeros(1, dtype=torch.long), rows, rows, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (concurrent programs)")
def test_the_in_kernel_merge_agrees_with_the_merge_kernel_on_a_gpu():
    """The last-program merge relies on the GPU's memory ordering (the interpreter runs programs one at a time): many
    calls over shapes with 2-8 splits give what the second kernel gives, every time."""
    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, dim, length in [(64, 14, 2, 64, 384), (8, 12, 2, 128, 512), (3, 16, 8, 64, 256)]:
        step = new_token((batch, heads, kv_heads, dim, batch, length, length), gen, torch.bfloat16)
        step = [t.nan_to_num().cuda() for t in step]  # each call writes the same key and value at pos again
        for splits in (2, 5, kernels.MERGE_IN_KERNEL_MAX_SPLITS):
            want = kernels.decode_attention_impl(*step, length, splits, merge_in_kernel=False).float()
            for _ in range(50):
                got = kernels.decode_attention_impl(*step, length, splits, merge_in_kernel=True).float()
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            assert not kernels._COUNTERS[step[0].device].any()
