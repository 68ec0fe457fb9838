"""The objectives of 2026 as whole runs of train_ppo.py on the tiny model (tests/test_ppo.py's assets and reward):
each raises the held-out score; on-policy distillation from a teacher trained to the task raises it with no task
reward at all; offline, the KL to the reference is the trained actor's, not the logging policy's."""

from __future__ import annotations

import json

import pytest
import torch
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

from conftest import explain, run_python, torchrun
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model

GROUP = {"kl": {"in_reward": False}}
OBJECTIVES = {
    "gspo": ({"adv_estimator": "grpo", **GROUP},
             {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "clip_low": 0.05, "clip_high": 0.05}),
    "cispo": ({"adv_estimator": "grpo", **GROUP}, {"policy_loss": "cispo", "clip_low": 1.0, "clip_high": 0.2}),
    "dr_grpo": ({"adv_estimator": "grpo", "norm_by_std": False, **GROUP}, {"loss_agg": "seq-mean-token-sum-norm"}),
    "reinforce_pp_baseline": ({"adv_estimator": "reinforce_pp_baseline", **GROUP}, {}),
}


def eval_rise(rows: list[dict]) -> tuple[float, float]:
    return rows[0]["eval/score/mean"], rows[-1]["eval/score/mean"]


def assert_eval_closes_gap(rows: list[dict], share: float = 0.4) -> None:
    """The held-out score (greedy, in [0, 1]) closes at least `share` of the start's distance to the best score."""
    before, after = eval_rise(rows)
    assert before < 0.9, f"the start model already solves the task ({before}): the run proves nothing"
    assert after >= before + share * (1.0 - before), f"eval {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_learns(name, assets, tmp_path):  # noqa: F811
    algorithm, actor = OBJECTIVES[name]
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 12}, algorithm=algorithm,
                       actor=actor)
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert "rollout_corr/mismatch_kl" in rows[1] and rows[1]["rollout_corr/mismatch_kl"] < 1e-6, rows[1]
    assert_eval_closes_gap(rows)


@pytest.fixture(scope="module")
def teacher(assets, tmp_path_factory) -> str:  # noqa: F811
    """A wider model than the student, trained by SFT to answer every prompt with '1111' (what the reward wants)."""
    return make_teacher(assets, tmp_path_factory.mktemp("teacher") / "model")


def make_teacher(assets, path) -> str:  # noqa: F811
    from roles.sft import encode_pairs, sft_train

    tokenizer = build_char_tokenizer("0123456789+=")
    model = save_tiny_model(path, tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, max_position_embeddings=64, seed=1)
    records = [{"prompt": json.loads(line)["prompt"], "response": "1111"}
               for line in (assets / "train.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    sft_train(model, encode_pairs(records, tokenizer), 150, 3e-3, 16, 0, torch.device("cpu"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_on_policy_distillation_from_a_teacher_alone_raises_the_student(assets, teacher, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 12},
                       algorithm={"adv_estimator": "reinforce_pp", "kl": {"in_reward": False},
                                  "distill": {"coef": 1.0, "task_weight": 0.0}},
                       teacher={"model_path": teacher, "fsdp": {"param_dtype": "float32"}})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    # the start-up line names the roles built: no critic (GRPO family) and no reference (no KL term) here
    assert "pool all: ranks 0-0 roles actor,reward,teacher mesh" in proc.stdout, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert "timing_s/teacher" in rows[1] and "actor/reward_kl" not in rows[1], rows[1]
    kl = [r["distill/reverse_kl"] for r in rows[1:]]
    assert kl[-1] < kl[0] / 2, f"the student did not move towards the teacher: {kl}"
    assert_eval_closes_gap(rows)


def test_a_teacher_with_another_tokenizer_is_refused(assets, tmp_path):  # noqa: F811
    other = build_char_tokenizer("0123456789+-=")
    save_tiny_model(tmp_path / "teacher", other, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0)
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", algorithm={"distill": {"coef": 1.0}},
                       teacher={"model_path": str(tmp_path / "teacher")})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "teacher.model_path=" in proc.stderr and "its tokenizer differs from the actor's" in proc.stderr


