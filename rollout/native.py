"""Native rollout engine: batched generation with a KV cache on the actor's own parameters, no second copy.

v1 algorithm: left-pad the prompts, prefill them once, repeat the cache for the n samples of each prompt, then
decode one token per forward for all rows with transformers' DynamicCache. Finished rows keep being fed pad tokens
until every row (of every rank in the lockstep group) is done. Works on FSDP2-sharded, tensor-parallel and plain
models, on CPU and GPU.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache

from rollout.sampling import sample_next_tokens


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy (argmax); top_k 0 means off.

    n samples are drawn per prompt and are consecutive in the output. A row ends after it emits one of
    stop_token_ids (the stop token is part of the response and its mask) or after max_new_tokens tokens.
    Stop tokens cannot be sampled before min_new_tokens tokens (benchmarks set min_new_tokens = max_new_tokens).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0

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


@dataclass
class RolloutOutput:
    """Samples of one generate call; N = len(prompts) * n, R = the longest response of the call.

    prompt_ids: per sample, the prompt (unpadded; repeated for the n samples of a prompt).
    response_ids: [N, R] long, right-padded with pad_token_id.
    response_mask: [N, R] long, 1 on response tokens (the stop token included), 0 on padding.
    logprobs: [N, R] float32, log_softmax(logits / temperature) at each sampled token (temperature 1 when greedy),
        before top-k/top-p truncation; 0 on padding.
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor


class NativeEngine:
    """Generates with the given Hugging Face causal LM in place: plain, FSDP2-sharded or tensor-parallel.

    lockstep_group: the ranks whose forwards must stay in step because FSDP2 all-gathers inside forward (the
        dp_shard group). They agree every step on whether any of them still decodes, so all make the same number of
        forwards. Each rank of the group must call generate the same number of times, also with no prompts.
    tp_group: the tensor-parallel group. Its ranks must pass the same prompts and params; every step they take the
        tokens sampled on the group's first rank, so floating-point differences can never make them diverge.
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        lockstep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ):
        self.vocab_size = model.config.vocab_size
        if not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be in [0, vocab_size={self.vocab_size}), got {pad_token_id}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.lockstep_group = lockstep_group
        self.tp_group = tp_group

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> RolloutOutput:
        """Sample len(prompts) * params.n responses; see RolloutOutput for the shapes.

        generator, if given, must live on the model's device; the same seed gives the same output.
        """
        self._validate(prompts, params)
        model = self.model
        was_training = model.training
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.eval()
        try:
            # All-gather the parameters once per rollout rather than once per layer per token.
            for module in fsdp_modules:
                module.set_reshard_after_forward(False, recurse=False)
            handles = [module.unshard(async_op=True) for module in fsdp_modules]
            for handle in handles:
                handle.wait()
            # no_grad, not inference_mode: FSDP2 unsharding under inference_mode raised "Inference tensors do not
            # track version counter" until pytorch#197327, newer than the torch 2.11 we run on GPUs.
            with torch.no_grad():
                return self._generate(prompts, params, generator)
        finally:
            # FSDP2 has no public getter for reshard_after_forward, so this restores True, the value
            # parallel/fsdp.py sets by default.
            for module in fsdp_modules:
                module.reshard()
                module.set_reshard_after_forward(True, recurse=False)
            model.train(was_training)

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {self.vocab_size})")
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if max_positions is not None and len(prompt) + params.max_new_tokens > max_positions:
                raise ValueError(
                    f"prompts[{i}] has {len(prompt)} tokens and max_new_tokens is {params.max_new_tokens}: "
                    f"{len(prompt) + params.max_new_tokens} positions exceed max_position_embeddings {max_positions}"
                )

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> RolloutOutput:
        # Read after unshard: with FSDP2 CPU offload the sharded parameters live on the CPU, the unsharded on the GPU.
        device = next(self.model.parameters()).device
        if generator is not None and generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device} but the model runs on {device}; create it there")
        pad = self.pad_token_id
        rows, n = prompts, params.n
        if not prompts:
            empty = torch.empty((0, 0), dtype=torch.long, device=device)
            if self.lockstep_group is None:
                return RolloutOutput([], empty, empty.clone(), empty.float())
            # The other ranks of the group forward in step with this one: take part with a row that is done at once.
            rows, n = [[pad]], 1

        width = max(len(p) for p in rows)
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in rows], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        # Left padding must not shift positions: each row counts from its first real token.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attention_mask = attention_mask.repeat_interleave(n, dim=0)
        num_rows = logits.size(0)
        positions = attention_mask.sum(-1)
        running = torch.full((num_rows,), bool(prompts), device=device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)

        token_steps, logprob_steps, mask_steps = [], [], []
        while True:
            banned = stop_ids if len(token_steps) < params.min_new_tokens and len(stop_ids) else None
            tokens, logprobs = sample_next_tokens(
                logits, params.temperature, params.top_k, params.top_p, generator, banned
            )
            if self.tp_group is not None:
                tokens, logprobs = self._take_first_tp_rank(tokens, logprobs)
            tokens = tokens.masked_fill(~running, pad)
            token_steps.append(tokens)
            logprob_steps.append(logprobs.masked_fill(~running, 0.0))
            mask_steps.append(running)
            running = running & ~torch.isin(tokens, stop_ids)
            if len(token_steps) >= params.max_new_tokens:
                running = torch.zeros_like(running)
            if not self._any_running(running):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(num_rows, 1)], dim=1)
            logits = self._forward(tokens[:, None], attention_mask, positions[:, None], cache)
            # Finished rows hold their position so that, while other ranks still decode, they never walk past
            # max_position_embeddings.
            positions = positions + running

        if not prompts:
            return RolloutOutput([], empty, empty.clone(), empty.float())
        response_mask = torch.stack(mask_steps, dim=1).long()
        # Steps this rank ran only to keep in step with its group are padding in every row: cut them.
        length = int(response_mask.sum(-1).max())
        return RolloutOutput(
            prompt_ids=[list(p) for p in prompts for _ in range(n)],
            response_ids=torch.stack(token_steps, dim=1)[:, :length],
            response_mask=response_mask[:, :length],
            logprobs=torch.stack(logprob_steps, dim=1)[:, :length].float(),
        )

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """input_ids, position_ids: [N, T]; attention_mask: [N, cached + T]. Returns [N, V] float32 last-position
        logits; the cache grows by T positions."""
        # The cache is passed by position: transformers renamed the keyword past_key_values -> cache after 5.17 (the
        # old name warns, then goes), and the fourth parameter of forward is the cache under either name.
        out = self.model(input_ids, attention_mask, position_ids, cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _any_running(self, running: torch.Tensor) -> bool:
        """running: [N] bool. True if a row here, or on any rank of the lockstep group, still decodes."""
        flag = running.any().to(torch.int32).reshape(1)
        if self.lockstep_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return bool(flag.item())

    def _take_first_tp_rank(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [N] long, logprobs: [N] float32 -> the same, as sampled on the tp group's first rank."""
        # One collective per step: float64 holds every token id and every float32 logprob exactly.
        packed = torch.stack([tokens.double(), logprobs.double()])
        dist.broadcast(packed, group=self.tp_group, group_src=0)
        return packed[0].long(), packed[1].float()
