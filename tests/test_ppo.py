"""End-to-end PPO / GRPO runs of train_ppo.py on a tiny random model, as real processes (python and torchrun/gloo).

The reward (tests/user_rewards.py:ones_fraction) is trivially learnable, so a working loop must raise it within a
few steps; a broken sign, advantage or transfer does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import explain, run_python, torchrun
from tasks.char_tokenizer import build_char_tokenizer
from tasks.synthetic import write_addition_dataset
from tasks.tiny_model import save_tiny_model
from tests.user_rewards import ones_fraction


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ppo_assets")
    tokenizer = build_char_tokenizer("0123456789+=")
    save_tiny_model(root / "model", tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0)
    write_addition_dataset(root, n_train=80, n_test=16, seed=0, digits=(1, 1))
    return root


def write_config(path: Path, assets: Path, run_dir: Path, **sections) -> str:
    cfg = {
        "run": {"name": "t", "output_dir": str(run_dir), "seed": 0, "total_steps": 10, "eval_every": 0,
                "device": "cpu", "tensorboard": False},
        "model": {"path": str(assets / "model")},
        "data": {"train_path": str(assets / "train.jsonl"), "eval_path": str(assets / "test.jsonl"),
                 "max_prompt_len": 8, "batch_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 4, "temperature": 1.0},
        "algorithm": {"adv_estimator": "gae", "kl": {"in_reward": True, "coef": 0.001}},
        "actor": {"optim": {"lr": 3e-3}, "fsdp": {"param_dtype": "float32"}, "ppo_epochs": 2, "mini_batch_size": 16},
        "critic": {"optim": {"lr": 3e-3}, "fsdp": {"param_dtype": "float32"}, "ppo_epochs": 2},
        "reference": {"fsdp": {"param_dtype": "float32"}},
        "reward": {"functions": [{"spec": "tests.user_rewards:ones_fraction"}], "num_workers": 1},
    }
    for section, values in sections.items():
        merged = cfg.setdefault(section, {})
        for k, v in values.items():
            if isinstance(v, dict) and isinstance(merged.get(k), dict):
                merged[k] = {**merged[k], **v}
            else:
                merged[k] = v
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "t" / "metrics.jsonl").read_text().splitlines()]


def assert_learns(rows: list[dict], margin: float = 0.1):
    scores = [r["reward/score/mean"] for r in rows if "reward/score/mean" in r]
    assert len(scores) >= 6, rows
    early, late = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert late > early + margin, f"reward did not rise: {scores}"


SPLIT = {"mode": "split", "pools": [
    {"name": "actor", "size": 2, "roles": ["actor"]},
    {"name": "critic", "size": 1, "roles": ["critic"]},
    {"name": "ref_reward", "size": 1, "roles": ["reference", "reward"]},
]}


def test_ppo_split_four_ranks_learns(assets, tmp_path):
    # every rank generates (rollout.ranks=all): the critic's and the reward's ranks on a copy of the actor's weights
    # broadcast before each rollout, each sample back to its actor rank (test_checkpoint's split run generates on the
    # actor's ranks only). 5 eval prompts on 2 actor ranks: dealt 3 + 2, generated on 3 engines, scored on the 1-rank
    # reward pool, each score back to its sample
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", placement=SPLIT, run={"total_steps": 12},
                       data={"eval_size": 5}, rollout={"ranks": "all"})
    # a FutureWarning is an error here: none may come from our calls (torch 2.13 renamed FSDP2's collectives)
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=4, timeout=400, PYTHONWARNINGS="error::FutureWarning")
    assert proc.returncode == 0, explain(proc)
    assert "Warning" not in proc.stderr, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == list(range(13)), "one metrics line per step, eval at 0"
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
                "critic/vf_loss", "critic/vf_explained_var", "response_length/mean", "timing_s/gen", "timing_s/step",
                "perf/throughput", "perf/max_memory_allocated_gb", "timing_s/gen_prefill", "timing_s/gen_decode"):
        assert key in rows[1], f"{key} missing from {sorted(rows[1])}"
    assert "eval/score/mean" in rows[0] and "eval/score/mean" in rows[-1]
    # float32: the rollout's log-probs are the actor's teacher-forced ones (FSDP2 over the 2 actor ranks): the
    # replicas on ranks 2 and 3 hold the weights of the latest update
    assert max(r["rollout/logprob_diff_max"] for r in rows[1:]) < 1e-4
    # a weight sync before every rollout after an update; step 1 generates on the weights the step-0 eval synced
    assert rows[1]["timing_s/reshard"] == 0 and all(r["timing_s/reshard"] > 0 for r in rows[2:]), rows
    assert_learns(rows[1:])
    evals = [json.loads(line) for line in (tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()]
    for ev in evals:
        assert len(ev["samples"]) == 5, ev
        for sample in ev["samples"]:
            assert sample["score"] == pytest.approx(ones_fraction(sample["response"], None, "")), sample


def test_grpo_colocate_two_ranks_learns(assets, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 12},
                       algorithm={"adv_estimator": "grpo",
                                  "kl": {"in_reward": False, "in_loss": True, "loss_kind": "k3"}})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=400)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert "critic/vf_loss" not in rows[1] and "actor/kl_loss" in rows[1]
    assert_learns(rows[1:])


def test_same_seed_same_metrics_and_a_failing_reward_does_not_stop_training(assets, tmp_path):
    marker = tmp_path / "hung_once"
    outs = []
    for i in range(2):
        # the second run writes no checkpoint at its end (checkpoint.save_final false), its step-2 one in the
        # background (finished before the process ends): the metrics are the same
        second = {"save_final": False, "save_every": 2, "async_save": True}
        cfg = write_config(tmp_path / f"c{i}.yaml", assets, tmp_path / f"runs{i}", run={"total_steps": 4},
                           reward={"functions": [{"spec": "tests.user_rewards:flaky_ones"}], "timeout_s": 2.0},
                           checkpoint=second if i else {})
        if marker.exists():
            marker.unlink()
        proc = run_python(["train_ppo.py", "--config", cfg], timeout=300, MESHRL_TEST_HANG_MARKER=marker)
        assert proc.returncode == 0, explain(proc)
        assert marker.exists(), "the reward function was expected to hang once"
        outs.append(read_metrics(tmp_path / f"runs{i}"))
    errors = sum(r.get("reward_fn/errors", 0) for r in outs[0])
    timeouts = sum(r.get("reward_fn/timeouts", 0) for r in outs[0])
    assert errors > 0 and timeouts == 1, (errors, timeouts)
    wall_clock = ("timing_s/", "perf/", "health/")  # and the health flags set from the timings
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(wall_clock)} for r in rows]
    assert strip(outs[0]) == strip(outs[1])
    finals = [sorted(p.name for p in (tmp_path / f"runs{i}").glob("*/checkpoints/step_*")) for i in range(2)]
    assert finals == [["step_00000004"], ["step_00000002"]], finals


def test_reward_failures_on_the_eval_set_warn_and_do_not_stop_training(assets, tmp_path):
    """Evaluation scores through the same reward functions: failures there score 0 and are logged, but only a
    training step's own failures stop the run (they used to stop the step after a failing eval)."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": "eval-only"}) + "\n"
                                 for i in range(4)))
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2, "eval_every": 1},
                       data={"eval_path": str(eval_file)},
                       reward={"functions": [{"spec": "tests.user_rewards:fails_on_eval"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == [0, 1, 2] and all("actor/pg_loss" in r for r in rows[1:]), rows
    # every eval sample failed; the training rows count the evals before steps 1 and 2 (4 prompts x eval_n 1 each)
    assert rows[0]["eval/score/mean"] == 0.0 and sum(r.get("reward_fn/errors", 0) for r in rows) == 2 * 4
    assert "evaluation: reward functions failed on" in proc.stderr, explain(proc)


def test_a_reward_model_with_another_tokenizer_exits_2_naming_it(assets, tmp_path):
    other = tmp_path / "rm_other_tokens"
    save_tiny_model(other, build_char_tokenizer("abcdefghij+="), hidden_size=32, num_layers=1, num_heads=4,
                    num_kv_heads=2, intermediate_size=64, max_position_embeddings=64, seed=0)
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", reward={"model_path": str(other)})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert f"reward.model_path={other}: its tokenizer's vocabulary differs from the policy's" in proc.stderr, \
        explain(proc)
    # a folder without a tokenizer: its embedding must hold every id of the policy's
    from transformers import AutoTokenizer

    from roles.reward import check_same_tokens

    bare = tmp_path / "rm_without_tokenizer"
    bare.mkdir()
    config = json.loads((assets / "model" / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "vocab_size": 5}))
    policy = AutoTokenizer.from_pretrained(assets / "model")
    with pytest.raises(ValueError, match=f"its vocabulary has 5 tokens, the policy's tokenizer {len(policy)}"):
        check_same_tokens(str(bare), policy)
    (bare / "config.json").write_text(json.dumps(config))
    check_same_tokens(str(bare), policy)


def test_missing_prompt_column_names_file_and_column(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1=", "ground_truth": "2"}\n')
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", data={"train_path": str(bad)})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert str(bad) in proc.stderr and "'prompt'" in proc.stderr, explain(proc)


def test_tp_peers_score_once_and_agree(assets, tmp_path):
    """tp=2 colocated: the reward function runs once per TP group (tp rank 0), and the peers train on its scores."""
    calls = tmp_path / "calls.txt"
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       placement={"mode": "colocate", "tp": 2}, algorithm={"adv_estimator": "grpo"},
                       reward={"functions": [{"spec": "tests.user_rewards:counted_ones"}]})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=300, MESHRL_TEST_CALLS=calls)
    assert proc.returncode == 0, explain(proc)
    n_eval = len((assets / "test.jsonl").read_text().splitlines())
    # the start-up call on the first train and eval records, eval before and after training, 2 steps of 8 prompts x 4
    # samples; the tp peer scores nothing
    assert len(calls.read_text().splitlines()) == 2 + 2 * n_eval + 2 * 8 * 4
    rows = read_metrics(tmp_path / "runs")
    assert all(r.get("reward_fn/errors", 0) == 0 for r in rows)


def test_every_group_filtered_skips_the_update_without_nan(assets, tmp_path):
    """A constant reward and DAPO dynamic sampling drop every group: no update, no NaN, not counted as diverged."""
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False},
                                  "filters": {"dynamic_sampling": True}},
                       reward={"functions": [{"spec": "tests.user_rewards:constant"}]},
                       checkpoint={"max_skipped_steps": 1})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/empty_batch"] == 1 and r["actor/skipped_steps"] == 0 and r["data/dropped_groups"] == 8, r
        assert all(v is not None for v in r.values()), f"a NaN was logged: {r}"


