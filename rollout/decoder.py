"""A compact forward for decoder-only transformers that reads the Hugging Face module's parameters in place.

What differs between families (Llama, Qwen2/3, Mistral, OLMo 2, SmolLM3, Gemma 2/3, Phi-3: norm placement and
arithmetic, q/k norms, activation, rotary table and attention window per layer, scalings, soft-capping, weight names,
fused weights) comes from the family's
description in rollout/families.py: rollout/model_weights.read_weights turns a model into family-agnostic
LayerWeights (a norm the family does not have is None), a Form (model-wide numerics) and a LayerSpec per layer, which
is all these functions read.

The slot engine (rollout/slots.py) runs prefill and decode through these functions against its own KV cache. The HF
modules are never called, so FSDP2's hooks do not run either: the engine unshards once per rollout and reads the
full tensors that FSDP2 swaps into the modules. Tensor-parallel parameters (DTensors from parallel/tp.py's plan) are
read as their local shards: q/k/v and gate/up hold whole heads / rows of this rank, and the row-parallel o/down
projections give partial sums that `reduce` adds up over the tp group, as RowwiseParallel does in training. Two
layouts need more: OLMo 2's q/k norm over the whole projection all-reduces each token's sum of squares
(_projection_norm), and Phi-3's fused qkv/gate_up weights, stored split by plain rows, are gathered once per read and
this rank's heads and rows copied out (_read).

Numerics follow the HF modules step for step (norms in float32, rotary tables cast to the model dtype unless the
family rotates in float32, residual sums in the model dtype), so greedy decoding in float32 matches HF `generate`
token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rollout.kernels import decode_attention
from rollout.model_weights import Form, LayerSpec, LayerWeights

Reduce = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             float32: bool = False) -> torch.Tensor:
    """x: [..., hidden] -> same shape; the variance in float32, as HF's RMSNorm. offset, float32: scaled by
    (offset + weight) in float32 before rounding (Gemma, OLMo 2), else by weight after rounding (Llama)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if float32:
        return (x * (offset + weight.float())).to(dtype)
    return weight * x.to(dtype)


