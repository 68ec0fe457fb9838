"""Next-token sampling on device: temperature, top-k, top-p, greedy; logprobs of the picked tokens."""

import torch
import torch.distributed as dist


def truncate_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set every token outside the top-k and then outside the nucleus to -inf.

    logits: [N, V] float. top_k: 0 (or >= V) keeps all; else the tokens at least as large as the k-th largest (ties
    with it included). top_p: keep the tokens whose mass above them (the probability, after the top-k cut and
    renormalised, of the tokens strictly larger) is below top_p: the smallest set of most likely tokens whose
    probability reaches top_p, with every token tied with its last one (so the set does not depend on how a sort
    orders ties); the most likely token is always kept. rollout/sample_kernels.sample_tokens_impl keeps the same sets.
    Returns [N, V], a new tensor.
    """
    vocab = logits.size(-1)
    if 0 < top_k < vocab:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(logits < nucleus_floor(logits, top_p), float("-inf"))
    return logits


@torch.library.custom_op("meshrl::nucleus_floor", mutates_args=())
def nucleus_floor(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] float -> [N, 1]: the smallest logit of each row's nucleus (truncate_top_k_top_p's rule). An operator of
    its own, so that torch.compile runs its sort and cumulative sum as PyTorch's kernels: Inductor's code for a
    cumulative sum over a 151936-token row split in parts failed to build (torch 2.11, an H100)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    sorted_probs = sorted_logits.softmax(dim=-1)
    # the mass ranked above each sorted token: the nucleus is every token up to the last one whose mass above is
    # below top_p (the best has 0 above), and all tokens tied with that one
    above = sorted_probs.cumsum(dim=-1) - sorted_probs
    last = ((above < top_p).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # 0: a row of -inf (NaN mass)
    return sorted_logits.gather(-1, last)


@nucleus_floor.register_fake
def _(logits, top_p):
    return logits.new_empty(logits.shape[0], 1)


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    banned_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits: [N, V] float32, the last position's logits. temperature 0 means greedy (argmax; top_k/top_p unused).
    banned_ids: [S] long or None, tokens that may not be picked (the stop tokens before min_new_tokens).
    generator: drives the sampling; it must live on logits' device.

    Returns (tokens [N] long, logprobs [N] float32). The logprob is log_softmax(logits / temperature) at the token
    (temperature 1 for greedy): the temperature-scaled distribution BEFORE top-k/top-p truncation and before banning,
    which is what a teacher-forced forward at the same temperature computes, so the two can be compared.
    """
    scaled = logits / temperature if temperature > 0 else logits
    logprobs = scaled.log_softmax(dim=-1)
    candidates = scaled if banned_ids is None else scaled.index_fill(-1, banned_ids, float("-inf"))
    if temperature == 0:
        tokens = candidates.argmax(dim=-1)
    else:
        probs = truncate_top_k_top_p(candidates, top_k, top_p).softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) is an exact draw from p (exponential race); unlike torch.multinomial it needs
        # no host sync. The clamp keeps a zero draw from turning a truncated token's 0/0 into a NaN that argmax picks.
        noise = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
        tokens = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed int32 constant torch accepts for int32 tensors."""
    return value - (1 << 32) if value >= 1 << 31 else value


_FMIX_1, _FMIX_2 = _int32(0x85EBCA6B), _int32(0xC2B2AE35)
_STEP_MUL, _COLUMN_MUL = _int32(0x9E3779B9), _int32(0x27D4EB2F)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int32 tensors: products wrap modulo 2^32 (as on CPU and CUDA), and the masks
    turn the arithmetic right shifts of signed ints into the logical shifts the finaliser is defined with."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _FMIX_1
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _FMIX_2
    return x ^ ((x >> 16) & 0xFFFF)


def gumbel_noise(seed: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 standard Gumbel noise, a pure function of (seed, key, step, token id).

    seed: [1] int32; keys, steps: [R] (any integer dtype), e.g. the sample index and the token index in its response.
    Counter-based rather than drawn from a torch.Generator: a captured CUDA graph replays it with no generator state,
    and a sample's noise depends on neither its slot nor the batch it is decoded in.
    """
    row = _fmix32(_fmix32(seed ^ keys.int()) + steps.int() * _STEP_MUL)
    columns = torch.arange(vocab, device=keys.device, dtype=torch.int32) * _COLUMN_MUL
    bits = _fmix32(row[:, None] ^ columns[None, :])
    # 23 bits at the centres of 2^23 equal bins: uniform in (0, 1) and, unlike 24 bits, never rounded to 1 in float32.
    uniform = (((bits >> 9) & 0x7FFFFF).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(uniform))


def sample_with_noise(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    banned: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row by Gumbel-max: argmax(logits / temperature + noise) over the untruncated tokens.

    logits: [R, V] (any float dtype; computed in float32). banned: [R, V] bool or None, tokens that may not be picked.
    noise: [R, V] Gumbel noise (gumbel_noise), unused and may be None when temperature is 0 (greedy: argmax).
    Returns (tokens [R] long, logprobs [R] float32) with the logprobs of sample_next_tokens: log_softmax(logits /
    temperature) at the token (temperature 1 for greedy), before truncation and banning.
    """
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature
    candidates = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    if temperature == 0:
        tokens = candidates.argmax(dim=-1)
    else:
        tokens = (truncate_top_k_top_p(candidates, top_k, top_p) + noise).argmax(dim=-1)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(dim=-1)
    return tokens, logprobs


def take_first_tp_rank(
    tokens: torch.Tensor, logprobs: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens: [N] long, logprobs: [N] float32 -> the same, as sampled on the group's first rank, so that
    floating-point differences between tensor-parallel ranks can never make their samples diverge."""
    # One collective per step: float64 holds every token id and every float32 logprob exactly.
    packed = torch.stack([tokens.double(), logprobs.double()])
    dist.broadcast(packed, group=group, group_src=0)
    return packed[0].long(), packed[1].float()
