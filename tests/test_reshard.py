"""parallel/reshard: HF names through wrapper prefixes, bucket bounds on an unsharded model, and the streamed weights of
FSDP2 / TP / HSDP / checkpointed / mixed-precision models against the unsharded one (4 gloo processes)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import AutoModelForCausalLM, Qwen2Config

from conftest import explain, torchrun
from parallel.reshard import hf_name, weight_buckets

LAYOUTS = ("fsdp4", "tp2", "hsdp", "ckpt", "ckpt_wrapper", "bf16", "bf16_unsharded")


def passed_ranks(stdout: str, check: str) -> set[str]:
    # ranks print concurrently, so lines may interleave: find the marks anywhere
    return set(re.findall(rf"rank (\d) PASS {re.escape(check)}(?= |\n|rank |$)", stdout))


def test_weight_buckets_under_torchrun():
    proc = torchrun(["tests/dist/reshard_buckets.py"], nproc=4)
    assert proc.returncode == 0, explain(proc)
    for check in (f"{layout}/{tie}" for layout in LAYOUTS for tie in ("untied", "tied")):
        passed = passed_ranks(proc.stdout, check)
        assert passed == {"0", "1", "2", "3"}, f"{check}: ranks {sorted(passed)} passed\n{explain(proc)}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPU offload needs CUDA (pinned memory)")
def test_weight_buckets_cpu_offload_on_gpus():
    n = torch.cuda.device_count()
    proc = torchrun(["tests/dist/reshard_buckets.py", "cuda"], nproc=n)
    assert proc.returncode == 0, explain(proc)
    for check in ("offload/untied", "offload/tied"):
        assert passed_ranks(proc.stdout, check) == {str(r) for r in range(n)}, f"{check}\n{explain(proc)}"


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("_fsdp_wrapped_module.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("module.lm_head.weight", "lm_head.weight"),
    ("module._orig_mod._fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module"
     ".self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"),
    ("_orig_mod.module.model.norm.weight", "model.norm.weight"),  # compiled DDP: `module` leads once the rest goes
    ("model.module.weight", "model.module.weight"),  # a submodule named `module` is no DDP prefix
    ("model.my_orig_mod.weight", "model.my_orig_mod.weight"),  # whole components only
])
def test_hf_name(name, expected):
    assert hf_name(name) == expected


def tiny_qwen2(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return AutoModelForCausalLM.from_config(cfg).float()


def flat(buckets):
    return [item for bucket in buckets for item in bucket]


def nbytes(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


@pytest.mark.parametrize("bound", [1, 4096, 8192, 20000, 1 << 30])
def test_buckets_bounded_and_greedy(bound):
    model = tiny_qwen2(tie=False)
    buckets = list(weight_buckets(model, bound))
    assert [n for n, _ in flat(buckets)] == [n for n, _ in model.named_parameters()]
    for i, bucket in enumerate(buckets):
        assert nbytes(bucket) <= bound or len(bucket) == 1
        if i + 1 < len(buckets):
            assert nbytes(bucket + buckets[i + 1][:1]) > bound, "closed a bucket the next tensor fits in"
    if bound == 1:
        assert all(len(b) == 1 for b in buckets)
    if bound == 1 << 30:
        assert len(buckets) == 1


def test_bound_counts_bytes_after_the_cast():
    model = tiny_qwen2(tie=False)
    full = list(weight_buckets(model, 8192))
    half = list(weight_buckets(model, 8192, dtype=torch.bfloat16))
    assert len(half) < len(full) and all(nbytes(b) <= 8192 or len(b) == 1 for b in half)
    params = dict(model.named_parameters())
    for name, tensor in flat(half):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, params[name].to(torch.bfloat16))


def test_tied_once_detached_and_values():
    model = tiny_qwen2(tie=True)
    names = [n for n, _ in flat(weight_buckets(model))]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    assert set(model.state_dict()) - set(names) == {"lm_head.weight"}
    for name, tensor in flat(weight_buckets(model, device="meta")):
        assert tensor.device.type == "meta" and not tensor.requires_grad, name
    params = dict(model.named_parameters())
    assert all(torch.equal(t, params[n]) and not t.requires_grad for n, t in flat(weight_buckets(model)))


def test_persistent_buffers_streamed_non_persistent_not():
    model = tiny_qwen2(tie=False)
    model.model.norm.register_buffer("scale", torch.ones(3))
    model.model.norm.register_buffer("cache", torch.ones(3), persistent=False)
    names = [n for n, _ in flat(weight_buckets(model))]
    assert sorted(names) == sorted(model.state_dict()) and names[-1] == "model.norm.scale"  # after the parameters
    assert not any("inv_freq" in n or "cache" in n for n in names)


def test_wrapper_names_stripped_on_an_unsharded_model():
    model = tiny_qwen2(tie=False)
    expected = [n for n, _ in model.named_parameters()]
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)  # not called: no compilation, only the `_orig_mod.` wrapper
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled.named_parameters())
    assert [n for n, _ in flat(weight_buckets(compiled))] == expected


def test_bad_bound():
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(weight_buckets(tiny_qwen2(tie=False), 0))
