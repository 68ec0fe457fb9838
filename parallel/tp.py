"""Tensor-parallel plans for the decoder families (Llama, Qwen2/3, Mistral, SmolLM3, Gemma 3: causal LM, and the
token/sequence-classification heads).

Megatron-style: q/k/v and gate/up are split by output features (ColwiseParallel), o and down by input features
(RowwiseParallel), so each rank holds whole attention heads and one all-reduce per block joins the partial sums.
Embeddings, norms and heads stay replicated: the logits (and values, scores) come out whole on every tp rank. Per-head
q/k norms (Qwen3, Gemma 3) stay replicated too, each rank norming its own whole heads; a q/k norm over the whole
projection (OLMo 2) would norm each rank's share alone, so those models are refused.
LoRA (peft's layers wrap a projection as base_layer + lora_A -> lora_B): the base is split as the projection would
be; of the adapter, the matrix on the split side is split the same way and the other stays whole: a column-split
projection's lora_B by output features (lora_A whole: its input is the whole hidden state), a row-split one's lora_A
by input features (its partial sums joined by an all-reduce of `rank` numbers per token; lora_B whole).
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
# model types whose q/k RMSNorm spans every head of the projection: a column split cannot keep it
WHOLE_PROJECTION_QK_NORM = ("olmo2",)
# model types whose checkpoint fuses q/k/v and gate/up into one weight each: the plan splits separate ones
FUSED_PROJECTIONS = ("phi3",)


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
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in WHOLE_PROJECTION_QK_NORM:
        raise ValueError(f"tensor parallelism: model_type {model_type!r} norms q and k over all heads at once, which a "
                         "split by heads cannot compute; set tp to 1 for it (FSDP2 shards it)")
    if model_type in FUSED_PROJECTIONS:
        raise ValueError(f"tensor parallelism: model_type {model_type!r} fuses q/k/v and gate/up in one weight each, "
                         "which this plan does not split; set tp to 1 for it (FSDP2 shards it)")
    for layer in decoder_layers(model):
        plan = {}
        for name, style in LAYER_PLAN.items():
            module = layer.get_submodule(name)
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a peft LoRA layer
                plan[f"{name}.base_layer"] = style()
                split = "lora_B" if style is ColwiseParallel else "lora_A"
                plan.update({f"{name}.{split}.{adapter}": style() for adapter in getattr(module, split)})
            else:
                plan[name] = style()
        parallelize_module(layer, tp_mesh, plan)
    return model
