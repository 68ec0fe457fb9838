"""The embedded vLLM rollout engine (`rollout.engine: vllm`): vLLM in every rank's process, fed the actor's weights.

vLLM's external launcher makes every rank of the torch world a vLLM worker; `rollout.vllm_tp` contiguous ranks form
one engine (its tensor-parallel group). The engine starts with dummy weights (nothing is read from disk) and takes the
actor's weights in place before every rollout that follows an update: `parallel/reshard.weight_buckets` gathers each
FSDP2 / TP / HSDP shard to a full tensor, bucket by bucket, and vLLM's `load_weights` copies it into its own layout;
then the prefix cache is reset. Between rollouts the engine sleeps (`rollout.vllm_sleep_level`: 1 keeps the weights
in host memory, 2 drops them, which is fine here since every wake is followed by a sync) so the training step has
the GPU.

Prompts are identical inside a vLLM TP group: each engine generates for the union of its ranks' prompts (a rank's
tp peers in the actor hold the same shard, counted once), and every rank takes its own outputs back, in order.
Log-probs are vLLM's "processed" ones: the temperature-scaled distribution (after top-k / top-p truncation when
those are on), so that `rollout/logprob_diff_max` compares them with the actor's teacher-forced log-probs.

`vllm` is imported when an engine is built: the rest of meshrl runs without it (requirements-vllm.txt pins the pair
that works: vllm 0.24.0 with torch 2.11.0).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel.reshard import weight_buckets
from rollout.api import RolloutOutput, SamplingParams

INSTALL_HINT = "pip install -r requirements-vllm.txt (vllm==0.24.0 with torch==2.11.0; see the README)"


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.engine=vllm needs vLLM, which is not importable here ({e}); {INSTALL_HINT}") from e
    return vllm


def engine_groups(world_size: int, tp: int) -> list[list[int]]:
    """The ranks of each vLLM engine: contiguous blocks of `tp`, as vLLM's external launcher builds them."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"rollout.vllm_tp={tp} must divide the world size {world_size}")
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def generate_for_group(prompts: list[list[int]], owner: int, group: dist.ProcessGroup | None,
                       generate_all: Callable[[list[list[int]]], list]) -> list:
    """Run `generate_all` once on the union of the prompts of the ranks of `group` (one vLLM engine), identical on
    each of them, and return this rank's own results in order.

    prompts: this rank's prompts; owner: who holds them (the actor's data-parallel rank: tp peers of the actor pass
    the same owner and the same prompts, which count once). generate_all(prompts) -> one result per prompt, in order.
    The union is ordered by owner, so every rank of the group passes the same list. A group of one (or None) calls
    generate_all on its own prompts.
    """
    if group is None or dist.get_world_size(group) == 1:
        return generate_all(prompts)
    shares: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, (owner, prompts), group=group)
    by_owner = dict(sorted(shares))
    union, start = [], {}
    for who, theirs in by_owner.items():
        start[who] = len(union)
        union.extend(theirs)
    results = generate_all(union)
    return results[start[owner] : start[owner] + len(prompts)]


class VLLMEngine:
    """vLLM behind the engine interface of rollout/native.py: generate(prompts, params, generator) -> RolloutOutput.

    model: the actor's (sharded) HF model, the source of every weight sync; model_path: its HF folder (vLLM reads
    the architecture from config.json, no weights); every rank of the world builds one at the same time.
    owner: this rank's data-parallel index in the actor pool. gpu_memory_utilization: vLLM's share of the whole GPU
    (weights + KV cache), requested when the engine starts, before the actor's optimizer state exists.
    """

    def __init__(self, model, model_path: str, pad_token_id: int, owner: int, *, tp: int = 1,
                 gpu_memory_utilization: float = 0.4, sleep_level: int = 1, max_model_len: int = 2048,
                 seed: int = 0, trust_remote_code: bool = False, bucket_bytes: int = 256 << 20):
        rank, world = dist.get_rank(), dist.get_world_size()
        # the external launcher runs the engine in this process and reads the torch world's coordinates from the
        # environment (a world of one started without torchrun has none)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for key, value in (("RANK", rank), ("LOCAL_RANK", torch.cuda.current_device()), ("WORLD_SIZE", world),
                           ("MASTER_ADDR", "localhost"), ("MASTER_PORT", 29500)):
            os.environ.setdefault(key, str(value))
        vllm = import_vllm()
        self.model, self.pad_token_id, self.owner, self.sleep_level = model, pad_token_id, owner, sleep_level
        self.bucket_bytes = bucket_bytes
        self.group = None
        for ranks in engine_groups(world, tp):  # every rank creates every group, in the same order
            made = dist.new_group(ranks)
            if rank in ranks:
                self.group = made
        self.engine_index = rank // tp
        began = time.perf_counter()
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

    def sync_weights(self) -> float:
        """Stream the actor's weights into the engine (every rank of the actor pool calls: each full tensor is a
        collective); returns the seconds it took. Only the weights wake for it: the KV cache stays asleep until the
        next generate, so the sync's full tensors and the cache are never on the GPU together."""
        began = time.perf_counter()
        if not self.weights_awake:
            torch.cuda.empty_cache()  # see wake()
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        target = self._vllm_model()
        device = next(target.parameters()).device
        for bucket in weight_buckets(self.model, self.bucket_bytes, dtype=torch.bfloat16, device=device):
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
        """Sample len(prompts) * params.n responses (RolloutOutput as the native engine's). generator seeds the
        requests: rank 0 of each engine draws the seeds and shares them, so every rank of the engine asks the same.
        max_new_tokens: optional per-prompt limits (benchmarks)."""
        if not self.loaded:
            raise RuntimeError("the vLLM engine does not hold the actor's weights: call sync_weights() first (after "
                               "every actor update, and after every sleep at level 2)")
        self.wake()
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device)) \
            if generator is not None else 0
        limits = max_new_tokens or [params.max_new_tokens] * len(prompts)

        def generate_all(batch: list) -> list:
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

        outputs = generate_for_group(list(zip(prompts, limits)), self.owner, self.group, generate_all)
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
