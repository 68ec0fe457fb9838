"""A compact forward for Llama / Qwen2-family decoders that reads the Hugging Face module's parameters in place.

The slot engine (rollout/slots.py) runs prefill and decode through these functions against its own KV cache. The HF
modules are never called, so FSDP2's hooks do not run either: the engine unshards once per rollout and reads the
full tensors that FSDP2 swaps into the modules. Tensor-parallel parameters (DTensors from parallel/tp.py's plan) are
read as their local shards: q/k/v and gate/up hold whole heads / rows of this rank, and the row-parallel o/down
projections give partial sums that `reduce` adds up over the tp group, as RowwiseParallel does in training.

Numerics follow the HF modules step for step (norms in float32, rotary tables cast to the model dtype, residual sums
in the model dtype), so greedy decoding in float32 matches HF `generate` token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rollout.kernels import decode_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Rotary variants whose inverse frequencies the HF rotary module fixes at init; the dynamic ones (NTK, longrope)
# change them with the sequence length, which this forward does not do.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")

Reduce = Callable[[torch.Tensor], torch.Tensor]


class LayerWeights(NamedTuple):
    """One decoder block's parameters as local tensors (this rank's shard under tensor parallelism).

    Norms [hidden]; q [heads * D, hidden], k/v [kv_heads * D, hidden], o [hidden, heads * D]; gate/up
    [inter, hidden], down [hidden, inter]; biases [out features] or None. heads, kv_heads, inter: this rank's share.
    """

    input_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    # fused copies (read_weights(fuse=True)): q/k/v rows stacked [(heads + 2 kv_heads) * D, hidden], gate/up rows
    # stacked [2 inter, hidden], and their biases; one GEMM each instead of three and two
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    """A model's parameters as the forward reads them: views (read_weights; valid while the parameters stay where
    they are, one rollout) or buffers of the engine's own (own_weights, refilled by fill_weights)."""

    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [V, hidden]
    inv_freq: torch.Tensor  # [D / 2] float32
    rope_scale: float
    eps: float
    head_dim: int
    kv_heads: int  # on this rank
    row_parallel: bool  # o/down give partial sums to be reduced over the tp group

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the compact forward cannot run `model`, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not 'silu'"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not one of {STATIC_ROPE_TYPES}"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention layers are not supported"
    backbone = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(backbone, name):
            return f"model.model.{name} is missing (not an HF Llama/Qwen2 causal LM layout)"
    if not hasattr(model, "lm_head"):
        return "model.lm_head is missing"
    return None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local data without autograd: a DTensor's shard on this rank, else the tensor itself."""
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def read_weights(model: nn.Module, fuse: bool = False) -> DecoderWeights:
    """Views of `model`'s parameters, read now (after any FSDP2 unshard). Raises ValueError on shapes this forward
    cannot run: heads not whole on this rank, or parameters still sharded by FSDP.

    fuse: also build each block's stacked q/k/v and gate/up weights (copies of about two thirds of a Qwen2.5
    block's weights: 0.47 GB at 0.5B, 1.7 GB at 1.5B in bf16; they live for one rollout) so a step runs two GEMMs
    where it ran five. Under tensor parallelism the local shards are stacked, which keeps whole heads and
    rows per rank."""
    config = model.config
    backbone = model.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = []
    for block in backbone.layers:
        attn, mlp = block.self_attn, block.mlp
        layers.append(
            LayerWeights(
                _local(block.input_layernorm.weight),
                _local(attn.q_proj.weight), _local(attn.q_proj.bias),
                _local(attn.k_proj.weight), _local(attn.k_proj.bias),
                _local(attn.v_proj.weight), _local(attn.v_proj.bias),
                _local(attn.o_proj.weight), _local(attn.o_proj.bias),
                _local(block.post_attention_layernorm.weight),
                _local(mlp.gate_proj.weight), _local(mlp.gate_proj.bias),
                _local(mlp.up_proj.weight), _local(mlp.up_proj.bias),
                _local(mlp.down_proj.weight), _local(mlp.down_proj.bias),
            )
        )
    first = layers[0]
    hidden = config.hidden_size
    heads, kv_heads = first.q.shape[0] // head_dim, first.k.shape[0] // head_dim
    expected = {
        "embed_tokens": (_local(backbone.embed_tokens.weight).shape, (config.vocab_size, hidden)),
        "q_proj": (first.q.shape, (heads * head_dim, hidden)),
        "k_proj": (first.k.shape, (kv_heads * head_dim, hidden)),
        "o_proj": (first.o.shape, (hidden, heads * head_dim)),
        "down_proj": (first.down.shape, (hidden, first.gate.shape[0])),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(
                f"{name} weight has local shape {tuple(got)}, expected {want}: parameters still sharded (unshard FSDP "
                "first) or a tensor-parallel split that does not keep whole heads"
            )
    if kv_heads == 0 or heads % kv_heads or config.num_attention_heads % heads:
        raise ValueError(
            f"{heads} query heads and {kv_heads} key/value heads on this rank (of {config.num_attention_heads} and "
            f"{config.num_key_value_heads}): tensor parallelism must split both into whole, matching groups"
        )
    rotary = backbone.rotary_emb
    weights = DecoderWeights(
        embed=_local(backbone.embed_tokens.weight),
        layers=layers,
        norm=_local(backbone.norm.weight),
        lm_head=_local(model.lm_head.weight),
        inv_freq=rotary.inv_freq.detach().float(),
        rope_scale=float(rotary.attention_scaling),
        eps=float(config.rms_norm_eps),
        head_dim=head_dim,
        kv_heads=kv_heads,
        row_parallel=heads < config.num_attention_heads,
    )
    if not fuse:
        return weights
    stacked = own_weights(weights, fuse=True, copy_all=False)  # q/k/v and gate/up stacked, the rest these views
    fill_weights(stacked, weights)
    return stacked


SEPARATE_FIELDS = LayerWeights._fields[:16]  # a block's own parameters; the rest are the fused stacks
FUSED_STACKS = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"), "gate_up": ("gate", "up"),
                "gate_up_bias": ("gate_bias", "up_bias")}


