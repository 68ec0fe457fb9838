"""LoRA roles (roles/lora.py) on FSDP2, 2 gloo processes; launched by tests/test_lora.py with a scratch folder as
argument; prints 'PASS <check>'.

- only the adapters (and the critic's value head) train: the optimizer holds them alone, float32, the base frozen in
  param_dtype;
- one update of the actor and of the critic logs the same metrics on 1 rank, on 2 (FSDP2 shards the base) and on 2
  with tensor parallelism (the base and one matrix of each adapter split, parallel/tp.py) and ends at the same
  adapters;
- the native engine decodes the merged weights: its log-probs equal the trainer's teacher-forced ones with the
  adapters on (float32), on 1 rank and on 2, on the slot engine and on the HF-forward path, and the sharded base is
  bit-for-bit what it was;
- the reference as the actor with its adapters disabled equals a reference loaded from the base model."""

from __future__ import annotations

import sys

import torch

import config as C
from monitor import gather_metrics
from parallel.layout import build_layout
from ppo.rollouts import rollout_batch
from roles.actor import Actor
from roles.critic import Critic
from roles.lora import BaseReference
from roles.reference import Reference
from rollout.api import SamplingParams
from tests.dist.report import run_worker, say
from tests.dist.same_metrics import RESP, close, make_batch, one_and_two_ranks

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "critic.lora.rank=4", "critic.lora.alpha=8",
        "critic.lora.target_modules=[q_proj,v_proj]"]