def test_offline_kl_is_measured_on_the_trained_actor(assets, tmp_path):  # noqa: F811
    """Rollouts logged by the reference itself (lr 0), then offline training with the KL in the reward: the KL of
    the actor being trained leaves 0 once it moves (it read 0.0 at every step when measured on the logged
    log-probs), and the adaptive controller sees it."""
    online = write_config(tmp_path / "online.yaml", assets, tmp_path / "runs", run={"total_steps": 2, "name": "log",
                          "save_rollouts": True}, algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}},
                          actor={"optim": {"lr": 0.0}})
    proc = run_python(["train_ppo.py", "--config", online], timeout=300)
    assert proc.returncode == 0, explain(proc)
    offline = write_config(
        tmp_path / "offline.yaml", assets, tmp_path / "runs", run={"total_steps": 4, "name": "t"},
        data={"train_path": "", "rollouts_path": str(tmp_path / "runs" / "log" / "rollouts")},
        algorithm={"adv_estimator": "grpo", "kl": {"in_reward": True, "coef": 0.05, "controller": "adaptive",
                                                   "target": 0.001, "horizon": 32}},
        actor={"optim": {"lr": 1e-2}, "ppo_epochs": 1, "mini_batch_size": 0})
    proc = run_python(["train_ppo.py", "--config", offline], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")[1:]
    # step 1: the actor is still the reference (exactly 0); from step 2 it has moved away from it
    assert rows[0]["actor/reward_kl"] == 0 and rows[0]["actor/ref_kl"] == 0, rows[0]
    assert all(r["actor/ref_kl"] > 1e-4 for r in rows[1:]), [r["actor/ref_kl"] for r in rows]
    # the adaptive coefficient (x 0.8 to x 1.2 a step: its horizon is one step's 32 samples) rises when the KL
    # runs above the target, which it never did while it read 0
    coefs = [r["actor/kl_coef"] for r in rows]
    assert any(b > a for a, b in zip(coefs, coefs[1:])), coefs


def test_with_top_p_the_engine_and_the_trainer_score_one_distribution(assets, tmp_path):  # noqa: F811
    """Under top-p the native engine's log-probs are of the whole tempered distribution, before the cut, like the
    trainer's: the engine/trainer mismatch is 0 and PPO's ratio is 1 at the first update of every step (old
    log-probs from a separate forward pass)."""
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       rollout={"top_p": 0.5, "temperature": 0.8},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}},
                       actor={"old_logprobs": "forward", "ppo_epochs": 1, "mini_batch_size": 0})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    for row in read_metrics(tmp_path / "runs")[1:]:
        assert row["rollout/logprob_diff_max"] < 1e-4 and row["rollout_corr/mismatch_kl"] < 1e-8, row
        assert abs(row["actor/ppo_kl"]) < 1e-7 and row["actor/pg_clipfrac"] == 0, row


def test_a_teacher_in_its_own_pool_scores_as_a_colocated_one(assets, teacher, tmp_path):  # noqa: F811
    """The teacher placed on a rank of its own (split pools, its log-probs sent back to the actor's rank) gives the
    run the colocated teacher gives: the same samples, the same reverse KL, step for step."""
    common = dict(run={"total_steps": 2, "eval_every": 0},
                  algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}, "distill": {"coef": 0.5}},
                  teacher={"model_path": teacher, "fsdp": {"param_dtype": "float32"}})
    one = write_config(tmp_path / "one.yaml", assets, tmp_path / "one", **common)
    proc = run_python(["train_ppo.py", "--config", one], timeout=300)
    assert proc.returncode == 0, explain(proc)
    split = {"mode": "split", "pools": [{"name": "actor", "size": 1, "roles": ["actor", "reward"]},
                                        {"name": "teacher", "size": 1, "roles": ["teacher"]}]}
    two = write_config(tmp_path / "two.yaml", assets, tmp_path / "two", placement=split, **common)
    proc = torchrun(["train_ppo.py", "--config", two], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "pool teacher: ranks 1-1 roles teacher" in proc.stdout, explain(proc)
    colocated, apart = read_metrics(tmp_path / "one")[1:], read_metrics(tmp_path / "two")[1:]
    for a, b in zip(colocated, apart, strict=True):
        for key in ("distill/reverse_kl", "reward/score/mean", "actor/pg_loss", "response_length/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


def test_the_quickstart_builds_its_teacher_once(tmp_path):
    from transformers import AutoModelForCausalLM

    import config as C
    from recipes.quickstart import prepare_quickstart

    cfg = C.load_config("configs/distill_quickstart.yaml", [
        f"quickstart.workdir={tmp_path}", "quickstart.n_train=40", "quickstart.n_test=8", "quickstart.hidden_size=16",
        "quickstart.sft_steps=2", "quickstart.teacher_hidden_size=32", "quickstart.teacher_sft_steps=2"])
    paths = prepare_quickstart(cfg.quickstart, 0)
    student = AutoModelForCausalLM.from_pretrained(paths["model"])
    teacher = AutoModelForCausalLM.from_pretrained(paths["teacher"])
    assert (student.config.hidden_size, teacher.config.hidden_size) == (16, 32)
    assert student.config.vocab_size == teacher.config.vocab_size
    built = {name: (tmp_path / name / "model.safetensors").stat().st_mtime_ns for name in ("sft", "teacher")}
    prepare_quickstart(cfg.quickstart, 0)  # built already: nothing is redone
    assert built == {name: (tmp_path / name / "model.safetensors").stat().st_mtime_ns for name in ("sft", "teacher")}
    cfg.quickstart.teacher_sft_steps = 3  # another teacher: only the teacher is rebuilt
    prepare_quickstart(cfg.quickstart, 0)
    assert (tmp_path / "sft" / "model.safetensors").stat().st_mtime_ns == built["sft"]
    assert (tmp_path / "teacher" / "model.safetensors").stat().st_mtime_ns != built["teacher"]
