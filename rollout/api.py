"""What a rollout engine takes and returns: SamplingParams in, RolloutOutput out; the attention kernels meshrl's own
forwards (native engine, trainers) may use."""

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

# SDPA without cuDNN's backend, for the native engine and the trainers' forwards: cuDNN builds an execution plan for
# every new attention shape, and rollout shapes (prompt widths, batch and context buckets, slot lengths) and
# micro-batch widths change from call to call. Seen on an H200: training steps whose micro-batches met new widths took
# 2-3 s more with cuDNN; a second rollout meeting new decode shapes 0.68 s with cuDNN, 0.53 s without (bench/warmup.py,
# varying lengths; the first, cold-cache call is ~32 s either way, compile-bound). Flash and memory-efficient
# attention have no per-shape set-up.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy (argmax); top_k 0 means off.

    n samples are drawn per prompt and are consecutive in the output. A row ends after it emits one of
    stop_token_ids (the stop token is part of the response and its mask) or after max_new_tokens tokens.
    Stop tokens cannot be sampled before min_new_tokens tokens (benchmarks set min_new_tokens = max_new_tokens).

    Multi-turn (rollout/episodes.py): context_tokens asks for room for sequences of this many tokens in all (an
    episode's prompt and whole budget), so that later calls can continue them; continues says that this call's
    prompts may start with sequences the engine's previous call left (its prompts and responses), under the same
    weights: the native slot engine then prefills only what a prompt adds, into the slot that holds the rest.
    Engines without such a cache ignore both.

    Partial rollouts (rollout/partial.py): tail_share > 0 lets the native slot engine return once no sequence waits
    and fewer than this share of the slots the call can fill (its slots, or its sequences if fewer) still decode, none
    of them among the call's first finish_first sequences (those always end in the call); RolloutOutput.unfinished
    marks the sequences cut short. Other engines (and the HF-forward path) finish every sequence.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    context_tokens: int = 0
    continues: bool = False
    tail_share: float = 0.0
    finish_first: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}")
        if not 0 <= self.tail_share < 1:
            raise ValueError(f"tail_share must be in [0, 1), got {self.tail_share}")
        if self.finish_first < 0:
            raise ValueError(f"finish_first must be >= 0, got {self.finish_first}")


@dataclass
class RolloutOutput:
    """Samples of one generate call; N = len(prompts) * n, R = the longest response of the call.

    prompt_ids: per sample, the prompt (unpadded; repeated for the n samples of a prompt).
    response_ids: [N, R] long, right-padded with pad_token_id.
    response_mask: [N, R] long, 1 on response tokens (the stop token included), 0 on padding.
    logprobs: [N, R] float32, log_softmax(logits / temperature) at each sampled token (temperature 1 when greedy),
        before top-k/top-p truncation; 0 on padding.
    unfinished: [N] bool, True where the call stopped a sequence before its end (SamplingParams.tail_share), its
        tokens so far in the rows above; None when every sequence ended.
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    unfinished: torch.Tensor | None = None



def stop_token_ids(model_path: str, tokenizer, extra=(), trust_remote_code: bool = False) -> tuple[int, ...]:
    """Every token that ends a response: rollout.stop_token_ids, the tokenizer's eos, and each id of the model's
    generation_config.eos_token_id (an int or a list: Llama-3 style models end turns with several)."""
    from transformers import GenerationConfig

    ids = {*extra, tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is all there is
        eos = None
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return tuple(sorted(ids - {None}))
