"""Native rollout engine: generation on the actor's own parameters, gathered once per rollout (no second engine).

Two paths behind one interface, picked per model:
- the slot engine (rollout/slots.py) for the families rollout/families.py describes (Llama, Qwen2/3, Mistral, OLMo 2,
  SmolLM3, Gemma 3), through rollout/decoder.py's compact forward: a preallocated KV cache of slots, batched prefill
  shared by a prompt's n samples, continuous batching, sampling and stop checks on the device, decode steps captured
  in CUDA graphs on GPU (eager on CPU); by default (resident) the cache, the graphs and the engine's weight buffers
  stay from one rollout to the next;
- the HF-forward loop (v1) for any other causal LM (a one-line warning at start-up names it): left-pad the prompts,
  prefill them once, repeat the cache for the n samples of each prompt, then decode one token per forward for all rows
  with transformers' DynamicCache. Finished rows keep being fed pad tokens until every row (of every rank in the
  lockstep group) is done.
Both run on FSDP2-sharded (unsharded once per rollout), tensor-parallel and plain models, on CPU and GPU.
"""

import dataclasses
import inspect
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from rollout.api import ATTENTION_BACKENDS, RolloutOutput, SamplingParams
from rollout.families import unsupported_reason
from rollout.sampling import sample_next_tokens, take_first_tp_rank
from rollout.slots import KERNEL_OPS, SlotEngine

__all__ = ["NativeEngine", "RolloutOutput", "SamplingParams"]

log = logging.getLogger(__name__)


def fallback_reason(model: nn.Module, compact_forward: bool = True) -> str | None:
    """Why NativeEngine would decode `model` through the HF forward (with a KV cache) instead of its slot engine, or
    None when the slot engine runs it."""
    return unsupported_reason(model) if compact_forward else "compact_forward=False"


