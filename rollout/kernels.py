"""Triton kernels for the native engine's decode step (rollout/slots.py), with the conditions under which they run.

decode_attention: one new query token per slot against that slot's KV cache, grouped-query heads unfolded (each
program reads a key/value head once for all the query heads sharing it) and only the live positions 0..pos[b] read,
split over the positions ("flash decoding") so that a small batch still fills the GPU; the last split to finish (or
a second small kernel) merges the splits. It also applies the rotary embedding to the new query and key and writes
the new key and value into the cache: two fewer kernels per layer than doing that beside it. SDPA, the fallback,
needs the query heads folded into a query length and a [B, 1, 1, T] mask, and reads the whole context bucket of
every slot.

The sampling kernel (sample_tokens) is in rollout/sample_kernels.py; the launch helpers below serve both.

The kernels run on CUDA tensors; with TRITON_INTERPRET=1 set before this module is imported they also run, slowly,
on CPU tensors (the tests check them that way against a plain softmax(q k^T) v). Without Triton, `available()`
says why and the engine keeps SDPA.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the CPU wheel of torch comes without Triton
    triton = tl = None
    _IMPORT_ERROR: str | None = f"triton is not importable ({error})"
else:
    _IMPORT_ERROR = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_T = 64  # cached positions per inner tile
# launch settings, chosen by bench/kernel_sweep.py on an H200 (bench/RESULTS.md)
ATTENTION_PROGRAMS_PER_SM = 2  # decode_attention splits the positions until about this many programs per SM
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2
_LOG2_E = 1.4426950408889634
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows: the query heads of a group are padded to this


def available(head_dim: int, device: torch.device) -> str | None:
    """None when decode_attention can run for this head size on this device, else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if device.type != "cuda" and not INTERPRETED:
        return f"the device is {device.type} (the kernels run on CUDA, or anywhere under TRITON_INTERPRET=1)"
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two in 16..256"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0) (bfloat16 tensor-core dots)"
    return None


def _part_count(total: int, tile: int, independent: int, programs: int) -> int:
    """Parts to cut `total` elements into, each at least one `tile`, so that `independent` programs per part come
    to about `programs`."""
    return max(1, min(_ceil_div(total, tile), _ceil_div(programs, max(independent, 1))))


def _whole_tiles(total: int, parts: int, tile: int) -> tuple[int, int]:
    """(part length, part count) of `total` elements in about `parts` parts of whole tiles (none left empty)."""
    length = _ceil_div(_ceil_div(total, parts), tile) * tile
    return length, _ceil_div(total, length)


def split_count(batch: int, kv_heads: int, length: int, programs: int) -> int:
    """Splits of the positions per (slot, key/value head): enough programs for about `programs`
    (ATTENTION_PROGRAMS_PER_SM per SM in decode_attention), each split at least one BLOCK_T tile."""
    return _part_count(length, BLOCK_T, batch * kv_heads, programs)


def _programs(device: torch.device, per_sm: int = 2) -> int:
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # interpreted: enough programs that small test batches are split


