"""Foundation checks under torchrun (4 CPU processes, gloo): layouts, FSDP2 / TP / 2-D / HSDP equivalence with the
unsharded model, and batch transfer between pools. Launched by tests/test_foundation.py; prints 'PASS <check>'."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from algo.losses import logprobs_from_logits
from config import FSDPConfig, PoolConfig
from parallel.distributed import init_distributed
from parallel.fsdp import compile_blocks, shard_model
from parallel.layout import build_layout
from parallel.transfer import transfer
from roles.micro_batches import micro_batches, trim
from roles.modeling import packed_rows, response_logits
from tests.dist.report import run_worker, say


def tiny_qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).float()


def pools(*specs):
    return [PoolConfig(name=n, size=s, roles=list(r), tp=tp, dp_replicate=rep) for n, s, r, tp, rep in specs]


def ranks_of(group):
    return dist.get_process_group_ranks(group)


def check_layouts(rank):
    colo = build_layout(pools(("all", 4, ["actor", "critic", "reference", "reward"], 1, 1)), "cpu")
    p = colo.pools[0]
    assert colo.my_roles == ("actor", "critic", "reference", "reward")
    assert (p.dp_replicate, p.dp_shard, p.tp, p.dp_size, p.dp_rank) == (1, 4, 1, 4, rank)
    assert ranks_of(p.dp_group) == [0, 1, 2, 3]
    assert ranks_of(p.mesh.get_group("dp_shard")) == [0, 1, 2, 3]

    two_d = build_layout(pools(("all", 4, ["actor"], 2, 1)), "cpu").pools[0]
    assert (two_d.dp_shard, two_d.tp) == (2, 2)
    assert ranks_of(two_d.mesh.get_group("tp")) == ([0, 1] if rank < 2 else [2, 3])
    assert ranks_of(two_d.dp_group) == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert (two_d.dp_rank, two_d.tp_rank) == (rank // 2, rank % 2)

    split = build_layout(pools(("actor", 2, ["actor", "reference"], 1, 1), ("critic", 1, ["critic"], 1, 1),
                               ("reward", 1, ["reward"], 1, 1)), "cpu")
    expect = {0: ("actor", "reference"), 1: ("actor", "reference"), 2: ("critic",), 3: ("reward",)}[rank]
    assert split.my_roles == expect, split.my_roles
    assert split.hosts("actor") == (rank < 2) and split.hosts("critic") == (rank == 2)
    assert split.pool_of("reference").ranks == (0, 1)
    if rank < 2:
        assert ranks_of(split.pools[0].dp_group) == [0, 1]
    assert split.pools[1].dp_group is None or rank == 2
    union = split.union_group(split.pools[0], split.pools[1])
    assert (union is not None) == (rank in (0, 1, 2))
    if union is not None:
        assert ranks_of(union) == [0, 1, 2]
    return split


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.detach(), grads


def check_sharded(rank, name, pool_spec, reference, ids):
    """Shard a copy of the model over the pool; each dp index takes its rows of `ids`; compare with `reference`."""
    layout = build_layout(pools(*pool_spec), "cpu")
    mine = [p for p in layout.pools if p.has(rank)]
    if not mine:
        return
    pool = mine[0]
    model = shard_model(copy.deepcopy(reference[0]), pool, FSDPConfig(param_dtype="float32"))
    rows = ids.shape[0] // pool.dp_size
    local = ids[pool.dp_rank * rows : (pool.dp_rank + 1) * rows]
    loss, grads = loss_and_grads(model, local)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=pool.dp_group)
    ref_loss, ref_grads = reference[1], reference[2]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{name} {key}: {m}")
    say(f"rank {rank} PASS {name} loss={loss.item():.6f}")


def packed_loss_and_grads(model, mb, pack: bool):
    """The actor's path (roles/modeling.response_logits) on one micro-batch, packed or padded."""
    model.zero_grad()
    logp = logprobs_from_logits(response_logits(model, mb, pack=pack), mb["response_ids"])
    m = mb["response_mask"]
    loss = -(logp * m * (1 + torch.arange(m.shape[1]) % 3)).sum() / m.sum()
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def check_packed(rank, name, pool_spec, model, mb, reference, compiled: bool = False):
    """Packed micro-batches (block-causal attention from position ids, the hook on the final norm) on a sharded copy:
    every rank takes the whole micro-batch; loss and gradients equal the unsharded padded forward's.
    compiled: the blocks compiled (parallel/fsdp.compile_blocks) with the "eager" backend: Dynamo's capture of the
    blocks between FSDP2's hooks, their guards and shared graphs, run as captured (AOTAutograd and Inductor run on
    GPUs only: on 2 CPU cores their dynamic-shape tracing takes minutes); the padded forward and a no-grad one checked
    as well."""
    layout = build_layout(pools(*pool_spec), "cpu")
    mine = [p for p in layout.pools if p.has(rank)]
    if not mine or (compiled and mine[0] is not layout.pools[0]):
        return  # compiled: the first pool only (tracing is the cost; two ranks show the sharding)
    sharded = shard_model(copy.deepcopy(model), mine[0], FSDPConfig(param_dtype="float32"))
    if compiled:
        compile_blocks(sharded, backend="eager")
        name += " compiled"
    for pack in (True, False) if compiled else (True,):
        loss, grads = packed_loss_and_grads(sharded, mb, pack=pack)
        torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6, msg=f"{name} pack={pack}: loss")
        for key, g in grads.items():
            torch.testing.assert_close(g, reference[1][key], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, key=key: f"{name} pack={pack} {key}: {m}")
    if compiled:
        with torch.no_grad():
            m = mb["response_mask"][..., None]  # past a response's end the packed rows repeat its last position
            torch.testing.assert_close(response_logits(sharded, mb, pack=True) * m, response_logits(model, mb) * m,
                                       rtol=1e-5, atol=1e-5)
        # one graph per (grad mode, layout) shared by both blocks, not one per block
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert 0 < graphs <= 3, f"compiled blocks: {graphs} graphs for 3 variants"
        # a new shape recompiles at most once, with dynamic dimensions, then no more (none of size 1: those
        # specialise); here the padded forward after the packed one may already have been that recompile
        for rows in (slice(3, None), slice(0, 2)):
            part = {k: v[rows] for k, v in mb.items()}
            part = trim(part, int(part["lengths_host"][:, 1].max()), int(part["response_len"].max()))
            packed_loss_and_grads(sharded, part, pack=False)
        now = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert now <= graphs + 1, f"two new shapes: {now - graphs} more graphs"
    say(f"rank {rank} PASS packed {name}")


