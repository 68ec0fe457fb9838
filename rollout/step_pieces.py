"""The pieces of a slot engine step that torch.compile compiles and the CUDA graphs replay (rollout/slots.py): the
embeddings, a decode step's inputs (positions, rotary rows, the mask), and sampling with the slots' bookkeeping on the
device (SlotState, rollout/slot_run.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rollout import sample_kernels
from rollout.decoder import rms_norm, soft_cap
from rollout.model_weights import Form
from rollout.sampling import gumbel_noise, sample_with_noise
from rollout.slot_run import SlotState


def embed_tokens(ids: torch.Tensor, embed: torch.Tensor, scale: float) -> torch.Tensor:
    """ids: [...] long -> [..., hidden]: the embeddings, times the family's scale (Form.embed_scale) unless 1."""
    hidden = F.embedding(ids, embed)
    return hidden if scale == 1.0 else hidden * scale


def decode_inputs(
    token: torch.Tensor,
    pos: torch.Tensor,
    embed: torch.Tensor,
    cos_tables: list[torch.Tensor],
    sin_tables: list[torch.Tensor],
    positions: torch.Tensor | None,
    embed_scale: float = 1.0,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """token, pos: [B] long; embed: [V, hidden]; cos/sin_tables: [T_max, D] per rotary table; positions: [T] =
    arange(T), or None when attention needs no mask (the Triton kernel reads each slot's live length itself).
    Returns embeddings [B, hidden], each table's cos and sin [B, D] at pos, and the attention mask [B, 1, 1, T]
    (positions <= pos: the cache so far and the token written this step) or None."""
    mask = None if positions is None else (positions[None, :] <= pos[:, None])[:, None, None, :]
    return (embed_tokens(token, embed, embed_scale), [t[pos] for t in cos_tables], [t[pos] for t in sin_tables],
            mask)


def sample_and_record(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    rows: torch.Tensor,
    norm: torch.Tensor,
    lm_head: torch.Tensor,
    state: SlotState,
    seed: torch.Tensor,
    stop_mask: torch.Tensor | None,
    form: Form,
    temperature: float,
    top_k: int,
    top_p: float,
    min_new_tokens: int,
    kernel_sampling: bool,
    advance_positions: bool,
    broadcast: Callable | None = None,
) -> None:
    """Sample the next token of the slots `rows` and update their state in place.

    hidden, residual: [R, hidden], the last block's output and residual at each slot's last position. rows: [R] long
    slots. seed: [1] int32. stop_mask: [V] bool (True on stop tokens) or None when there are none. form: the model's
    numerics (its final norm's).
    A slot that is not live samples too (its work is in the batch anyway) but writes to the spare output row and
    keeps its state. advance_positions: a decode step moves pos past the token it just wrote; prefill does not (the
    prompt's next position is already set). broadcast: under tensor parallelism, makes every rank take rank 0's
    tokens and logprobs. kernel_sampling: draw by rollout/sample_kernels.py's kernel (one pass over the logits, and with
    top-p a few passes over the rows whose first pick lies outside the nucleus), the draw of
    sampling.sample_with_noise with its noise within a few float32 steps (a token differs only on a near-tie, or,
    with top-p, where a token's mass above it is within rounding of top_p).
    """
    logits = F.linear(rms_norm(hidden + residual, norm, form.eps, form.norm_offset, form.norm_float32), lm_head)
    logits = soft_cap(logits, form.logit_softcap)  # Gemma 2's final soft-capping (0: none)
    gen, seq, live = state.gen[rows], state.seq[rows], state.live[rows]
    ban = stop_mask is not None and min_new_tokens > 0
    if kernel_sampling:
        tokens, logprobs = sample_kernels.sample_tokens(logits, temperature, seed, seq, gen, stop_mask if ban else None,
                                                 gen < min_new_tokens if ban else None, top_k, top_p)
    else:
        banned = (gen < min_new_tokens)[:, None] & stop_mask[None, :] if ban else None
        noise = gumbel_noise(seed, seq, gen, logits.shape[-1]) if temperature > 0 else None
        tokens, logprobs = sample_with_noise(logits, temperature, top_k, top_p, banned, noise)
    if broadcast is not None:
        tokens, logprobs = broadcast(tokens, logprobs)
    spare = state.out_len.shape[0] - 1
    out_row, out_col = torch.where(live, seq, spare), torch.where(live, gen, 0)
    state.out_tokens[out_row, out_col] = tokens
    state.out_logprobs[out_row, out_col] = logprobs
    state.out_len[out_row] = gen + 1
    finished = gen + 1 >= state.limit[rows]
    if stop_mask is not None:
        finished = finished | stop_mask[tokens]
    state.token[rows] = tokens
    state.gen[rows] = gen + live
    if advance_positions:
        state.pos[rows] = state.pos[rows] + live
    state.live[rows] = live & ~finished