if triton is not None:

    @triton.jit
    def _rotate_half(x, x_partner, cos, sin, sign):
        """Rotary embedding in the rotate-half layout, x * cos + rotate_half(x) * sin, in float32: x_partner holds
        x at (d + D/2) % D, sign is -1 on the first half, +1 on the second."""
        return x.to(tl.float32) * cos + sign * x_partner.to(tl.float32) * sin

    @triton.jit
    def _soft_cap(s, cap):
        """cap * tanh(s / cap) (Gemma 2's soft-capping), tanh from one exponential of -2|x| (no overflow; Triton's
        core has no tanh that the CPU interpreter runs too): 1 - e^-2|x| is exact in float32 for e^-2|x| >= 1/2, so
        the capped score's absolute error stays near cap * 2^-24 (3e-6 at cap 50) for every s."""
        x = s / cap
        e = tl.exp(-2.0 * tl.abs(x))
        y = (1.0 - e) / (1.0 + e)
        return cap * tl.where(x < 0, -y, y)

    @triton.jit
    def _attend_split(
        Q, K_NEW, V_NEW, COS, SIN, K, V, POS, OUT, M_PART, L_PART, ACC_PART, COUNTERS,
        stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb,
        stride_ks, stride_kh, stride_kt,
        stride_vs, stride_vh, stride_vt,
        stride_ob, stride_oh,
        scale, softcap, window, split_len, splits,
        HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
        ONE_SPLIT: tl.constexpr, MERGE: tl.constexpr, SPLIT_ROWS: tl.constexpr, BLOCK: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, ROTARY_DIM: tl.constexpr, CAP: tl.constexpr,
    ):
        """Program (b, kv head, split): the GROUP query heads of that kv head, rotated, over positions [split *
        split_len, min(split * split_len + split_len, pos[b] + 1)) of slot b, those past pos[b] - window only (a
        sliding window; window >= T_max for full attention), position pos[b] being the new key and
        value: the program whose split holds pos[b] (the last one when none does) rotates the new key, writes it and
        the new value into the cache at pos[b] and attends to them from registers; the others read positions
        before pos[b] only, so no program reads what another writes. One split: writes the normalised output; else
        the running max, the sum of exponentials and the unnormalised output of its positions, and with MERGE the
        last program of (b, kv head) to finish merges the splits into the output (a counter per (b, kv head) in
        COUNTERS, zero before and after). IEEE: float32 products (no TF32); UPCAST: float32 products for 16-bit
        inputs (the interpreter's tl.dot does not take bfloat16). CAP: scores soft-capped by `softcap` after the
        scale (Gemma 2)."""
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's cache may pass 2^31 elements
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(POS + b)
        g = tl.arange(0, GROUP_ROWS)
        d = tl.arange(0, HEAD_DIM)
        head = kvh * GROUP + g
        real = g < GROUP
        # q and the new key rotated (_rotate_half) in float32 and rounded once to the inputs' dtype, as the compiled
        # PyTorch form computes
        # rotate-half over the first ROTARY_DIM dimensions; the rest (partial rotary) have cos 1, sin 0 and pass
        partner = tl.where(d < ROTARY_DIM, (d + ROTARY_DIM // 2) % ROTARY_DIM, d)
        sign = tl.where(d < ROTARY_DIM // 2, -1.0, 1.0)
        cos = tl.load(COS + b * stride_cb + d).to(tl.float32)
        sin = tl.load(SIN + b * stride_cb + d).to(tl.float32)
        q_rows = Q + b * stride_qb + head[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=real[:, None], other=0.0)
        q_partner = tl.load(q_rows + partner[None, :], mask=real[:, None], other=0.0)
        q = _rotate_half(q, q_partner, cos[None, :], sin[None, :], sign[None, :]).to(q.dtype)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([GROUP_ROWS], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([GROUP_ROWS], dtype=tl.float32)
        acc = tl.zeros([GROUP_ROWS, HEAD_DIM], dtype=tl.float32)
        start = split * split_len
        end = tl.minimum(start + split_len, pos)  # cached positions only: the new one comes from registers
        first = tl.maximum(start, pos - window + 1)  # a sliding window's first key; splits before it read nothing
        k_base = K + b * stride_ks + kvh * stride_kh
        v_base = V + b * stride_vs + kvh * stride_vh
        # the new key (rotated) and value, loaded by every program (a few hundred bytes) and written into the cache
        # by the owner, before the loop
        owner = split == tl.minimum(pos // split_len, splits - 1)
        k_new = K_NEW + b * stride_knb + kvh * stride_knh
        key = _rotate_half(tl.load(k_new + d), tl.load(k_new + partner), cos, sin, sign).to(K.dtype.element_ty)
        value = tl.load(V_NEW + b * stride_vnb + kvh * stride_vnh + d).to(V.dtype.element_ty)
        if owner:
            tl.store(k_base + pos * stride_kt + d, key)  # pos < T_max: the caller's promise, not checked here
            tl.store(v_base + pos * stride_vt + d, value)
        for t0 in range(first, end, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            live = t < end
            k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=live[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if CAP:
                s = _soft_cap(s, softcap)
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=live[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if owner:
            if pos < start + split_len:  # else a slot past the context bound: the new position is not attended
                s = tl.sum(q.to(tl.float32) * key.to(tl.float32)[None, :], 1) * scale
                if CAP:
                    s = _soft_cap(s, softcap)
                m_new = tl.maximum(m, s)
                p = tl.exp(s - m_new)
                alpha = tl.exp(m - m_new)
                denom = denom * alpha + p
                # p rounded to the values' dtype, as the tiles' p v on a GPU (the interpreter's tiles keep float32)
                acc = acc * alpha[:, None] + p.to(value.dtype).to(tl.float32)[:, None] * value.to(tl.float32)[None, :]
                m = m_new
        if ONE_SPLIT:
            out = acc / denom[:, None]
            tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                     mask=real[:, None])
        else:
            row = (b * HEADS + head) * splits + split
            tl.store(M_PART + row, m, mask=real)
            tl.store(L_PART + row, denom, mask=real)
            tl.store(ACC_PART + row[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])
            if MERGE:
                # every thread's stores done, then one release/acquire count: the program that counts last sees
                # every split's partials (read past L1, which may not hold other SMs' writes)
                tl.debug_barrier()
                counter = COUNTERS + b * (HEADS // GROUP) + kvh
                if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                    out = _merge_partials(M_PART, L_PART, ACC_PART, b * HEADS + head, real, splits, d, HEAD_DIM,
                                          SPLIT_ROWS, ".cg")
                    tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + d[None, :],
                             out.to(OUT.dtype.element_ty), mask=real[:, None])
                    tl.atomic_xchg(counter, 0)

    @triton.jit
    def _merge_partials(M_PART, L_PART, ACC_PART, heads, real, splits, d, HEAD_DIM: tl.constexpr,
                        SPLIT_ROWS: tl.constexpr, CACHE: tl.constexpr):
        """[R, HEAD_DIM] outputs of the R (slot, query head) rows `heads` (b * HEADS + h; `real` marks the rows
        that exist) from their splits' partials: sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the splits
        i (M = max m_i; a split past the slot's live length has m = -inf and weighs 0; split 0 always holds
        position 0). CACHE: the loads' cache modifier."""
        i = tl.arange(0, SPLIT_ROWS)
        used = real[:, None] & (i[None, :] < splits)
        rows = heads[:, None] * splits + i[None, :]  # [R, SPLIT_ROWS]
        m = tl.load(M_PART + rows, mask=used, other=float("-inf"), cache_modifier=CACHE)
        denom = tl.load(L_PART + rows, mask=used, other=0.0, cache_modifier=CACHE)
        acc = tl.load(ACC_PART + rows[:, :, None] * HEAD_DIM + d[None, None, :], mask=used[:, :, None], other=0.0,
                      cache_modifier=CACHE)
        top = tl.where(real, tl.max(m, 1), 0.0)  # rows that do not exist: all -inf, no NaN
        weight = tl.where(used, tl.exp(m - top[:, None]), 0.0)
        total = tl.where(real, tl.sum(denom * weight, 1), 1.0)
        return tl.sum(acc * weight[:, :, None], 1) / total[:, None]

    @triton.jit
    def _merge_splits(
        M_PART, L_PART, ACC_PART, OUT, stride_ob, stride_oh, splits,
        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_ROWS: tl.constexpr,
    ):
        """Program (b, head): the head's output from its splits' partials (_merge_partials over one row)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        row = tl.full([1], 0, tl.int32) + b * HEADS + h
        out = _merge_partials(M_PART, L_PART, ACC_PART, row, row >= 0, splits, d, HEAD_DIM, SPLIT_ROWS, "")
        tl.store(OUT + b * stride_ob + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty))


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous (a view of a fused projection's output is), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device, int32 zeros: decode_attention's merge counters
# replaced buffers stay allocated: a CUDA graph captured with one keeps its address
_RETIRED_COUNTERS: list[torch.Tensor] = []
# the in-kernel merge holds [query heads, splits, head_dim] floats in every split program (registers for the whole
# kernel): past this many splits (small batches, long contexts) the second kernel merges instead
MERGE_IN_KERNEL_MAX_SPLITS = 8
FULL_WINDOW = 1 << 30  # the kernel's window for full attention: more positions than any cache holds


def merge_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """At least `needed` int32 counters on `device`, all zero (the kernel leaves them so), or None when there are too
    few and a CUDA graph is being captured (no new memory then: the splits merge in a second kernel instead)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            _RETIRED_COUNTERS.append(have)
        have = _COUNTERS[device] = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
    return have


def decode_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int,
                          splits: int = 0, merge_in_kernel: bool = True, window: int = 0,
                          scale: float | None = None, rotary_dim: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One decode step's attention, rotary embedding and cache write in one kernel.

    q: [B, H, D], k, v: [B, KVH, D], the new token's projections in the first B slots, not yet rotated (views of a
    fused projection's output are taken as they are); k_cache, v_cache: [S, KVH, T_max, D] (S >= B, T_max >= length,
    the last dimension contiguous), this block's cache, positions 0..pos[b]-1 of slot b filled; pos: [B] long, each
    slot's new position (< T_max); cos, sin: [B, D], the rotary tables at pos (rotate-half layout). Rotates q and k,
    writes k and v into the caches at pos, and returns softmax attention of q[b] over positions 0..pos[b] of slot b,
    scale 1/sqrt(D) (or `scale`), query head h reading key/value head h // (H / KVH), [B, H, D] in q's dtype.
    window > 0: a sliding window, positions pos[b] - window + 1..pos[b] only (the splits before it read nothing; the
    cache keeps every position: its memory is the full slot's, its reads the window's). rotary_dim > 0: partial
    rotary, the first rotary_dim dimensions of each head rotated (cos, sin are 1 and 0 past them), the rest as they
    are. softcap > 0: scores soft-capped, softcap * tanh(score / softcap), after the scale (Gemma 2).
    length (>= 1) sizes the splits: positions from length rounded up to whole splits on are never read, so a slot
    with pos >= length (a finished one still in the decode batch, whose output is unused) gets attention over a
    prefix only (its new key and value are still written). splits: 0 picks the count (split_count).
    merge_in_kernel: the last split of each (slot, kv head) merges them (merge_counters; up to
    MERGE_IN_KERNEL_MAX_SPLITS splits), else a second kernel does."""
    if length < 1:
        raise ValueError(f"length must be >= 1 (the context the attention may read), got {length}")
    q, k, v, cos, sin = (_rows_contiguous(t) for t in (q, k, v, cos, sin))
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if splits <= 0:
        splits = split_count(batch, kv_heads, length, _programs(q.device, ATTENTION_PROGRAMS_PER_SM))
    split_len, splits = _whole_tiles(length, splits, BLOCK_T)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    counters = None
    if splits == 1:
        m_part = l_part = acc_part = out  # unused by the kernel
    else:
        if merge_in_kernel and splits <= MERGE_IN_KERNEL_MAX_SPLITS:
            counters = merge_counters(q.device, batch * kv_heads)
        m_part = torch.empty(batch * heads * splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(batch * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    _attend_split[(batch, kv_heads, splits)](
        q, k, v, cos, sin, k_cache, v_cache, pos, out, m_part, l_part, acc_part,
        counters if counters is not None else pos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        head_dim ** -0.5 if scale is None else scale, softcap or 1.0, window if window > 0 else FULL_WINDOW, split_len,
        splits,
        HEADS=heads, GROUP=group, GROUP_ROWS=max(MIN_GROUP_ROWS, _next_power_of_two(group)), HEAD_DIM=head_dim,
        ONE_SPLIT=splits == 1, MERGE=counters is not None, SPLIT_ROWS=_next_power_of_two(splits), BLOCK=BLOCK_T,
        IEEE=ieee or INTERPRETED, UPCAST=INTERPRETED, ROTARY_DIM=rotary_dim or head_dim, CAP=softcap > 0,
        num_warps=ATTENTION_WARPS,
        num_stages=ATTENTION_STAGES,
    )
    if splits > 1 and counters is None:
        _merge_splits[(batch, heads)](
            m_part, l_part, acc_part, out, out.stride(0), out.stride(1), splits,
            HEADS=heads, HEAD_DIM=head_dim, SPLIT_ROWS=_next_power_of_two(splits),
        )
    return out


@torch.library.custom_op("meshrl::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int, window: int = 0,
                     scale: float = 0.0, rotary_dim: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """decode_attention_impl as an operator torch.compile keeps whole (its graphs call the kernels as they are); it
    writes the caches in place. scale 0: 1/sqrt(D); rotary_dim 0: the whole head; softcap 0: no soft-capping."""
    return decode_attention_impl(q, k, v, k_cache, v_cache, pos, cos, sin, length, window=window,
                                 scale=scale or None, rotary_dim=rotary_dim, softcap=softcap)


@decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, pos, cos, sin, length, window=0, scale=0.0, rotary_dim=0, softcap=0.0):
    return q.new_empty(q.shape)