def own_weights(w: DecoderWeights, fuse: bool, copy_all: bool) -> DecoderWeights:
    """Buffers for a copy of `w` (views of a model's parameters) that stays where it is from one rollout to the next,
    so that CUDA graphs captured on it stay valid; fill_weights copies the parameters in.

    fuse: each block's q/k/v and gate/up rows stacked into one buffer each, their separate fields views of it.
    copy_all: every other tensor gets its own buffer too (the parameters move: FSDP2 unshards into new storage);
    else those fields stay `w`'s tensors, the model's parameters, which must then stay where they are."""

    def own(t: torch.Tensor | None) -> torch.Tensor | None:
        return torch.empty_like(t) if copy_all and t is not None else t

    stacked = {name for parts in FUSED_STACKS.values() for name in parts} if fuse else set()
    layers = []
    for block in w.layers:
        fields = {name: getattr(block, name) if name in stacked else own(getattr(block, name))
                  for name in SEPARATE_FIELDS}
        if fuse:
            for stack, parts in FUSED_STACKS.items():
                tensors = [getattr(block, name) for name in parts]
                if tensors[0] is None:
                    continue
                buffer = torch.empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype,
                                     device=tensors[0].device)
                fields[stack] = buffer
                fields.update(zip(parts, buffer.split([t.shape[0] for t in tensors])))
        layers.append(LayerWeights(**fields))
    embed = own(w.embed)
    tied = w.lm_head.data_ptr() == w.embed.data_ptr() and w.lm_head.shape == w.embed.shape
    return DecoderWeights(embed=embed, layers=layers, norm=own(w.norm), lm_head=embed if tied else own(w.lm_head),
                          inv_freq=w.inv_freq.clone(), rope_scale=w.rope_scale, eps=w.eps, head_dim=w.head_dim,
                          kv_heads=w.kv_heads, row_parallel=w.row_parallel)