def shake_adapters(role, seed: int) -> None:
    """Non-zero B matrices (peft starts them at zero: the adapters would change nothing), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in role.lora.lora_layers():
            w = layer.lora_B["default"].weight
            full = torch.randn(w.shape, generator=gen) * 0.5
            w.copy_(_shard_like(full, w))


def _shard_like(full: torch.Tensor, param) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements) if hasattr(param, "device_mesh") else full


def main() -> None:
    rank, model_path, solo, pair = one_and_two_ranks(sys.argv[1])
    cpu = torch.device("cpu")
    tp = build_layout([C.PoolConfig("tp", 2, ["actor", "critic"], tp=2)], "cpu")

    # what trains: the adapters (and the critic's head) in float32, the base frozen in param_dtype
    cfg = C.load_config(None, [*LORA, "actor.fsdp.param_dtype=bfloat16"])
    actor = Actor(model_path, cfg.actor, pair.pools[0], cpu, 0, 10, comm_cfg=cfg.comm, rollout_cfg=cfg.rollout)
    trained = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), sorted(trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}, "all-linear: every linear layer of the blocks"
    optimized = [p for g in actor.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(trained) and all(p.requires_grad for p in optimized)
    assert all(p.dtype == torch.float32 for p in optimized)
    frozen = [(n, p.dtype) for n, p in actor.model.named_parameters() if not p.requires_grad]
    assert frozen and all(d == torch.bfloat16 for _, d in frozen), frozen[:3]
    critic = Critic(model_path, cfg.critic, pair.pools[0], cpu, 10, comm_cfg=cfg.comm)
    trained = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert any(n.startswith("score.") for n in trained), sorted(trained)
    assert {n.split(".")[-4] for n in trained if ".lora_" in n} == {"q_proj", "v_proj"}, sorted(trained)
    say(f"rank {rank} PASS adapters only ({len(optimized)} actor tensors)")

    # one update, 1 rank and 2 ranks: the same metrics and the same adapters afterwards
    cfg = C.load_config(None, [*LORA, "algorithm.adv_estimator=gae", "actor.fsdp.param_dtype=float32",
                               "critic.fsdp.param_dtype=float32", "actor.optim.lr=1e-2", "critic.optim.lr=1e-2",
                               "actor.entropy_coef=0.01", "actor.micro_batch_tokens=16",
                               "critic.micro_batch_tokens=16", "actor.ppo_epochs=2", "critic.ppo_epochs=2"])
    full = make_batch(14)
    full["advantages"] = torch.randn(full["response_mask"].shape, generator=torch.Generator().manual_seed(5)) \
        * full["response_mask"]
    full["returns"] = full["values"] + full["advantages"]

    def update(pool, rows):
        torch.manual_seed(1)
        a = Actor(model_path, cfg.actor, pool, cpu, 0, 10, comm_cfg=cfg.comm, rollout_cfg=cfg.rollout)
        shake_adapters(a, 7)
        logged = a.update(rows, 1.0, 0.0, max_response_len=RESP, generator=torch.Generator())
        torch.manual_seed(1)
        c = Critic(model_path, cfg.critic, pool, cpu, 10, comm_cfg=cfg.comm)
        logged.update(c.update(rows, torch.Generator()))
        weights = {n: p.full_tensor().clone() for n, p in a.model.named_parameters() if p.requires_grad}
        return logged, weights

    one, w_one = update(solo.pools[0], dict(full)) if rank == 0 else ({}, {})
    from batch import select

    two, w_two = update(pair.pools[0], select(full, slice(rank * 4, rank * 4 + 4)))
    logged_one, logged_two = gather_metrics(one), gather_metrics(two)
    split, w_split = update(tp.pools[0], select(full, slice(0, 8)))  # tp peers hold the same rows
    logged_split = gather_metrics(split)
    if rank == 0:
        keys = [k for k in logged_one if not k.endswith("/lr")]
        assert {"actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"} <= set(keys), keys
        assert logged_one["actor/grad_norm"] > 0 and logged_one["critic/grad_norm"] > 0
        for other, w_other, how in ((logged_two, w_two, "FSDP2"), (logged_split, w_split, "TP")):
            for key in keys:
                close(logged_one[key], other[key], f"{how} {key}")
            for name, w in w_one.items():
                torch.testing.assert_close(w_other[name], w, rtol=1e-4, atol=1e-6, msg=f"{how} adapter {name}")
        say(f"PASS same metrics 1 vs 2 ranks, FSDP2 and TP ({len(keys)} keys)")

    # the engine decodes the merged weights: its log-probs are the trainer's with the adapters on; the base is
    # untouched; the reference with the adapters off is the base model's
    gen_cfg = C.load_config(None, [*LORA, "actor.fsdp.param_dtype=float32", "reference.fsdp.param_dtype=float32"])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, n=2, stop_token_ids=[])
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    hf_forward = C.load_config(None, [*LORA, "actor.fsdp.param_dtype=float32", "rollout.compact_forward=false"])
    for name, pool, mine, rollout in (("1 rank", solo.pools[0], prompts, gen_cfg.rollout),
                                      ("2 ranks", pair.pools[0], prompts[rank::2], gen_cfg.rollout),
                                      ("2 ranks HF forward", pair.pools[0], prompts[rank::2], hf_forward.rollout),
                                      ("2 ranks TP", tp.pools[0], prompts, gen_cfg.rollout)):
        if not pool.has(rank):
            continue
        a = Actor(model_path, gen_cfg.actor, pool, cpu, 0, 10, comm_cfg=gen_cfg.comm, rollout_cfg=rollout)
        assert (a.engine.slots is None) == (rollout is hf_forward.rollout)
        shake_adapters(a, 11)
        before = {n: p.to_local().clone() for n, p in a.model.named_parameters()}
        with a.lora.disabled():  # the base alone (the HF-forward path calls the modules, adapters and all)
            plain = a.engine.generate(mine, params, torch.Generator().manual_seed(0))
        out = a.generate(mine, params, torch.Generator().manual_seed(0))
        for n, p in a.model.named_parameters():
            assert torch.equal(p.to_local(), before[n]), f"{name}: generate changed {n}"
        batch = rollout_batch(out, list(range(len(out.prompt_ids))), cpu)
        trainer = a.log_probs(batch, 1.0)
        m = batch["response_mask"].bool()
        gap = (trainer - batch["rollout_logprobs"]).abs()[m].max()
        assert gap < 1e-4, f"{name}: engine vs trainer log-probs differ by {gap}"
        base_batch = rollout_batch(plain, list(range(len(plain.prompt_ids))), cpu)
        on = a.log_probs(base_batch, 1.0)
        base_m = base_batch["response_mask"].bool()
        assert (on - base_batch["rollout_logprobs"]).abs()[base_m].max() > 1e-2, "the adapters change nothing"
        ref = BaseReference(a).log_probs(base_batch, 1.0)
        assert (ref - base_batch["rollout_logprobs"]).abs()[base_m].max() < 1e-4, f"{name}: reference != base"
        loaded = Reference(model_path, gen_cfg.reference, pool, cpu, 8192).log_probs(base_batch, 1.0)
        torch.testing.assert_close(ref, loaded, rtol=1e-5, atol=1e-5, msg=f"{name}: base reference")
        assert torch.equal(a.log_probs(batch, 1.0), trainer), f"{name}: the reference left the adapters off"
        say(f"rank {rank} PASS merged engine and base reference, {name} (gap {float(gap):.2e})")


if __name__ == "__main__":
    run_worker(main)
