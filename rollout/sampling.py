"""Next-token sampling on device: temperature, top-k, top-p, greedy; logprobs of the picked tokens."""

import torch


def truncate_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set every token outside the top-k and then outside the nucleus to -inf.

    logits: [N, V] float. top_k: 0 (or >= V) keeps all. top_p: keep the smallest set of most likely tokens whose
    probability (after the top-k cut, renormalised) sums to >= top_p; the most likely token is always kept.
    Returns [N, V], a new tensor.
    """
    vocab = logits.size(-1)
    if 0 < top_k < vocab:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # A token is dropped once the tokens ranked above it already reach top_p; the best token has 0 mass above it.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
