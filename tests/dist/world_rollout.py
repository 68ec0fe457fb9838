"""rollout/world.py under torchrun (4 CPU processes, gloo), real engines on a tiny Qwen2 (float32):

- split: the actor's pool on ranks 0-1 (FSDP2 over 2), replicas on ranks 2 and 3. The broadcast weight stream gives
  the replicas the unsharded model's weights under HF names in bounded buckets; owners with 3 and 2 prompts get back
  exactly the greedy samples a plain engine gives on their own prompts (the 5 prompts dealt over 3 engines), sampled
  rows carry their own tokens' log-probs (teacher-forced under the right prompt); after an update (version 1) the
  replicas follow, and an unchanged version syncs nothing.
- failure: an engine that raises (an empty prompt dealt to a replica) makes every rank raise, none waits.
- split with tp: the actor's pool is one tp-2 engine on ranks 0-1 (its peers pass the same prompts, both get them
  back), replicas on 2 and 3.
- blocks: every rank an actor rank (dp 4) and engines of 2 contiguous ranks, each keeping its own copy of the weights
  (vLLM's layout in colocate): owners with 0-3 prompts, each rank gets its own back.

With the argument `cuda` (NCCL, one process a GPU): the blocks check with engines of one rank, the collectives on
the GPU. Launched by tests/test_world_rollout.py; prints 'rank R PASS <check>'.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from algo.losses import logprobs_from_logits
from config import FSDPConfig
from parallel.distributed import init_distributed
from parallel.fsdp import shard_model
from parallel.layout import build_layout
from parallel.reshard import broadcast_buckets, weight_buckets
from rollout.api import SamplingParams
from rollout.native import NativeEngine
from rollout.world import Replica, WorldRollout, units_in_blocks, units_of_split
from tests.dist.report import run_worker, say

BOUND = 8192
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
ENGINE = dict(max_num_seqs=8, kv_cache_tokens=512, cuda_graphs=False, compile=False)


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG)).float().eval()


def pool(name, size, roles):
    return SimpleNamespace(name=name, size=size, roles=roles, tp=1, dp_replicate=1)


def prompts_of(owner: int, count: int) -> list[list[int]]:
    return [[(owner * 7 + i * 3 + k) % 90 + 1 for k in range(3 + i % 3)] for i in range(count)]


def expect_greedy(out, reference, prompts, n):
    """The samples equal what a plain engine on the unsharded model gives for these prompts alone."""
    want = NativeEngine(reference, 0, **ENGINE).generate(prompts, SamplingParams(6, temperature=0.0, n=n))
    assert out.prompt_ids == want.prompt_ids, (out.prompt_ids, want.prompt_ids)
    assert torch.equal(out.response_mask, want.response_mask) and torch.equal(out.response_ids, want.response_ids)
    torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-5, rtol=0)


def teacher_forced_gap(model, out) -> float:
    worst = 0.0
    for i, prompt in enumerate(out.prompt_ids):
        length = int(out.response_mask[i].sum())
        ids = torch.tensor([prompt + out.response_ids[i, :length].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        forced = logprobs_from_logits(logits, ids[:, len(prompt) :])[0]
        worst = max(worst, float((forced - out.logprobs[i, :length]).abs().max()))
    return worst


def split(rank: int) -> None:
    layout = build_layout([pool("actor", 2, ["actor"]), pool("critic", 1, ["critic"]), pool("reward", 1, ["reward"])],
                          "cpu")
    actor_pool = layout.pool_of("actor")
    reference = tiny(0)
    fsdp = FSDPConfig(param_dtype="float32")
    actor = shard_model(copy.deepcopy(reference).train(), actor_pool, fsdp) if actor_pool.has(rank) else None

    # the stream itself: rank 0 sends, rank 1 gathers with it, 2 and 3 receive whole tensors in bounded buckets
    group = dist.new_group([0, 2, 3])
    local = weight_buckets(actor, BOUND, dtype=torch.float32) if actor is not None else None
    if rank == 1:
        for _ in local:
            pass
    else:
        received = [[(name, t.clone()) for name, t in bucket]
                    for bucket in broadcast_buckets(local, group, 0, torch.device("cpu"))]
        want = {name: t for name, t in reference.named_parameters()}
        assert [name for bucket in received for name, _ in bucket] == list(want), "names and order"
        for bucket in received:
            assert sum(t.numel() * 4 for _, t in bucket) <= BOUND or len(bucket) == 1, [n for n, _ in bucket]
            for name, tensor in bucket:
                assert torch.equal(tensor, want[name].detach()), name
        assert len(received) >= 3
    say(f"rank {rank} PASS broadcast stream")

    engine = NativeEngine(actor, 0, lockstep_group=actor_pool.dp_group, **ENGINE) if actor is not None else \
        Replica(tiny(seed=100 + rank), 0, **ENGINE)
    units = units_of_split(4, actor_pool)
    assert units.unit_of == [0, 1, 2, 3], units
    world = WorldRollout(engine, units, actor_pool, actor, 0, torch.float32, torch.device("cpu"), bucket_bytes=BOUND)
    counts = {0: 3, 1: 2}
    mine = prompts_of(actor_pool.dp_rank, counts[actor_pool.dp_rank]) if actor is not None else None
    greedy = SamplingParams(6, temperature=0.0, n=2)
    out = world.generate(mine, greedy, torch.Generator().manual_seed(rank), version=0)
    if actor is None:
        assert out is None
        for name, tensor in reference.named_parameters():
            assert torch.equal(engine.model.get_parameter(name), tensor), name
    else:
        expect_greedy(out, reference, mine, 2)
    say(f"rank {rank} PASS split greedy")

    sampled = SamplingParams(6, temperature=1.0, n=3)
    out = world.generate(mine, sampled, torch.Generator().manual_seed(rank), version=0)
    assert world.stats["reshard_s"] == 0.0, "the same version syncs nothing"
    if actor is not None:
        assert out.prompt_ids == [p for p in mine for _ in range(3)] and out.response_ids.shape[0] == 3 * len(mine)
        assert teacher_forced_gap(reference, out) < 1e-4
    say(f"rank {rank} PASS split sampled")

    # an update: the actor's weights move; version 1 brings the replicas along
    moved = copy.deepcopy(reference)
    with torch.no_grad():
        for model in (actor, moved):
            if model is not None:
                for p in model.parameters():
                    p.mul_(0.9)
    out = world.generate(mine, greedy, None, version=1)
    assert world.stats["reshard_s"] > 0.0
    if actor is None:
        for name, tensor in moved.named_parameters():
            assert torch.equal(engine.model.get_parameter(name), tensor), name
    else:
        expect_greedy(out, moved, mine, 2)
    say(f"rank {rank} PASS split after update")

    # owner 1's second prompt is empty: dealt [1, 1, 1, 0] over the 4 engines, it fails on rank 2's replica
    bad = {0: [[3, 4]], 1: [[5], []]}.get(actor_pool.dp_rank) if actor is not None else None
    try:
        world.generate(bad, greedy, None, version=1)
        raise AssertionError("a failed engine must raise on every rank")
    except (ValueError, RuntimeError) as e:
        expected = "is empty" if rank == 2 else "generation of the rollout failed on another rank"
        assert expected in str(e), (rank, str(e))
    say(f"rank {rank} PASS failure")


def split_tp(rank: int) -> None:
    tp_pool = SimpleNamespace(name="actor", size=2, roles=["actor"], tp=2, dp_replicate=1)
    layout = build_layout([tp_pool, pool("critic", 1, ["critic"]), pool("reward", 1, ["reward"])], "cpu")
    actor_pool = layout.pool_of("actor")
    reference = tiny(2)
    actor = shard_model(copy.deepcopy(reference).train(), actor_pool, FSDPConfig(param_dtype="float32")) \
        if actor_pool.has(rank) else None
    engine = NativeEngine(actor, 0, lockstep_group=actor_pool.dp_group, tp_group=actor_pool.mesh.get_group("tp"),
                          **ENGINE) if actor is not None else Replica(tiny(seed=300 + rank), 0, **ENGINE)
    units = units_of_split(4, actor_pool)
    assert units.unit_of == [0, 0, 1, 2], units
    world = WorldRollout(engine, units, actor_pool, actor, 0, torch.float32, torch.device("cpu"))
    mine = prompts_of(0, 4) if actor is not None else None
    out = world.generate(mine, SamplingParams(6, temperature=0.0, n=2), None, version=0)
    if actor is not None:
        expect_greedy(out, reference, mine, 2)
    say(f"rank {rank} PASS split tp greedy")


def blocks(rank: int, world_size: int, size: int, device: torch.device) -> None:
    layout = build_layout([pool("all", world_size, ["actor", "critic", "reference", "reward"])], device.type)
    actor_pool = layout.pool_of("actor")
    reference = tiny(1).to(device)
    actor = shard_model(copy.deepcopy(reference).train(), actor_pool, FSDPConfig(param_dtype="float32"))
    engine = Replica(tiny(seed=200 + rank).to(device), 0, **ENGINE)  # an engine with its own copy, as vLLM's
    world = WorldRollout(engine, units_in_blocks(world_size, size), actor_pool, actor, 0, torch.float32, device)
    mine = prompts_of(rank, [2, 0, 3, 1][rank % 4])
    out = world.generate(mine, SamplingParams(6, temperature=0.0, n=1), None, version=0)
    for name, tensor in reference.named_parameters():
        assert torch.equal(engine.model.get_parameter(name), tensor), name
    expect_greedy(out, reference, mine, 1)
    say(f"rank {rank} PASS blocks greedy")


def main() -> None:
    if sys.argv[1:] == ["cuda"]:  # NCCL, one process a GPU, any number: engines of one rank each
        info = init_distributed("nccl", timeout_s=120, device="cuda")
        blocks(info.rank, info.world_size, 1, torch.device("cuda", torch.cuda.current_device()))
        return
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    assert info.world_size == 4
    split(info.rank)
    split_tp(info.rank)
    blocks(info.rank, 4, 2, torch.device("cpu"))


if __name__ == "__main__":
    run_worker(main)
