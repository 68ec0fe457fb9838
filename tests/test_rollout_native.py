"""NativeEngine and its sampling on tiny random Qwen2 / Llama models (CPU, float32), plus one torchrun launch for
FSDP2 and tensor parallel (tests/dist/rollout_fsdp_tp.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from conftest import explain, torchrun
from rollout.model_weights import read_weights
from rollout.native import NativeEngine, SamplingParams
from rollout.sampling import sample_next_tokens, truncate_top_k_top_p

PAD = 0
VOCAB = 64
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]
CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig}


def tiny_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[family](
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen2")


def responses(out) -> list[list[int]]:
    """The unpadded response of every sample."""
    return [ids[: int(m.sum())].tolist() for ids, m in zip(out.response_ids, out.response_mask)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF `generate`'s greedy continuation of one prompt: the reference the engines' greedy tokens must equal."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """[len(response)] log_softmax(logits / temperature) at the response tokens, from one unpadded forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    return predicting.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_greedy_matches_hf_generate(model):
    max_new = 10
    unstopped = NativeEngine(model, PAD).generate(PROMPTS, SamplingParams(max_new_tokens=max_new, temperature=0))
    # A stop token that the first prompt emits mid-way, so at least one row ends early.
    stop = int(unstopped.response_ids[0, 4])
    params = SamplingParams(max_new_tokens=max_new, temperature=0, stop_token_ids=(stop,), min_new_tokens=2)
    out = NativeEngine(model, PAD).generate(PROMPTS, params)

    got = responses(out)
    assert len(got[0]) <= 5 and got[0][-1] == stop
    for prompt, response in zip(PROMPTS, got):
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=2,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=PAD,
        )
        assert response == hf[0, len(prompt) :].tolist()
    for i, (prompt, response) in enumerate(zip(PROMPTS, got)):
        expected = teacher_forced_logprobs(model, prompt, response, temperature=1.0)
        torch.testing.assert_close(out.logprobs[i, : len(response)], expected, atol=1e-4, rtol=0)


def test_sampled_logprobs_match_teacher_forcing(model):
    params = SamplingParams(
        max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, n=3, stop_token_ids=(7, 9), min_new_tokens=2
    )
    out = NativeEngine(model, PAD).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    for i, (prompt, response) in enumerate(zip(out.prompt_ids, responses(out))):
        expected = teacher_forced_logprobs(model, prompt, response, temperature=0.7)
        torch.testing.assert_close(out.logprobs[i, : len(response)], expected, atol=1e-4, rtol=0)
    assert out.logprobs.dtype == torch.float32
    assert (out.logprobs[out.response_mask == 0] == 0).all()


def test_stop_token_ends_row_and_max_new_tokens_is_honoured(qwen):
    engine = NativeEngine(qwen, PAD)
    unstopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    assert unstopped.response_ids.shape == (len(PROMPTS), 8)
    assert (unstopped.response_mask == 1).all()

    first_row = unstopped.response_ids[0].tolist()
    stop = first_row[3]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,)))
    end = first_row.index(stop) + 1
    assert out.response_ids[0, :end].tolist() == first_row[:end]
    assert out.response_mask[0].tolist() == [1] * end + [0] * (out.response_ids.size(1) - end)
    assert (out.response_ids[0, end:] == PAD).all()
    for row, full in zip(responses(out), unstopped.response_ids.tolist()):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert row == expected


def test_n_samples_are_consecutive_and_different(qwen):
    n = 4
    out = NativeEngine(qwen, PAD).generate(
        PROMPTS, SamplingParams(max_new_tokens=8, n=n), torch.Generator().manual_seed(0)
    )
    assert out.response_ids.shape[0] == len(PROMPTS) * n
    assert out.prompt_ids == [p for p in PROMPTS for _ in range(n)]
    rows = responses(out)
    for k in range(len(PROMPTS)):
        group = rows[k * n : (k + 1) * n]
        assert len({tuple(r) for r in group}) == n


def test_greedy_n_samples_share_the_prompt_prefill(qwen):
    # The n samples of a prompt share its prefill cache; greedy rows must therefore equal n = 1.
    engine = NativeEngine(qwen, PAD)
    once = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    thrice = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, n=3))
    assert torch.equal(thrice.response_ids, once.response_ids.repeat_interleave(3, dim=0))
    torch.testing.assert_close(thrice.logprobs, once.logprobs.repeat_interleave(3, dim=0))


def test_min_new_tokens(qwen):
    engine = NativeEngine(qwen, PAD)
    stops = tuple(range(1, VOCAB, 2))  # half the vocabulary: without min_new_tokens rows end almost at once
    params = SamplingParams(max_new_tokens=10, stop_token_ids=stops, min_new_tokens=5)
    out = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    for row in responses(out):
        assert len(row) >= 5
        assert not set(row[:4]) & set(stops)
        assert len(row) == 10 or row[-1] in stops

    fixed = SamplingParams(max_new_tokens=7, stop_token_ids=stops, min_new_tokens=7)
    out = engine.generate(PROMPTS, fixed, torch.Generator().manual_seed(1))
    assert out.response_ids.shape == (len(PROMPTS), 7) and (out.response_mask == 1).all()


def test_same_seed_same_output(qwen):
    engine = NativeEngine(qwen, PAD)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, n=2, stop_token_ids=(3,))
    a = engine.generate(PROMPTS, params, torch.Generator().manual_seed(7))
    b = engine.generate(PROMPTS, params, torch.Generator().manual_seed(7))
    c = engine.generate(PROMPTS, params, torch.Generator().manual_seed(8))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_restores_training_flag_and_leaves_no_grad(qwen):
    qwen.train()
    try:
        out = NativeEngine(qwen, PAD).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3))
        assert qwen.training
        assert not out.logprobs.requires_grad
    finally:
        qwen.eval()


