"""Every family of rollout/families.py on the native slot engine, CPU, float32: a random-init model built from
transformers' own config class, its norm weights perturbed (Gemma's start at 0, the others' at 1: a norm left at its
init would hide a wrong offset or placement). Greedy tokens equal HF `generate`'s over 32+ tokens; sampled rows'
engine log-probs equal the teacher-forced ones; windowed and soft-capped attention through the Triton kernel
(interpreted on CPU) equals the PyTorch path; one train_ppo.py step on Qwen3 decodes natively; a model without a
description falls back with one warning naming the slow path."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_rollout_native import hf_greedy, responses, teacher_forced_logprobs
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from conftest import explain, run_python, torchrun
from rollout import kernels
from rollout.model_weights import read_weights
from rollout.native import NativeEngine, SamplingParams

VOCAB = 96
PAD = 0
MAX_NEW = 40
# prompts from 1 to 19 tokens: with MAX_NEW, sequences run well past the 8-token sliding windows below
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], list(range(20, 39))]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=None)

FAMILIES = {
    # head_dim 32, not hidden / heads = 16: the q/k norms and the cache take the config's head_dim
    "qwen3": lambda: Qwen3Config(**SHAPE, num_hidden_layers=2, head_dim=32),
    "qwen3-window": lambda: Qwen3Config(**SHAPE, num_hidden_layers=2, head_dim=32, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1),
    "mistral": lambda: MistralConfig(**SHAPE, num_hidden_layers=2, head_dim=16, sliding_window=None),
    "mistral-window": lambda: MistralConfig(**SHAPE, num_hidden_layers=2, head_dim=16, sliding_window=8),
    "olmo2": lambda: Olmo2Config(**SHAPE, num_hidden_layers=2),
    # no rotary on layer 4 of 4 (no_rope_layers [1, 1, 1, 0])
    "smollm3": lambda: SmolLM3Config(**SHAPE, num_hidden_layers=4),
    # sliding and global layers with their own rotary bases (the global one with linear scaling), query scale
    # 1/sqrt(24) where 1/sqrt(head_dim) would be 1/4
    "gemma3": lambda: Gemma3TextConfig(
        **SHAPE, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}}),
    # sliding and global layers alternating; attention scores soft-capped at 2 with weights 10x the default init, so
    # that scores reach ~10 and the cap bends them (it moves the log-probs by up to 0.7); the final logits capped at
    # 4 as well (released checkpoints cap them at 30)
    "gemma2": lambda: Gemma2Config(**SHAPE, num_hidden_layers=4, head_dim=16, sliding_window=8,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                   final_logit_softcapping=4.0, initializer_range=0.2),
    # fused qkv and gate_up weights; rotary on half of each head (Phi-4-mini: 0.75)
    "phi3": lambda: Phi3Config(**SHAPE, num_hidden_layers=2, partial_rotary_factor=0.5),
}


def tiny_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
    model.generation_config.eos_token_id = None  # some configs name one (Mistral: 2); HF generate would stop there
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return tiny_model(request.param)


def test_takes_the_compact_forward(model):
    engine = NativeEngine(model, PAD)
    assert engine.fallback_reason is None and engine.slots is not None


def test_greedy_matches_hf_generate(model):
    out = NativeEngine(model, PAD).generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
    for prompt, response in zip(PROMPTS, responses(out)):
        assert response == hf_greedy(model, prompt, MAX_NEW)


def test_sampled_logprobs_match_teacher_forcing(model):
    # Both sides are float32 forwards of the same weights that differ only in summation order (batched vs single
    # rows, cached vs full attention): about 1e-6 relative on logits of order 1-10, so log-probs agree to ~1e-5;
    # 1e-4 leaves an order of magnitude, and a wrong norm, scale, window or rotary moves them by 1e-2 or more.
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, n=2)
    out = NativeEngine(model, PAD).generate(PROMPTS, params, torch.Generator().manual_seed(1))
    rows = [p for p in PROMPTS for _ in range(params.n)]
    for i, (prompt, response) in enumerate(zip(rows, responses(out))):
        expected = teacher_forced_logprobs(model, prompt, response, temperature=0.9)
        torch.testing.assert_close(out.logprobs[i, : len(response)], expected, atol=1e-4, rtol=0)


def test_the_description_reads_each_familys_layers():
    gemma = read_weights(tiny_model("gemma3"))
    assert [s.window for s in gemma.specs] == [8, 8, 0, 8] and [s.rope for s in gemma.specs] == [1, 1, 0, 1]
    assert gemma.form.scale == 24 ** -0.5 and gemma.form.embed_scale == 8.0 and gemma.form.activation == "gelu_tanh"
    assert len(gemma.rope) == 2 and gemma.rope[0][1] == 1.0
    gemma2 = read_weights(tiny_model("gemma2"))
    assert [s.window for s in gemma2.specs] == [8, 0, 8, 0] and gemma2.form.attn_softcap == 2.0
    assert gemma2.form.norm_offset == 1.0 and gemma2.layers[0].q_norm is None
    assert gemma2.layers[0].attn_out_norm is not None and gemma2.layers[0].mlp_out_norm is not None
    smol = read_weights(tiny_model("smollm3"))
    assert [s.rope for s in smol.specs] == [0, 0, 0, 1] and not smol.rope[1][0].any()
    olmo = read_weights(tiny_model("olmo2"))
    assert olmo.layers[0].input_norm is None and olmo.layers[0].post_norm is None
    assert olmo.layers[0].attn_out_norm is not None and olmo.layers[0].q_norm.shape == (4 * 16,)
    assert [s.window for s in read_weights(tiny_model("mistral-window")).specs] == [8, 8]
    assert [s.window for s in read_weights(tiny_model("qwen3-window")).specs] == [0, 8]
    phi = tiny_model("phi3")
    phi_weights = read_weights(phi)
    assert phi_weights.form.rotary_dim == 8 and phi_weights.head_dim == 16
    fused = phi.model.layers[0].self_attn.qkv_proj.weight
    assert phi_weights.layers[0].k.data_ptr() == fused[64:].data_ptr()  # a view of the checkpoint's fused rows


def test_unsupported_configs_fall_back_with_the_reason():
    torch.manual_seed(0)
    capped = AutoModelForCausalLM.from_config(Gemma3TextConfig(**SHAPE, num_hidden_layers=1, head_dim=16,
                                                               final_logit_softcapping=30.0)).eval()
    assert NativeEngine(capped, PAD).fallback_reason is None  # the sampler caps the final logits (gemma2's test)
    both_ways = AutoModelForCausalLM.from_config(Gemma2Config(**SHAPE, num_hidden_layers=1, head_dim=16,
                                                              final_logit_softcapping=None,
                                                              use_bidirectional_attention=True)).eval()
    assert "use_bidirectional_attention" in NativeEngine(both_ways, PAD).fallback_reason
    dynamic = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE, num_hidden_layers=1, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})).eval()
    assert "dynamic" in NativeEngine(dynamic, PAD).fallback_reason


def test_a_fallback_warns_once_naming_the_slow_path(caplog):
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)).eval()
    with caplog.at_level(logging.WARNING, logger="rollout.native"):
        NativeEngine(gpt2, PAD)
        NativeEngine(tiny_model("qwen3"), PAD)
        NativeEngine(gpt2, PAD, compact_forward=False)  # asked for: no warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollout.native"]
    assert len(warnings) == 1 and "HF-forward" in warnings[0] and "gpt2" in warnings[0], warnings
    assert "\n" not in warnings[0]


def slow_windowed_attention(q, k_cache, v_cache, pos, window, scale, softcap=0.0):
    """q: [B, H, D]; caches [B, KVH, T, D] already holding the new key/value at pos: softmax over the window of the
    scores, soft-capped (softcap * tanh(score / softcap)) where softcap > 0."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        lo = max(0, int(pos[b]) - window + 1) if window else 0
        for h in range(q.shape[1]):
            keys = k_cache[b, h // group, lo: int(pos[b]) + 1].double()
            values = v_cache[b, h // group, lo: int(pos[b]) + 1].double()
            scores = keys @ q[b, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=0)
            out[b, h] = (weights @ values).to(q.dtype)
    return out


@pytest.mark.skipif(kernels.available(16, torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None,
                    reason="the Triton kernel cannot run here")
@pytest.mark.parametrize("window, splits, softcap", [(8, 1, 0.0), (8, 3, 0.0), (100, 2, 0.0), (0, 3, 0.0),
                                                     (8, 3, 0.5), (0, 1, 0.5)])
def test_decode_attention_reads_only_the_window(window, splits, softcap):
    # softcap 0.5 against scores of up to ~5 (random q, k with D 16 at scale 0.3): the cap bends every score
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 4, 2, 192, 16
    q, k, v = (torch.randn(batch, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.randn(batch, kv_heads, length, dim, generator=gen) for _ in range(2))
    pos = torch.tensor([5, 70, 150])
    cos, sin = torch.ones(batch, dim), torch.zeros(batch, dim)  # no rotation: the reference needs none
    scale = 0.3
    got_caches = [t.clone().to(device) for t in (k_cache, v_cache)]
    got = kernels.decode_attention_impl(*(t.to(device) for t in (q, k, v)), *got_caches, pos.to(device),
                                        cos.to(device), sin.to(device), length, splits, window=window, scale=scale,
                                        softcap=softcap)
    rows = torch.arange(batch)
    k_cache[rows, :, pos], v_cache[rows, :, pos] = k, v
    torch.testing.assert_close(got_caches[0].cpu(), k_cache)
    want = slow_windowed_attention(q, k_cache, v_cache, pos, window, scale, softcap)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(kernels.available(16, torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None,
                    reason="the Triton kernel cannot run here")
@pytest.mark.parametrize("name", ["mistral-window", "gemma3", "gemma2", "phi3"])
def test_windowed_families_decode_through_the_kernel_as_through_torch(name):
    # the kernel's sliding window, query scale, soft-capping and partial rotary against the PyTorch path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(name).to(device)
    params = SamplingParams(max_new_tokens=24, temperature=1.1)
    outs = {}
    for kernel in ("triton", "torch"):
        engine = NativeEngine(model, PAD, decode_kernels=kernel, compile=False)
        outs[kernel] = engine.generate(PROMPTS, params, torch.Generator(device).manual_seed(3))
        assert engine.stats["kernel_attention"] == (kernel == "triton")
    assert torch.equal(outs["triton"].response_ids, outs["torch"].response_ids)
    torch.testing.assert_close(outs["triton"].logprobs, outs["torch"].logprobs, atol=1e-5, rtol=0)


def save_family_assets(root, name: str):
    """A tiny model of family `name` (a FAMILIES entry, resized to the char tokenizer and 2-4 small layers), saved
    with the tokenizer, and the addition data set, under `root`."""
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.synthetic import write_addition_dataset

    tokenizer = build_char_tokenizer("0123456789+=")
    config = FAMILIES[name]()
    config.vocab_size = len(tokenizer)
    config.max_position_embeddings = 64
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_addition_dataset(root, n_train=16, n_test=4, seed=0, digits=(1, 1))
    return root


@pytest.mark.parametrize("name, ranks, placement, algorithm", [
    ("qwen3", 1, {}, {}),
    ("qwen3", 2, {"mode": "colocate"}, {}),
    ("qwen3", 2, {"mode": "colocate", "tp": 2}, {}),
    # GRPO: no critic, as transformers has no token-classification head for Gemma 3 text or OLMo 2
    ("gemma3", 2, {"mode": "colocate", "tp": 2}, {"adv_estimator": "grpo"}),
    ("olmo2", 2, {"mode": "colocate"}, {"adv_estimator": "grpo"}),
    ("olmo2", 2, {"mode": "colocate", "tp": 2}, {"adv_estimator": "grpo"}),
    # the fused qkv/gate_up split in the actor, the critic (GAE) and the reference, and in the engine
    ("phi3", 2, {"mode": "colocate", "tp": 2}, {}),
    ("gemma2", 2, {"mode": "colocate", "tp": 2}, {}),
], ids=["qwen3-1-rank", "qwen3-fsdp2", "qwen3-tp2", "gemma3-tp2", "olmo2-fsdp2", "olmo2-tp2", "phi3-tp2", "gemma2-tp2"])
def test_one_ppo_step_decodes_natively(tmp_path, name, ranks, placement, algorithm):
    """train_ppo.py, one step: 1 process, 2 gloo ranks under FSDP2, 2 under TP=2 (per-head q/k norms replicated, each
    rank norming its own heads; Gemma 3's sandwich norms and sliding layers too; OLMo 2's q/k norm over the split
    projection, Phi-3's fused weights: parallel/tp.py; Gemma 2's soft-capped attention). The rollout takes the slot
    engine (no fallback warning, gen_decode timed) and its log-probs are the actor's teacher-forced ones."""
    from test_ppo import write_config

    assets = save_family_assets(tmp_path, name)
    sections = {"placement": placement} if placement else {}
    if algorithm:
        sections["algorithm"] = algorithm
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 1}, **sections)
    if ranks == 1:
        proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    else:
        proc = torchrun(["train_ppo.py", "--config", cfg], nproc=ranks, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "HF-forward" not in proc.stderr, explain(proc)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r["step"] == 1][0]
    assert step["timing_s/gen_decode"] > 0, step
    assert step["rollout/logprob_diff_max"] < 1e-4, step
