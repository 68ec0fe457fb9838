"""rollout/world.py: generation on engines laid out apart from the actor's data (split placement's whole-world
rollout, vLLM's engine blocks): the dealing of prompts and the weight stream, under torchrun with real engines."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from conftest import explain, torchrun
from rollout.world import chunks, units_in_blocks, units_of_split


def test_chunks_are_contiguous_near_equal_and_cover_everything():
    for count in range(0, 12):
        for parts in range(1, 6):
            bounds = chunks(count, parts)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_units_in_blocks_are_contiguous_and_must_divide_the_world():
    assert units_in_blocks(8, 4).unit_of == [0, 0, 0, 0, 1, 1, 1, 1]
    assert units_in_blocks(3, 1).unit_of == [0, 1, 2] and units_in_blocks(3, 1).leader(2) == 2
    with pytest.raises(ValueError, match="rollout.vllm_tp=3 must divide the world size 4"):
        units_in_blocks(4, 3)


def test_units_of_split_keep_tp_peers_together_and_give_every_other_rank_its_own():
    # the actor's pool on ranks 2-5 with tp 2 (dp indices 0, 0, 1, 1); ranks 0, 1 and 6 host other roles
    actor = SimpleNamespace(ranks=(2, 3, 4, 5), tp=2)
    actor.has = lambda rank: rank in actor.ranks
    actor.dp_rank_of = lambda rank: actor.ranks.index(rank) // actor.tp
    units = units_of_split(7, actor)
    assert units.unit_of == [0, 1, 2, 2, 3, 3, 4]
    assert [units.leader(u) for u in range(units.count)] == [0, 1, 2, 4, 6]


def test_world_rollout_under_torchrun():
    proc = torchrun(["tests/dist/world_rollout.py"], nproc=4, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for check in ("broadcast stream", "split greedy", "split sampled", "split after update", "failure",
                  "split tp greedy", "blocks greedy"):
        passed = set(re.findall(rf"rank (\d) PASS {check}", proc.stdout))
        assert passed == {"0", "1", "2", "3"}, f"{check}: {sorted(passed)}\n{explain(proc)}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_world_rollout_on_gpus():
    n = torch.cuda.device_count()
    proc = torchrun(["tests/dist/world_rollout.py", "cuda"], nproc=n, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert set(re.findall(r"rank (\d) PASS blocks greedy", proc.stdout)) == {str(r) for r in range(n)}, explain(proc)