def fill_weights(dst: DecoderWeights, src: DecoderWeights) -> None:
    """Copy the parameters `src` views into the buffers of `dst` (own_weights of the same model), in a few
    multi-tensor kernels; fields that are the same memory in both (the model's own parameters) need no copy."""
    pairs = [(dst.embed, src.embed), (dst.norm, src.norm)]
    if dst.lm_head is not dst.embed:
        pairs.append((dst.lm_head, src.lm_head))
    for d, s in zip(dst.layers, src.layers):
        pairs += [(getattr(d, name), getattr(s, name)) for name in SEPARATE_FIELDS]
    # a field that stayed the model's parameter is read anew (a new tensor object) but is the same memory
    pairs = [(d, s) for d, s in pairs if d is not None and d.data_ptr() != s.data_ptr()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def rope_tables(weights: DecoderWeights, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, D] in the model dtype for positions 0..length-1, computed as the HF rotary module does."""
    freqs = torch.arange(length, device=device).float()[:, None] * weights.inv_freq.to(device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos() * weights.rope_scale, angles.sin() * weights.rope_scale
    return cos.to(weights.dtype), sin.to(weights.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> same shape; the variance in float32, as HF's RMSNorm."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., D]; cos, sin broadcastable to x. Rotary embedding in HF's rotate-half layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reduce: Reduce | None):
    """o_proj / down_proj: partial sums reduced over the tp group before the (replicated) bias is added once."""
    y = F.linear(x, weight)
    if reduce is not None:
        y = reduce(y)
    return y if bias is None else y + bias


def _add(projected: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """projected + residual computed in float32 and rounded once to the model dtype, which is how PyTorch adds two
    16-bit tensors anyway; spelled out so that torch.compile does not fold the add into the GEMM that produced
    `projected` (addmm with the residual as its input: cuBLAS rounds the sum only once, and the residual is first
    copied into the output, one more kernel per block in the decode step)."""
    return (projected.float() + residual.float()).to(projected.dtype)


def _qkv(x: torch.Tensor, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., hidden] -> q [..., heads * D], k and v [..., kv_heads * D]; one GEMM when the weights are fused."""
    if w.qkv is None:
        return F.linear(x, w.q, w.q_bias), F.linear(x, w.k, w.k_bias), F.linear(x, w.v, w.v_bias)
    return F.linear(x, w.qkv, w.qkv_bias).split([w.q.shape[0], w.k.shape[0], w.v.shape[0]], dim=-1)


def _mlp(x: torch.Tensor, w: LayerWeights, reduce: Reduce | None) -> torch.Tensor:
    if w.gate_up is None:
        gate, up = F.linear(x, w.gate, w.gate_bias), F.linear(x, w.up, w.up_bias)
    else:
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return _row_parallel(F.silu(gate) * up, w.down, w.down_bias, reduce)


def decode_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    eps: float,
    head_dim: int,
    reduce: Reduce | None = None,
    length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block for one new token in each of the first B slots of the cache.

    hidden, residual: [B, hidden], the previous block's output and the residual stream before it (summed here, so the
    sum fuses with the norm under torch.compile; the first block gets the embeddings and zeros).
    k_cache, v_cache: [S, kv_heads, T_max, D], this block's cache; the new key/value of slot b is written at pos[b].
    pos: [B] long. cos, sin: [B, D]. mask: [B, 1, 1, T] bool, True on the cached positions slot b may attend to
    (T <= T_max: SDPA reads only the first T positions of each slot); None: rotary embedding, cache write and
    attention by rollout/kernels.py's decode_attention, which reads positions 0..pos[b] of slot b (length: the
    context bucket, required then).
    Returns (block output, residual), [B, hidden] each.
    """
    residual = hidden + residual
    x = rms_norm(residual, w.input_norm, eps)
    batch = x.shape[0]
    q, k, v = (t.view(batch, -1, head_dim) for t in _qkv(x, w))
    if mask is None:  # the kernel rotates q and k and writes k and v into the cache itself
        out = decode_attention(q, k, v, k_cache, v_cache, pos, cos, sin, length)
    else:
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        rows = torch.arange(batch, device=x.device)
        k_cache[rows, :, pos] = k
        v_cache[rows, :, pos] = v
        # Grouped-query attention for one position: the query heads sharing a key/value head become that head's
        # "query positions", so SDPA reads each cached key/value head once and needs no repeat.
        kv_heads, length = k.shape[1], mask.shape[-1]
        out = F.scaled_dot_product_attention(
            q.view(batch, kv_heads, -1, head_dim), k_cache[:batch, :, :length], v_cache[:batch, :, :length],
            attn_mask=mask,
        )
    residual = _add(_row_parallel(out.reshape(batch, -1), w.o, w.o_bias, reduce), residual)
    return _mlp(rms_norm(residual, w.post_norm, eps), w, reduce), residual


def prefill_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dest: torch.Tensor,
    src: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    head_dim: int,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block over P right-padded prompts of width L (positions 0..L-1).

    hidden, residual: [P, L, hidden] (as in decode_layer). cos, sin: [L, D].
    dest: [R] long slots; src: [R] long prompt of each slot. Prompt src[r]'s keys/values go to positions 0..L-1 of slot
    dest[r], so the n samples of a prompt share one prefill. Right padding needs no mask: causal attention never lets
    a real token see the padding after it, and the padding's cache entries lie past the prompt, where decode
    overwrites them before any mask admits them.
    Returns (block output, residual), [P, L, hidden] each.
    """
    residual = hidden + residual
    x = rms_norm(residual, w.input_norm, eps)
    prompts, width = x.shape[:2]
    q, k, v = (t.view(prompts, width, -1, head_dim).transpose(1, 2) for t in _qkv(x, w))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_cache[dest, :, :width] = k[src]
    v_cache[dest, :, :width] = v[src]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = out.transpose(1, 2).reshape(prompts, width, -1)
    residual = _add(_row_parallel(out, w.o, w.o_bias, reduce), residual)
    return _mlp(rms_norm(residual, w.post_norm, eps), w, reduce), residual
