"""LoRA for the actor and critic (roles/lora.py, issue 39): the config's checks, the roles on FSDP2 (1 and 2 gloo
ranks: tests/dist/lora.py), and real runs of train_ppo.py: a LoRA PPO run learns, resumes exactly, and exports as a
peft adapter folder and as a merged model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import comparable, config
from test_ppo import assert_learns, assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

import config as C
from conftest import explain, run_python, torchrun

# the tiny model's logits are near uniform (a small random LM head after the final norm): adapters in the blocks alone
# move the greedy answers (eval) but hardly sharpen the sampled ones, so the LM head gets an adapter too
LORA = {"lora": {"rank": 8, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj", "lm_head"]}}
SECTIONS = dict(actor={**LORA, "optim": {"lr": 3e-2}}, critic={**LORA, "optim": {"lr": 3e-2}})


@pytest.mark.parametrize("overrides, message", [
    (["placement.tp=2", "actor.lora.dropout=0.1"], "actor.lora.dropout=0.1 with placement.tp=2"),
    (["actor.lora.target_modules=q_proj"], "a list of module names"),
    (["actor.lora.target_modules=[]"], "name the modules to adapt"),
    (["actor.lora.alpha=0"], "actor.lora.alpha=0.0"),
    (["actor.lora.init_path=/nonexistent"], "not a peft adapter folder"),
])
def test_lora_config_refuses_what_it_cannot_run(overrides, message):
    cfg = C.load_config(None, ["quickstart.enabled=true", "actor.lora.rank=8", "run.device=cpu", *overrides])
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        C.check_lora(cfg, 2) if "alpha" not in message else C.check_ranges(cfg, C.PPO_RANGES)


def test_lora_config_keys():
    cfg = C.load_config(None, ["actor.lora.rank=16", "actor.lora.target_modules=[q_proj,v_proj]",
                               "critic.lora.init_path=adapters/critic"])
    assert cfg.actor.lora.rank == 16 and cfg.actor.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.critic.lora.target_modules == "all-linear" and cfg.critic.lora.init_path == "adapters/critic"
    assert C.load_config(None, []).actor.lora.rank == 0  # off by default


def test_lora_roles_on_one_and_two_ranks(tmp_path):
    proc = torchrun(["tests/dist/lora.py", str(tmp_path)], nproc=2, timeout=400)
    assert proc.returncode == 0, explain(proc)
    for rank in (0, 1):
        assert f"rank {rank} PASS adapters only" in proc.stdout, explain(proc)
        assert f"rank {rank} PASS merged engine and base reference, 2 ranks" in proc.stdout, explain(proc)
        assert f"rank {rank} PASS merged engine and base reference, 2 ranks HF forward" in proc.stdout, explain(proc)
    assert "PASS same metrics 1 vs 2 ranks" in proc.stdout, explain(proc)
    assert "rank 0 PASS merged engine and base reference, 1 rank" in proc.stdout, explain(proc)


def test_lora_ppo_learns_exports_an_adapter_and_a_merged_model_and_starts_from_it(assets, tmp_path):  # noqa: F811
    from peft import PeftModel

    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 12}, **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=600)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    # the reference is the actor's base (adapters off): the adapters start at zero, so the first KL is 0
    first = next(r for r in rows if "actor/ref_kl" in r)
    assert abs(first["actor/ref_kl"]) < 1e-6, first
    assert_learns(rows[1:])

    latest = tmp_path / "runs" / "t" / "checkpoints" / "latest"
    step = latest.parent / latest.read_text().strip()
    saved = dcp.FileSystemReader(str(step / "actor")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]  # the adapters only
    critic_keys = [k for k in dcp.FileSystemReader(str(step / "critic")).read_metadata().state_dict_metadata
                   if k.startswith("model.")]
    assert all(".lora_" in k or k.startswith("model.score.") for k in critic_keys), critic_keys

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for out, extra in ((adapter, []), (merged, ["--merged"])):
        proc = run_python(["scripts/export_hf.py", str(latest), "--out", str(out), *extra])
        assert proc.returncode == 0, explain(proc)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(assets / "model")
    models = {"peft adapter": PeftModel.from_pretrained(base, adapter).eval(),
              "merged": AutoModelForCausalLM.from_pretrained(merged).eval()}
    tokenizer = AutoTokenizer.from_pretrained(merged)
    final_eval = json.loads((tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()[-1])
    assert final_eval["step"] == 12
    for sample in final_eval["samples"]:
        ids = torch.tensor([tokenizer(sample["prompt"])["input_ids"]])
        for name, model in models.items():
            with torch.no_grad():
                gen = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            assert text == sample["response"], (name, sample, text)

    # the critic's adapters and trained value head: the peft folder on the base and the merged model give one value
    from roles.modeling import load_value_model

    critic_adapter, critic_merged = tmp_path / "critic_adapter", tmp_path / "critic_merged"
    for out, extra in ((critic_adapter, []), (critic_merged, ["--merged"])):
        proc = run_python(["scripts/export_hf.py", str(latest), "--out", str(out), "--role", "critic", *extra])
        assert proc.returncode == 0, explain(proc)
    ids = torch.tensor([tokenizer("3+4=7")["input_ids"]])
    with torch.no_grad():
        via_peft = PeftModel.from_pretrained(load_value_model(str(assets / "model")), critic_adapter).eval()(
            input_ids=ids).logits
        merged_values = load_value_model(str(critic_merged)).eval()(input_ids=ids).logits
    torch.testing.assert_close(via_peft, merged_values, rtol=1e-4, atol=1e-5)

    # the exported adapter as the start of another run (actor.lora.init_path): its eval before any step is the
    # first run's final eval
    again = write_config(tmp_path / "again.yaml", assets, tmp_path / "again", run={"total_steps": 1},
                         actor={"lora": {"init_path": str(adapter)}})
    proc = run_python(["train_ppo.py", "--config", again], timeout=600)
    assert proc.returncode == 0, explain(proc)
    start = read_metrics(tmp_path / "again")[0]
    assert start["step"] == 0 and start["eval/score/mean"] == rows[-1]["eval/score/mean"], (start, rows[-1])


def test_lora_grpo_colocate_two_ranks_learns(assets, tmp_path):  # noqa: F811
    # FSDP2 over 2 ranks through train_ppo.py; the KL loss against the actor's base (adapters off) on the same shards
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 12},
                       algorithm={"adv_estimator": "grpo",
                                  "kl": {"in_reward": False, "in_loss": True, "loss_kind": "k3"}},
                       actor=SECTIONS["actor"])
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=400)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    # before the first update the policy is the base (the adapters start at zero); the updates move it away
    assert "critic/vf_loss" not in rows[1] and rows[1]["actor/ref_kl"] == pytest.approx(0, abs=1e-6)
    assert rows[-1]["actor/ref_kl"] > 1e-2 and rows[-1]["actor/kl_loss"] > 1e-2
    assert_learns(rows[1:])


def test_lora_split_pools_send_the_merged_weights_to_the_replicas(assets, tmp_path):  # noqa: F811
    # rollout.ranks=all: the reward's rank generates on a replica, sent the actor's weights with the adapters merged
    # (the actor's own engine merges them in place); in float32 every sample's engine log-probs are the actor's
    # teacher-forced ones with its adapters, which the updates have moved away from the base by step 2
    split = {"mode": "split", "pools": [{"name": "actor", "size": 1, "roles": ["actor"]},
                                        {"name": "reward", "size": 1, "roles": ["reward"]}]}
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 3}, placement=split,
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}}, rollout={"ranks": "all"},
                       actor=SECTIONS["actor"])
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=400)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")[1:]
    assert all(r["timing_s/reshard"] > 0 for r in rows[1:]), rows
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4, [r["rollout/logprob_diff_max"] for r in rows]
    assert rows[1]["actor/grad_norm"] > 0


def test_lora_resume_equals_uninterrupted(assets, tmp_path):  # noqa: F811
    whole = write_config(tmp_path / "whole.yaml", assets, tmp_path / "whole", run={"total_steps": 4}, **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", whole])
    assert proc.returncode == 0, explain(proc)
    reference = comparable(read_metrics(tmp_path / "whole"))
    # 3 steps (checkpoints at 2 and 3), step 3's adapters damaged: the resume starts from step 2, as
    # test_checkpoint's does (the last step's checkpoint comes after the final eval)
    first = config(tmp_path, assets, "a", run={"total_steps": 3}, checkpoint={"save_every": 2}, **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", first])
    assert proc.returncode == 0, explain(proc)
    shard = next((tmp_path / "runs" / "t" / "checkpoints" / "step_00000003" / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    second = config(tmp_path, assets, "b", run={"total_steps": 4}, checkpoint={"save_every": 2}, **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", second])
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stderr and "step_00000002 (step 2)" in proc.stderr, explain(proc)
    rows = comparable(read_metrics(tmp_path / "runs"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[3:] == reference[3:]
    # another alpha would rescale the saved adapters: refused on resume (exit 2), nothing trained
    rescaled = {**SECTIONS, "actor": {**SECTIONS["actor"], "lora": {**LORA["lora"], "alpha": 64}}}
    third = config(tmp_path, assets, "c", run={"total_steps": 6}, checkpoint={"save_every": 2}, **rescaled)
    proc = run_python(["train_ppo.py", "--config", third])
    assert proc.returncode == 2 and "actor.lora.alpha: 32.0 -> 64.0" in proc.stderr, explain(proc)


@pytest.mark.parametrize("role,dtype", [("actor", "float32"), ("actor", "bfloat16"), ("critic", "float32")])
def test_planner_counts_base_and_adapters_as_allocated(tmp_path, role, dtype):
    from test_plan import allocated, one_step, tiny_model

    import plan as P
    from roles.lora import apply_lora, value_head_name
    from roles.modeling import load_causal_lm, load_value_model
    from roles.update_loop import make_optimizer

    path = tiny_model(tmp_path / "m")
    cfg = C.load_config(None, [f"model.path={path}", f"{role}.lora.rank=4", f"{role}.fsdp.param_dtype={dtype}",
                               f"{role}.lora.target_modules=[q_proj,v_proj,down_proj]"])
    model = (load_causal_lm if role == "actor" else load_value_model)(path)
    section = getattr(cfg, role)
    adapters = apply_lora(model, section.lora, dtype, value_head_name(model) if role == "critic" else None)
    optimizer = make_optimizer(adapters.model, section.optim)
    planned = P.role_plan(cfg, role, P.model_shape(path, "lm" if role == "actor" else "value", "model.path"), 1, 1, 1)
    if dtype == "float32":  # the CPU forward needs one dtype (FSDP2's mixed precision casts on GPUs)
        one_step(adapters.model, optimizer)
        assert (planned.params, planned.grads, planned.optim) == allocated(adapters.model, optimizer)
    else:
        assert planned.params == allocated(adapters.model, optimizer)[0]
    full = P.role_plan(C.load_config(None, [f"model.path={path}"]), role,
                       P.model_shape(path, "lm" if role == "actor" else "value", "model.path"), 1, 1, 1)
    assert planned.optim < full.optim / 10


def test_planner_fits_a_7b_lora_grpo_on_one_gpu_where_full_training_does_not(tmp_path):
    import plan as P

    arch = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
            "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
            "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    grpo = ["algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false", "algorithm.kl.in_loss=true",
            f"model.path={tmp_path}", "data.batch_size=8", "rollout.n=4", "data.max_prompt_len=512",
            "rollout.max_new_tokens=512", "actor.micro_batch_tokens=2048", "actor.fsdp.activation_checkpointing=true",
            "reward.functions=[{spec: gsm8k}]", "rollout.max_num_seqs=32"]
    lora = P.make_plan(C.load_config(None, [*grpo, "actor.lora.rank=16"]), 1, 141 * P.GiB)
    full = P.make_plan(C.load_config(None, grpo), 1, 141 * P.GiB)
    (pool,), (full_pool,) = lora.pools, full.pools
    assert pool.roles["reference"].params == 0  # the actor's base, adapters off
    assert pool.fits(141 * P.GiB) and not full_pool.fits(141 * P.GiB), (pool.peak / P.GiB, full_pool.peak / P.GiB)
    base = 7.6e9 * 2  # the frozen base in bf16
    assert base < pool.roles["actor"].params < base * 1.05


# LoRA SFT on two ranks: tests/test_sft.py (parametrised over full and LoRA training)


def test_lora_sigterm_saves_the_adapters_and_the_resume_continues_exactly(assets, tmp_path):  # noqa: F811
    import signal

    from conftest import start_run_and_wait

    cfg = config(tmp_path, assets, "c", run={"total_steps": 200}, **SECTIONS)
    proc = start_run_and_wait(cfg, tmp_path / "runs" / "t" / "metrics.jsonl", lines=3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    last = read_metrics(tmp_path / "runs")[-1]["step"]
    assert 2 <= last < 200, last
    done = config(tmp_path, assets, "d", run={"total_steps": last + 2}, **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", done])
    assert proc.returncode == 0 and f"(step {last})" in proc.stderr, explain(proc)
    whole = write_config(tmp_path / "whole.yaml", assets, tmp_path / "whole", run={"total_steps": last + 2},
                         **SECTIONS)
    proc = run_python(["train_ppo.py", "--config", whole])
    assert proc.returncode == 0, explain(proc)
    rows, reference = comparable(read_metrics(tmp_path / "runs")), comparable(read_metrics(tmp_path / "whole"))
    assert [r["step"] for r in rows] == list(range(last + 3))
    assert rows[last + 1:] == reference[last + 1:]
