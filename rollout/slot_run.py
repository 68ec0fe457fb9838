"""A slot engine's run (rollout/slots.py): the KV cache, the decode state on the device (SlotState), the captured
graphs and the host's view of the slots, kept between calls by a resident engine; and what the last call's finished
sequences left in their slots, for a call that continues them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollout.model_weights import DecoderWeights, rope_tables


class SlotState(NamedTuple):
    """The decode state on the device. S slots; N sequences; R_max the longest response allowed."""

    token: torch.Tensor  # [S] long: the slot's last sampled token, not yet in the cache
    pos: torch.Tensor  # [S] long: the position that token takes in the cache
    gen: torch.Tensor  # [S] long: tokens generated so far
    limit: torch.Tensor  # [S] long: the sequence's max_new_tokens
    live: torch.Tensor  # [S] bool
    seq: torch.Tensor  # [S] long: the sequence (output row) the slot serves
    out_tokens: torch.Tensor  # [N + 1, R_max] long; row N takes the writes of slots that are not live
    out_logprobs: torch.Tensor  # [N + 1, R_max] float32
    out_len: torch.Tensor  # [N + 1] long


class SlotRun:
    """The cache, the device state, the captured graphs and the host's view of the slots: one generate call's, or,
    with a resident engine, kept for the next call that fits it (reset between calls, the cache kept: what the last
    call's sequences left in their slots, `last`, may be continued).

    config: what, besides the slots, slot length and the bucket, a captured step depends on (sequences and response
    length, which a later call may have fewer of; whether there are stop tokens, the sampling settings, dtype, the
    attention kernel)."""

    def __init__(self, slots: int, slot_len: int, config: tuple, w: DecoderWeights, device):
        num_seqs, max_new, stops = config[:3]
        self.slots, self.slot_len, self.config, self.num_seqs, self.max_new = slots, slot_len, config, num_seqs, max_new
        self.shapes = (slots, slot_len, *config)  # a captured step's inputs besides the bucket
        shape = (slots, w.kv_heads, slot_len, w.head_dim)
        self.k = [torch.empty(shape, dtype=w.dtype, device=device) for _ in w.layers]
        self.v = [torch.empty(shape, dtype=w.dtype, device=device) for _ in w.layers]
        self.cos, self.sin = rope_tables(w, slot_len, device)
        self.positions = torch.arange(slot_len, device=device)
        self.rows = torch.arange(slots, device=device)
        long = dict(dtype=torch.long, device=device)
        self.state = SlotState(
            token=torch.empty(slots, **long),
            pos=torch.empty(slots, **long),
            gen=torch.empty(slots, **long),
            limit=torch.empty(slots, **long),
            live=torch.empty(slots, dtype=torch.bool, device=device),
            seq=torch.empty(slots, **long),
            out_tokens=torch.empty(num_seqs + 1, max_new, **long),
            out_logprobs=torch.empty(num_seqs + 1, max_new, dtype=torch.float32, device=device),
            out_len=torch.empty(num_seqs + 1, **long),
        )
        # the seed of the sampling noise and the stop tokens, filled in by each call: graphs read them here
        self.seed = torch.empty(1, dtype=torch.int32, device=device)
        self.stop_mask = torch.empty(w.embed.shape[0], dtype=torch.bool, device=device) if stops else None
        # the captured steps: decode ("decode", batch bucket, context bucket), prefill ("prefill", *_prefill_shape)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.prefill_inputs: dict[tuple, list[torch.Tensor]] = {}  # a prefill graph's inputs: ids, dest, src, last
        cuda = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.capture_stream = torch.cuda.Stream(device) if cuda else None
        # The cache is zeroed once, not left as allocated: attention weighs masked positions by exactly 0, but
        # 0 * NaN is NaN. Every later write is a computed key or value.
        torch._foreach_zero_([*self.k, *self.v])
        # what the last call left: (its prompts, each sequence's prompt index, responses, their lengths,
        # {slot: sequence} of the finished sequences whose slots still hold them), for a call that continues them
        self.last: tuple | None = None
        self.reset()

    def reset(self) -> None:
        """Every slot free, nothing generated (the cache keeps what it holds, but `last` no longer says what: this
        call's writes begin now, and a call that fails before its end must leave nothing to continue)."""
        self.last = None
        st = self.state
        torch._foreach_zero_([st.token, st.pos, st.gen, st.live, st.out_tokens, st.out_logprobs, st.out_len])
        st.limit.fill_(1)
        st.seq.fill_(self.num_seqs)  # the spare output row
        self.slot_seq: list[int | None] = [None] * self.slots  # host: the sequence in each slot, None when free
        self.slot_pos = [0] * self.slots  # host: pos of each occupied slot, exact at every check
        self.slot_left = [0] * self.slots  # host: an upper bound on the steps each occupied slot may still decode
        self.finished_at: dict[int, int] = {}  # host: slot -> the finished sequence whose tokens it still holds

    def held(self) -> dict[int, list[int]]:
        """slot -> the tokens whose keys and values it holds from the last call: a finished sequence's prompt and
        response but its last token (sampled, never fed back)."""
        if self.last is None:
            return {}
        prompts, owner, response, lengths, finished = self.last
        rows = list(finished.values())
        tokens, counts = response[rows].tolist(), lengths[rows].tolist()
        return {slot: prompts[owner[seq]] + t[: count - 1]
                for (slot, seq), t, count in zip(finished.items(), tokens, counts)}

    def occupied(self) -> list[int]:
        return [s for s, seq in enumerate(self.slot_seq) if seq is not None]