class NativeEngine:
    """Generates with the given Hugging Face causal LM in place: plain, FSDP2-sharded or tensor-parallel.

    lockstep_group: the ranks whose forwards must stay in step because FSDP2 all-gathers inside forward (the
        dp_shard group). On the HF-forward path they agree every step on whether any of them still decodes, so all
        make the same number of forwards; the slot path never calls the modules' forward and needs no lockstep. Each
        rank of the group must call generate the same number of times, also with no prompts (unshard is collective).
    tp_group: the tensor-parallel group. Its ranks must pass the same prompts and params; every step they take the
        tokens sampled on the group's first rank, so floating-point differences can never make them diverge.

    Slot path only (see rollout/slots.py): max_num_seqs bounds the sequences decoded at once; kv_cache_tokens sizes
    the KV cache in tokens, or else gpu_memory_utilization (the share of the GPU's memory this process may hold in
    all) does on CUDA; max_prefill_tokens bounds the padded prompt tokens of one prefill forward; cuda_graphs and
    compile turn on CUDA-graph capture of the decode step (and of small prefills) and torch.compile of its pieces
    (CUDA only).
    fused_projections: decode with q/k/v and gate/up stacked into one weight each, refilled once per rollout (one
    GEMM where there were three and two; the copies hold about two thirds of the decoder blocks' weights).
    decode_kernels: "auto", "triton" or "torch", the decode step's attention and sampling kernels, kernel_ops which
    of them (rollout/slots.SlotEngine).
    compact_forward=False forces the HF-forward path; models the compact forward cannot run use it anyway, and
    fallback_reason says why. resident: the slot engine keeps its decode weights, KV cache and CUDA graphs between
    calls (rollout/slots.SlotEngine), and an FSDP2 model is resharded as soon as its parameters are copied, before
    the decoding. reshard_after_forward: the FSDP2 setting the model was sharded with, put back after
    every rollout (which keeps the parameters unsharded while it runs, or until the resident engine copied them).
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        lockstep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        *,
        max_num_seqs: int = 256,
        kv_cache_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_prefill_tokens: int = 16384,
        cuda_graphs: bool = True,
        compile: bool = True,
        compact_forward: bool = True,
        fused_projections: bool = True,
        decode_kernels: str = "auto",
        kernel_ops: frozenset[str] = KERNEL_OPS,
        resident: bool = True,
        reshard_after_forward: bool = True,
    ):
        self.vocab_size = model.config.vocab_size
        if not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be in [0, vocab_size={self.vocab_size}), got {pad_token_id}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if kv_cache_tokens is not None and kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1 or None (size from gpu_memory_utilization), got "
                             f"{kv_cache_tokens}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.reshard_after_forward = reshard_after_forward
        self.lockstep_group = lockstep_group
        self.tp_group = tp_group
        self.fallback_reason = fallback_reason(model, compact_forward)
        if compact_forward and self.fallback_reason is not None:
            log.warning("native rollout engine: %s decodes on the HF-forward path (one forward per token, tens of "
                        "times slower than the slot engine): %s", model.config.model_type, self.fallback_reason)
        self.slots = None
        if self.fallback_reason is None:
            self.slots = SlotEngine(model, pad_token_id, tp_group, max_num_seqs, kv_cache_tokens,
                                    gpu_memory_utilization, max_prefill_tokens, cuda_graphs, compile,
                                    fused_projections, decode_kernels, kernel_ops, resident)
        self.stats: dict[str, float] = {}  # of the last generate call: reshard_s, and the slot engine's counters

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        max_new_tokens: list[int] | None = None,
        samples: list[int] | None = None,
    ) -> RolloutOutput:
        """Sample len(prompts) * params.n responses; see RolloutOutput for the shapes.

        generator, if given, must live on the model's device; the same seed gives the same output.
        max_new_tokens: optional per-prompt response limits, each in [1, params.max_new_tokens] (benchmarks use it to
        force a spread of lengths; partial rollouts to continue a response); params.max_new_tokens for every prompt
        when None. samples: optional per-prompt sample counts (>= 1) instead of params.n each, a prompt's samples
        consecutive in the output (partial rollouts: a continued response is a prompt of its own, one sample).
        """
        limits = self._validate(prompts, params, max_new_tokens)
        if samples is not None and (len(samples) != len(prompts) or min(samples, default=1) < 1):
            raise ValueError(f"samples must give a count >= 1 for each of the {len(prompts)} prompts, got "
                             f"{samples[:8]}{'...' if len(samples) > 8 else ''} ({len(samples)} entries)")
        if samples is not None and self.slots is None:  # the HF-forward loop takes one count: a row per sample
            prompts = [p for p, count in zip(prompts, samples) for _ in range(count)]
            limits = [limit for limit, count in zip(limits, samples) for _ in range(count)]
            params, samples = dataclasses.replace(params, n=1), None
        # this call's alone (a call without prompts has no engine counters); cleared in place: a replica shares it
        self.stats.clear()
        model = self.model
        was_training = model.training
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.eval()
        start, switch_s = time.perf_counter(), 0.0
        try:
            # All-gather the parameters once per rollout rather than once per layer per token.
            for module in fsdp_modules:
                module.set_reshard_after_forward(False, recurse=False)
            handles = [module.unshard(async_op=True) for module in fsdp_modules]
            for handle in handles:
                handle.wait()
            switch_s = time.perf_counter() - start
            # no_grad, not inference_mode: FSDP2 unsharding under inference_mode raised "Inference tensors do not
            # track version counter" until pytorch#197327, newer than the torch 2.11 we run on GPUs. The attention
            # backends are fixed before the first call compiles the decode step (SDPA picks its kernel at trace time).
            with torch.no_grad(), sdpa_kernel(ATTENTION_BACKENDS):
                # Read after unshard: with FSDP2 CPU offload the sharded parameters live on the CPU, the unsharded
                # on the GPU.
                device = next(model.parameters()).device
                if generator is not None and generator.device.type != device.type:
                    raise ValueError(
                        f"generator is on {generator.device} but the model runs on {device}; create it there"
                    )
                if self.slots is None:
                    return self._generate(prompts, params, generator, limits)
                if not prompts:
                    empty = torch.empty((0, 0), dtype=torch.long, device=device)
                    return RolloutOutput([], empty, empty.clone(), empty.float())
                if self.slots.resident:
                    # the engine holds its own copy now: the gathered parameters are freed before decoding
                    began = time.perf_counter()
                    self.slots.load_weights()
                    for module in fsdp_modules:
                        module.reshard()
                    switch_s += time.perf_counter() - began
                out = self.slots.generate(prompts, params, generator, limits, samples)
                self.stats.update(self.slots.stats)
                return out
        finally:
            # FSDP2 has no public getter for reshard_after_forward: the owner says what to restore
            # (fsdp.reshard_after_forward of the role, as parallel/fsdp.py applied it).
            start = time.perf_counter()
            for module in fsdp_modules:
                module.reshard()
                module.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            model.train(was_training)
            self.stats["reshard_s"] = switch_s + time.perf_counter() - start

    def _validate(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: list[int] | None):
        """Raises ValueError on bad arguments; returns the response limit of every prompt."""
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {self.vocab_size})")
        if max_new_tokens is None:
            limits = [params.max_new_tokens] * len(prompts)
        else:
            if len(max_new_tokens) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
            bad = [m for m in max_new_tokens if not 1 <= m <= params.max_new_tokens]
            if bad:
                raise ValueError(f"max_new_tokens {bad[:5]} outside [1, params.max_new_tokens={params.max_new_tokens}]")
            limits = list(max_new_tokens)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if max_positions is not None and len(prompt) + limit > max_positions:
                raise ValueError(
                    f"prompts[{i}] has {len(prompt)} tokens and max_new_tokens is {limit}: "
                    f"{len(prompt) + limit} positions exceed max_position_embeddings {max_positions}"
                )
        return limits

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None, limits: list[int]
    ) -> RolloutOutput:
        """The HF-forward loop; limits: max_new_tokens per prompt."""
        device = next(self.model.parameters()).device
        pad = self.pad_token_id
        rows, n = prompts, params.n
        if not prompts:
            empty = torch.empty((0, 0), dtype=torch.long, device=device)
            if self.lockstep_group is None:
                return RolloutOutput([], empty, empty.clone(), empty.float())
            # The other ranks of the group forward in step with this one: take part with a row that is done at once.
            rows, n, limits = [[pad]], 1, [1]

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
        row_limits = torch.tensor(limits, device=device).repeat_interleave(n)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)

        token_steps, logprob_steps, mask_steps = [], [], []
        while True:
            banned = stop_ids if len(token_steps) < params.min_new_tokens and len(stop_ids) else None
            tokens, logprobs = sample_next_tokens(
                logits, params.temperature, params.top_k, params.top_p, generator, banned
            )
            if self.tp_group is not None:
                tokens, logprobs = take_first_tp_rank(tokens, logprobs, self.tp_group)
            tokens = tokens.masked_fill(~running, pad)
            token_steps.append(tokens)
            logprob_steps.append(logprobs.masked_fill(~running, 0.0))
            mask_steps.append(running)
            running = running & ~torch.isin(tokens, stop_ids) & (row_limits > len(token_steps))
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
        # transformers renamed the keyword past_key_values -> cache after 5.17 (the old name warns, then goes), so the
        # name is read off the model's forward.
        cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
        return out.logits[:, -1].float()

    def _any_running(self, running: torch.Tensor) -> bool:
        """running: [N] bool. True if a row here, or on any rank of the lockstep group, still decodes."""
        flag = running.any().to(torch.int32).reshape(1)
        if self.lockstep_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return bool(flag.item())
