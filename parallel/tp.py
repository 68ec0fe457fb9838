"""Tensor-parallel plans for the decoder families (Llama, Qwen2/3, Mistral, SmolLM3, Gemma 3, OLMo 2, Phi-3: causal
LM, and the token/sequence-classification heads).

Megatron-style: q/k/v and gate/up are split by output features (ColwiseParallel), o and down by input features
(RowwiseParallel), so each rank holds whole attention heads and one all-reduce per block joins the partial sums.
Embeddings, norms and heads stay replicated: the logits (and values, scores) come out whole on every tp rank. Per-head
q/k norms (Qwen3, Gemma 3) stay replicated too, each rank norming its own whole heads.
Two layouts need more than the split (FAMILY_STYLES):
- OLMo 2 norms q and k over the whole projection, every head at once: its q_norm/k_norm weights are split like the
  projection's output (each rank its heads' share) and the sum of squares of each token is all-reduced over the tp
  group before the rsqrt (ProjectionNormParallel); the backward all-reduces that sum's gradient.
- Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj. A rank must compute its own q, k and v heads and its
  own gate and up rows, which are not one contiguous block of the fused weight. The weight is stored split by rows
  as any column-parallel one (so the DTensor's whole tensor is the checkpoint's: weight sync, checkpoints and the
  planner's memory figures need nothing special), and each forward gathers it over the tp group and multiplies by
  this rank's rows of each part (FusedColwiseParallel); the backward reduce-scatters the weight's gradient back to
  the shards. Cost: one all-gather of these two weights per block and forward (a reduce-scatter in backward), the
  communication of ZeRO-3 over the tp group, and the whole fused weights of one block in memory at a time; the
  attention module gets its own copy of the config with this rank's head count, as HF's Phi-3 slices the fused
  output by config.num_attention_heads.
LoRA (peft's layers wrap a projection as base_layer + lora_A -> lora_B): the base is split as the projection would
be; of the adapter, the matrix on the split side is split the same way and the other stays whole: a column-split
projection's lora_B by output features (lora_A whole: its input is the whole hidden state), a row-split one's lora_A
by input features (its partial sums joined by an all-reduce of `rank` numbers per token; lora_B whole).
Apply before FSDP (2-D: tp inside a node, dp_shard across).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

# every split projection of the families, by its path under a decoder block (a block has some of them); how each
# weight is split at rest, which plan/'s memory figures read
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.qkv_proj": ColwiseParallel,  # Phi-3: rows split at rest, computed by FusedColwiseParallel
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.gate_up_proj": ColwiseParallel,  # Phi-3, as qkv_proj
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


def _shard_rows(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """module.weight (and bias) as DTensors split by rows (dim 0) over `mesh`, in place."""
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, mesh, [Shard(0)], src_data_rank=src_data_rank), param.requires_grad))


def _replicated_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x, the same on every tp rank, as it is; its gradient, a partial one on each rank (each rank's heads or rows
    use it), is all-reduced in backward, as ColwiseParallel does for its input."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _SumOverRanks(torch.autograd.Function):
    """x summed over `group`; the gradient summed likewise (every rank's result is used by that rank alone)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverRanks.apply(grad, ctx.group), None


class ProjectionNormParallel(ParallelStyle):
    """An RMSNorm over the whole output of a column-parallel projection (OLMo 2's q_norm, k_norm), which a rank holds
    only this rank's share of: the weight split by rows like the projection's output, the sum of squares all-reduced
    over the tp group. x: [..., width / tp] -> same shape."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _shard_rows(module, mesh, self.src_data_rank)
        module.forward = partial(_projection_norm, module, mesh)
        return module


def _projection_norm(module: nn.Module, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    squares = _SumOverRanks.apply(x.pow(2).sum(-1, keepdim=True), mesh.get_group())
    x = x * torch.rsqrt(squares / (x.shape[-1] * mesh.size()) + module.variance_epsilon)
    return (module.weight.to_local() * x).to(dtype)


class FusedColwiseParallel(ParallelStyle):
    """A linear layer whose output stacks parts (Phi-3's q | k | v, gate | up), each of which tensor parallelism
    splits by rows: this rank computes its share of every part, [q_r | k_r | v_r]. The weight is stored split by
    rows (Shard(0)) and gathered whole in each forward (see the module docstring for the cost).
    parts(module) -> the parts' sizes in output rows; each must divide by the tp degree."""

    def __init__(self, parts: Callable[[nn.Module], list[int]]):
        self.parts = parts

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        parts = self.parts(module)
        assert sum(parts) == module.weight.shape[0], (parts, module.weight.shape)
        if any(size % mesh.size() for size in parts):
            raise ValueError(f"tensor parallelism over {mesh.size()} ranks: the fused projection's parts {parts} "
                             "(rows) must each divide by it")
        _shard_rows(module, mesh, self.src_data_rank)
        module.forward = partial(_fused_linear, module, mesh, parts)
        return module


def own_rows(whole: torch.Tensor, parts: list[int], rank: int, ranks: int) -> torch.Tensor:
    """whole: [sum(parts), ...], the parts stacked by rows -> this rank's share of each part, stacked:
    [sum(parts) / ranks, ...]."""
    return torch.cat([part.chunk(ranks)[rank] for part in whole.split(parts)])


def _fused_linear(module: nn.Module, mesh: DeviceMesh, parts: list[int], x: torch.Tensor) -> torch.Tensor:
    rank, ranks = mesh.get_local_rank(), mesh.size()
    # the gradient of the gathered weight is this rank's rows only: partial sums, reduce-scattered to the shards
    weights = [own_rows(p.full_tensor(grad_placements=[Partial()]), parts, rank, ranks)
               if p is not None else None for p in (module.weight, module.bias)]
    return F.linear(_replicated_input(x, mesh), *weights)


def _qkv_parts(module: nn.Module, config) -> list[int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [config.num_attention_heads * head_dim, *[config.num_key_value_heads * head_dim] * 2]


def _phi3_attention(layer: nn.Module, ranks: int) -> None:
    """HF's Phi-3 attention slices its fused output at config.num_attention_heads * head_dim and reshapes by its
    num_key_value_heads: give it this rank's counts (a config of its own, the model's left as it is)."""
    attention = layer.self_attn
    attention.config = copy.copy(attention.config)
    attention.config.num_attention_heads //= ranks
    attention.config.num_key_value_heads //= ranks
    attention.num_key_value_heads //= ranks


# per model type, the styles that replace or join LAYER_PLAN's for the paths named, and a fix-up of each block
FAMILY_STYLES: dict[str, dict[str, Callable[[object], ParallelStyle]]] = {
    "olmo2": {"self_attn.q_norm": lambda config: ProjectionNormParallel(),
              "self_attn.k_norm": lambda config: ProjectionNormParallel()},
    "phi3": {"self_attn.qkv_proj": lambda config: FusedColwiseParallel(partial(_qkv_parts, config=config)),
             "mlp.gate_up_proj": lambda config: FusedColwiseParallel(lambda m: [m.weight.shape[0] // 2] * 2)},
}
BLOCK_FIXES: dict[str, Callable[[nn.Module, int], None]] = {"phi3": _phi3_attention}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard the attention and MLP projections of every block over `tp_mesh` (1-D), in place."""
    if tp_mesh.size() == 1:
        return model
    config = getattr(model, "config", None)
    family = FAMILY_STYLES.get(getattr(config, "model_type", None), {})
    for layer in decoder_layers(model):
        plan = {}
        for name, style in LAYER_PLAN.items():
            module = layer.get_submodule(name) if _has(layer, name) else None
            if module is None:
                continue
            make = family.get(name, lambda config, style=style: style())
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a peft LoRA layer
                plan[f"{name}.base_layer"] = make(config)
                split = "lora_B" if style is ColwiseParallel else "lora_A"
                # a fused base's lora_B [rows, rank] has the base's rows: split and computed as the base
                plan.update({f"{name}.{split}.{adapter}": make(config) for adapter in getattr(module, split)})
            else:
                plan[name] = make(config)
        plan.update({name: make(config) for name, make in family.items() if name not in LAYER_PLAN})
        parallelize_module(layer, tp_mesh, plan)
        fix = BLOCK_FIXES.get(getattr(config, "model_type", None))
        if fix is not None:
            fix(layer, tp_mesh.size())
    return model


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True