def test_empty_prompt_list(qwen):
    out = NativeEngine(qwen, PAD).generate([], SamplingParams(max_new_tokens=4, n=2))
    assert out.prompt_ids == []
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape == (0, 0)
    assert out.logprobs.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n "),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 9}, "min_new_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"max_new_tokens": 8, **kwargs})


def test_invalid_generate_arguments(qwen):
    engine = NativeEngine(qwen, PAD)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1, 2], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"60 tokens.*max_new_tokens is 5.*max_position_embeddings 64"):
        engine.generate([[1], [2] * 60], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[1]], SamplingParams(max_new_tokens=4, stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError, match="pad_token_id"):
        NativeEngine(qwen, pad_token_id=-1)


def test_truncate_top_k_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda top_k, top_p: torch.isfinite(truncate_top_k_top_p(logits, top_k, top_p))[0].tolist()
    assert kept(0, 1.0) == [True, True, True, True]
    assert kept(2, 1.0) == [False, True, False, True]
    assert kept(0, 0.75) == [False, True, False, True]
    assert kept(0, 0.85) == [False, True, True, True]
    assert kept(0, 0.1) == [False, True, False, False]
    # top_p applies to the distribution renormalised after the top-k cut: 0.5/0.8 = 0.625 >= 0.6.
    assert kept(2, 0.6) == [False, True, False, False]


def test_top_p_keeps_every_token_tied_with_the_last_one_it_needs():
    """Three tokens tied at 0.2 below one at 0.22: with top_p 0.5 the nucleus needs the best and two of the tied
    ones; which two a sort puts first is arbitrary, so all three are kept (a token is kept when the mass strictly
    above it is below top_p)."""
    probs = torch.tensor([[0.2, 0.2, 0.22, 0.2, 0.18, 0.0]])
    logits = probs.log()
    kept = torch.isfinite(truncate_top_k_top_p(logits, 0, 0.5))[0].tolist()
    assert kept == [True, True, True, True, False, False]
    # the rule against its definition on random rows with many ties (bfloat16-rounded logits), in float64
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=gen) * 2).bfloat16().float()
    for top_k, top_p in [(0, 0.3), (0, 0.9), (40, 0.7)]:
        got = torch.isfinite(truncate_top_k_top_p(logits, top_k, top_p))
        for row, out in zip(logits.double(), got):
            if top_k:
                row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
            p = row.softmax(-1)
            above = torch.stack([p[row > x].sum() for x in row])
            want = torch.isfinite(row) & (above < top_p)
            # float32 against float64 sums: only tokens whose mass above is within 1e-5 of top_p may differ
            near = (above - top_p).abs() < 1e-5
            assert torch.equal(out[~near], want[~near])


def test_the_nucleus_floor_operator_passes_opcheck():
    """Its schema and fake implementation as torch.compile sees them (the engine's compiled sampler calls it)."""
    from rollout.sampling import nucleus_floor

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(nucleus_floor, (logits, 0.7))


def test_sampling_follows_the_truncated_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(40_000, 4)
    tokens, logprobs = sample_next_tokens(logits, 1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95, atol=0.01, rtol=0)
    # logprobs are of the untruncated distribution.
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_fsdp2_and_tensor_parallel_under_torchrun():
    proc = torchrun(["tests/dist/rollout_fsdp_tp.py"], nproc=2, timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("all checks passed") == 2, explain(proc)


def test_stop_tokens_include_every_eos_of_the_generation_config(tmp_path):
    """Llama-3 style checkpoints end turns with several ids (generation_config.eos_token_id is a list)."""
    from transformers import GenerationConfig

    from rollout.api import stop_token_ids
    from tasks.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=")
    GenerationConfig(eos_token_id=[5, 9]).save_pretrained(tmp_path / "multi")
    assert stop_token_ids(str(tmp_path / "multi"), tokenizer, [7]) == tuple(sorted({5, 7, 9, tokenizer.eos_token_id}))
    GenerationConfig(eos_token_id=4).save_pretrained(tmp_path / "single")
    assert stop_token_ids(str(tmp_path / "single"), tokenizer) == tuple(sorted({4, tokenizer.eos_token_id}))
    (tmp_path / "none").mkdir()
    assert stop_token_ids(str(tmp_path / "none"), tokenizer) == (tokenizer.eos_token_id,)


def test_fused_projections_decode_as_the_separate_ones(model):
    """Stacked q/k/v and gate/up weights (the default) against the three and two separate GEMMs: the same greedy
    tokens and log-probs, and the stacks are exactly the parameters."""
    w = read_weights(model, fuse=True)
    block, attn, mlp = w.layers[0], model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(block.qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(block.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert read_weights(model).layers[0].qkv is None
    params = SamplingParams(max_new_tokens=10, temperature=0)
    fused = NativeEngine(model, PAD).generate(PROMPTS, params)
    separate = NativeEngine(model, PAD, fused_projections=False).generate(PROMPTS, params)
    assert responses(fused) == responses(separate)
    torch.testing.assert_close(fused.logprobs, separate.logprobs, atol=1e-5, rtol=0)


def test_the_residual_add_rounds_as_pytorch_adds():
    """decoder._add (the attention output into the residual stream) is a + b of the model dtype, bit for bit: PyTorch
    adds 16-bit tensors in float32 and rounds once, as _add spells out."""
    from rollout.decoder import _add

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a, b = (torch.randn(64, 96, generator=gen) * 3).to(dtype), torch.randn(64, 96, generator=gen).to(dtype)
        got = _add(a, b)
        assert got.dtype == dtype and torch.equal(got, a + b)