def norm(x: torch.Tensor, weight: torch.Tensor | None, form: Form) -> torch.Tensor:
    """The family's RMSNorm of x with `weight`; x itself where the family has no norm there (weight None)."""
    if weight is None:
        return x
    return rms_norm(x, weight, form.eps, form.norm_offset, form.norm_float32)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x: [..., D]; cos, sin broadcastable to x. Rotary embedding in HF's rotate-half layout over the first
    rotary_dim dimensions (the rest have cos 1 and sin 0: x * 1 + x * 0, exactly x), in the tables' dtype (float32
    tables: rounded once to x's dtype)."""
    if rotary_dim == x.shape[-1]:
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    else:
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:rotary_dim], x[..., :half], x[..., rotary_dim:]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capping, in HF's order of operations); x itself where cap is 0."""
    return x if not cap else torch.tanh(x / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: Form, mask: torch.Tensor | None = None,
            causal: bool = False, gqa: bool = True) -> torch.Tensor:
    """Attention of q [..., H, Lq, D] over k, v [..., KVH, Lk, D] (H a multiple of KVH), mask: bool, True where a
    query may see a key, broadcastable to [..., H, Lq, Lk], or causal. PyTorch's SDPA; with soft-capped scores
    (form.attn_softcap, Gemma 2), which SDPA cannot compute, HF's eager attention: scores in the inputs' dtype,
    capped, masked, softmax in float32 rounded back. Returns [..., H, Lq, D]."""
    if not form.attn_softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=form.scale,
                                              enable_gqa=gqa)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
    scale = q.shape[-1] ** -0.5 if form.scale is None else form.scale
    scores = soft_cap(q @ k.transpose(-1, -2) * scale, form.attn_softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


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


def _projection_norm(x: torch.Tensor, weight: torch.Tensor, form: Form, reduce: Reduce | None) -> torch.Tensor:
    """x: [..., width], this rank's share of a projection's output -> same shape, RMSNormed over the whole
    projection (qk_norm "all"): under tensor parallelism (form.qk_norm_split > 1) each token's sum of squares is
    all-reduced over the tp group, as parallel/tp.ProjectionNormParallel does in training."""
    if form.qk_norm_split == 1:
        return norm(x, weight, form)
    assert reduce is not None, "a q/k norm over a projection split over tp ranks needs the tp group's reduce"
    dtype = x.dtype
    x = x.float()
    squares = reduce(x.pow(2).sum(-1, keepdim=True))
    x = x * torch.rsqrt(squares / (x.shape[-1] * form.qk_norm_split) + form.eps)
    if form.norm_float32:
        return (x * (form.norm_offset + weight.float())).to(dtype)
    return (form.norm_offset + weight) * x.to(dtype)


def _qkv(x: torch.Tensor, w: LayerWeights, form: Form,
         reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., hidden] -> q [..., heads * D], k and v [..., kv_heads * D]; one GEMM when the weights are fused.
    q and k normed over the whole projection where the family says so (qk_norm "all"; "head" is the caller's);
    reduce: the tp group's sum, which that norm needs when the heads are split."""
    if w.qkv is None:
        q, k, v = F.linear(x, w.q, w.q_bias), F.linear(x, w.k, w.k_bias), F.linear(x, w.v, w.v_bias)
    else:
        q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([w.q.shape[0], w.k.shape[0], w.v.shape[0]], dim=-1)
    if form.qk_norm == "all":
        q, k = _projection_norm(q, w.q_norm, form, reduce), _projection_norm(k, w.k_norm, form, reduce)
    return q, k, v


def _heads_norm(q: torch.Tensor, k: torch.Tensor, w: LayerWeights, form: Form) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., heads, D], k [..., kv_heads, D]: each head RMSNormed over D where the family says so (qk_norm "head")."""
    if form.qk_norm != "head":
        return q, k
    return norm(q, w.q_norm, form), norm(k, w.k_norm, form)


def _mlp(x: torch.Tensor, w: LayerWeights, form: Form, reduce: Reduce | None) -> torch.Tensor:
    if w.gate_up is None:
        gate, up = F.linear(x, w.gate, w.gate_bias), F.linear(x, w.up, w.up_bias)
    else:
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    act = F.silu(gate) if form.activation == "silu" else F.gelu(gate, approximate="tanh")
    return _row_parallel(act * up, w.down, w.down_bias, reduce)


def _finish_block(attn: torch.Tensor, residual: torch.Tensor, w: LayerWeights, form: Form,
                  reduce: Reduce | None) -> tuple[torch.Tensor, torch.Tensor]:
    """attn: [..., heads * D] the attention's output; residual: the block's input. Returns (MLP output, residual
    after attention): the output projection, the norms around it and the MLP wherever the family puts them."""
    residual = _add(norm(_row_parallel(attn, w.o, w.o_bias, reduce), w.attn_out_norm, form), residual)
    return norm(_mlp(norm(residual, w.post_norm, form), w, form, reduce), w.mlp_out_norm, form), residual


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
    form: Form,
    spec: LayerSpec,
    head_dim: int,
    reduce: Reduce | None = None,
    length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block for one new token in each of the first B slots of the cache.

    hidden, residual: [B, hidden], the previous block's output and the residual stream before it (summed here, so the
    sum fuses with the norm under torch.compile; the first block gets the embeddings and zeros).
    k_cache, v_cache: [S, kv_heads, T_max, D], this block's cache; the new key/value of slot b is written at pos[b].
    pos: [B] long. cos, sin: [B, D], this layer's rotary table at pos. mask: [B, 1, 1, T] bool, True on the cached
    positions slot b may attend to (T <= T_max: SDPA reads only the first T positions of each slot; a sliding window,
    spec.window, narrows it here); None: rotary embedding, cache write and attention by rollout/kernels.py's
    decode_attention, which reads positions 0..pos[b] of slot b, or the window's last ones (length: the context
    bucket, required then).
    Returns (block output, residual), [B, hidden] each.
    """
    residual = hidden + residual
    x = norm(residual, w.input_norm, form)
    batch = x.shape[0]
    q, k, v = (t.view(batch, -1, head_dim) for t in _qkv(x, w, form, reduce))
    q, k = _heads_norm(q, k, w, form)
    if mask is None:  # the kernel rotates q and k and writes k and v into the cache itself
        scale = head_dim ** -0.5 if form.scale is None else form.scale
        out = decode_attention(q, k, v, k_cache, v_cache, pos, cos, sin, length, spec.window, scale, form.rotary_dim,
                               form.attn_softcap)
    else:
        q, k = _rotate(q, cos[:, None], sin[:, None], form.rotary_dim), _rotate(k, cos[:, None], sin[:, None],
                                                                                form.rotary_dim)
        rows = torch.arange(batch, device=x.device)
        k_cache[rows, :, pos] = k
        v_cache[rows, :, pos] = v
        kv_heads, length = k.shape[1], mask.shape[-1]
        if spec.window:
            positions = torch.arange(length, device=x.device)
            mask = mask & (positions[None, :] > (pos - spec.window)[:, None])[:, None, None, :]
        # Grouped-query attention for one position: the query heads sharing a key/value head become that head's
        # "query positions", so SDPA reads each cached key/value head once and needs no repeat.
        out = _attend(q.view(batch, kv_heads, -1, head_dim), k_cache[:batch, :, :length], v_cache[:batch, :, :length],
                      form, mask, gqa=False)
    return _finish_block(out.reshape(batch, -1), residual, w, form, reduce)


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
    form: Form,
    spec: LayerSpec,
    head_dim: int,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block over P right-padded prompts of width L (positions 0..L-1).

    hidden, residual: [P, L, hidden] (as in decode_layer). cos, sin: [L, D], this layer's rotary table.
    dest: [R] long slots; src: [R] long prompt of each slot. Prompt src[r]'s keys/values go to positions 0..L-1 of slot
    dest[r], so the n samples of a prompt share one prefill. Right padding needs no mask: causal attention never lets
    a real token see the padding after it, and the padding's cache entries lie past the prompt, where decode
    overwrites them before any mask admits them. A sliding window (spec.window < L) adds a banded mask.
    Returns (block output, residual), [P, L, hidden] each.
    """
    residual = hidden + residual
    x = norm(residual, w.input_norm, form)
    prompts, width = x.shape[:2]
    q, k, v = (t.view(prompts, width, -1, head_dim) for t in _qkv(x, w, form, reduce))
    q, k = _heads_norm(q, k, w, form)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = _rotate(q, cos, sin, form.rotary_dim), _rotate(k, cos, sin, form.rotary_dim)
    k_cache[dest, :, :width] = k[src]
    v_cache[dest, :, :width] = v[src]
    if spec.window and spec.window < width:
        positions = torch.arange(width, device=x.device)
        offset = positions[:, None] - positions[None, :]  # query - key
        band = (offset >= 0) & (offset < spec.window)
        out = _attend(q, k, v, form, band)
    else:
        out = _attend(q, k, v, form, causal=True)
    return _finish_block(out.transpose(1, 2).reshape(prompts, width, -1), residual, w, form, reduce)


def extend_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    rest: torch.Tensor,
    length: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    form: Form,
    spec: LayerSpec,
    head_dim: int,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block over P right-padded continuations of width L: row i's rest[i] tokens take positions
    starts[i]..starts[i]+rest[i]-1 of slot slots[i], whose cache already holds the keys/values of the positions
    before starts[i] (an earlier call's sequence that this row's prompt continues), so only the new tokens are
    computed.

    hidden, residual: [P, L, hidden]. slots, starts, rest: [P] long. length: the cache positions attention reads,
    max(starts + rest) (from the host: no sync here). cos, sin: this layer's whole rotary table [T, D]. A padding
    position stands where its row's last token does: it attends as that token, and nothing of it is written.
    Attention reads each row's slot up to `length`: a query sees the keys at or before its position (and within
    spec.window). The query heads of each key/value head are stacked as rows of one block, so SDPA's
    memory-efficient kernel takes the mask (it refuses enable_gqa). Returns (block output, residual), [P, L, hidden].
    """
    residual = hidden + residual
    x = norm(residual, w.input_norm, form)
    prompts, width = x.shape[:2]
    q, k, v = (t.view(prompts, width, -1, head_dim) for t in _qkv(x, w, form, reduce))
    q, k = _heads_norm(q, k, w, form)
    steps = torch.arange(width, device=x.device)
    real = steps[None, :] < rest[:, None]  # [P, L]
    positions = starts[:, None] + torch.minimum(steps[None, :], rest[:, None] - 1)
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]  # [P, L, 1, D]
    q, k = _rotate(q, c, s, form.rotary_dim), _rotate(k, c, s, form.rotary_dim)
    rows, at = slots[:, None].expand(-1, width)[real], positions[real]
    k_cache[rows, :, at] = k[real]  # [N, kv_heads, D] into [slot, :, position]
    v_cache[rows, :, at] = v[real]
    keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]  # [P, kv_heads, T, D]
    key_pos = torch.arange(length, device=x.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [P, L, T]
    if spec.window:
        visible &= key_pos[None, None, :] > positions[:, :, None] - spec.window
    kv_heads = keys.shape[1]
    group = q.shape[2] // kv_heads
    stacked = q.permute(0, 2, 1, 3).reshape(prompts, kv_heads, group * width, head_dim)
    mask = visible[:, None, None].expand(prompts, 1, group, width, length).reshape(prompts, 1, group * width, length)
    out = _attend(stacked, keys, values, form, mask, gqa=False)  # [P, kv_heads, group * L, D]
    out = out.reshape(prompts, kv_heads * group, width, head_dim).transpose(1, 2)
    return _finish_block(out.reshape(prompts, width, -1), residual, w, form, reduce)
