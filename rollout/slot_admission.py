"""Admission into a slot engine's run (rollout/slots.py): the waiting sequences' state put into free slots, and their
prompts prefilled into the KV cache, batched by prompt (a prompt's samples share one forward), small prefills padded to
bucket shapes and replayed from CUDA graphs; a continuing call's prompts found among the sequences the slots still
hold from the last call, and only what each adds prefilled (SamplingParams.continues)."""

from __future__ import annotations

import bisect
from functools import partial

import torch

from rollout.decoder import extend_layer
from rollout.model_weights import DecoderWeights
from rollout.slot_run import SlotRun
from rollout.step_pieces import embed_tokens

# A prefill of at most this many padded prompt tokens (prompts x width, after padding to the bucket) replays a CUDA
# graph: its ~23 kernels per layer take ~10-20 ms to launch, several times their device time (0.5B, 1-2k tokens).
# Its activations stay in the graphs' memory pool while the run is kept (plan/'s bound: 45 KB per token at 0.5B,
# 80 KB at 1.5B in bf16).
PREFILL_GRAPH_TOKENS = 4096
PREFILL_WIDTH_BUCKET = 64  # a graphed prefill's prompts are right-padded to a multiple of this
# a prompt continues what a slot holds from the last call (SamplingParams.continues) when it starts with at least
# this many of its tokens (a shorter history is prefilled again: not worth a forward of its own)
MIN_CONTINUED_TOKENS = 4
# a continuing prefill's chunk holds at most this many cells of its attention mask (bools: 256 MiB)
ATTENTION_CELLS = 1 << 28
CONTINUED_LOOKBACK = 8  # held sequences a prompt's search walks back over (those between it and its own are rare)


