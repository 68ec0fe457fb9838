"""Config schema, overrides, and the exit-code-2 contract for mistakes (checked on real entry-point processes)."""

from __future__ import annotations

import pytest
import yaml
from transformers import Qwen2Config

import config as C
from conftest import explain, run_python, torchrun


def write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_yaml_and_overrides(tmp_path):
    path = write(tmp_path, {"run": {"name": "x", "seed": 3}, "actor": {"optim": {"lr": "1e-5"}}})
    cfg = C.load_config(path, ["actor.optim.lr=2e-6", "placement.mode=split", "critic.fsdp.cpu_offload=true",
                               "reward.functions=[{spec: exact_match, weight: 0.5}]"])
    assert cfg.run.name == "x" and cfg.run.seed == 3
    assert cfg.actor.optim.lr == 2e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.placement.mode == "split" and cfg.critic.fsdp.cpu_offload is True
    assert cfg.reward.functions[0].spec == "exact_match" and cfg.reward.functions[0].weight == 0.5
    assert cfg.run.total_steps == C.RunConfig().total_steps


@pytest.mark.parametrize(
    "raw, overrides, needle",
    [
        ({"run": {"nmae": "x"}}, [], "unknown key 'run.nmae'; did you mean 'run.name'?"),
        ({"actor": {"optimm": {}}}, [], "did you mean 'actor.optim'?"),
        ({"run": {"seed": "three"}}, [], "run.seed='three': expected an integer"),
        ({"run": {"seed": 1.5}}, [], "run.seed=1.5: expected an integer"),
        ({"actor": {"fsdp": {"cpu_offload": "yes"}}}, [], "actor.fsdp.cpu_offload='yes': expected true or false"),
        ({}, ["placement.mode=ring"], "placement.mode='ring': must be one of 'colocate', 'split'"),
        ({}, ["actor.optim.lr"], "expected KEY=VALUE"),
        ({}, ["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo': must be one of 'gae', 'grpo'"),
        ({"placement": {"pools": [{"name": "a", "sise": 2}]}}, [], "did you mean 'placement.pools[0].size'?"),
        ({"data": {"eval_path": ["a.jsonl", 3]}}, [], "data.eval_path[1]=3: expected a string"),
        ({"data": {"eval_path": 3}}, [], "data.eval_path=3: expected a string"),
    ],
)
def test_key_and_type_errors_name_the_key(tmp_path, raw, overrides, needle):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(write(tmp_path, raw), overrides)
    assert needle in str(err.value)


def test_eval_path_is_one_file_or_several(tmp_path):
    assert C.load_config(write(tmp_path, {"data": {"eval_path": "a.jsonl"}})).data.eval_path == "a.jsonl"
    both = C.load_config(write(tmp_path, {}), ["data.eval_path=[a.jsonl, b.parquet]"]).data.eval_path
    assert both == ["a.jsonl", "b.parquet"] and C.path_list(both) == both and C.path_list("a") == ["a"]
    assert C.path_list(None) == []
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = C.load_config(write(tmp_path, {"data": {"train_path": str(data), "eval_path": [str(data), "nowhere.jsonl"]},
                                         "model": {"path": model_dir(tmp_path)},
                                         "reward": {"functions": [{"spec": "gsm8k"}]}}))
    with pytest.raises(C.ConfigError, match=r"data.eval_path\[1\]='nowhere.jsonl': not found"):
        C.check_ppo(cfg, 1)


def model_dir(tmp_path, heads=4, kv_heads=2):
    path = tmp_path / "model"
    Qwen2Config(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=32).save_pretrained(path)
    return str(path)


def split_pools(*sizes_tp):
    roles = [["actor", "reference"], ["critic"], ["reward"]]
    return [{"name": f"p{i}", "size": s, "roles": roles[i], "tp": tp} for i, (s, tp) in enumerate(sizes_tp)]


@pytest.mark.parametrize(
    "world, placement, needle",
    [
        (8, {"mode": "split", "pools": split_pools((4, 1), (2, 1), (1, 1))},
         "pool sizes add up to 7 (p0=4 + p1=2 + p2=1) but the world size is 8"),
        (4, {"mode": "colocate", "tp": 3}, "placement.tp=3: must divide the pool size 4; valid: [1, 2, 4]"),
        (4, {"mode": "colocate", "tp": 4},
         "placement.tp=4: must divide the model's num_key_value_heads=2; valid: [1, 2]"),
        (3, {"mode": "split", "pools": split_pools((2, 1), (1, 1))}, "no pool hosts the role(s) reward"),
        (4, {"mode": "split", "pools": [{"name": "a", "size": 4, "roles": ["actor", "judge"]}]},
         "unknown role 'judge'"),
    ],
)
def test_world_errors(tmp_path, world, placement, needle):
    cfg = C.load_config(write(tmp_path, {"placement": placement, "model": {"path": model_dir(tmp_path)}}))
    with pytest.raises(C.ConfigError) as err:
        C.check_world(cfg, world)
    assert needle in str(err.value)


def test_entry_point_exits_2_with_one_message(tmp_path):
    """The real entry point, as rank 0 of a world of 4 (checks run before any process group exists)."""
    bad = write(tmp_path, {"placement": {"mode": "split", "pools": split_pools((2, 1), (1, 1), (2, 1))}})
    proc = run_python(["train_ppo.py", "--config", bad], RANK=0, WORLD_SIZE=4, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("config error:") == 1 and "world size is 4" in proc.stderr, explain(proc)
    proc = run_python(["train_ppo.py", "--config", bad, "run.sed=1"], timeout=120)
    assert proc.returncode == 2 and "did you mean 'run.seed'?" in proc.stderr, explain(proc)
    proc = run_python(["train_ppo.py", "--config", str(tmp_path / "missing.yaml")], timeout=120)
    assert proc.returncode == 2 and "file not found" in proc.stderr, explain(proc)


def test_every_rank_stops_under_torchrun(tmp_path):
    bad = write(tmp_path, {"placement": {"mode": "colocate", "tp": 4}, "model": {"path": model_dir(tmp_path)}})
    # 3 ranks: the line must reach the console however the ranks race to exit (it went missing when another rank
    # ended first and torchrun stopped rank 0 before it printed)
    proc = torchrun(["train_ppo.py", "--config", bad], nproc=3, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("config error: placement.tp=4: must divide the pool size 3") == 1, explain(proc)
    # torchrun reports the exit code of the first worker to fail: rank 0's 2; none ran on
    assert "exitcode: 2" in out and "Traceback (most recent call last):\n  File \"/" not in proc.stdout, explain(proc)


def test_base_file_is_read_first(tmp_path):
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({"run": {"name": "p", "seed": 5}, "rollout": {"n": 4}}))
    child = write(tmp_path, {"base": "parent.yaml", "run": {"name": "c"}}, name="child.yaml")
    cfg = C.load_config(child)
    assert (cfg.run.name, cfg.run.seed, cfg.rollout.n) == ("c", 5, 4)
    loop = write(tmp_path, {"base": "loop.yaml"}, name="loop.yaml")
    with pytest.raises(C.ConfigError, match="include each other"):
        C.load_config(loop)


def test_shipped_configs_load():
    for name in ("quickstart.yaml", "quickstart_split.yaml", "distill_quickstart.yaml"):
        cfg = C.load_config(f"configs/{name}")
        C.check_ppo(cfg, 4 if "split" in name else 1)
    # the GSM8K example names files the user brings; its keys, types and placement must hold all the same
    cfg = C.load_config("configs/gsm8k_qwen2.5_1.5b.yaml")
    C.check_world(cfg, 8, C.required_roles(cfg))


@pytest.mark.parametrize("override, needle", [
    ("rollout.temperature=0", "rollout.temperature=0.0: must be in (0, inf) (PPO samples from the policy"),
    ("rollout.top_p=0", "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.eval_n=0", "rollout.eval_n=0: must be in [1, inf)"),
    ("actor.micro_batch_tokens=0", "actor.micro_batch_tokens=0: must be in [1, inf)"),
    ("actor.dual_clip=1.0", "actor.dual_clip=1.0: must be in (1, inf)"),
    ("critic.value_clip=0", "critic.value_clip=0.0: must be in (0, inf)"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5: must be in [0, 1]"),
    ("algorithm.kl.target=0", "algorithm.kl.target=0.0: must be in (0, inf)"),
    ("algorithm.kl.coef=-1", "algorithm.kl.coef=-1.0: must be in [0, inf)"),
    ("algorithm.replay.mix_fraction=2", "algorithm.replay.mix_fraction=2.0: must be in [0, 1]"),
    ("actor.optim.betas=[0.9]", "actor.optim.betas=[0.9]: expected two numbers in [0, 1)"),
    ("algorithm.filters.overlong_buffer=1000", "algorithm.filters.overlong_buffer=1000: must be <= rollout"),
    ("algorithm.kl.loss_kind=k1", "algorithm.kl.loss_kind=k1: as a loss term this estimator has no useful gradient"),
    ("algorithm.kl.loss_kind=abs", "algorithm.kl.loss_kind=abs"),
    ("algorithm.kl.kind=k3", "algorithm.kl.kind is no longer a key: it was split in two"),
    ("algorithm.kl.controller=adaptive algorithm.kl.coef=0", "the adaptive controller scales the coefficient"),
    ("actor.tis_cap=2 rollout.top_p=0.9", "the native engine reports log-probs before the top-k/top-p cut"),
    ("actor.tis_cap=2 rollout.top_k=50", "actor.tis_cap with rollout.top_p=1.0 / top_k=50"),
    ("actor.rollout_correction.mask=geometric rollout.top_p=0.9", "actor.rollout_correction.mask with rollout.top_p"),
    ("actor.tis_cap=2 actor.rollout_correction.weight=sequence", "both set importance weights"),
    ("actor.rollout_correction.mask_high=1", "actor.rollout_correction.mask_high=1.0: must be in (1, inf)"),
    ("actor.clip_low=1", "clip_low=1 (no lower bound) is for policy_loss=cispo"),
    ("actor.policy_loss=gspo actor.dual_clip=3", "the dual clip bounds the ppo objective's loss"),
    ("actor.policy_loss=grpo", "actor.policy_loss"),
    ("algorithm.adv_estimator=reinforce_pp_baseline rollout.n=1", "compares the samples of a prompt"),
    ("algorithm.distill.coef=1", "on-policy distillation needs a teacher; set teacher.model_path"),
    ("teacher.model_path=t", "the teacher would be loaded and never used"),
    # the rail's KL without a reference is the update's own ratio: 0 with one optimizer step per rollout
    ("algorithm.guard.kl_limit=0.1 algorithm.adv_estimator=grpo algorithm.kl.in_reward=false rollout.n=4",
     "so the rail could never fire"),
    ("algorithm.guard.kl_limit=0.1 algorithm.adv_estimator=grpo algorithm.kl.in_reward=false rollout.n=4 "
     "actor.old_logprobs=forward", "so the rail could never fire"),
])
def test_values_that_would_fail_at_step_one_fail_at_config_time(override, needle):
    with pytest.raises(C.ConfigError) as err:
        cfg = C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                                   *override.split()])
        C.check_ppo(cfg, 1)
    assert needle in str(err.value)


def test_a_rollout_over_the_world_refuses_replicas_that_differ():
    # local SGD keeps the actor's replicas apart between averagings; the engines outside the pool take one copy
    pools = ("placement.pools=[{name: a, size: 2, dp_replicate: 2, roles: [actor, reference]},"
             " {name: b, size: 2, roles: [critic, reward]}]")
    base = ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]", "placement.mode=split", pools,
            "comm.param_averaging=true"]
    C.check_ppo(C.load_config(None, base), 4)  # the actor's pool generates alone: fine
    with pytest.raises(C.ConfigError, match="comm.param_averaging=true with a rollout over the world"):
        C.check_ppo(C.load_config(None, [*base, "rollout.ranks=all"]), 4)


