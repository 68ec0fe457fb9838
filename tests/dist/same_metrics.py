"""The same batch on 1 rank and on 2 ranks gives the same advantages and logs the same metrics: algo/pipeline.py
(whitening, group baselines, statistics through the dp reduction) and the actor's and critic's updates (losses,
entropy, clip fractions, gradient norm) on FSDP2, then monitor.gather_metrics as the trainer calls it. Also the
updates of a batch with one sample per rank and of a batch empty on every rank. 2 gloo processes; launched by
tests/test_metrics.py with a scratch folder as argument; prints 'PASS <check>'."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

import config as C
from algo.kl_control import make_kl_controller
from algo.pipeline import prepare_batch
from batch import select
from monitor import gather_metrics
from parallel.distributed import init_distributed, reducer
from parallel.layout import build_layout
from roles.actor import Actor
from roles.critic import Critic
from roles.micro_batches import micro_batches
from roles.modeling import packed_rows
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model
from tests.dist.report import run_worker, say

N, B, PROMPT, RESP = 4, 8, 3, 5  # samples per prompt, batch rows, prompt and response widths


def make_batch(vocab: int) -> dict:
    """A scored rollout of 2 prompts x 4 samples with ragged responses, as train_ppo.py builds it."""
    gen = torch.Generator().manual_seed(0)
    r_len = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])
    mask = (torch.arange(RESP)[None] < r_len[:, None]).float()
    resp = torch.randint(1, vocab, (B, RESP), generator=gen) * mask.long()
    ids = torch.zeros(B, PROMPT + RESP, dtype=torch.long)
    ids[:, :PROMPT] = torch.randint(1, vocab, (B, PROMPT), generator=gen)
    ids[:, PROMPT:] = resp
    old = (-torch.rand(B, RESP, generator=gen) * 4 - 1) * mask
    return {"input_ids": ids, "prompt_len": torch.full((B,), PROMPT), "response_len": r_len, "response_ids": resp,
            "response_mask": mask, "rollout_logprobs": old.clone(), "old_logprobs": old,
            "ref_logprobs": (old - torch.rand(B, RESP, generator=gen)) * mask,
            "values": torch.randn(B, RESP, generator=gen) * mask,
            "teacher_logprobs": (old - torch.rand(B, RESP, generator=gen) + 0.3) * mask,
            "scores": torch.tensor([1.0, 0.0, 0.5, 0.25, 0.9, 0.1, 0.1, 0.7]),
            "prompt_index": torch.arange(B) // N}


def run(cfg, pool, model_path, batch, with_critic: bool) -> tuple[dict, dict]:
    """prepare_batch then the updates on this pool's share of `batch`; returns (local metrics, prepared batch)."""
    reduce = reducer(pool.dp_group)
    ctl = make_kl_controller(cfg.algorithm.kl.controller, cfg.algorithm.kl.coef, cfg.algorithm.kl.target,
                             cfg.algorithm.kl.horizon)
    prepared, metrics = prepare_batch(batch, cfg.algorithm, ctl, group_size=N, max_response_len=RESP,
                                      min_reward=0.05, reduce=reduce)
    torch.manual_seed(1)  # the critic's fresh value head
    actor = Actor(model_path, cfg.actor, pool, torch.device("cpu"), 0, 10, comm_cfg=cfg.comm, rollout_cfg=cfg.rollout)
    metrics.update(actor.update(prepared, 1.0, 0.0, max_response_len=RESP, generator=torch.Generator()))
    if with_critic:
        torch.manual_seed(1)
        critic = Critic(model_path, cfg.critic, pool, torch.device("cpu"), 10, comm_cfg=cfg.comm)
        metrics.update(critic.update(prepared, torch.Generator()))
    return metrics, prepared


def close(a: float, b: float, key: str) -> None:
    assert math.isclose(a, b, rel_tol=2e-4, abs_tol=1e-6), f"{key}: 1 rank {a} vs 2 ranks {b}"