class Admission:
    """SlotEngine's admission and prefill (a mixin: reads the engine's max_prefill_tokens, pad_token_id, pad_prefills,
    stats and its CUDA-graph capture, _graph)."""

    @staticmethod
    def _admit(run: SlotRun, w: DecoderWeights, prompts, owner, limits, admitted) -> None:
        """The (sequence, slot) pairs' state: each slot serves its sequence from the position after its prompt.
        owner: sequence -> its prompt's index."""
        st, device = run.state, w.embed.device
        seqs = torch.tensor([seq for seq, _ in admitted], device=device)
        slots = torch.tensor([slot for _, slot in admitted], device=device)
        prompt_lens = [len(prompts[owner[seq]]) for seq, _ in admitted]
        seq_limits = [limits[owner[seq]] for seq, _ in admitted]
        st.seq[slots] = seqs
        st.limit[slots] = torch.tensor(seq_limits, device=device)
        st.pos[slots] = torch.tensor(prompt_lens, device=device)
        st.gen[slots] = 0
        st.live[slots] = True
        for (seq, slot), prompt_len, limit in zip(admitted, prompt_lens, seq_limits):
            run.slot_seq[slot], run.slot_pos[slot], run.slot_left[slot] = seq, prompt_len, limit - 1
            run.finished_at.pop(slot, None)

    def _prefill(self, run: SlotRun, w: DecoderWeights, prompts, owner, limits, admitted, layer, sample_rows, clock,
                 use_graphs: bool) -> None:
        """Put the admitted (sequence, slot) pairs into their slots: one prefill per prompt, the first token sampled.
        layer: prefill_layer (maybe compiled) with its reduce bound."""
        self._admit(run, w, prompts, owner, limits, admitted)
        by_prompt: dict[int, list[int]] = {}
        for seq, slot in admitted:
            by_prompt.setdefault(owner[seq], []).append(slot)
        chunks, width = [[]], 0
        for index in by_prompt:
            # Chunks of padded prompt tokens within max_prefill_tokens; a longer prompt still goes, alone.
            width = max(width, len(prompts[index]))
            if chunks[-1] and (len(chunks[-1]) + 1) * width > self.max_prefill_tokens:
                chunks.append([])
                width = len(prompts[index])
            chunks[-1].append(index)
        for chunk in chunks:
            self._prefill_chunk(run, w, [prompts[i] for i in chunk], [by_prompt[i] for i in chunk], layer,
                                sample_rows, clock, use_graphs)

    def _extend(self, run: SlotRun, w: DecoderWeights, prompts, owner, limits, continued: dict[int, tuple[int, int]],
                reduce, sample_rows, clock) -> None:
        """Admit the sequences of `continued` ({sequence: (slot, start)}: the slot holds its prompt's first `start`
        tokens from the last call) into those slots: prefill the rest of each prompt (extend_layer, op by op) and
        sample its first token. Chunks: at most max_prefill_tokens new tokens (padded), and at most ATTENTION_CELLS
        cells of the attention mask (rows x query heads per key head x new tokens x context)."""
        self._admit(run, w, prompts, owner, limits, [(seq, slot) for seq, (slot, _) in continued.items()])
        device = w.embed.device
        self.stats["continued"] += len(continued)
        self.stats["continued_tokens"] += sum(start for _, start in continued.values())
        group = w.layers[0].q.shape[0] // w.layers[0].k.shape[0]
        chunks, width, longest = [[]], 0, 0
        for seq, (slot, start) in continued.items():
            rest, whole = len(prompts[owner[seq]]) - start, len(prompts[owner[seq]])
            size = len(chunks[-1]) + 1
            if chunks[-1] and (size * max(width, rest) > self.max_prefill_tokens
                               or size * group * max(width, rest) * max(longest, whole) > ATTENTION_CELLS):
                chunks.append([])
                width = longest = 0
            width, longest = max(width, rest), max(longest, whole)
            chunks[-1].append((prompts[owner[seq]][start:], slot, start))
        for chunk in chunks:
            width = max(len(rest) for rest, _, _ in chunk)
            padded = [rest + [self.pad_token_id] * (width - len(rest)) for rest, _, _ in chunk]
            ids = torch.tensor(padded, device=device)
            slots, starts, rest = (torch.tensor(values, device=device) for values in
                                   ([c[1] for c in chunk], [c[2] for c in chunk], [len(c[0]) for c in chunk]))
            length = max(start + len(r) for r, _, start in chunk)
            self.stats["prefills"] += 1
            with clock("prefill_s"):
                hidden = embed_tokens(ids, w.embed, w.form.embed_scale)
                residual = torch.zeros_like(hidden)
                for block, spec, k, v in zip(w.layers, w.specs, run.k, run.v):
                    hidden, residual = extend_layer(hidden, residual, block, k, v, slots, starts, rest, length,
                                                    run.cos[spec.rope], run.sin[spec.rope], w.form, spec, w.head_dim,
                                                    reduce)
                rows = torch.arange(len(chunk), device=device)
                sample_rows(hidden[rows, rest - 1], residual[rows, rest - 1], slots, False)

    def _prefill_chunk(self, run: SlotRun, w: DecoderWeights, chunk_prompts, chunk_slots, layer, sample_rows, clock,
                       use_graphs: bool) -> None:
        """chunk_prompts: P prompts; chunk_slots: the slots of each prompt's admitted samples. A chunk that fits a
        graph's bucket (_prefill_shape) is padded to it when graphs are used (or pad_prefills says so): prompts of
        padding only, and rows that repeat the last (slot, prompt) pair, which write the same cache entries and
        draw the same token again (the draw is a function of the slot's sequence and step)."""
        width = max(len(p) for p in chunk_prompts)
        dest = [s for slots in chunk_slots for s in slots]
        src = [i for i, slots in enumerate(chunk_slots) for _ in slots]
        last = [len(p) - 1 for p in chunk_prompts]
        shape = _prefill_shape(len(chunk_prompts), width, len(dest), run.slot_len)
        pad = shape is not None and (use_graphs if self.pad_prefills is None else self.pad_prefills)
        if pad:
            prompts_b, width, rows_b = shape
            chunk_prompts = chunk_prompts + [[]] * (prompts_b - len(chunk_prompts))
            last += [0] * (prompts_b - len(last))
            dest += [dest[-1]] * (rows_b - len(dest))
            src += [src[-1]] * (rows_b - len(src))
            self.stats["prefills_padded"] += 1
        ids = [p + [self.pad_token_id] * (width - len(p)) for p in chunk_prompts]
        inputs = [torch.tensor(values) for values in (ids, dest, src, last)]
        self.stats["prefills"] += 1
        forward = partial(self._prefill_forward, run, w, layer=layer, sample_rows=sample_rows)
        if not (pad and use_graphs):
            with clock("prefill_s"):
                forward(*(t.to(w.embed.device) for t in inputs))
            return
        key = ("prefill", *shape)
        if key in run.graphs:
            for buffer, values in zip(run.prefill_inputs[key], inputs):
                buffer.copy_(values)
        else:
            buffers = run.prefill_inputs[key] = [t.to(w.embed.device) for t in inputs]
            with clock("capture_s", host=True):
                self._graph(run, key, partial(forward, *buffers))
            self.stats["prefill_graphs"] += 1
        with clock("prefill_s"):
            run.graphs[key].replay()

    @staticmethod
    def _prefill_forward(run: SlotRun, w: DecoderWeights, ids, dest, src, last, layer, sample_rows) -> None:
        """ids: [P, L] right-padded prompts; dest, src: [R] slots and their prompts; last: [P] each prompt's last
        position. Writes the prompts' keys/values into the slots and samples each slot's first token."""
        hidden = embed_tokens(ids, w.embed, w.form.embed_scale)
        residual = torch.zeros_like(hidden)
        width = ids.shape[1]
        for block, spec, k, v in zip(w.layers, w.specs, run.k, run.v):
            hidden, residual = layer(hidden, residual, block, k, v, dest, src, run.cos[spec.rope][:width],
                                     run.sin[spec.rope][:width], w.form, spec, w.head_dim)
        rows = torch.arange(ids.shape[0], device=ids.device)
        sample_rows(hidden[rows, last][src], residual[rows, last][src], dest, False)


