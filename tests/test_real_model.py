"""The real model and task of `make real-assets` (scripts/real_assets.py): SmolLM2-135M-Instruct converted from the
registry's GGUF, reasoning-gym's chain_sum scored by its own scorer, and a GRPO step of the shipped recipe on the CPU.
The tests that need the assets (270 MB, built by `make real-assets`) are skipped where they were not built."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import config as C
from conftest import ROOT, explain, run_python
from tasks.reasoning_gym_reward import last_number

ASSETS = ROOT / "runs" / "real_assets"
MODEL = ASSETS / "smollm2-135m-instruct"
needs_assets = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file() or
                                  importlib.util.find_spec("reasoning_gym") is None,
                                  reason="the real model and task are not built here: `make real-assets` builds them")


def test_the_last_number_is_the_answer():
    assert last_number("3 + 4 = 7, so the answer is 12.") == "12"
    assert last_number("It is -1,250.5 apples") == "-1250.5"
    assert last_number("no idea") is None


def test_the_recipe_config_holds():
    cfg = C.load_config("configs/smollm2_chain_sum.yaml")
    C.check_ppo(cfg, 1, this_machine=False)
    assert cfg.reward.functions[0].spec == "tasks.reasoning_gym_reward:compute_score"


@needs_assets
def test_the_converted_model_has_real_weights_and_its_chat_template():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert model.config.model_type == "llama" and sum(p.numel() for p in model.parameters()) == 134_515_008
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>") and "hi<|im_end|>" in text, text
    ids = tokenizer("The cat sat on the mat because it was warm and the sun was shining on the floor.",
                    return_tensors="pt").input_ids
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        natural, scrambled = (float(model(x, labels=x).loss) for x in (ids, shuffled))
    # trained weights: prose is far likelier than the same tokens shuffled, and both beat a uniform guess
    assert natural + 2 < scrambled < torch.log(torch.tensor(float(model.config.vocab_size))), (natural, scrambled)


@needs_assets
def test_the_task_scorer_through_the_reward_convention():
    from tasks.reasoning_gym_reward import compute_score

    rows = [json.loads(line) for line in (ASSETS / "chain_sum_test.jsonl").read_text().splitlines()[:20]]
    for row in rows:
        right = f"The sum is {row['ground_truth']}."
        assert compute_score(row["data_source"], right, row["ground_truth"], row["extra_info"]) == 1.0
        wrong = f"The sum is {int(row['ground_truth']) + 1}."
        assert compute_score(row["data_source"], wrong, row["ground_truth"], row["extra_info"]) < 1.0


@needs_assets
def test_a_grpo_step_of_the_recipe_on_the_cpu(tmp_path: Path):
    proc = run_python(["train_ppo.py", "--config", "configs/smollm2_chain_sum.yaml", f"run.output_dir={tmp_path}",
                       "run.device=cpu", "run.total_steps=1", "data.batch_size=2", "rollout.n=2",
                       "rollout.max_new_tokens=16", "data.eval_size=2", "actor.fsdp.param_dtype=float32"],
                      timeout=600, HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, explain(proc)
    rows = [json.loads(line) for line in (tmp_path / "smollm2_chain_sum" / "metrics.jsonl").read_text().splitlines()]
    step = rows[1]
    # Llama runs on the native slot engine (its metric), and the engine's log-probs are the trainer's in float32
    assert "timing_s/gen_decode" in step and step["rollout/logprob_diff_max"] < 1e-3, step
    assert "eval/score/mean" in rows[0] and step["reward_fn/errors"] == 0, step
