"""The Triton kernel of the native engine's decode step that samples (rollout/step_pieces.py): sample_tokens, the
next token of every row by Gumbel-max with rollout/sampling.py's counter-based noise, and its log-prob, in one pass
over the [R, V] logits as they come from the LM head (bfloat16): each program takes a chunk of a row's vocabulary and
keeps the running max and sum of exponentials (the log-softmax normaliser) and the best noisy score with its token,
in base-2 units with one exponential and one logarithm (the noise's) per token; a second small kernel merges the
chunks. The logarithms and exponentials run on the GPU's approximate ex2/lg2 where that stays within a few float32
steps of the exact noise (_exponential): the same draw but for near-ties. The PyTorch form of the draw
(sampling.sample_with_noise) builds the float32 logits, the [R, V] noise and reduces them in separate passes.
Top-k: torch.topk's k-th largest logit is each row's floor. Top-p without sorting: the pick is checked against the
nucleus (the mass of the tokens above it below top_p), and a pick outside it is replaced by the best pick above it,
round after round (nucleus_rounds; each round reads only the rows still open): the sorted PyTorch form's draw.

When it runs, and the shared launch helpers: rollout/kernels.py (with decode attention)."""

from __future__ import annotations

import math

import torch

from rollout.kernels import (
    _LOG2_E,
    INTERPRETED,
    _ceil_div,
    _next_power_of_two,
    _part_count,
    _programs,
    _rows_contiguous,
    _whole_tiles,
    tl,
    triton,
)

BLOCK_V = 1024  # vocabulary entries per inner tile of sample_tokens
SAMPLE_WARPS = 8  # launch setting, chosen by bench/kernel_sweep.py on an H200 (bench/RESULTS.md)


