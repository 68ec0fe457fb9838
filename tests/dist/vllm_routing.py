"""Prompts and outputs between the actor's data layout and the vLLM engines' layout (rollout/vllm.py), 4 gloo
processes, no vLLM needed: engines of 2 contiguous ranks; each engine generates once for the union of its ranks'
prompts, identical on both ranks, and every rank gets its own outputs back in order, also when two ranks are tp
peers of the actor holding the same prompts. Launched by tests/test_vllm_engine.py; prints 'rank R PASS <check>'."""

from __future__ import annotations

import torch.distributed as dist

from parallel.distributed import init_distributed
from rollout.vllm import engine_groups, generate_for_group
from tests.dist.report import run_worker, say


def main() -> None:
    info = init_distributed("gloo", timeout_s=60, device="cpu")
    rank = info.rank
    assert info.world_size == 4
    groups = engine_groups(4, 2)
    assert groups == [[0, 1], [2, 3]]
    made = [dist.new_group(g) for g in groups]
    mine = made[rank // 2]
    seen = []

    def generate_all(prompts):  # a deterministic "engine": the response is the reversed prompt plus its length
        seen.append(list(prompts))
        return [list(reversed(p)) + [len(p)] for p in prompts]

    # data-parallel owners 0..3, one per rank, with different numbers of prompts (rank 2 has none)
    prompts = [[[rank, i, 7] for i in range(rank + 1)] if rank != 2 else []][0]
    out = generate_for_group(prompts, rank, mine, generate_all)
    assert out == [list(reversed(p)) + [len(p)] for p in prompts], out
    unions: list = [None] * 4
    dist.all_gather_object(unions, seen[-1])
    assert unions[0] == unions[1] and unions[2] == unions[3], unions
    assert len(unions[0]) == 1 + 2 and len(unions[2]) == 0 + 4
    say(f"rank {rank} PASS dp owners")

    # the actor with tp 2 on the same ranks: peers 0, 1 (owner 0) and 2, 3 (owner 1) hold the same prompts
    owner = rank // 2
    prompts = [[owner, i] for i in range(3)]
    out = generate_for_group(prompts, owner, mine, generate_all)
    assert out == [list(reversed(p)) + [len(p)] for p in prompts] and len(seen[-1]) == 3, (out, seen[-1])
    say(f"rank {rank} PASS tp peers once")


if __name__ == "__main__":
    run_worker(main)
