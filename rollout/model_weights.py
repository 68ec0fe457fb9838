"""A model read for the compact forward (rollout/decoder.py): through its family's description
(rollout/families.py) into family-agnostic LayerWeights (a norm the family does not have is None), a Form
(model-wide numerics), a LayerSpec per layer and the rotary tables; and the resident engine's own copies of them.

Tensor-parallel parameters (DTensors from parallel/tp.py's plan) are read as their local shards: q/k/v and gate/up
hold whole heads / rows of this rank. Phi-3's fused qkv/gate_up weights, stored split by plain rows under tensor
parallelism, are gathered once per read and this rank's heads and rows copied out (_read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rollout.families import ACTIVATIONS, Fused, family_of, parameter


class LayerWeights(NamedTuple):
    """One decoder block's parameters as local tensors (this rank's shard under tensor parallelism).

    Norms [hidden] (None: the family has none there): input_norm before attention, post_norm before the MLP,
    attn_out_norm on the attention's output and mlp_out_norm on the MLP's before each joins the residual stream
    (OLMo 2, Gemma 3); q_norm, k_norm [D] per head or [heads * D] over the projection (Form.qk_norm).
    q [heads * D, hidden], k/v [kv_heads * D, hidden], o [hidden, heads * D]; gate/up [inter, hidden], down
    [hidden, inter]; biases [out features] or None. heads, kv_heads, inter: this rank's share.
    """

    input_norm: torch.Tensor | None
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor | None
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    # fused copies (read_weights(fuse=True)): q/k/v rows stacked [(heads + 2 kv_heads) * D, hidden], gate/up rows
    # stacked [2 inter, hidden], and their biases; one GEMM each instead of three and two
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None


class Form(NamedTuple):
    """A model's numerics that the compiled pieces branch on (Python constants there), from its family.

    eps: the RMSNorms' epsilon; norm_offset, norm_float32: RMSNorm scales by (offset + weight), in float32 before
    rounding or (Llama) after; activation: the MLP gate's, "silu" or "gelu_tanh"; qk_norm: "none", "head" or "all";
    scale: attention's softmax scale, None for head_dim ** -0.5; embed_scale: the embeddings' factor (1.0, or
    sqrt(hidden) in Gemma, already rounded to the model dtype as HF's buffer is); rotary_dim: the leading dimensions
    of each head that rotary rotates (the head's size, or less: partial rotary, Phi-4-mini), the rest pass as they are.
    qk_norm_split: qk_norm "all" under tensor parallelism (OLMo 2): the ranks the projection is split over, across
    which each token's sum of squares is all-reduced (1: every head on this rank).
    attn_softcap, logit_softcap: Gemma 2's soft-capping (cap * tanh(x / cap)) of the attention scores (after the
    scale, before the mask) and of the final logits; 0: none.
    """

    eps: float
    norm_offset: float = 0.0
    norm_float32: bool = False
    activation: str = "silu"
    qk_norm: str = "none"
    scale: float | None = None
    embed_scale: float = 1.0
    rotary_dim: int = 0
    qk_norm_split: int = 1
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0


class LayerSpec(NamedTuple):
    """Per layer: rope, the index of its rotary table (DecoderWeights.rope); window, the keys a query attends to
    counting itself (kv position > query position - window), 0 for full causal attention."""

    rope: int = 0
    window: int = 0


@dataclass
class DecoderWeights:
    """A model's parameters as the forward reads them: views (read_weights; valid while the parameters stay where
    they are, one rollout) or buffers of the engine's own (own_weights, refilled by fill_weights)."""

    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [V, hidden]
    rope: list[tuple[torch.Tensor, float]]  # rotary tables: inverse frequencies [D / 2] float32, attention scaling
    form: Form
    specs: list[LayerSpec]  # one per layer
    rotary_float32: bool  # rotary tables in float32 (q/k rotated in float32, rounded once), else in the model dtype
    head_dim: int
    kv_heads: int  # on this rank
    row_parallel: bool  # o/down give partial sums to be reduced over the tp group

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local data without autograd: a DTensor's shard on this rank, else the tensor itself."""
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _read(block: nn.Module, path: str | Fused, config, gathered: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The local tensor of one LayerWeights field of `block`. A part of a fused weight (Phi-3) is a view of its rows;
    under tensor parallelism, where parallel/tp.py stores the fused weight split by rows, the weight is gathered
    (a collective of the tp group; once per block, kept in `gathered`) and this rank's share of the part copied."""
    if not isinstance(path, Fused):
        return _local(parameter(block, path))
    fused = parameter(block, path.path)
    if not (isinstance(fused, DTensor) and fused.device_mesh.size() > 1):
        return _local(fused).split(path.sizes(config))[path.part]
    if path.path not in gathered:
        gathered[path.path] = fused.full_tensor().detach()
    mesh = fused.device_mesh
    part = gathered[path.path].split(path.sizes(config))[path.part]
    return part.chunk(mesh.size())[mesh.get_local_rank()].clone()


def read_weights(model: nn.Module, fuse: bool = False) -> DecoderWeights:
    """Views of `model`'s parameters, read now (after any FSDP2 unshard) through its family's description
    (rollout/families.py). Raises ValueError on shapes this forward cannot run: heads not whole on this rank, or
    parameters still sharded by FSDP. Collective under tensor parallelism for a family with fused weights (_read).

    fuse: also build each block's stacked q/k/v and gate/up weights (copies of about two thirds of a Qwen2.5
    block's weights: 0.47 GB at 0.5B, 1.7 GB at 1.5B in bf16; they live for one rollout) so a step runs two GEMMs
    where it ran five. Under tensor parallelism the local shards are stacked, which keeps whole heads and
    rows per rank."""
    config = model.config
    family = family_of(model)
    assert family is not None, f"read_weights on model_type {config.model_type!r}: check unsupported_reason first"
    backbone = model.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # a norm or bias the family does not have stays None
    absent = {name: None for name in ("input_norm", "post_norm", "q_bias", "k_bias", "v_bias", "o_bias", "gate_bias",
                                      "up_bias", "down_bias")}
    layers = []
    for block in backbone.layers:
        gathered = {}
        layers.append(LayerWeights(**{**absent, **{name: _read(block, path, config, gathered)
                                                   for name, path in family.weights.items()}}))
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
    row_parallel = heads < config.num_attention_heads
    dtype = _local(backbone.embed_tokens.weight).dtype
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    embed_scale = float(torch.tensor(hidden ** 0.5).to(dtype)) if family.embed_scale else 1.0
    scale = family.attn_scale(config)
    rotary = family.rotary(model)
    rotary_dim = 2 * rotary.tables[0][0].numel()
    assert all(2 * t.numel() == rotary_dim for t, _ in rotary.tables) and rotary_dim <= head_dim
    form = Form(eps=float(config.rms_norm_eps), norm_offset=family.norm_offset, norm_float32=family.norm_float32,
                activation=ACTIVATIONS[act], qk_norm=family.qk_norm,
                scale=None if scale is None else float(scale), embed_scale=embed_scale, rotary_dim=rotary_dim,
                qk_norm_split=config.num_attention_heads // heads if family.qk_norm == "all" else 1,
                attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
                logit_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0))
    weights = DecoderWeights(
        embed=_local(backbone.embed_tokens.weight),
        layers=layers,
        norm=_local(backbone.norm.weight),
        lm_head=_local(model.lm_head.weight),
        rope=rotary.tables,
        form=form,
        specs=[LayerSpec(rope, window) for rope, window in zip(rotary.layers, family.windows(config), strict=True)],
        rotary_float32=family.rotary_float32,
        head_dim=head_dim,
        kv_heads=kv_heads,
        row_parallel=row_parallel,
    )
    if not fuse:
        return weights
    stacked = own_weights(weights, fuse=True, copy_all=False)  # q/k/v and gate/up stacked, the rest these views
    fill_weights(stacked, weights)
    return stacked


