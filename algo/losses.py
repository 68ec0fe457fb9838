"""KL estimators, loss aggregation, PPO policy and value losses, and chunked log-prob / entropy from logits.

Per-token tensors are [B, T] with a response `mask` (bool or float, nonzero on response tokens). A loss is
built as a [B, T] matrix and reduced by `aggregate`, whose normalisers can be global counts so that the losses
of micro-batches add up to the loss of the whole batch (gradient accumulation without rescaling).
"""

import torch
from torch.autograd.function import once_differentiable

from algo import kernels
from algo.advantages import as_bool_mask, masked_mean
from algo.objectives import LOG_RATIO_CLAMP, OBJECTIVES
from algo.rollout_correction import correction_weights

# k3 per token is clamped to this (as verl's low_var_kl): one token far off the reference must not dominate the batch.
K3_VALUE_CLAMP = 10.0

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
# As a loss term the samples are fixed and the gradient flows through logp only. With y ~ pi:
#   E[grad k1] = E[grad log pi] = 0                           (k1 / abs: no useful gradient: refused as a loss)
#   E[grad k2] = sum_y pi (log pi - log ref) grad log pi = grad KL(pi || ref)
#   E[grad k3] = sum_y (pi - ref) grad log pi = grad KL(ref || pi)   (the reverse KL; same minimum, pi = ref)
# tests/test_algo_losses.py checks these on a small softmax.
LOSS_KL_KINDS = ("k2", "k3", "low_var_kl")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_same_shape(**tensors: torch.Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"these tensors must all have the same [B, T] shape: {shapes}")


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman, "Approximating KL", 2020).

    With d = logp - ref:
      k1:  d
      k2:  0.5 * d^2
      k3 (alias low_var_kl):  min(exp(-d) - (-d) - 1, 10), computed as expm1(x) - x with
           x = clamp(ref - logp, -20, 20); expm1 keeps the result >= 0 near d = 0 where exp(x) - x - 1 cancels
           catastrophically, the inner clamp keeps exp finite and the outer one (verl's) bounds one token's weight
           (the gradient is 0 outside either clamp).
      abs: |d|
    logprobs, ref_logprobs: same shape (any). Returns that shape. Unmasked: callers mask or aggregate.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        x = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.expm1(x) - x).clamp(max=K3_VALUE_CLAMP)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def _normaliser(name: str, given: int | float | torch.Tensor | None, local: torch.Tensor) -> torch.Tensor | float:
    if given is None:
        # An all-padding batch then gives a loss of 0 instead of 0 / 0.
        return local.clamp(min=1)
    # A tensor (typically all-reduced) is used as is: checking it would force a device sync per micro-batch.
    if not isinstance(given, torch.Tensor) and not given > 0:
        raise ValueError(f"{name} must be > 0, got {given}")
    return given


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar. loss_mat, mask: [B, T]; returns a 0-dim tensor.

    With l = loss_mat, m = mask, L_b = sum_t m_bt * l_bt, n_b = sum_t m_bt:
      token-mean:               sum_b L_b / global_tokens
      seq-mean-token-sum:       sum_b L_b / global_seqs
      seq-mean-token-mean:      sum_b (L_b / n_b) / global_seqs      (rows with n_b = 0 add 0)
      seq-mean-token-sum-norm:  sum_b (L_b / max_response_len) / global_seqs   (Dr. GRPO; max_response_len required)
    Every mode is a sum over rows divided by a constant, so splitting a batch into micro-batches and calling this
    on each with the global counts of the whole batch (tokens: sum of the mask; seqs: rows with at least one
    valid token) gives losses that add up to the whole batch's loss. When a count is None it defaults to this
    batch's own count, which makes a single call on the whole batch the ordinary mean.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid modes: {', '.join(AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    m = as_bool_mask(mask, loss_mat.shape)
    row_sums = torch.where(m, loss_mat, 0).sum(dim=-1)
    if agg == "token-mean":
        return row_sums.sum() / _normaliser("global_tokens", global_tokens, m.sum())
    if agg == "seq-mean-token-mean":
        row_sums = row_sums / m.sum(dim=-1).clamp(min=1)
    elif agg == "seq-mean-token-sum-norm":
        if max_response_len is None or max_response_len <= 0:
            raise ValueError(f"loss aggregation {agg!r} needs max_response_len > 0, got {max_response_len}")
        row_sums = row_sums / max_response_len
    return row_sums.sum() / _normaliser("global_seqs", global_seqs, m.any(dim=-1).sum())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    max_response_len: int | None = None,
    objective: str = "ppo",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A policy-gradient loss: the per-token loss of `objective` (algo/objectives.py: ppo, gspo, gspo_token, cispo),
    with an optional dual clip, importance weights, and aggregation.

    ppo: l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)), ratio = exp(clamp(logp - old, -20, 20))
        (clip_high > clip_low: DAPO's clip-higher); the other objectives' formulas are in algo/objectives.py
    dual clip (Ye et al. 2020; ppo only), where A < 0:  l = min(l, -A * dual_clip)
    TIS, when tis_cap is given:  l = l * w with w = min(exp(old - rollout), tis_cap), detached; it corrects for the
        rollout engine's sampling distribution differing from the trainer's (rollout_logprobs ignored without tis_cap)
    weights [B, T], detached (algo/rollout_correction.correction_weights):  l = l * weights
    loss = aggregate(l, mask, agg, global_tokens, global_seqs, max_response_len)

    logprobs, old_logprobs, advantages, mask, rollout_logprobs: [B, T]. Returns (loss 0-dim, metrics) with detached
    0-dim metrics, means over this call's valid tokens: pg_clipfrac (the clipped branch was taken), pg_clipfrac_lower
    (dual clip active), ppo_kl (mean of old - logp), tis_weight_mean (only with TIS).
    """
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, rollout_logprobs=rollout_logprobs,
        weights=weights,
    )
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown policy objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    # CISPO clips an importance weight, not a trust region: clip_low = 1 there means no lower bound
    if not 0.0 <= clip_low < 1.0 and not (objective == "cispo" and clip_low == 1.0):
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if dual_clip is not None and objective != "ppo":
        raise ValueError(f"dual_clip bounds the ppo objective's loss; objective {objective!r} has none")
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError("tis_cap is set but rollout_logprobs is None; truncated IS needs the rollout log-probs")
    if tis_cap is not None and not tis_cap > 0.0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    m = as_bool_mask(mask, logprobs.shape)

    token_loss, metrics = OBJECTIVES[objective](logprobs, old_logprobs, advantages, m, clip_low, clip_high)

    if dual_clip is not None:
        bound = -advantages * dual_clip
        lower = (advantages < 0) & (token_loss > bound)
        token_loss = torch.where(lower, bound, token_loss)
        metrics["pg_clipfrac_lower"] = masked_mean(lower.float(), m).detach()
    else:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=logprobs.device)

    if tis_cap is not None:
        weight, _ = correction_weights(old_logprobs, rollout_logprobs, m, "token", tis_cap)
        token_loss = token_loss * weight
        metrics["tis_weight_mean"] = masked_mean(weight, m)
    if weights is not None:
        token_loss = token_loss * weights.detach()

    metrics["ppo_kl"] = masked_mean(old_logprobs - logprobs, m).detach()
    loss = aggregate(token_loss, m, agg, global_tokens, global_seqs, max_response_len)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    agg: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 baselines style).

    v_clip = old + clip(v - old, -clip, clip)
    l = 0.5 * max((v - R)^2, (v_clip - R)^2)
    loss = aggregate(l, mask, agg, global_tokens, global_seqs, max_response_len)

    values, old_values, returns, mask: [B, T]. Returns (loss 0-dim, metrics) with vf_clipfrac: the detached mean,
    over this call's valid tokens, of where the clipped term was the larger.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns)
    if not clip > 0.0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    m = as_bool_mask(mask, values.shape)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped_values - returns).square()
    token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), m).detach()}
    return aggregate(token_loss, m, agg, global_tokens, global_seqs, max_response_len), metrics


def _blocks(batch: int, steps: int, chunk_size: int):
    """Yield (b_slice, t_slice) tiling [batch, steps] with at most chunk_size rows of the flattened view per tile.

    Tiling [B, T] directly (rather than reshaping to [B*T, V]) keeps a strided input such as logits[:, :-1] a
    view: reshaping it would copy the whole tensor.
    """
    if batch == 0 or steps == 0:
        return
    t_step = min(steps, chunk_size)
    b_step = max(1, chunk_size // t_step)
    for b0 in range(0, batch, b_step):
        for t0 in range(0, steps, t_step):
            yield slice(b0, b0 + b_step), slice(t0, t0 + t_step)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """A fresh upcast copy of a logits tile divided by the temperature (in place; skipped at 1)."""
    x = logits.to(dtype, copy=True)
    return x if temperature == 1.0 else x.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature) at labels; forward and backward upcast one tile at a time.

    Autograd on the plain expression would keep the float32 copy of every tile alive until backward; here only
    the logits (already held by the caller) and the [B, T] logsumexp are saved, and backward recomputes softmax
    tile by tile: d logp / d logits = (onehot(label) - softmax(logits / temperature)) / temperature.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        out = logits.new_empty(labels.shape, dtype=dtype)
        lse = logits.new_empty(labels.shape, dtype=dtype)
        for bs, ts in _blocks(labels.shape[0], labels.shape[1], chunk_size):
            x = _tile(logits[bs, ts], dtype, temperature)
            lse[bs, ts] = torch.logsumexp(x, dim=-1)
            out[bs, ts] = x.gather(-1, labels[bs, ts].unsqueeze(-1)).squeeze(-1) - lse[bs, ts]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for bs, ts in _blocks(labels.shape[0], labels.shape[1], ctx.chunk_size):
            g = grad_out[bs, ts].unsqueeze(-1).to(lse.dtype)
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            x = _tile(logits[bs, ts], lse.dtype, ctx.temperature)
            x.sub_(lse[bs, ts].unsqueeze(-1)).exp_().mul_(-g)
            x.scatter_add_(-1, labels[bs, ts].unsqueeze(-1), g)
            grad[bs, ts] = x
        return grad, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) per row; forward and backward upcast one tile at a time.

    Saves only the logits and the [B, T] logsumexp; backward recomputes p tile by tile. With x = logits / temperature:
    d H / d logits_j = -p_j * (x_j - sum_i p_i * x_i) / temperature.
    """

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        out = logits.new_empty(logits.shape[:2], dtype=dtype)
        lse = logits.new_empty(logits.shape[:2], dtype=dtype)
        for bs, ts in _blocks(logits.shape[0], logits.shape[1], chunk_size):
            x = _tile(logits[bs, ts], dtype, temperature)
            tile_lse = torch.logsumexp(x, dim=-1)
            probs = torch.exp(x - tile_lse.unsqueeze(-1))
            lse[bs, ts] = tile_lse
            out[bs, ts] = tile_lse - (probs * x).sum(dim=-1)
        ctx.save_for_backward(logits, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for bs, ts in _blocks(logits.shape[0], logits.shape[1], ctx.chunk_size):
            x = _tile(logits[bs, ts], lse.dtype, ctx.temperature)
            probs = torch.exp(x - lse[bs, ts].unsqueeze(-1))
            expected = (probs * x).sum(dim=-1, keepdim=True)
            scale = -grad_out[bs, ts].unsqueeze(-1).to(lse.dtype) / ctx.temperature
            grad[bs, ts] = x.sub_(expected).mul_(probs).mul_(scale)
        return grad, None, None


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., V] . [..., V] -> [...] as a batched matmul: no [..., V] product is written."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Both _ChunkedLogprobs and _ChunkedEntropy from one upcast tile and one softmax: what the actor's update needs
    (the log-probs for the loss, the entropy for the bonus or the metric). Saves the logits, the [B, T] logsumexp
    and sum_v p_v x_v; backward recomputes p once per tile and skips the entropy term when its gradient is None:
    d/d logits = [g_logp (onehot - p) - g_ent p (x - sum p x)] / temperature."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(logits.dtype)
        logp = logits.new_empty(labels.shape, dtype=dtype)
        entropy = logits.new_empty(labels.shape, dtype=dtype)
        lse = logits.new_empty(labels.shape, dtype=dtype)
        mean_x = logits.new_empty(labels.shape, dtype=dtype)
        for bs, ts in _blocks(labels.shape[0], labels.shape[1], chunk_size):
            x = _tile(logits[bs, ts], dtype, temperature)
            tile_lse = torch.logsumexp(x, dim=-1)
            logp[bs, ts] = x.gather(-1, labels[bs, ts].unsqueeze(-1)).squeeze(-1) - tile_lse
            probs = (x - tile_lse.unsqueeze(-1)).exp_()
            tile_mean = _dot(probs, x)
            lse[bs, ts], mean_x[bs, ts] = tile_lse, tile_mean
            entropy[bs, ts] = tile_lse - tile_mean
        ctx.save_for_backward(logits, labels, lse, mean_x)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, mean_x = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        grad = torch.empty_like(logits)
        t = ctx.temperature
        for bs, ts in _blocks(labels.shape[0], labels.shape[1], ctx.chunk_size):
            x = _tile(logits[bs, ts], lse.dtype, t)
            probs = (x - lse[bs, ts].unsqueeze(-1)).exp()
            if grad_entropy is not None:
                # -g_ent p (x - E[x]) - g_logp p, written into x
                g_ent = grad_entropy[bs, ts].unsqueeze(-1).to(lse.dtype)
                x.sub_(mean_x[bs, ts].unsqueeze(-1)).mul_(-g_ent)
                if grad_logp is not None:
                    x.sub_(grad_logp[bs, ts].unsqueeze(-1).to(lse.dtype))
                x.mul_(probs)
            else:
                x = probs.mul_(-grad_logp[bs, ts].unsqueeze(-1).to(lse.dtype))
            if grad_logp is not None:
                x.scatter_add_(-1, labels[bs, ts].unsqueeze(-1), grad_logp[bs, ts].unsqueeze(-1).to(lse.dtype))
            grad[bs, ts] = x if t == 1.0 else x.div_(t)
        return grad, None, None, None


class _FusedLogprobsEntropy(torch.autograd.Function):
    """What _ChunkedLogprobsEntropy computes, by algo/kernels.py's Triton kernels: one read of each logits row
    forward, one read and one write backward, no float32 tile. Saves the logits, the [B, T] logsumexp and E_p[x]."""

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        ctx.set_materialize_grads(False)
        logp, entropy, lse, mean_x = kernels.forward(logits, labels, temperature)
        ctx.save_for_backward(logits, labels, lse, mean_x)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return None, None, None
        logits, labels, lse, mean_x = ctx.saved_tensors
        return kernels.backward(logits, labels, ctx.temperature, lse, mean_x, grad_logp, grad_entropy), None, None


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of the same logits in one pass over them, each [B, T] float32,
    both differentiable (an unused one costs nothing in backward). On a GPU (algo/kernels.usable) the Triton
    kernels compute them (chunk_size unused); else tiles of chunk_size positions in PyTorch."""
    _check_logits(logits, labels, temperature, chunk_size)
    if kernels.usable(logits):
        return _FusedLogprobsEntropy.apply(logits, labels, float(temperature))
    return _ChunkedLogprobsEntropy.apply(logits, labels, float(temperature), chunk_size)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _check_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int) -> None:
    """The arguments of logprobs_from_logits and logprobs_and_entropy."""
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"need logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_chunk_size(chunk_size)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(l) with l = logits / temperature:
    H = logsumexp(l) - sum_v softmax(l)_v * l_v.

    logits: [B, T, V], any float dtype (bf16 is upcast). Returns [B, T] in float32 (float64 for float64 input).
    The temperature is applied tile by tile: no scaled copy of the logits is made, and at most chunk_size positions
    are upcast at a time, in forward and in backward, so no float32 copy of the whole [B, T, V] exists;
    differentiable (entropy bonus).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_chunk_size(chunk_size)
    return _ChunkedEntropy.apply(logits, float(temperature), chunk_size)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """Log-probability of each label: log_softmax(logits / temperature)[..., label].

    logits: [B, T, V], any float dtype (bf16 is upcast); labels: [B, T] integer token ids in [0, V).
    Returns [B, T] in float32 (float64 for float64 input). At most chunk_size positions are upcast at a time, in
    forward and in backward, so no float32 copy of the whole [B, T, V] exists; differentiable w.r.t. logits. On a
    GPU (algo/kernels.usable) the Triton kernels of logprobs_and_entropy compute it.
    """
    _check_logits(logits, labels, temperature, chunk_size)
    if kernels.usable(logits):
        return _FusedLogprobsEntropy.apply(logits, labels, float(temperature))[0]
    return _ChunkedLogprobs.apply(logits, labels, float(temperature), chunk_size)
