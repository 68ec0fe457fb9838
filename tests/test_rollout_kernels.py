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
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_decode_attention_matches_softmax_attention(shape, splits):
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
    got = kernels.decode_attention_impl(*(t.to(DEVICE) for t in (q, k, v, pos)), length, splits)
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


def head16_model() -> torch.nn.Module:
    """A tiny Qwen2 with head_dim 16 (the kernel's smallest), two query heads per key/value head."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval().to(DEVICE)


def test_engine_decodes_through_the_kernel_as_through_sdpa():
    """Greedy and sampled decoding, 10 sequences in 4 slots (slot reuse, then compaction into a smaller bucket),
    stop tokens: the same tokens and log-probs with decode_kernels="triton" as with "torch"."""
    model = head16_model()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23], [30, 31]]
    for params in (SamplingParams(max_new_tokens=12, temperature=0, n=2, stop_token_ids=(11,), min_new_tokens=1),
                   SamplingParams(max_new_tokens=9, temperature=1.0, n=2)):
        outs = {}
        for kernels_ in ("triton", "torch"):
            engine = NativeEngine(model, 0, max_num_seqs=4, decode_kernels=kernels_, compile=False)
            gen = torch.Generator(DEVICE).manual_seed(3)
            outs[kernels_] = engine.generate(prompts, params, gen, max_new_tokens=[12, 3, 9, 7, 2]
                                              if params.temperature == 0 else None)
            assert engine.stats["kernel_attention"] == engine.stats["kernel_sampling"] == (kernels_ == "triton")
            assert engine.stats["decode_steps"] > 0
        assert torch.equal(outs["triton"].response_ids, outs["torch"].response_ids)
        torch.testing.assert_close(outs["triton"].logprobs, outs["torch"].logprobs, atol=1e-5, rtol=0)


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