def check_transfer(rank, split):
    """A ragged batch on the 2-rank pool -> the 1-rank pool -> back: same samples, same order, zero padding."""
    a, b = split.pools[0], split.pools[1]
    gen = torch.Generator().manual_seed(7)
    lengths = [torch.randint(1, 9, (n,), generator=gen) for n in (3, 5)]  # shard sizes differ, widths differ
    shards = []
    for lens in lengths:
        width = int(lens.max())
        ids = torch.randint(1, 100, (len(lens), width), generator=gen)
        mask = torch.arange(width)[None] < lens[:, None]
        shards.append({"input_ids": ids * mask, "mask": mask, "lens": lens,
                       "score": torch.randn(len(lens), generator=gen, dtype=torch.float64)})
    mine = shards[a.dp_rank_of(rank)] if a.has(rank) else None
    there = transfer(mine, a, b, split, torch.device("cpu"))
    if rank == 2:
        assert there["input_ids"].shape == (8, max(int(lens.max()) for lens in lengths))
        assert torch.equal(there["lens"], torch.cat(lengths))
        assert there["mask"].dtype == torch.bool and there["score"].dtype == torch.float64
    back = transfer(there, b, a, split, torch.device("cpu"))
    if a.has(rank):
        # 3 + 5 samples come back balanced over 2 ranks, 4 each, in the original order
        lo = 4 * a.dp_rank_of(rank)
        assert torch.equal(back["lens"], torch.cat(lengths)[lo : lo + 4])
        assert torch.equal(back["score"], torch.cat([s["score"] for s in shards])[lo : lo + 4])
        rows = [row[: int(n)] for s in shards for row, n in zip(s["input_ids"], s["lens"])]
        for i in range(4):
            n = int(back["lens"][i])
            assert torch.equal(back["input_ids"][i, :n], rows[lo + i])
            assert not back["input_ids"][i, n:].any() and not back["mask"][i, n:].any()
    # back with the original shard sizes (3 and 5, not balanced): every row returns to the rank it came from
    home = transfer(there, b, a, split, torch.device("cpu"), want=len(mine["lens"]) if a.has(rank) else None)
    if a.has(rank):
        assert torch.equal(home["lens"], mine["lens"]) and torch.equal(home["score"], mine["score"])
    if a.has(rank) or b.has(rank):
        try:
            transfer(there, b, a, split, torch.device("cpu"), want=1 if a.has(rank) else None)
            raise AssertionError("asking for 2 of 8 rows must fail")
        except ValueError as e:
            assert "asked for rows" in str(e), e
    # into a tp=2 pool: both tp peers receive the whole batch; back out, only tp rank 0 sends
    tp_split = build_layout(pools(("dp", 2, ["actor"], 1, 1), ("tp", 2, ["critic"], 2, 1)), "cpu")
    a, b = tp_split.pools
    there = transfer(shards[a.dp_rank_of(rank)] if a.has(rank) else None, a, b, tp_split, torch.device("cpu"))
    if b.has(rank):
        assert torch.equal(there["lens"], torch.cat(lengths))
        there["score"] = there["score"] + b.tp_rank_of(rank)  # tp rank 1's copy must not be the one sent
    back = transfer(there, b, a, tp_split, torch.device("cpu"))
    if a.has(rank):
        lo = 4 * a.dp_rank_of(rank)
        assert torch.equal(back["score"], torch.cat([s["score"] for s in shards])[lo : lo + 4])
    say(f"rank {rank} PASS transfer")