FUSED_STACKS = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"), "gate_up": ("gate", "up"),
                "gate_up_bias": ("gate_bias", "up_bias")}


SEPARATE_FIELDS = tuple(name for name in LayerWeights._fields if name not in FUSED_STACKS)  # a block's own tensors


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
                          rope=[(inv_freq.clone(), scale) for inv_freq, scale in w.rope], form=w.form,
                          specs=list(w.specs), rotary_float32=w.rotary_float32, head_dim=w.head_dim,
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


def rope_tables(weights: DecoderWeights, length: int, device: torch.device) -> tuple[list[torch.Tensor],
                                                                                          list[torch.Tensor]]:
    """cos, sin [length, D] for positions 0..length-1 of each rotary table, computed as the HF rotary module does,
    in the model dtype (float32 where the family rotates in float32). Under partial rotary the dimensions past
    Form.rotary_dim get cos 1 and sin 0: they pass unchanged."""
    dtype = torch.float32 if weights.rotary_float32 else weights.dtype
    passed = weights.head_dim - weights.form.rotary_dim
    cos_tables, sin_tables = [], []
    for inv_freq, scale in weights.rope:
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * scale, angles.sin() * scale
        if passed:
            cos = torch.cat((cos, cos.new_ones(length, passed)), dim=-1)
            sin = torch.cat((sin, sin.new_zeros(length, passed)), dim=-1)
        cos_tables.append(cos.to(dtype))
        sin_tables.append(sin.to(dtype))
    return cos_tables, sin_tables