def test_the_kl_rail_without_a_reference_is_fine_with_several_steps_per_rollout():
    base = ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]", "algorithm.guard.kl_limit=0.1",
            "algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false", "rollout.n=4"]
    C.check_ppo(C.load_config(None, [*base, "actor.ppo_epochs=2"]), 1)
    C.check_ppo(C.load_config(None, [*base, "actor.mini_batch_size=16"]), 1)


def test_tis_with_the_whole_distribution_is_fine():
    C.check_ppo(C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                                     "actor.tis_cap=2", "rollout.top_p=1.0", "rollout.top_k=0"]), 1)


def test_kl_estimators_default_per_use():
    kl = C.KLConfig()
    # the reward: k1, unbiased for the KL's value; the loss: k3, whose gradient is not 0 in expectation (k1's is)
    assert (kl.reward_kind, kl.loss_kind) == ("k1", "low_var_kl")
    assert kl.target == 0.1, "the adaptive target is a per-token mean (see algo/kl_control.py)"


def test_temperature_zero_exits_2_before_any_step(tmp_path):
    proc = run_python(["train_ppo.py", "--config", "configs/quickstart.yaml", "rollout.temperature=0",
                       f"run.output_dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2 and "rollout.temperature=0.0" in proc.stderr, explain(proc)
    assert not any(tmp_path.iterdir()), "nothing written"


def test_a_missing_or_unreadable_config_is_named(tmp_path, capsys):
    """No arguments, an empty file, a `base:` that is not there, a byte that is not UTF-8: each says what is wrong
    with which file (they used to talk about the reward, blame --config, or print a traceback)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    child = tmp_path / "child.yaml"
    child.write_text("base: gone.yaml\nrun: {name: c}\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"run:\n  name: caf\xe9\n")
    cases = [([], "no config given: python "), (["--config", str(empty)], f"--config {empty}: the file is empty"),
             (["--config", str(child)], f"--config {child}: base: file not found: '{tmp_path / 'gone.yaml'}'"),
             (["--config", str(latin)], f"--config {latin}: line 2, column 12: byte 0xe9 is not UTF-8 text")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            C.parse_or_exit(argv, world_size=1, rank=0)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_old_logprobs_need_a_forward_pass_only_when_the_update_cannot_give_them():
    """The update's own forward stands in for PPO's old log-probs when it is the rollout's only optimizer step and
    nothing reads them earlier; every other case names its reason (config.old_logprobs_pass)."""
    one_step = ["algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false", "actor.ppo_epochs=1",
                "data.batch_size=4", "rollout.n=4"]
    for extra in ([], ["actor.mini_batch_size=0"], ["actor.mini_batch_size=16"], ["actor.mini_batch_size=64"],
                  ["algorithm.adv_estimator=gae"], ["actor.tis_cap=2.0"]):
        assert C.old_logprobs_pass(C.load_config(None, one_step + extra)) is None, extra
    for extra, needle in ((["actor.old_logprobs=forward"], "actor.old_logprobs=forward"),
                          (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
                          (["actor.mini_batch_size=8"], "below the 16 samples"),
                          (["algorithm.kl.in_loss=true"], "algorithm.kl"),
                          (["algorithm.kl.in_reward=true"], "algorithm.kl"),
                          (["algorithm.replay.enabled=true"], "algorithm.replay"),
                          (["data.rollouts_path=logged.jsonl"], "offline")):
        reason = C.old_logprobs_pass(C.load_config(None, one_step + extra))
        assert reason is not None and needle in reason, (extra, reason)
    with pytest.raises(C.ConfigError, match="actor.old_logprobs"):
        C.load_config(None, ["actor.old_logprobs=sometimes"])


def test_a_key_given_twice_in_a_config_file_or_an_override_value_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys silently: a section or a setting written twice trained with one of them
    and nothing said so."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("run:\n  name: a\n  seed: 1\nactor:\n  optim: {lr: 1.0e-3}\nrun:\n  seed: 2\n")
    with pytest.raises(C.ConfigError, match=r"twice.yaml: line 6: the key 'run' is given twice in one mapping \(first "
                                            r"on line 1\)"):
        C.load_config(str(twice))
    inline = tmp_path / "inline.yaml"
    inline.write_text("actor:\n  optim: {lr: 1.0e-3, lr: 2.0e-3}\n")
    with pytest.raises(C.ConfigError, match="line 2: the key 'lr' is given twice"):
        C.load_config(str(inline))
    with pytest.raises(C.ConfigError, match=r"override 'reward.functions=\[\{spec: a, spec: b\}\]': line 1: the key "
                                            "'spec' is given twice"):
        C.load_config(None, ["reward.functions=[{spec: a, spec: b}]"])
