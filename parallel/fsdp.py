"""FSDP2 for HF models: `fully_shard` each decoder block, then the root (embeddings, final norm, heads)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from parallel.layout import Pool
from parallel.tp import apply_tp, decoder_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_model(model: nn.Module, pool: Pool, fsdp_cfg, train: bool = True, replicate: bool = True,
                compile: bool = True) -> nn.Module:
    """Tensor-parallel (when pool.tp > 1) then FSDP2 over the pool's data-parallel axes, in place; then, on a GPU
    with fsdp_cfg.compile and `compile`, the decoder blocks compiled (compile_blocks).

    HSDP when pool.dp_replicate > 1: shards inside a (dp_shard) group, replicas across (dp_replicate). With
    replicate=False FSDP2 stops at dp_shard and the caller joins the replicas itself (compressed gradients,
    parameter averaging: see roles/update_loop.ReplicaSync).
    `fsdp_cfg` is config.FSDPConfig. Frozen models (reference, reward) pass train=False: no activation checkpointing.
    """
    apply_tp(model, pool.mesh["tp"])
    if fsdp_cfg.activation_checkpointing and train:
        # HF's own hook: non-reentrant checkpointing of each decoder block, which composes with FSDP2
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = pool.mesh["dp_replicate", "dp_shard"] if pool.dp_replicate > 1 and replicate else pool.mesh["dp_shard"]
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=DTYPES[fsdp_cfg.param_dtype], reduce_dtype=DTYPES[fsdp_cfg.reduce_dtype]
        ),
        offload_policy=CPUOffloadPolicy() if fsdp_cfg.cpu_offload else OffloadPolicy(),
    )
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=fsdp_cfg.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=fsdp_cfg.reshard_after_forward, **kwargs)
    if compile and fsdp_cfg.compile and pool.mesh.device_type == "cuda" and pool.tp == 1:
        compile_blocks(model)
    return model


BLOCK_RECOMPILE_LIMIT = 64


def compile_blocks(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """torch.compile each decoder block's `forward`, in place: Inductor fuses the blocks' pointwise work (norms in
    float32, rotary, SiLU x up, residual adds) in forward and backward. Only `forward` is compiled, so FSDP2's
    hooks around it stay eager and parameter names do not change (checkpoints, the weight sync). Every block runs
    one code object, so the blocks share their graphs: one per grad mode and layout (the causal rows, or packed rows
    with their block-causal mask), first with static shapes, and once more with dynamic batch and length dimensions
    when a second shape comes, then no more (except dimensions of size 1, which Dynamo specialises).
    dynamic=True from the start would save that recompile, but its first trace took 5x the static one on 2 CPU
    cores, and the one GPU run with it did not finish in its time limit, cause not found (bench/RESULTS.md).
    Dynamo's recompile limit is raised to BLOCK_RECOMPILE_LIMIT for the process (never lowered) to hold the
    variants of other models and settings.
    The blocks must be called with use_cache=False: a KV cache makes Dynamo specialise on each block.
    backend: torch.compile's (tests on CPU: "eager", Dynamo's capture alone)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, BLOCK_RECOMPILE_LIMIT)
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend=backend)
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
