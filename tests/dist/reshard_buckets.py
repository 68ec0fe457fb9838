"""parallel/reshard.weight_buckets under torchrun (4 CPU processes, gloo): the streamed weights of a sharded tiny Qwen2
(FSDP2, TP x FSDP2, HSDP, activation checkpointing, bf16 mixed precision) equal the unsharded model's, under its HF
names, in bounded buckets, in the same order on every rank. With the argument `cuda` (NCCL, one process a GPU, any
number): FSDP2 with CPU offload, which CPU-only torch cannot build. Launched by tests/test_reshard.py; prints
'rank R PASS <layout>/<tied|untied>'."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import AutoModelForCausalLM, Qwen2Config

from config import FSDPConfig, PoolConfig
from parallel.distributed import init_distributed
from parallel.fsdp import shard_model
from parallel.layout import build_layout
from parallel.reshard import weight_buckets
from tests.dist.report import run_worker, say

BOUND = 8192  # bytes: embeddings (96 x 32 float32 = 12 KiB) exceed it, q_proj (4 KiB) and norms pack under it


def tiny_qwen2(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).float()


def checkpoint_keys(model) -> list[str]:
    """The HF state_dict keys, a tied tensor under its first key only."""
    seen, keys = set(), []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            keys.append(key)
    return keys


def check_buckets(buckets, bound, layout):
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert len(buckets) >= 3 and max(len(b) for b in buckets) > 1, f"{layout}: bound {bound} gave {sizes}"
    for i, (bucket, size) in enumerate(zip(buckets, sizes)):
        assert size <= bound or len(bucket) == 1, f"{layout}: bucket {i} has {size} bytes in {len(bucket)} tensors"
        if i + 1 < len(buckets):  # greedy: the next tensor did not fit
            first = buckets[i + 1][0][1]
            assert size + first.numel() * first.element_size() > bound, f"{layout}: bucket {i} closed early {sizes}"


def check_layout(rank, layout, pool, reference, fsdp_cfg, wrap=False, forward=False):
    model = copy.deepcopy(reference)
    if wrap:  # torch's wrapper renames: model.layers.0._checkpoint_wrapped_module.*
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    shard_model(model, pool, fsdp_cfg)
    if forward:  # leaves the blocks unsharded, in param_dtype
        model(input_ids=torch.arange(8)[None])
    expected = dict(reference.named_parameters())
    assert list(expected) == checkpoint_keys(reference), f"{layout}: named_parameters != checkpoint keys"
    assert ("lm_head.weight" in expected) != reference.config.tie_word_embeddings

    buckets = list(weight_buckets(model, BOUND))
    order = [[name for name, _ in bucket] for bucket in buckets]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, order)
    assert all(o == order for o in everyone), f"{layout}: ranks differ in names, their order or the buckets"
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == list(expected), f"{layout}: names {names}\n != {list(expected)}"
    for name, tensor in (item for bucket in buckets for item in bucket):
        want = expected[name]
        assert type(tensor) is torch.Tensor and not tensor.requires_grad, f"{layout} {name}: {type(tensor)}"
        assert tensor.dtype == torch.float32 and torch.equal(tensor.cpu(), want), f"{layout} {name}: differs"
    check_buckets(buckets, BOUND, layout)

    halves = list(weight_buckets(model, BOUND // 2, dtype=torch.bfloat16, device="cpu"))
    assert [n for b in halves for n, _ in b] == names, f"{layout}: bf16 names differ"
    for name, tensor in (item for bucket in halves for item in bucket):
        want = expected[name].to(torch.bfloat16)
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want), f"{layout} {name}: bf16 differs"
    check_buckets(halves, BOUND // 2, layout)

    say(f"rank {rank} PASS {layout}")


def main():
    if sys.argv[1:] == ["cuda"]:
        info = init_distributed("nccl", timeout_s=120, device="cuda")
        layouts = {"offload": (1, 1, FSDPConfig(param_dtype="float32", cpu_offload=True), {})}
    else:
        info = init_distributed("gloo", timeout_s=120, device="cpu")
        assert info.world_size == 4, "run with --nproc_per_node 4"
        layouts = cpu_layouts()
    references = {"untied": tiny_qwen2(tie=False), "tied": tiny_qwen2(tie=True)}
    for layout, (tp, rep, fsdp_cfg, options) in layouts.items():
        pool_cfg = PoolConfig(name="all", size=info.world_size, roles=["actor"], tp=tp, dp_replicate=rep)
        pool = build_layout([pool_cfg], info.device.type).pools[0]
        for tie, reference in references.items():
            check_layout(info.rank, f"{layout}/{tie}", pool, reference, fsdp_cfg, **options)


def cpu_layouts() -> dict:
    """name: (tp, dp_replicate, FSDP config, check_layout options), on 4 ranks"""
    fp32 = FSDPConfig(param_dtype="float32")
    return {
        "fsdp4": (1, 1, fp32, {}),
        "tp2": (2, 1, fp32, {}),
        "hsdp": (1, 2, fp32, {}),
        "ckpt": (1, 1, FSDPConfig(param_dtype="float32", activation_checkpointing=True), {}),
        "ckpt_wrapper": (1, 1, fp32, {"wrap": True}),
        "bf16": (1, 1, FSDPConfig(param_dtype="bfloat16"), {}),
        "bf16_unsharded": (1, 1, FSDPConfig(param_dtype="bfloat16", reshard_after_forward=False), {"forward": True}),
    }


if __name__ == "__main__":
    run_worker(main)
