"""Tensor-parallel plans for the Llama / Qwen2 families (causal LM, and the token/sequence-classification heads).

Megatron-style: q/k/v and gate/up are split by output features (ColwiseParallel), o and down by input features
(RowwiseParallel), so each rank holds whole attention heads and one all-reduce per block joins the partial sums.
Embeddings, norms and heads stay replicated: the logits (and values, scores) come out whole on every tp rank.
Apply before FSDP (2-D: tp inside a node, dp_shard across).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF Llama/Qwen2-family model (`model.model.layers`)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: expected decoder blocks at .model.layers (HF Llama/Qwen2 families); "
            "this architecture is not supported by meshrl's FSDP/TP plans"
        )
    return layers


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard the attention and MLP projections of every block over `tp_mesh` (1-D), in place."""
    if tp_mesh.size() == 1:
        return model
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {name: style() for name, style in LAYER_PLAN.items()})
    return model