if triton is not None:

    @triton.jit
    def _fmix32(x):
        """MurmurHash3's 32-bit finaliser on uint32 (logical shifts, products modulo 2^32), as sampling._fmix32."""
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        return x ^ (x >> 16)

    _FLOOR = tl.constexpr(-3.0e38)  # sample_tokens: -inf logits (and the state before any token) as this floor

    @triton.jit
    def _log2(x, ASM: tl.constexpr):
        """log2 of float32 x > 0 by the GPU's lg2.approx.ftz (an absolute error of ~2^-22; subnormal x, which the
        callers never pass, read as 0); tl.log2 under the interpreter, which runs no PTX."""
        if ASM:
            return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.log2(x)

    @triton.jit
    def _exp2(x, ASM: tl.constexpr):
        """2^x in float32 by the GPU's ex2.approx.ftz (~2 ulp; results below 2^-126 flushed to 0); tl.exp2 under
        the interpreter."""
        if ASM:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.exp2(x)

    @triton.jit
    def _exponential(uniform, ASM: tl.constexpr):
        """E = -log2(u) for u in (0, 1) on the grid of sampling.gumbel_noise: an exponential variable in units of
        ln 2 (the Gumbel noise is -log(E ln 2)), within 1.5e-6 relative of float64 (tests/test_rollout_kernels.py
        derives the bound). The noise's largest values come from u near 1, where lg2.approx's absolute error would
        be most of E: for u >= 7/8, with w = 1 - u (exact), -log2(1 - w) = log2(e) sum_n w^n / n, seven terms
        (truncation < 7e-8 relative at w = 1/8); for u < 7/8, E > 0.19 and lg2.approx's error is < 1.3e-6 of it."""
        w = 1.0 - uniform
        series = 1.4426950408889634 / 7.0
        series = series * w + 1.4426950408889634 / 6.0
        series = series * w + 1.4426950408889634 / 5.0
        series = series * w + 1.4426950408889634 / 4.0
        series = series * w + 1.4426950408889634 / 3.0
        series = series * w + 1.4426950408889634 / 2.0
        series = series * w + 1.4426950408889634
        return tl.where(uniform < 0.875, -_log2(uniform, ASM), w * series)

    @triton.jit
    def _row_hash(SEED, KEYS, STEPS, r):
        """The noise's hash of row r (sampling.gumbel_noise's counters: the seed, the row's key and step)."""
        key = tl.load(KEYS + r).to(tl.uint32)
        step = tl.load(STEPS + r).to(tl.uint32)
        return _fmix32(_fmix32(tl.load(SEED).to(tl.uint32) ^ key) + step * 0x9E3779B9)

    @triton.jit
    def _noise_exponential(row_hash, v, ASM: tl.constexpr):
        """E of tokens v's Gumbel noise in the row of row_hash (_exponential of gumbel_noise's uniform)."""
        bits = _fmix32(row_hash ^ (v.to(tl.uint32) * 0x27D4EB2F))
        # (k + 1/2) 2^-23 for the 23-bit k, as one exact fma
        uniform = ((bits >> 9) & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07 + 5.9604644775390625e-08
        return _exponential(uniform, ASM)

    @triton.jit
    def _first_best(best, token, picked):
        """(the best score, the lowest token holding it, that token's x) over the lanes or parts of a row."""
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, token, 2147483647), 0)
        return top, first, tl.sum(tl.where((best == top) & (token == first), picked, 0.0), 0)

    @triton.jit
    def _store_first_best(BEST_PART, TOKEN_PART, PICKED_PART, i, best, token, picked):
        """_first_best of the lanes, stored as part i."""
        part_best, first, at = _first_best(best, token, picked)
        tl.store(BEST_PART + i, part_best)
        tl.store(TOKEN_PART + i, first)
        tl.store(PICKED_PART + i, at)

    @triton.jit
    def _sample_tile(
        row_logits, v, inside, scale, row_hash, row_banned, STOP, row_floor, m, total, kept_max, kept, best, best_e,
        token, picked,
        MASKED: tl.constexpr, NOISE: tl.constexpr, BAN: tl.constexpr, FLOORED: tl.constexpr, KEPT_SUM: tl.constexpr,
        RATIO: tl.constexpr, ASM: tl.constexpr,
    ):
        """One tile of _sample_chunk: tokens v (all inside the vocabulary unless MASKED, then `inside` says which)
        folded into the lanes' state (m, total, kept_max, kept, best, best_e, token, picked), returned updated.
        FLOORED: tokens whose logit is below row_floor may not be picked (top-k); KEPT_SUM: `kept` sums
        2^(x - kept_max) over the tokens that may be picked, kept_max their max (top-p's normaliser, measured from
        their own max: a banned token far above them would underflow them all)."""
        if MASKED:
            logit = tl.load(row_logits + v, mask=inside, other=float("-inf")).to(tl.float32)
        else:
            logit = tl.load(row_logits + v).to(tl.float32)
        # -inf logits (and padding) as _FLOOR; a NaN logit stays NaN, so the row's log-prob is NaN as PyTorch's
        x = tl.maximum(logit * scale, _FLOOR, propagate_nan=tl.PropagateNan.ALL)
        up = x > m
        e = _exp2(-tl.abs(x - m), ASM)  # 2^(x - m) if x <= m, else the sum's rescale to the new max x
        rescale = tl.where(up, e, 1.0)
        p = tl.where(up, 1.0, e)
        total = total * rescale + p
        m = tl.maximum(m, x)
        allowed = inside
        if BAN:
            if MASKED:
                stop = tl.load(STOP + v, mask=inside, other=0) != 0
                allowed = inside & ~(stop & row_banned)
            else:
                allowed = ~((tl.load(STOP + v) != 0) & row_banned)
        if FLOORED:
            allowed = allowed & (logit >= row_floor)
        if KEPT_SUM:
            x_kept = tl.where(allowed, x, _FLOOR)
            up_kept = x_kept > kept_max
            e_kept = _exp2(-tl.abs(x_kept - kept_max), ASM)
            kept = kept * tl.where(up_kept, e_kept, 1.0) + tl.where(allowed, tl.where(up_kept, 1.0, e_kept), 0.0)
            kept_max = tl.maximum(kept_max, x_kept)
        if NOISE:
            exponential = _noise_exponential(row_hash, v, ASM)
        if RATIO:
            best = best * rescale  # the best's 2^(x - m), rescaled with the sum
            if MASKED or FLOORED:
                p = tl.where(allowed, p, 0.0)
            better = p * best_e > best * exponential  # strict: the earlier token wins a tie, as argmax
            best = tl.where(better, p, best)
            best_e = tl.where(better, exponential, best_e)
        else:
            if NOISE:
                score = x - _log2(exponential, ASM)
            else:
                score = logit  # greedy: the logit itself (x rounds neighbouring float32 logits together)
            if BAN or MASKED or FLOORED:
                score = tl.where(allowed, score, float("-inf"))
            better = score > best  # strict: the earlier token wins a tie, as argmax
            best = tl.where(better, score, best)
        token = tl.where(better, v, token)
        picked = tl.where(better, x, picked)
        return m, total, kept_max, kept, best, best_e, token, picked

    @triton.jit
    def _sample_chunk(
        LOGITS, SEED, KEYS, STEPS, STOP, BANNED_ROWS, FLOORS, M_PART, S_PART, KEPT_MAX_PART, KEPT_PART, BEST_PART,
        TOKEN_PART, PICKED_PART, stride_l, vocab, scale, chunk_len, chunks,
        BLOCK: tl.constexpr, NOISE: tl.constexpr, BAN: tl.constexpr, FLOORED: tl.constexpr, KEPT_SUM: tl.constexpr,
        RATIO: tl.constexpr, ASM: tl.constexpr,
    ):
        """Program (row, chunk) over tokens [chunk * chunk_len, chunk * chunk_len + chunk_len) (chunk_len a
        multiple of BLOCK): x = logits * scale (scale = log2(e) / temperature: base-2 units throughout, so that
        2^x is one ex2); keeps, per lane, max x, sum 2^(x - max) and the best token not banned, with its x; stores
        the chunk's max, sum, best score and token and the token's x. Whole tiles unmasked, then the vocabulary's
        last partial tile masked. -inf logits count as _FLOOR: 2^(_FLOOR - max) is 0 beside any real logit.

        One exponential per token: e = 2^-|x - max| is 2^(x - max) when x <= max, else the factor that rescales
        the sum (and the best below) to the new max. The best score is x + g, g = -log2(E) the Gumbel noise in
        base-2 units (E from _exponential; up to a constant shared by every token); greedy, the logit itself (x
        would round neighbouring float32 logits to one value: argmax must still tell them apart). RATIO (noise, no
        banned tokens): x + g > x_b + g_b is p / E > p_b / E_b with p = 2^(x - max), compared as p E_b > p_b E
        (p_b rescaled with the sum), so the noise takes one logarithm per token (E's) and no division, and the
        lane's best score x_b - log2 E_b is taken once at the end. Not with banned tokens: a banned token that is
        the lane's max would leave the others' p underflowed to 0 (x more than ~126 below it, as at a low
        temperature), none of them a candidate. A NaN logit makes the row's sum, so its log-prob, NaN.
        FLOORED: a token whose logit is below the row's FLOORS entry may not be picked (top-k; every token at or above
        the floor is, so the lane max is one that may be picked whenever the lane holds one, and the ratios hold).
        KEPT_SUM: also stores the chunk's max x and sum of 2^(x - that max) over the tokens that may be picked (top-p's
        mass)."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        row_logits = LOGITS + r.to(tl.int64) * stride_l  # 64-bit: rows x vocab may pass 2^31
        m = tl.full([BLOCK], _FLOOR, tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        token = tl.zeros([BLOCK], tl.int32)
        picked = tl.zeros([BLOCK], tl.float32)
        best_e = tl.full([BLOCK], 1.0, tl.float32)  # the best's E (RATIO only)
        if RATIO:
            best = tl.zeros([BLOCK], tl.float32)  # the best's 2^(x - max); 0: none yet
        else:
            best = tl.full([BLOCK], float("-inf"), tl.float32)
        row_hash = tl.zeros([], tl.uint32)
        if NOISE:
            row_hash = _row_hash(SEED, KEYS, STEPS, r)
        row_banned = False
        if BAN:
            row_banned = tl.load(BANNED_ROWS + r) != 0
        row_floor = 0.0
        if FLOORED:
            row_floor = tl.load(FLOORS + r)
        kept_max = tl.full([BLOCK], _FLOOR, tl.float32)
        kept = tl.zeros([BLOCK], tl.float32)
        start = c * chunk_len
        end = tl.minimum(start + chunk_len, vocab)
        whole = tl.minimum(start + chunk_len, vocab // BLOCK * BLOCK)
        lanes = tl.arange(0, BLOCK)
        for v0 in range(start, whole, BLOCK):
            v = tl.max_contiguous(tl.multiple_of(v0 + lanes, BLOCK), BLOCK)  # v0 is a multiple of BLOCK
            m, total, kept_max, kept, best, best_e, token, picked = _sample_tile(
                row_logits, v, lanes >= 0, scale, row_hash, row_banned, STOP, row_floor, m, total, kept_max, kept, best,
                best_e, token, picked, False, NOISE, BAN, FLOORED, KEPT_SUM, RATIO, ASM)
        if whole < end:  # the vocabulary's last, partial tile
            v = whole + lanes
            m, total, kept_max, kept, best, best_e, token, picked = _sample_tile(
                row_logits, v, v < end, scale, row_hash, row_banned, STOP, row_floor, m, total, kept_max, kept, best,
                best_e, token, picked, True, NOISE, BAN, FLOORED, KEPT_SUM, RATIO, ASM)
        if RATIO:
            best = tl.where(best > 0.0, picked - _log2(best_e, ASM), float("-inf"))
        chunk_max = tl.max(m, 0)
        chunk_total = tl.sum(total * tl.exp2(m - chunk_max), 0)
        if KEPT_SUM:
            chunk_kept_max = tl.max(kept_max, 0)
            tl.store(KEPT_MAX_PART + r * chunks + c, chunk_kept_max)
            tl.store(KEPT_PART + r * chunks + c, tl.sum(kept * tl.exp2(kept_max - chunk_kept_max), 0))
        i = r * chunks + c
        tl.store(M_PART + i, chunk_max)
        tl.store(S_PART + i, chunk_total)
        _store_first_best(BEST_PART, TOKEN_PART, PICKED_PART, i, best, token, picked)

    @triton.jit
    def _merge_samples(
        M_PART, S_PART, KEPT_MAX_PART, KEPT_PART, BEST_PART, TOKEN_PART, PICKED_PART, TOKENS, LOGPROBS, LOGITS,
        NUCLEUS, OPEN, OPEN_COUNT, stride_l, top_p, chunks,
        CHUNK_ROWS: tl.constexpr, TOP_P: tl.constexpr, KEPT_SUM: tl.constexpr,
    ):
        """Program (row): the token of the best chunk (the first on a tie) and its log-prob, (x - log2(sum_v
        2^x_v)) ln 2 (the chunks' x in base-2 units). TOP_P: also the row's state for the nucleus rounds (NUCLEUS
        [R, 4]: the frame of the masses, the max x of the tokens that may be picked (KEPT_SUM: their own max, else
        the row's); log2 of the row's sum; top_p times the mass of the tokens that may be picked in that frame; and
        the picked token's logit) and the row appended to the list of open rows (OPEN, OPEN_COUNT its length, zero
        before) unless no token may be picked: nothing to check."""
        r = tl.program_id(0)
        c = tl.arange(0, CHUNK_ROWS)
        used = c < chunks
        i = r * chunks + c
        m = tl.load(M_PART + i, mask=used, other=float("-inf"))
        total = tl.load(S_PART + i, mask=used, other=0.0)
        best = tl.load(BEST_PART + i, mask=used, other=float("-inf"))
        token = tl.load(TOKEN_PART + i, mask=used, other=2147483647)
        picked = tl.load(PICKED_PART + i, mask=used, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log2(tl.sum(total * tl.exp2(m - top), 0))
        row_best, chosen, at = _first_best(best, token, picked)
        tl.store(TOKENS + r, chosen.to(tl.int64))
        # a row of -inf logits only (its sum counts floors): NaN, as PyTorch's log-softmax gives
        tl.store(LOGPROBS + r, tl.where(top > _FLOOR, (at - lse) * 0.6931471805599453, float("nan")))
        if TOP_P:
            frame = top
            if KEPT_SUM:
                kept_max = tl.load(KEPT_MAX_PART + i, mask=used, other=_FLOOR)
                kept = tl.load(KEPT_PART + i, mask=used, other=0.0)
                frame = tl.max(kept_max, 0)
                mass = tl.sum(kept * tl.exp2(kept_max - frame), 0)
            else:
                mass = tl.sum(total * tl.exp2(m - top), 0)
            state = NUCLEUS + r * 4
            tl.store(state, frame)
            tl.store(state + 1, lse)
            tl.store(state + 2, top_p * mass)
            if row_best > float("-inf"):  # else no token may be picked: nothing to check
                tl.store(state + 3, tl.load(LOGITS + r.to(tl.int64) * stride_l + chosen).to(tl.float32))
                tl.store(OPEN + tl.atomic_add(OPEN_COUNT, 1), r)

    @triton.jit
    def _nucleus_tile(
        row_logits, v, inside, scale, frame, pivot, row_hash, row_banned, STOP, mass, best, token, picked,
        MASKED: tl.constexpr, MASS: tl.constexpr, BAN: tl.constexpr, ASM: tl.constexpr,
    ):
        """One tile of _nucleus_pass over the tokens v that may be picked and lie above the pivot logit: MASS adds
        their 2^(x - frame) to `mass` (frame: NUCLEUS[r, 0], at least their x), else their best noisy score
        x - log2 E goes into (best, token, picked)."""
        if MASKED:
            logit = tl.load(row_logits + v, mask=inside, other=float("-inf")).to(tl.float32)
        else:
            logit = tl.load(row_logits + v).to(tl.float32)
        x = tl.maximum(logit * scale, _FLOOR)
        allowed = logit > pivot  # -inf padding never is
        if BAN:
            if MASKED:
                stop = tl.load(STOP + v, mask=inside, other=0) != 0
            else:
                stop = tl.load(STOP + v) != 0
            allowed = allowed & ~(stop & row_banned)
        if MASS:
            mass += tl.where(allowed, _exp2(x - frame, ASM), 0.0)
        else:
            score = tl.where(allowed, x - _log2(_noise_exponential(row_hash, v, ASM), ASM), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            token = tl.where(better, v, token)
            picked = tl.where(better, x, picked)
        return mass, best, token, picked

    @triton.jit
    def _nucleus_pass(
        LOGITS, SEED, KEYS, STEPS, STOP, BANNED_ROWS, NUCLEUS, ROWS, COUNT, MASS_PART, BEST_PART, TOKEN_PART,
        PICKED_PART, stride_l, vocab, scale, pieces,
        PIECE: tl.constexpr, BLOCK: tl.constexpr, MASS: tl.constexpr, BAN: tl.constexpr, ASM: tl.constexpr,
    ):
        """A pass of a nucleus round over the rows listed in ROWS (COUNT of them), in (row, piece) items of PIECE
        tokens that the programs take in turn (a fixed grid: few rows spread over many programs, none cost a
        launch). Over the piece's tokens that may be picked and whose logit is above the row's picked one
        (NUCLEUS[r, 3]): MASS, the sum of 2^(x - NUCLEUS[r, 0]), the mass above the picked token; else the best
        noisy score with its token and x, the pick among them. Tokens above the picked one are above any top-k
        floor, which therefore needs no check here."""
        lanes = tl.arange(0, BLOCK)
        items = tl.load(COUNT) * pieces
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            r = tl.load(ROWS + item // pieces)
            piece = item % pieces
            row_logits = LOGITS + r.to(tl.int64) * stride_l
            frame = tl.load(NUCLEUS + r * 4)
            pivot = tl.load(NUCLEUS + r * 4 + 3)
            row_hash = tl.zeros([], tl.uint32)
            if not MASS:
                row_hash = _row_hash(SEED, KEYS, STEPS, r)
            row_banned = False
            if BAN:
                row_banned = tl.load(BANNED_ROWS + r) != 0
            mass = tl.zeros([BLOCK], tl.float32)
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            token = tl.zeros([BLOCK], tl.int32)
            picked = tl.zeros([BLOCK], tl.float32)
            start = piece * PIECE
            if start + PIECE <= vocab:
                for t in tl.static_range(0, PIECE, BLOCK):
                    v = tl.max_contiguous(tl.multiple_of(start + t + lanes, BLOCK), BLOCK)
                    mass, best, token, picked = _nucleus_tile(
                        row_logits, v, lanes >= 0, scale, frame, pivot, row_hash, row_banned, STOP, mass, best, token,
                        picked, False, MASS, BAN, ASM)
            else:  # the vocabulary's last, partial piece
                for t in tl.static_range(0, PIECE, BLOCK):
                    v = start + t + lanes
                    mass, best, token, picked = _nucleus_tile(
                        row_logits, v, v < vocab, scale, frame, pivot, row_hash, row_banned, STOP, mass, best, token,
                        picked, True, MASS, BAN, ASM)
            i = r * pieces + piece
            if MASS:
                tl.store(MASS_PART + i, tl.sum(mass, 0))
            else:
                _store_first_best(BEST_PART, TOKEN_PART, PICKED_PART, i, best, token, picked)

    @triton.jit
    def _nucleus_merge(
        LOGITS, NUCLEUS, ROWS, COUNT, NEXT_ROWS, NEXT_COUNT, MASS_PART, BEST_PART, TOKEN_PART, PICKED_PART,
        TOKENS, LOGPROBS, stride_l, pieces,
        PIECE_ROWS: tl.constexpr, MASS: tl.constexpr,
    ):
        """Program i of a nucleus round, for the i-th listed row r. MASS: its picked token is in the nucleus when
        the mass above it is below top_p times the mass of all that may be picked (NUCLEUS[r, 2]): the row is done;
        else it is listed for the pick (NEXT_ROWS, NEXT_COUNT). Else: the best token above the picked one (the
        pieces' picks) replaces it, with its log-prob and logit, and the row is listed for the next round's check
        (when no token may be picked above it, which the mass above it rules out but for rounding, it is done)."""
        i = tl.program_id(0)
        if i < tl.load(COUNT):
            r = tl.load(ROWS + i)
            c = tl.arange(0, PIECE_ROWS)
            used = c < pieces
            j = r * pieces + c
            if MASS:
                mass = tl.sum(tl.load(MASS_PART + j, mask=used, other=0.0), 0)
                if mass >= tl.load(NUCLEUS + r * 4 + 2):
                    tl.store(NEXT_ROWS + tl.atomic_add(NEXT_COUNT, 1), r)
            else:
                best = tl.load(BEST_PART + j, mask=used, other=float("-inf"))
                token = tl.load(TOKEN_PART + j, mask=used, other=2147483647)
                picked = tl.load(PICKED_PART + j, mask=used, other=0.0)
                row_best, chosen, at = _first_best(best, token, picked)
                if row_best > float("-inf"):
                    lse = tl.load(NUCLEUS + r * 4 + 1)
                    tl.store(TOKENS + r, chosen.to(tl.int64))
                    tl.store(LOGPROBS + r, (at - lse) * 0.6931471805599453)
                    tl.store(NUCLEUS + r * 4 + 3,
                             tl.load(LOGITS + r.to(tl.int64) * stride_l + chosen).to(tl.float32))
                    tl.store(NEXT_ROWS + tl.atomic_add(NEXT_COUNT, 1), r)


def _ptx(device: torch.device) -> bool:
    """Whether kernels may carry PTX inline assembly: compiled for an NVIDIA GPU (not interpreted, not ROCm)."""
    return device.type == "cuda" and not INTERPRETED and torch.version.hip is None


def sample_chunks(rows: int, vocab: int, programs: int) -> int:
    """Chunks of each row's vocabulary in sample_tokens: about `programs` programs, each at least one BLOCK_V tile."""
    return _part_count(vocab, BLOCK_V, rows, programs)


NUCLEUS_PIECE = 2 * BLOCK_V  # tokens of a row per work item of a nucleus round
# sample_tokens' programs per SM: with BLOCK_V and SAMPLE_WARPS, the setting bench/kernel_sweep.py found best over
# 64 and 256 rows on an H200 (23.6 and 78.4 us; bench/RESULTS.md)
SAMPLE_PROGRAMS_PER_SM = 8


def nucleus_rounds(top_p: float) -> int:
    """Nucleus rounds for top_p: enough that a draw still outside the nucleus after them has a probability below
    1e-9. Round k checks a row's k-th candidate and, when the mass above it reaches top_p, picks the (k + 1)-th, the
    best pick above it; the mass above a pick is (for a continuous distribution) uniform below the mass above the
    last, so the (k + 1)-th candidate is still outside when a product of k + 1 uniforms stays above top_p:
    P(Poisson(ln(1 / top_p)) >= k + 1). A bound for real vocabularies too: a token's probability mass of its own
    only makes the mass strictly above it smaller than uniform."""
    rate = math.log(1.0 / top_p)
    term = math.exp(-rate)  # P(Poisson = 0)
    tail, n = 1.0 - term, 1  # P(Poisson >= n)
    while tail >= 1e-9:
        term *= rate / n
        tail -= term
        n += 1
    return n - 1


def sample_tokens_impl(logits: torch.Tensor, temperature: float, seed: torch.Tensor, keys: torch.Tensor,
                       steps: torch.Tensor, stop_mask: torch.Tensor | None, banned_rows: torch.Tensor | None,
                       chunks: int = 0, top_k: int = 0, top_p: float = 1.0,
                       rounds: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sampling.sample_with_noise with the same noise, without sorting the vocabulary.

    logits: [R, V] (any float dtype, last dimension contiguous); temperature 0 is greedy (argmax, log-probs at
    temperature 1; top-k / top-p unused). seed: [1] int32, keys, steps: [R] integers, the noise's counters
    (sampling.gumbel_noise). stop_mask: [V] bool and banned_rows: [R] bool, or both None: stop_mask's tokens may not
    be picked in the rows banned_rows marks (the stop tokens before min_new_tokens). chunks: 0 picks the count
    (sample_chunks).
    top_k: the k-th largest logit that may be picked (torch.topk) is each row's floor: tokens below it may not be
    picked. top_p: the pick (Gumbel-max over what may be picked) is in the nucleus when the mass of the tokens above
    it is below top_p of the mass of all that may be picked (sampling.truncate_top_k_top_p's rule); else the best
    pick among the tokens above it is the next candidate, which is the pick over the nucleus once it is in it: each
    round checks one candidate of every row still open (a pass summing the mass above it over those rows only) and
    picks the next for the rows it rejects (a pass over those), in pieces of NUCLEUS_PIECE tokens spread over all
    programs. rounds: how many (None: nucleus_rounds(top_p); 0: the first pick, unchecked); a row still outside
    after them keeps its last candidate, which lies above every token outside the nucleus that was rejected.
    Returns (tokens [R] long, logprobs [R] float32), the log-probs of the untruncated distribution."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if rounds is not None and rounds < 0:
        raise ValueError(f"rounds must be >= 0 (0: the first pick, unchecked), got {rounds}")
    logits = _rows_contiguous(logits)
    rows, vocab = logits.shape
    device = logits.device
    if chunks <= 0:
        chunks = sample_chunks(rows, vocab, _programs(device, SAMPLE_PROGRAMS_PER_SM))
    chunk, chunks = _whole_tiles(vocab, chunks, BLOCK_V)
    ban = stop_mask is not None
    sampled = temperature > 0
    floored = sampled and 0 < top_k < vocab
    nucleus = sampled and top_p < 1.0
    kept_sum = nucleus and (ban or floored)
    floors = None
    if floored:
        candidates = logits.masked_fill(banned_rows[:, None] & stop_mask[None, :], float("-inf")) if ban else logits
        floors = candidates.topk(top_k, dim=-1).values[:, -1].float().contiguous()  # a column: stride k
    parts = [torch.empty(rows * chunks, dtype=torch.float32, device=device) for _ in range(6)]
    token_part = torch.empty(rows * chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    rounds = (nucleus_rounds(top_p) if rounds is None else rounds) if nucleus else 0
    state = torch.empty(rows, 4, dtype=torch.float32, device=device) if nucleus else logprobs
    # the rows each step of the rounds takes: list j, open_rows[j], of length counts[j]
    open_rows = torch.empty(2 * rounds + 1, rows, dtype=torch.int32, device=device) if nucleus else token_part
    counts = torch.zeros(2 * rounds + 1, dtype=torch.int32, device=device) if nucleus else token_part
    stop = stop_mask if ban else tokens  # unused without BAN
    banned = banned_rows if ban else tokens
    scale = _LOG2_E / temperature if sampled else _LOG2_E
    asm = _ptx(device)
    _sample_chunk[(rows, chunks)](
        logits, seed, keys, steps, stop, banned, floors if floored else logprobs, parts[0], parts[1], parts[5],
        parts[4], parts[2], token_part, parts[3], logits.stride(0), vocab, scale, chunk, chunks,
        BLOCK=BLOCK_V, NOISE=sampled, BAN=ban, FLOORED=floored, KEPT_SUM=kept_sum, RATIO=sampled and not ban,
        ASM=asm, num_warps=SAMPLE_WARPS,
    )
    _merge_samples[(rows,)](parts[0], parts[1], parts[5], parts[4], parts[2], token_part, parts[3], tokens, logprobs,
                            logits, state, open_rows, counts, logits.stride(0), top_p, chunks,
                            CHUNK_ROWS=_next_power_of_two(chunks), TOP_P=nucleus, KEPT_SUM=kept_sum)
    if rounds:
        pieces = _ceil_div(vocab, NUCLEUS_PIECE)
        round_parts = [torch.empty(rows * pieces, dtype=torch.float32, device=device) for _ in range(3)]
        round_tokens = torch.empty(rows * pieces, dtype=torch.int32, device=device)
        programs = _programs(device, SAMPLE_PROGRAMS_PER_SM)
        pass_args = (logits, seed, keys, steps, stop, banned, state)
        parts_args = (round_parts[0], round_parts[1], round_tokens, round_parts[2])
        for k in range(rounds):
            # lists 2k (the rows to check, from the last round), 2k + 1 (the rows to pick again), 2k + 2 (the next)
            for j, mass in ((2 * k, True), (2 * k + 1, False)):
                _nucleus_pass[(programs,)](*pass_args, open_rows[j], counts[j:], *parts_args, logits.stride(0), vocab,
                                           scale, pieces, PIECE=NUCLEUS_PIECE, BLOCK=BLOCK_V, MASS=mass, BAN=ban,
                                           ASM=asm, num_warps=SAMPLE_WARPS)
                _nucleus_merge[(rows,)](logits, state, open_rows[j], counts[j:], open_rows[j + 1], counts[j + 1:],
                                        *parts_args, tokens, logprobs, logits.stride(0), pieces,
                                        PIECE_ROWS=_next_power_of_two(pieces), MASS=mass)
    return tokens, logprobs


@torch.library.custom_op("meshrl::sample_tokens", mutates_args=())
def sample_tokens(logits: torch.Tensor, temperature: float, seed: torch.Tensor, keys: torch.Tensor,
                  steps: torch.Tensor, stop_mask: torch.Tensor | None, banned_rows: torch.Tensor | None,
                  top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_tokens_impl as an operator torch.compile keeps whole."""
    return sample_tokens_impl(logits, temperature, seed, keys, steps, stop_mask, banned_rows, top_k=top_k, top_p=top_p)


@sample_tokens.register_fake
def _(logits, temperature, seed, keys, steps, stop_mask, banned_rows, top_k=0, top_p=1.0):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)
