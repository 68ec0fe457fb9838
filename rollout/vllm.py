"""The embedded vLLM rollout engine (`rollout.engine: vllm`): vLLM in every rank's process, fed the actor's weights.

vLLM's external launcher makes every rank of the torch world a vLLM worker; `rollout.vllm_tp` contiguous ranks form
one engine (its tensor-parallel group), in colocated and in split placement alike. The engine starts with dummy
weights (nothing is read from disk) and takes the actor's weights in place before every rollout that follows an
update: `sync_weights` copies a stream of (hf_name, full tensor) buckets into vLLM's own layout with its
`load_weights` (parallel/reshard.weight_buckets gathers them from the actor's FSDP2 / TP / HSDP shards; outside the
actor's pool they arrive by broadcast, see rollout/world.py); then the prefix cache is reset. Between rollouts the
engine sleeps (`rollout.vllm_sleep_level`: 1 keeps the weights in host memory, 2 drops them, which is fine here since
every wake is followed by a sync) so the training step has the GPU.

Every rank of an engine passes the same prompts (rollout/world.py deals them out); rank 0 of the engine draws the
request seeds. Log-probs are vLLM's "processed" ones: the temperature-scaled distribution (after top-k / top-p
truncation when those are on), so that `rollout/logprob_diff_max` compares them with the actor's teacher-forced
log-probs.

`vllm` is imported when an engine is built: the rest of meshrl runs without it (requirements-vllm.txt pins the pair
that works: vllm 0.24.0 with torch 2.11.0).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from rollout.api import RolloutOutput, SamplingParams
from rollout.world import units_in_blocks

INSTALL_HINT = "pip install -r requirements-vllm.txt (vllm==0.24.0 with torch==2.11.0; see the README)"


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.engine=vllm needs vLLM, which is not importable here ({e}); {INSTALL_HINT}") from e
    return vllm


class VLLMEngine:
    """vLLM behind the engine interface of rollout/native.py: generate(prompts, params, generator) -> RolloutOutput.

    model_path: the actor's HF folder (vLLM reads the architecture from config.json, no weights); every rank of the
    world builds one at the same time. gpu_memory_utilization: vLLM's share of the whole GPU (weights + KV cache),
    requested when the engine starts, before the actor's optimizer state exists.
    """

    def __init__(self, model_path: str, pad_token_id: int, *, tp: int = 1, gpu_memory_utilization: float = 0.4,
                 sleep_level: int = 1, max_model_len: int = 2048, seed: int = 0, trust_remote_code: bool = False):
        rank, world = dist.get_rank(), dist.get_world_size()
        # the external launcher runs the engine in this process and reads the torch world's coordinates from the
        # environment (a world of one started without torchrun has none)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for key, value in (("RANK", rank), ("LOCAL_RANK", torch.cuda.current_device()), ("WORLD_SIZE", world),
                           ("MASTER_ADDR", "localhost"), ("MASTER_PORT", 29500)):
            os.environ.setdefault(key, str(value))
        vllm = import_vllm()
        self.pad_token_id, self.sleep_level = pad_token_id, sleep_level
        self.group = None
        units = units_in_blocks(world, tp)
        for unit in range(units.count):  # every rank creates every group, in the same order
            ranks = [r for r in range(world) if units.unit_of[r] == unit]
            made = dist.new_group(ranks)
            if rank in ranks:
                self.group = made
        self.engine_index = rank // tp
        began = time.perf_counter()
        # vLLM checks that gpu_memory_utilization x the GPU is free: the blocks PyTorch cached while the roles were
        # loaded and sharded would count against it
        torch.cuda.empty_cache()
        self.llm = vllm.LLM(
            model=model_path, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
            distributed_executor_backend="external_launcher", tensor_parallel_size=tp,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True, max_model_len=max_model_len,
            logprobs_mode="processed_logprobs", seed=seed + self.engine_index, enable_prefix_caching=True,
            trust_remote_code=trust_remote_code, disable_log_stats=True)
        self.stats: dict[str, float] = {"engine_init_s": time.perf_counter() - began}
        self.sampling_params = vllm.SamplingParams
        self.tokens_prompt = vllm.inputs.TokensPrompt
        self.weights_awake, self.cache_awake = True, True
        self.loaded = False  # holds the actor's weights (dummy ones until the first sync; none after a level-2 sleep)

    # ------------------------------------------------------------------------------------------------ weights
    def _vllm_model(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def sync_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> float:
        """Copy the actor's weights, a stream of (hf_name, full tensor) buckets, into the engine; returns the seconds
        it took (the stream's gathers and broadcasts included). Only the weights wake for it: the KV cache stays
        asleep until the next generate, so the sync's full tensors and the cache are never on the GPU together."""
        began = time.perf_counter()
        if not self.weights_awake:
            torch.cuda.empty_cache()  # see wake()
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        target = self._vllm_model()
        for bucket in buckets:
            target.load_weights(bucket)
        self.llm.reset_prefix_cache()
        self.loaded = True
        torch.cuda.synchronize()
        self.stats["reshard_s"] = time.perf_counter() - began
        return self.stats["reshard_s"]

    def wake(self) -> None:
        """Weights (level 1: back from host memory) and KV cache on the GPU; rollout/vllm_memory_gb is what that
        took from the free memory."""
        if not (self.weights_awake and self.cache_awake):
            # vLLM maps its memory through the driver, outside PyTorch's caching allocator: the blocks the update's
            # activations left cached there must go back first (1.5B with a whole-step micro-batch: 95 GiB cached
            # beside a 42 GiB engine on a 140 GiB H200 failed its wake-up without this)
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        for tag, awake in (("weights", self.weights_awake), ("kv_cache", self.cache_awake)):
            if not awake:
                self.llm.wake_up(tags=[tag])
        if not (self.weights_awake and self.cache_awake):
            self.stats["memory_gb"] = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
        self.weights_awake = self.cache_awake = True

    def sleep(self) -> None:
        if self.weights_awake or self.cache_awake:
            self.llm.sleep(level=self.sleep_level)
            self.weights_awake = self.cache_awake = False
            if self.sleep_level == 2:
                self.loaded = False  # level 2 drops the weights: the next rollout syncs them again

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None,
                 max_new_tokens: list[int] | None = None) -> RolloutOutput:
        """Sample len(prompts) * params.n responses (RolloutOutput as the native engine's); every rank of the engine
        passes the same prompts. generator seeds the requests: rank 0 of the engine draws the seeds and shares them,
        so every rank of the engine asks the same. max_new_tokens: optional per-prompt limits (benchmarks)."""
        if not self.loaded:
            raise RuntimeError("the vLLM engine does not hold the actor's weights: call sync_weights() first (after "
                               "every actor update, and after every sleep at level 2)")
        self.wake()
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device)) \
            if generator is not None else 0
        limits = max_new_tokens or [params.max_new_tokens] * len(prompts)

        def generate_all(batch: list) -> list:
            if not batch:  # every rank of the engine was dealt none
                return []
            # vLLM seeds a request's n samples seed, seed + 1, ..., seed + n - 1: a stride of n keeps every sample's
            # stream its own (base + i would give sample j + 1 of prompt i and sample j of prompt i + 1 one stream)
            seeds = [base + i * params.n for i in range(len(batch))]
            shared = [seeds]
            if self.group is not None and dist.get_world_size(self.group) > 1:
                dist.broadcast_object_list(shared, src=dist.get_global_rank(self.group, 0), group=self.group)
            requests = [self.tokens_prompt(prompt_token_ids=list(ids)) for ids, _ in batch]
            sampling = [self.sampling_params(
                n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=limit, min_tokens=min(params.min_new_tokens, limit),
                stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=False, seed=seed)
                for (_, limit), seed in zip(batch, shared[0])]
            return self.llm.generate(requests, sampling, use_tqdm=False)

        outputs = generate_all(list(zip(prompts, limits)))
        self.sleep()
        return self._rollout_output(prompts, params.n, outputs)

    def _rollout_output(self, prompts: list[list[int]], n: int, outputs: list) -> RolloutOutput:
        rows = [(prompt, completion) for prompt, out in zip(prompts, outputs) for completion in out.outputs[:n]]
        width = max((len(c.token_ids) for _, c in rows), default=0)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (_, c) in enumerate(rows):
            tokens = list(c.token_ids)
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = 1
            # one dict per generated token, {token id: Logprob}; the sampled token is always among them
            logprobs[i, : len(tokens)] = torch.tensor([step[t].logprob for t, step in zip(tokens, c.logprobs)])
        device = torch.device("cuda", torch.cuda.current_device())
        return RolloutOutput([list(p) for p, _ in rows], ids.to(device), mask.to(device), logprobs.to(device))