def test_hsdp_with_int8_gradients_and_accumulated_sync(assets, tmp_path):
    """colocate on 4 ranks as HSDP 2 x 2: int8-compressed gradient all-reduce across the replicas, gradients reduced
    every 2nd micro-batch, the start-up bandwidth check; the run completes and reports what it sent."""
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 3},
                       placement={"mode": "colocate", "dp_replicate": 2},
                       actor={"micro_batch_tokens": 64}, critic={"micro_batch_tokens": 64},
                       comm={"compression": "int8", "grad_sync_every": 2, "bandwidth_check": True})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=4, timeout=400)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert rows[0]["comm/allreduce_busbw_gbps"] > 0
    for r in rows[1:]:
        assert r["comm/grad_bytes"] > 0 and r["comm/critic/grad_bytes"] > 0
        assert 0 < r["perf/comm_fraction"] < 1


@pytest.mark.parametrize(
    "algorithm",
    [
        # GRPO with every filter of the loop: thresholds, DAPO dynamic sampling and overlong penalty, PF-PPO
        # resampling, the replay buffer, guard rails (limits low enough to fire)
        {"adv_estimator": "grpo", "kl": {"in_reward": False, "in_loss": True},
         "filters": {"min_reward": 0.0, "filter_ratio": 0.1, "dynamic_sampling": True, "pf_ppo": "pow",
                     "overlong_buffer": 2, "overlong_penalty": 0.5},
         "replay": {"enabled": True, "capacity": 64, "quality_threshold": 0.2, "mix_fraction": 0.25},
         "guard": {"kl_limit": 1e-9, "var_limit": 1e-9}},
        # no KL term, one optimizer step per rollout: the old log-probs come from the update's forward
        {"adv_estimator": "rloo", "kl": {"in_reward": False}},
        {"adv_estimator": "reinforce_pp", "kl": {"in_reward": True, "controller": "adaptive", "target": 0.01}},
    ],
    ids=["grpo_filters", "rloo_one_step", "reinforce_pp"],
)
def test_estimators_and_filters_run(assets, tmp_path, algorithm):
    one_step = algorithm["adv_estimator"] == "rloo"
    actor = {"ppo_epochs": 1, "mini_batch_size": 0} if one_step else {}
    # GRPO's filters: a reward high for most responses, so that the floors the guard raises (0.1 a step) leave
    # groups to train on whatever the draws
    reward = {"functions": [{"spec": "tests.user_rewards:not_ones"}]} if algorithm["adv_estimator"] == "grpo" else {}
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 3}, algorithm=algorithm,
                       actor=actor, reward=reward)
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    last = rows[-1]
    assert "critic/vf_loss" not in last
    # float32: the engine's log-probs are the actor's, measured by a pass before the update or in the update itself
    assert max(r["rollout/logprob_diff_max"] for r in rows[1:]) < 1e-4
    assert all(("timing_s/old_logprobs" in r) != one_step for r in rows[1:]), rows
    assert ("from the update's forward" in proc.stderr) == one_step, explain(proc)
    if algorithm["adv_estimator"] == "grpo":
        assert "data/dropped_groups" in last and last["replay/size"] > 0
        # the limits are tiny: the variance rail fires every step (min_reward + 0.1 each), the KL rail from step 2 on
        # (at step 1 the policy is still the reference: KL exactly 0), backing the lr off by 0.9 each time
        assert last["guard/min_reward"] == pytest.approx(0.3) and rows[1]["actor/ref_kl"] == 0.0, rows
        assert last["guard/lr_scale"] == pytest.approx(0.9**2), rows
    if algorithm["kl"].get("controller") == "adaptive":
        assert rows[1]["actor/kl_coef"] != rows[3]["actor/kl_coef"]


