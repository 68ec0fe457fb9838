"""The model families the native engine's compact forward runs: one short description per family.

A description says where a decoder block's weights live in the Hugging Face module (paths under `model.layers[i]`),
how its RMSNorms compute, the MLP's activation, the q/k norms, the attention's scale, the embeddings' scale and, per
layer, the rotary table and the attention window. rollout/model_weights.py reads a model through its family's
description (read_weights) into family-agnostic weights, a Form (model-wide numerics) and a LayerSpec per layer;
the slot engine and the Triton kernels see only those. A new family is a description here and a test
(tests/test_rollout_families.py builds a random-init model of each from transformers' own config class and checks
greedy tokens against HF `generate` and the engine's log-probs against the teacher-forced ones).

Not described, so decoded through the HF forward (rollout/native.py warns once naming that slower path):
mixture-of-experts families, dynamic rotary scaling (NTK, longrope, YaRN: Phi-3's long-context variants use longrope),
bidirectional attention (Gemma's use_bidirectional_attention), and any model_type not listed in FAMILIES. Gemma 2's
soft-capping is computed: the attention's in the compact forward and the decode kernel, the final logits' in the
sampler (rollout/step_pieces.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

# Rotary variants whose inverse frequencies the HF rotary module fixes at init; the dynamic ones (NTK, longrope)
# change them with the sequence length, which the compact forward does not do.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's names -> the decoder's

# LayerWeights field -> parameter path under a decoder block, Llama's layout (Qwen2, Mistral and SmolLM3 share it)
LLAMA_WEIGHTS = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k": "self_attn.k_proj.weight", "k_bias": "self_attn.k_proj.bias",
    "v": "self_attn.v_proj.weight", "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight", "o_bias": "self_attn.o_proj.bias",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "gate_bias": "mlp.gate_proj.bias",
    "up": "mlp.up_proj.weight", "up_bias": "mlp.up_proj.bias",
    "down": "mlp.down_proj.weight", "down_bias": "mlp.down_proj.bias",
}
QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
REQUIRED = ("q", "k", "v", "o", "gate", "up", "down")
def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Fused:
    """A weight the checkpoint holds inside a fused one: part `part` of the rows of the weight at `path`, which stacks
    parts of sizes(config) rows (Phi-3: q | k | v in qkv_proj, gate | up in gate_up_proj).
    rollout/model_weights.py reads it as a view of those rows, or under tensor parallelism (parallel/tp.py stores
    the fused weight split by rows) gathers the weight and takes this rank's share of the part."""

    path: str
    part: int
    sizes: Callable[[object], list[int]]


def _qkv_sizes(config) -> list[int]:
    d = _head_dim(config)
    return [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]


def _gate_up_sizes(config) -> list[int]:
    return [config.intermediate_size] * 2