def one_and_two_ranks(folder: str):
    """2 gloo processes, the tiny model saved in `folder`/model by rank 0, and the layouts to compare: `solo` (the
    actor and critic on rank 0 alone) and `pair` (on both ranks). Returns (rank, model path, solo, pair)."""
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    assert info.world_size == 2, "run with --nproc_per_node 2"
    model_path = f"{folder}/model"
    if info.rank == 0:
        tokenizer = build_char_tokenizer("0123456789+=")
        save_tiny_model(model_path, tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, max_position_embeddings=64, seed=0)
    dist.barrier()
    solo = build_layout([C.PoolConfig("solo", 1, ["actor", "critic"]), C.PoolConfig("idle", 1, ["reward"])], "cpu")
    pair = build_layout([C.PoolConfig("all", 2, ["actor", "critic"])], "cpu")
    return info.rank, model_path, solo, pair


def main() -> None:
    rank, model_path, solo, pair = one_and_two_ranks(sys.argv[1])
    full = make_batch(14)
    halves = [select(full, slice(0, 4)), select(full, slice(4, 8))]  # whole groups on each rank

    # the objectives of algo/objectives.py and the corrections of algo/rollout_correction.py, on engine log-probs
    # that differ from the trainer's old ones (by up to 0.6 nats a token: every mask and weight bites)
    noise = 0.6 * torch.rand(B, RESP, generator=torch.Generator().manual_seed(3)) - 0.3
    mismatched = dict(full, rollout_logprobs=(full["old_logprobs"] + noise) * full["response_mask"])
    cases = [(e, [f"algorithm.adv_estimator={e}"], full) for e in ("gae", "reinforce_pp", "grpo", "rloo",
                                                                      "reinforce_pp_baseline")]
    cases += [
        ("gspo", ["algorithm.adv_estimator=grpo", "actor.policy_loss=gspo", "actor.loss_agg=seq-mean-token-mean",
                  "actor.rollout_correction.weight=sequence", "actor.rollout_correction.mask=geometric",
                  "actor.rollout_correction.mask_high=1.1"], mismatched),
        ("gspo_token", ["algorithm.adv_estimator=rloo", "actor.policy_loss=gspo_token",
                        "actor.rollout_correction.mask=sequence"], mismatched),
        ("cispo", ["algorithm.adv_estimator=grpo", "actor.policy_loss=cispo", "actor.clip_low=1",
                   "actor.clip_high=0.1", "actor.rollout_correction.weight=token",
                   "actor.rollout_correction.mask=token", "actor.rollout_correction.mask_low=0.8"], mismatched),
        ("distill", ["algorithm.adv_estimator=rloo", "algorithm.distill.coef=0.5",
                     "algorithm.distill.task_weight=0.5"], full),
    ]
    for estimator, overrides, rows in cases:
        cfg = C.load_config(None, [
            *overrides, "algorithm.kl.in_reward=true", "algorithm.kl.coef=0.2",
            "algorithm.filters.dynamic_sampling=true", "actor.fsdp.param_dtype=float32",
            "critic.fsdp.param_dtype=float32", "actor.optim.lr=1e-2", "critic.optim.lr=1e-2",
            "actor.entropy_coef=0.01", "actor.micro_batch_tokens=16", "critic.micro_batch_tokens=16"])
        mine = [select(rows, slice(0, 4)), select(rows, slice(4, 8))][rank]
        one, one_adv = {}, None
        if rank == 0:
            one, prepared = run(cfg, solo.pools[0], model_path, dict(rows), estimator == "gae")
            one_adv = prepared["advantages"]
        two, prepared = run(cfg, pair.pools[0], model_path, dict(mine), estimator == "gae")
        parts: list = [None, None]
        dist.all_gather_object(parts, prepared["advantages"])
        logged_one, logged_two = gather_metrics(one), gather_metrics(two)
        if rank == 0:
            joined = torch.cat([p[:, : one_adv.shape[1]] for p in parts])
            torch.testing.assert_close(joined, one_adv, rtol=1e-5, atol=1e-6, msg=f"{estimator} advantages")
            keys = [k for k in logged_one if k not in ("actor/lr", "critic/lr")]
            for key in ("actor/entropy", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
                        "reward/score/max", "reward/score/min", "reward/score/var", "response_length/mean",
                        "data/kept_fraction", "data/dropped_groups", "actor/reward_kl", "actor/ref_kl",
                        "critic/score/mean", "critic/rewards/mean", "critic/advantages/max", "prompt_length/mean",
                        "response_length/max", "data/flat_group_fraction"):
                assert key in keys, f"{estimator}: {key} not logged: {sorted(keys)}"
            if estimator == "gae":
                assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var"} <= set(keys), keys
            assert {"rollout_corr/mismatch_kl", "rollout_corr/mismatch_kl_max"} <= set(keys), keys
            if rows is mismatched:
                corr = {k: logged_one[k] for k in keys if k.startswith("rollout_corr/")}
                assert corr["rollout_corr/mismatch_kl"] > 1e-3 and 0 < corr["rollout_corr/masked_fraction"] < 1, corr
            if estimator == "distill":
                assert logged_one["distill/reverse_kl"] != 0 and logged_one["distill/reverse_kl_k3"] > 0, logged_one
            for key in keys:
                close(logged_one[key], logged_two[key], f"{estimator} {key}")
            assert logged_one["data/dropped_groups"] == 0 and logged_one["reward/score/max"] == 1.0
            say(f"PASS same metrics {estimator} ({len(keys)} keys)")

    # packed micro-batches (roles/modeling.packed_rows) of the actor and the critic under FSDP2: the whole batch in
    # one micro-batch, packed on 1 and on 2 ranks, and padded on 1 rank, log the same values
    base = ["algorithm.adv_estimator=gae", "algorithm.kl.in_reward=true", "algorithm.kl.coef=0.2",
            "actor.fsdp.param_dtype=float32", "critic.fsdp.param_dtype=float32", "actor.optim.lr=1e-2",
            "critic.optim.lr=1e-2", "actor.entropy_coef=0.01", "actor.micro_batch_tokens=4096",
            "critic.micro_batch_tokens=4096"]
    (mine,) = micro_batches(dict(halves[rank]), 4096, None)
    assert packed_rows(mine) is not None, "the test batch must be one that packs"
    padded, packed = {}, {}
    if rank == 0:
        (whole,) = micro_batches(dict(full), 4096, None)
        assert packed_rows(whole) is not None
        unpacked = [*base, "actor.pack_sequences=false", "critic.pack_sequences=false"]
        padded, _ = run(C.load_config(None, unpacked), solo.pools[0], model_path, dict(full), True)
        packed, _ = run(C.load_config(None, base), solo.pools[0], model_path, dict(full), True)
    two, _ = run(C.load_config(None, base), pair.pools[0], model_path, dict(halves[rank]), True)
    logged_padded, logged_packed, logged_two = gather_metrics(padded), gather_metrics(packed), gather_metrics(two)
    if rank == 0:
        keys = [k for k in logged_padded if k not in ("actor/lr", "critic/lr")]
        wanted = {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"}
        assert wanted <= set(keys), keys
        for key in keys:
            close(logged_padded[key], logged_packed[key], f"packed vs padded {key}")
            close(logged_packed[key], logged_two[key], f"packed {key}")
        say(f"PASS packed micro-batches ({len(keys)} keys)")

    # the on-policy update (config.old_logprobs_pass is None): a batch without old log-probs, trained in one
    # optimizer step, logs what the same update logs after a forward pass for them, ends at the same weights, and
    # measures rollout/logprob_diff_max itself; on 1 and on 2 ranks alike
    on_policy = C.load_config(None, [
        "algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false", "actor.fsdp.param_dtype=float32",
        "actor.optim.lr=1e-2", "actor.entropy_coef=0.01", "actor.micro_batch_tokens=16", "actor.ppo_epochs=1"])
    assert C.old_logprobs_pass(on_policy) is None

    def on_policy_update(pool, rows, with_old: bool):
        reduce = reducer(pool.dp_group)
        ctl = make_kl_controller("fixed", 0.0, 0.1, 1)
        fresh = {k: v for k, v in rows.items() if k != "old_logprobs"}
        prepared, _ = prepare_batch(fresh, on_policy.algorithm, ctl, group_size=N, max_response_len=RESP,
                                    min_reward=None, reduce=reduce)
        actor = Actor(model_path, on_policy.actor, pool, torch.device("cpu"), 0, 10, comm_cfg=on_policy.comm,
                      rollout_cfg=on_policy.rollout)
        gap = None
        if with_old:
            prepared["old_logprobs"] = actor.log_probs(prepared, 1.0)
            gap = float(((prepared["old_logprobs"] - prepared["rollout_logprobs"]).abs()
                         * prepared["response_mask"]).max())
        logged = actor.update(prepared, 1.0, max_response_len=RESP, generator=torch.Generator())
        weights = {n: p.full_tensor().clone() for n, p in actor.model.named_parameters()}
        return logged, weights, gap

    if rank == 0:
        forward, w_forward, gap = on_policy_update(solo.pools[0], dict(full), True)
        shortcut, w_shortcut, _ = on_policy_update(solo.pools[0], dict(full), False)
        assert "rollout/logprob_diff_max" not in forward and gap > 0.5, "the test's rollout log-probs are made up"
        close(shortcut["rollout/logprob_diff_max"], gap, "rollout/logprob_diff_max")
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
            close(forward[key], shortcut[key], f"on-policy {key}")
        for name, w in w_forward.items():
            torch.testing.assert_close(w_shortcut[name], w, rtol=1e-5, atol=1e-6, msg=f"on-policy weights {name}")
    two, _, _ = on_policy_update(pair.pools[0], dict(halves[rank]), False)
    if rank == 0:
        for key in shortcut:
            if key != "actor/lr":
                close(shortcut[key], two[key], f"on-policy 2 ranks {key}")
        say(f"PASS on-policy old log-probs ({len(shortcut)} keys)")
    two_epochs = C.load_config(None, ["actor.fsdp.param_dtype=float32", "actor.ppo_epochs=2"])
    actor = Actor(model_path, two_epochs.actor, pair.pools[0], torch.device("cpu"), 0, 10, comm_cfg=two_epochs.comm,
                  rollout_cfg=two_epochs.rollout)
    no_old = {k: v for k, v in halves[rank].items() if k != "old_logprobs"}
    no_old["advantages"] = no_old["response_mask"].clone()
    try:
        actor.update(no_old, 1.0, generator=torch.Generator())
        raise AssertionError("two optimizer steps without old log-probs must be refused")
    except ValueError as e:
        assert "one optimizer step" in str(e), e
    say(f"rank {rank} PASS no old log-probs, two steps refused")

    # one sample per rank, one sample per mini-batch asked for: no empty global mini-batch, no skipped step
    cfg = C.load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false",
                               "actor.fsdp.param_dtype=float32", "actor.mini_batch_size=1"])
    actor = Actor(model_path, cfg.actor, pair.pools[0], torch.device("cpu"), 0, 10, comm_cfg=cfg.comm,
                  rollout_cfg=cfg.rollout)
    one_each = select(full, slice(rank * 4, rank * 4 + 1))
    one_each["advantages"] = one_each["response_mask"] * (1.0 if rank == 0 else -1.0)
    m = actor.update(one_each, 1.0, generator=torch.Generator())
    assert m["actor/skipped_steps"] == 0 and m["actor/empty_batch"] == 0 and math.isfinite(m["actor/pg_loss"]), m
    assert actor.skips_in_a_row == 0
    say(f"rank {rank} PASS one sample per rank")

    empty = select(one_each, slice(0, 0))
    m = actor.update(empty, 1.0, generator=torch.Generator())
    assert m["actor/empty_batch"] == 1 and m["actor/skipped_steps"] == 0 and actor.skips_in_a_row == 0, m
    assert all(math.isfinite(v) for v in m.values()), m
    say(f"rank {rank} PASS empty batch")


if __name__ == "__main__":
    run_worker(main)