def main():
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    rank = info.rank
    assert info.world_size == 4, "run with --nproc_per_node 4"
    split = check_layouts(rank)
    say(f"rank {rank} PASS layouts")

    model = tiny_qwen2()
    ids = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), ids)
    reference = (model, ref_loss, ref_grads)
    check_sharded(rank, "fsdp4", [("all", 4, ["actor"], 1, 1)], reference, ids)
    check_sharded(rank, "tp2+fsdp2", [("tp", 2, ["actor"], 2, 1), ("fsdp", 2, ["critic"], 1, 1)], reference, ids)
    check_sharded(rank, "2d", [("all", 4, ["actor"], 2, 1)], reference, ids)
    check_sharded(rank, "hsdp", [("all", 4, ["actor"], 1, 2)], reference, ids)

    lengths = [(3, 9), (2, 1), (2, 14), (4, 6), (2, 1), (3, 1)]  # (prompt, response): 2 packed rows of 32, not 6 of 16
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, 96, (p + r,), generator=gen) for p, r in lengths]
    width, r_max = max(p + r for p, r in lengths), max(r for _, r in lengths)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "prompt_len": torch.tensor([p for p, _ in lengths]), "response_len": torch.tensor([r for _, r in lengths]),
             "response_ids": torch.zeros(len(rows), r_max, dtype=torch.long),
             "response_mask": torch.zeros(len(rows), r_max)}
    for i, ((p, r), row) in enumerate(zip(lengths, rows)):
        batch["input_ids"][i, : p + r] = row
        batch["response_ids"][i, :r] = row[p:]
        batch["response_mask"][i, :r] = 1
    (mb,) = micro_batches(batch, 10_000, None)
    assert packed_rows(mb) is not None
    padded = packed_loss_and_grads(copy.deepcopy(model), mb, pack=False)
    check_packed(rank, "tp2", [("tp", 2, ["actor"], 2, 1), ("fsdp", 2, ["critic"], 1, 1)], model, mb, padded)
    check_packed(rank, "2d", [("all", 4, ["actor"], 2, 1)], model, mb, padded)
    check_packed(rank, "fsdp2", [("fsdp", 2, ["actor"], 1, 1), ("idle", 2, ["critic"], 1, 1)], model, mb, padded,
                 compiled=True)
    check_transfer(rank, split)


if __name__ == "__main__":
    run_worker(main)