PHI3_WEIGHTS = {
    "input_norm": "input_layernorm.weight",
    **{name: Fused("self_attn.qkv_proj.weight", i, _qkv_sizes) for i, name in enumerate(("q", "k", "v"))},
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    **{name: Fused("mlp.gate_up_proj.weight", i, _gate_up_sizes) for i, name in enumerate(("gate", "up"))},
    "down": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class Rotary:
    """A model's rotary tables and which one each layer uses.

    tables: (inverse frequencies [D / 2] float32, attention scaling) per table; an all-zero inverse frequency is the
    identity (cos 1, sin 0: a layer without rotary). layers: each layer's table index."""

    tables: list[tuple[torch.Tensor, float]]
    layers: list[int]


def _rotary_module(model: nn.Module) -> Rotary:
    """One table for every layer: the backbone's rotary_emb (Llama, Qwen2/3, Mistral, OLMo 2)."""
    rotary = model.model.rotary_emb
    return Rotary([(rotary.inv_freq.detach().float(), float(rotary.attention_scaling))],
                  [0] * model.config.num_hidden_layers)


def _rotary_skipping_layers(model: nn.Module) -> Rotary:
    """SmolLM3: no_rope_layers[i] == 0 marks a layer without rotary (every fourth in the released models)."""
    table = _rotary_module(model).tables[0]
    identity = (torch.zeros_like(table[0]), 1.0)
    return Rotary([table, identity], [0 if use else 1 for use in model.config.no_rope_layers])


def _rotary_per_layer_type(model: nn.Module) -> Rotary:
    """Gemma 3: a table per layer type (sliding layers a local base, global layers theirs and its scaling)."""
    rotary, types = model.model.rotary_emb, model.config.layer_types
    kinds = sorted(set(types))
    tables = [(getattr(rotary, f"{kind}_inv_freq").detach().float(),
               float(getattr(rotary, f"{kind}_attention_scaling"))) for kind in kinds]
    return Rotary(tables, [kinds.index(kind) for kind in types])


def _windows_by_layer_type(config) -> list[int]:
    """The sliding window (keys a query sees, itself included) of each layer, 0 for full attention: layers of type
    sliding_attention take config.sliding_window (Qwen2/3, SmolLM3 with use_sliding_window, Gemma 3)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    if getattr(config, "use_sliding_window", True) is False:
        window = 0
    return [window if kind == "sliding_attention" else 0 for kind in types]


def _windows_everywhere(config) -> list[int]:
    """Mistral: config.sliding_window (None: full attention) on every layer."""
    return [getattr(config, "sliding_window", None) or 0] * config.num_hidden_layers


def _gemma_check(config) -> str | None:
    """Gemma 2/3 settings the compact forward does not compute."""
    if getattr(config, "use_bidirectional_attention", None):
        return "use_bidirectional_attention=True (the compact forward attends causally)"
    return None


# Gemma's sandwich norms: after attention and after the MLP as well as before each
GEMMA_WEIGHTS = {**LLAMA_WEIGHTS, "attn_out_norm": "post_attention_layernorm.weight",
                 "post_norm": "pre_feedforward_layernorm.weight", "mlp_out_norm": "post_feedforward_layernorm.weight"}


@dataclass(frozen=True)
class Family:
    """How the compact forward reads one family. Field names of `weights` are rollout/model_weights.LayerWeights'."""

    weights: dict[str, str | Fused] = field(default_factory=lambda: dict(LLAMA_WEIGHTS))
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): 1 in Gemma, whose norm weights are 0-centred
    norm_float32: bool = False  # the weight multiplies the float32 normalised x (OLMo 2, Gemma), not its rounding
    qk_norm: str = "none"  # "head": RMSNorm over each head (Qwen3, Gemma 3); "all": over the whole projection (OLMo 2)
    rotary_float32: bool = False  # q/k rotated by float32 tables, rounded once (OLMo 2); else tables in the model dtype
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the model dtype first (Gemma)
    attn_scale: Callable[[object], float | None] = lambda config: None  # the softmax scale; None: head_dim ** -0.5
    rotary: Callable[[nn.Module], Rotary] = _rotary_module
    windows: Callable[[object], list[int]] = _windows_by_layer_type
    check: Callable[[object], str | None] = lambda config: None  # a family's own reason not to run a config


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(),
    "mistral": Family(windows=_windows_everywhere),
    "qwen3": Family(weights={**LLAMA_WEIGHTS, **QK_NORMS}, qk_norm="head"),
    "smollm3": Family(rotary=_rotary_skipping_layers),
    "olmo2": Family(
        weights={**{k: v for k, v in LLAMA_WEIGHTS.items() if not k.endswith("_norm")}, **QK_NORMS,
                 "attn_out_norm": "post_attention_layernorm.weight",
                 "mlp_out_norm": "post_feedforward_layernorm.weight"},
        norm_float32=True, qk_norm="all", rotary_float32=True,
    ),
    "gemma3_text": Family(
        weights={**GEMMA_WEIGHTS, **QK_NORMS},
        norm_offset=1.0, norm_float32=True, qk_norm="head", embed_scale=True,
        attn_scale=lambda config: config.query_pre_attn_scalar ** -0.5,
        rotary=_rotary_per_layer_type, check=_gemma_check,
    ),
    # Gemma 3 without q/k norms, one rotary table; attention scores soft-capped (Form.attn_softcap, from the config)
    "gemma2": Family(
        weights=GEMMA_WEIGHTS, norm_offset=1.0, norm_float32=True, embed_scale=True,
        attn_scale=lambda config: config.query_pre_attn_scalar ** -0.5, check=_gemma_check,
    ),
    # q/k/v and gate/up fused in the checkpoint (read as views of their rows); partial rotary (Phi-4-mini: 0.75 of
    # each head) comes with the rotary module's table, narrower than the head
    "phi3": Family(weights=PHI3_WEIGHTS),
}


# families whose HF attention rotates only the first rotary_dim of each head's dimensions (the decoder does so too)
PARTIAL_ROTARY = ("phi3",)


def family_of(model: nn.Module) -> Family | None:
    return FAMILIES.get(getattr(model.config, "model_type", None))


def parameter(block: nn.Module, path: str | Fused, config=None) -> torch.Tensor | None:
    """The tensor at `path` under `block` ("self_attn.q_proj.bias"), or None where a module has none (no bias);
    a Fused path gives its view of the fused weight's rows (of a whole weight: rollout/model_weights.py reads split
    ones)."""
    if isinstance(path, Fused):
        fused = parameter(block, path.path)
        return None if fused is None else fused.split(path.sizes(config))[path.part]
    obj = block
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the compact forward cannot run `model`, or None when it can."""
    config = model.config
    family = family_of(model)
    if family is None:
        return f"model_type {config.model_type!r} is not one of {tuple(FAMILIES)} (rollout/families.py)"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} is not one of {tuple(ACTIVATIONS)}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in per_type:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope_type {rope_type!r} is not one of {STATIC_ROPE_TYPES}"
        if params.get("partial_rotary_factor", 1.0) != 1.0 and config.model_type not in PARTIAL_ROTARY:
            return f"partial_rotary_factor {params['partial_rotary_factor']} (partial rotary) in {config.model_type}"
    layer_types = getattr(config, "layer_types", None) or ()
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        return f"layer_types {sorted(unknown)} are not supported"
    reason = family.check(config)
    if reason is not None:
        return reason
    backbone = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(backbone, name):
            return f"model.model.{name} is missing (not an HF {config.model_type} causal LM layout)"
    if not hasattr(model, "lm_head"):
        return "model.lm_head is missing"
    block = backbone.layers[0]
    for name, path in family.weights.items():
        where = path.path if isinstance(path, Fused) else path  # no split: a DTensor's would gather it
        if name in REQUIRED and parameter(block, where) is None:
            return f"model.model.layers[0].{where} is missing (the {config.model_type} layout of rollout/families.py)"
    return None