def _continued(held: dict[int, list[int]], prompts: list[list[int]], first: list[int]) -> dict[int, tuple[int, int]]:
    """{sequence: (slot, start)} for the prompts that continue what a slot holds (held: slot -> its tokens): the
    first sample of a prompt that starts with a slot's tokens (at least MIN_CONTINUED_TOKENS of them), start their
    count but at most all but the prompt's last token (whose forward samples the first new one). The held sequences
    are sorted: one that a prompt starts with sorts at or before it, and any sorting between them starts with it too
    (a longer one the prompt may also start with), so a binary search and a short walk back find the longest."""
    order = sorted((tokens, slot) for slot, tokens in held.items() if len(tokens) >= MIN_CONTINUED_TOKENS)
    continued: dict[int, tuple[int, int]] = {}
    taken: set[int] = set()
    for index, prompt in enumerate(prompts):
        at = bisect.bisect_right(order, (prompt, float("inf")))
        for tokens, slot in reversed(order[max(at - CONTINUED_LOOKBACK, 0):at]):
            if slot not in taken and len(tokens) <= len(prompt) and prompt[: len(tokens)] == tokens:
                continued[first[index]] = (slot, min(len(tokens), len(prompt) - 1))
                taken.add(slot)
                break
    return continued


def _prefill_shape(prompts: int, width: int, rows: int, slot_len: int) -> tuple[int, int, int] | None:
    """The bucket shape (prompts, width, rows) a prefill chunk of `prompts` prompts of at most `width` tokens for
    `rows` slots is padded to for a CUDA graph, or None when it is over PREFILL_GRAPH_TOKENS padded tokens.

    The width stays below the slot's length, as a prompt's does (a slot holds at least one generated token): traced
    at a width equal to the cache's slot length, the compiled prefill (dynamic shapes) took the two for one size, and
    a later call with a longer slot failed Inductor's size assertion (torch 2.11 on a GPU, 2.13 on CPU). Where the
    bucket would reach the slot, the width is the slot's length less one: one shape, not one per prompt width."""
    width = min(-(-width // PREFILL_WIDTH_BUCKET) * PREFILL_WIDTH_BUCKET, slot_len - 1)
    prompts = _size_bucket(prompts)
    if prompts * width > PREFILL_GRAPH_TOKENS:
        return None
    return prompts, width, _size_bucket(rows)


def _size_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them) at least n: a third of
    a bucket at most is padding."""
    bucket = 1
    while bucket < n:
        if bucket >= 2 and bucket * 3 // 2 >= n:
            return bucket * 3 // 2
        bucket *= 2
    return bucket