def test_rollout_batch_lays_out_prompt_and_response_per_row():
    """ppo.rollouts.rollout_batch against a row-by-row layout: ragged prompts, responses of every length up to the
    padded width (one of them empty), each row prompt + response, right-padded with zeros."""
    import torch

    from ppo.rollouts import rollout_batch
    from rollout.native import RolloutOutput

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (7,), generator=gen).tolist()
    prompts = [torch.randint(1, 50, (k,), generator=gen).tolist() for k in lengths]
    r_len = torch.tensor([5, 0, 3, 5, 1, 4, 2])
    mask = (torch.arange(5)[None, :] < r_len[:, None]).long()
    response = torch.randint(1, 50, (7, 5), generator=gen).masked_fill(mask == 0, 63)  # the engine's pad id, say
    out = RolloutOutput(prompts, response, mask, torch.randn(7, 5, generator=gen) * mask)
    batch = rollout_batch(out, [3, 3, 1, 1, 0, 0, 2], torch.device("cpu"))
    width = max(len(p) + int(r) for p, r in zip(prompts, r_len))
    assert batch["input_ids"].shape == (7, width)
    for i, (prompt, r) in enumerate(zip(prompts, r_len.tolist())):
        row = prompt + response[i, :r].tolist()
        assert batch["input_ids"][i].tolist() == row + [0] * (width - len(row))
    assert batch["prompt_len"].tolist() == [len(p) for p in prompts]
    assert batch["response_len"].tolist() == r_len.tolist()
    assert batch["prompt_index"].tolist() == [3, 3, 1, 1, 0, 0, 2]
    assert torch.equal(batch["rollout_logprobs"], out.logprobs)
    empty = torch.empty((0, 0), dtype=torch.long)  # a rank without prompts (the engines' empty output)
    none = rollout_batch(RolloutOutput([], empty, empty.clone(), empty.float()), [], torch.device("cpu"))
    assert none["input_ids"].shape == (0, 1) and none["response_len"].shape == (0,)
