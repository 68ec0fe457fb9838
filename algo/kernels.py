"""Triton kernels for losses.logprobs_and_entropy on GPUs: the labels' log-probs and the entropy of
softmax(logits / temperature) for every row of [B, T, V] logits, forward and backward, one program per row.

The forward reads a row once (an online max, sum of exponentials and sum of p x over vocabulary tiles, in float32)
and writes four floats; the backward reads it once more and writes its gradient in the logits' dtype. The chunked
PyTorch form (losses._ChunkedLogprobsEntropy) makes a float32 copy of each tile and runs ~10 kernels over it in each
direction: on the actor's update of the e2e benchmark (16k response tokens x 152k vocabulary, bfloat16) that was
~85 ms of a ~260 ms update on an H200, against ~4 ms of reading and writing the logits.

They run on CUDA tensors; with TRITON_INTERPRET=1 set before this module is imported, also (slowly) on CPU tensors:
tests/test_algo_losses.py checks them that way against the float64 softmax.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without Triton
    triton = tl = None

BLOCK_V = 4096  # vocabulary entries per tile
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def usable(logits: torch.Tensor) -> bool:
    """Whether losses.py hands these logits to the kernels: Triton importable, a CUDA tensor, a 16/32-bit float
    dtype (float64 stays on the PyTorch path), [B, T, V] with unit stride along V. (Under the interpreter the
    kernels take CPU tensors too, when called directly: the tests do.)"""
    return (triton is not None and logits.is_cuda and logits.dtype in DTYPES and logits.dim() == 3
            and logits.stride(-1) == 1)


if triton is not None:

    @triton.jit
    def _row_start(logits, stride_b, stride_t, T):
        row = tl.program_id(0)
        return row, logits + (row // T).to(tl.int64) * stride_b + (row % T).to(tl.int64) * stride_t

    @triton.jit
    def _forward_rows(logits, stride_b, stride_t, T, V, labels, inv_temp, logp_out, entropy_out, lse_out, mean_out,
                      BLOCK: tl.constexpr):
        row, start = _row_start(logits, stride_b, stride_t, T)
        cols = tl.arange(0, BLOCK)
        # per-lane running max, sum of exp(x - max) and sum of exp(x - max) x; lanes merged after the last tile
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        run_dot = tl.zeros([BLOCK], tl.float32)
        for offset in range(0, V, BLOCK):
            inside = offset + cols < V
            x = tl.load(start + offset + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
            new_max = tl.maximum(run_max, x)
            seen = new_max > float("-inf")
            scale = tl.where(seen, tl.exp(run_max - new_max), 1.0)
            e = tl.where(inside & seen, tl.exp(x - new_max), 0.0)
            run_sum = run_sum * scale + e
            run_dot = run_dot * scale + tl.where(e > 0, e * x, 0.0)  # a -inf logit weighs 0, not NaN
            run_max = new_max
        top = tl.max(run_max, axis=0)
        weight = tl.where(run_max > float("-inf"), tl.exp(run_max - top), 0.0)
        total = tl.sum(run_sum * weight, axis=0)
        lse = top + tl.log(total)
        mean = tl.sum(run_dot * weight, axis=0) / total
        label = tl.load(labels + row)
        valid = (label >= 0) & (label < V)
        x_label = tl.load(start + label, mask=valid, other=float("nan")).to(tl.float32) * inv_temp
        tl.store(logp_out + row, x_label - lse)
        tl.store(entropy_out + row, lse - mean)
        tl.store(lse_out + row, lse)
        tl.store(mean_out + row, mean)

    @triton.jit
    def _backward_rows(logits, stride_b, stride_t, T, V, labels, inv_temp, lse_in, mean_in, grad_logp, grad_entropy,
                       grad, HAS_LOGP: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row, start = _row_start(logits, stride_b, stride_t, T)
        cols = tl.arange(0, BLOCK)
        lse = tl.load(lse_in + row)
        mean = tl.load(mean_in + row)
        g_logp = tl.load(grad_logp + row) if HAS_LOGP else 0.0
        g_ent = tl.load(grad_entropy + row) if HAS_ENTROPY else 0.0
        label = tl.load(labels + row)
        out = grad + row.to(tl.int64) * V
        for offset in range(0, V, BLOCK):
            inside = offset + cols < V
            x = tl.load(start + offset + cols, mask=inside, other=0.0).to(tl.float32) * inv_temp
            p = tl.exp(x - lse)
            # d logp / dx = onehot - p;  d H / dx = -p (x - E_p[x]);  then d x / d logits = 1 / temperature
            g = tl.where(p > 0, -(g_logp + g_ent * (x - mean)) * p, 0.0)  # a -inf logit: 0, not 0 x inf
            g = tl.where(offset + cols == label, g + g_logp, g) * inv_temp
            tl.store(out + offset + cols, g.to(grad.dtype.element_ty), mask=inside)


def forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, T, V] (usable), labels [B, T] -> (logp, entropy, lse, mean_x), each [B, T] float32, of
    x = logits / temperature: logp = x[label] - lse, entropy = lse - mean_x, lse = logsumexp(x), mean_x = E_p[x].
    A label outside [0, V) gives a NaN log-prob."""
    b, t, v = logits.shape
    labels = labels.contiguous()
    logp, entropy, lse, mean = (torch.empty((b, t), dtype=torch.float32, device=logits.device) for _ in range(4))
    if b * t:
        _forward_rows[(b * t,)](logits, logits.stride(0), logits.stride(1), t, v, labels, 1.0 / temperature,
                                logp, entropy, lse, mean, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)))
    return logp, entropy, lse, mean


def backward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor, mean: torch.Tensor,
             grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """The gradient [B, T, V] (contiguous, the logits' dtype) of sum(grad_logp * logp + grad_entropy * entropy)
    w.r.t. the logits, from forward's lse and mean_x; a None gradient counts as zero."""
    b, t, v = logits.shape
    grad = torch.empty((b, t, v), dtype=logits.dtype, device=logits.device)
    if b * t:
        g_logp = grad_logp.float().contiguous() if grad_logp is not None else lse
        g_ent = grad_entropy.float().contiguous() if grad_entropy is not None else lse
        _backward_rows[(b * t,)](logits, logits.stride(0), logits.stride(1), t, v, labels.contiguous(),
                                 1.0 / temperature, lse, mean, g_logp, g_ent, grad, HAS_LOGP=grad_logp is not None,
                                 HAS_ENTROPY=grad_entropy is not None, BLOCK=min(BLOCK_V, triton.next_power_of_2(v)))
    return grad
