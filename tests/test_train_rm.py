"""train_rm.py: the Bradley-Terry loss against a loop, a reward model learning the quickstart's addition task on 2
gloo ranks and scoring a PPO run, the same metrics on 1 and 2 ranks, and bad preference files."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification

from conftest import explain, run_python, torchrun
from roles.modeling import forward, load_value_model
from roles.rm import bradley_terry_loss, encode_preferences, load_reward_model, pair_scores
from tasks.char_tokenizer import build_char_tokenizer
from tasks.data import load_preference_records, padding_id
from tasks.synthetic import make_addition_split
from tasks.tiny_model import save_tiny_model

CPU = torch.device("cpu")


def tiny_model(path, hidden=32, layers=2):
    tokenizer = build_char_tokenizer("0123456789+=")
    save_tiny_model(path, tokenizer, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                    intermediate_size=2 * hidden, max_position_embeddings=64, seed=0)
    return tokenizer


def addition_pairs(n_problems, wrong_per_problem, digits, seed):
    """The quickstart's addition task as preferences: the right sum over the sum of another problem."""
    problems = make_addition_split(n_problems, digits=digits, seed=seed)
    rng = random.Random(seed)
    pairs = []
    for p in problems:
        for _ in range(wrong_per_problem):
            wrong = p["ground_truth"]
            while wrong == p["ground_truth"]:
                wrong = rng.choice(problems)["ground_truth"]
            pairs.append({"prompt": p["prompt"], "chosen": p["ground_truth"], "rejected": wrong})
    rng.shuffle(pairs)
    return pairs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_config(path, cfg):
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loss_matches_a_loop_over_pairs_of_a_real_model(tmp_path):
    tokenizer = tiny_model(tmp_path / "m")
    torch.manual_seed(0)
    model = load_reward_model(str(tmp_path / "m"), tokenizer.pad_token_id).eval()
    records = [{"prompt": "1+2=", "chosen": "3", "rejected": "12", "margin": 0.0},
               {"prompt": "45+67=", "chosen": "112", "rejected": "9", "margin": 1.5},
               {"prompt": "8+8=", "chosen": "16", "rejected": "61", "margin": -0.5}]
    pairs, dropped, blank = encode_preferences(records, tokenizer, max_len=64)
    assert dropped == 0 and blank == [] and pairs[1][0] == tokenizer.encode("45+67=112") + [tokenizer.eos_token_id]
    with torch.no_grad():
        chosen, rejected = pair_scores(model, pairs, CPU)  # one right-padded forward of all six sequences
        losses = bradley_terry_loss(chosen, rejected, torch.tensor([r["margin"] for r in records]))
        for i, (c_ids, r_ids, margin) in enumerate(pairs):
            # each sequence alone, no padding: the head's output at its last token
            c = model(input_ids=torch.tensor([c_ids])).logits[0, -1, 0].item()
            r = model(input_ids=torch.tensor([r_ids])).logits[0, -1, 0].item()
            assert chosen[i].item() == pytest.approx(c, abs=1e-5) and rejected[i].item() == pytest.approx(r, abs=1e-5)
            expected = -math.log(1 / (1 + math.exp(-(c - r - margin))))
            assert losses[i].item() == pytest.approx(expected, abs=1e-5)
    # far from zero: the loss stays finite and exact where a naive log(sigmoid) would not
    gaps = [-120.0, -3.0, 0.0, 4.0, 90.0]
    big = bradley_terry_loss(torch.tensor(gaps), torch.zeros(5), torch.full((5,), 0.25))
    assert big.tolist() == pytest.approx([math.log1p(math.exp(-(g - 0.25))) for g in gaps], abs=1e-6)
    # a chat prompt and an assistant-message response are the tokens of the text ones (train_ppo.py's templating)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    chat = [{"prompt": [{"role": "user", "content": "1+2"}], "chosen": "3", "rejected": "12", "margin": 0.0}]
    assert encode_preferences(chat, tokenizer, 64)[0] == pairs[:1]


def test_reward_model_learns_addition_on_two_ranks_and_scores_ppo(tmp_path):
    tokenizer = tiny_model(tmp_path / "init", hidden=64)
    pairs = addition_pairs(100, 8, digits=(1, 1), seed=0)  # 800 pairs; a held-out pair shares its prompt, not its
    held_out, train = pairs[:160], pairs[160:]             # wrong answer, with training pairs
    cfg = {"run": {"device": "cpu", "seed": 0, "name": "rm", "output_dir": str(tmp_path / "runs"), "log_every": 100,
                   "tensorboard": False},
           "model": {"path": str(tmp_path / "init")},
           "rm": {"train_path": write_jsonl(tmp_path / "train.jsonl", train),
                  "eval_path": write_jsonl(tmp_path / "eval.jsonl", held_out), "steps": 300, "batch_size": 64,
                  "lr": 1e-3, "eval_every": 150, "output_dir": str(tmp_path / "rm"),
                  "fsdp": {"param_dtype": "float32"}}}
    proc = torchrun(["train_rm.py", "--config", write_config(tmp_path / "rm.yaml", cfg)], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    evals = [m for m in read_metrics(tmp_path / "runs/rm/metrics.jsonl") if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 150, 300] and evals[-1]["eval/pairs"] == 160
    # Chance is 0.5 (a scorer that learned nothing orders a pair either way). Of 160 held-out pairs, a coin gets
    # >= 136 right (0.85) with probability < 1e-18; this set-up reaches 0.93-0.97 in 300 steps (four data seeds and
    # 1 vs 2 ranks, whose rounding differs), so 0.85 fails a model that did not learn the sums and nothing else.
    assert evals[0]["eval/accuracy"] < 0.7 and evals[-1]["eval/accuracy"] >= 0.85, evals
    assert evals[-1]["eval/margin/mean"] > evals[0]["eval/margin/mean"] + 1.0

    # the saved folder as HF's sequence classification and as roles/reward.py reads it: the same scores, and the
    # accuracy the run logged
    seq_cls = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    per_token = load_value_model(str(tmp_path / "rm")).eval()
    encoded, _, _ = encode_preferences(load_preference_records(tmp_path / "eval.jsonl"), tokenizer, 64)
    seqs = [p[0] for p in encoded] + [p[1] for p in encoded]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.full((len(seqs), int(lengths.max())), tokenizer.pad_token_id)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        hf = seq_cls(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits[:, 0]
        batch = {"input_ids": ids, "prompt_len": lengths, "response_len": torch.zeros_like(lengths)}
        ppo_side = forward(per_token, batch)[..., 0].gather(1, (lengths - 1)[:, None])[:, 0]
    torch.testing.assert_close(ppo_side, hf, atol=1e-5, rtol=1e-5)
    right = int((hf[: len(encoded)] > hf[len(encoded):]).sum())
    assert right == round(evals[-1]["eval/accuracy"] * len(encoded))  # pairs, not a float32 mean (77/80 is inexact)

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p["prompt"]} for p in train[:8]])
    ppo = {"run": {"device": "cpu", "seed": 0, "name": "ppo", "output_dir": str(tmp_path / "runs"), "total_steps": 2,
                   "tensorboard": False},
           "model": {"path": str(tmp_path / "init")},
           "data": {"train_path": prompts, "max_prompt_len": 8, "batch_size": 4},
           "rollout": {"n": 2, "max_new_tokens": 3},
           "algorithm": {"adv_estimator": "grpo", "kl": {"in_reward": False}},
           "actor": {"fsdp": {"param_dtype": "float32"}},
           "reward": {"model_path": str(tmp_path / "rm"), "fsdp": {"param_dtype": "float32"}}}
    proc = run_python(["train_ppo.py", "--config", write_config(tmp_path / "ppo.yaml", ppo)])
    assert proc.returncode == 0, explain(proc)
    scored = [m for m in read_metrics(tmp_path / "runs/ppo/metrics.jsonl") if "reward/model_score/mean" in m]
    assert [m["step"] for m in scored] == [1, 2] and all(math.isfinite(m["reward/model_score/mean"]) for m in scored)


def test_metrics_are_the_same_on_one_and_two_ranks(tmp_path):
    tiny_model(tmp_path / "init")
    # 23 pairs of varied lengths; 7 held out (eval_fraction), which split 4 + 3 over two ranks: per-rank means
    # averaged would not give the metrics of the whole set
    rows = addition_pairs(23, 1, digits=(1, 2), seed=1)
    for i, row in enumerate(rows):
        row["margin"] = 0.5 * (i % 3)
    cfg = {"run": {"device": "cpu", "seed": 0, "output_dir": str(tmp_path / "runs"), "tensorboard": False},
           "model": {"path": str(tmp_path / "init")},
           "rm": {"train_path": write_jsonl(tmp_path / "pairs.jsonl", rows), "eval_fraction": 0.3, "steps": 3,
                  "batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "schedule": "cosine", "min_lr_ratio": 0.1,
                  "fsdp": {"param_dtype": "float32"}}}
    path = write_config(tmp_path / "c.yaml", cfg)
    one = run_python(["train_rm.py", "--config", path, "run.name=one", f"rm.output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, explain(one)
    # two ranks, and gradient accumulation over one pair per forward: the same steps
    two = torchrun(["train_rm.py", "--config", path, "run.name=two", f"rm.output_dir={tmp_path / 'two'}",
                    "rm.micro_batch_pairs=1"], nproc=2)
    assert two.returncode == 0, explain(two)
    a, b = (read_metrics(tmp_path / "runs" / name / "metrics.jsonl") for name in ("one", "two"))
    assert [m["step"] for m in a] == [0, 1, 2, 3] and a[0]["eval/pairs"] == 7
    # one warmup step (factor 1 / 1), then cosine from 1 at step index 1 to 0.1 at 3: half way at index 2, where
    # 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55
    assert [m["rm/lr"] for m in a[1:]] == pytest.approx([1e-3, 1e-3, 0.55e-3])
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-7), (x, y)  # float rounding of other batch shapes
    assert a[0]["eval/loss"] != pytest.approx(math.log(2), abs=1e-3)  # the margins count: not an untrained 0.693


def test_a_file_without_rejected_exits_2_naming_file_and_row(tmp_path):
    tiny_model(tmp_path / "init")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                               {"prompt": "2+2=", "chosen": "4"}])
    cfg = {"run": {"device": "cpu", "output_dir": str(tmp_path / "runs")}, "model": {"path": str(tmp_path / "init")},
           "rm": {"train_path": bad, "batch_size": 1, "output_dir": str(tmp_path / "out")}}
    proc = run_python(["train_rm.py", "--config", write_config(tmp_path / "c.yaml", cfg)])
    assert proc.returncode == 2, explain(proc)
    assert f"{bad}:2: no rejected column 'rejected'" in proc.stderr, explain(proc)
    assert not (tmp_path / "out").exists()


def test_preference_records_from_parquet_with_messages_and_margins(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "1+2"}], "chosen": [{"role": "assistant", "content": "3"}],
             "rejected": [{"role": "assistant", "content": "4"}], "margin": 2},
            {"prompt": [{"role": "user", "content": "2+2"}], "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "5"}], "margin": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    records = load_preference_records(tmp_path / "p.parquet")
    where = f"{tmp_path / 'p.parquet'} row"
    assert records == [{"prompt": [{"role": "user", "content": "1+2"}], "chosen": "3", "rejected": "4", "margin": 2.0,
                        "where": f"{where} 0"},
                       {"prompt": [{"role": "user", "content": "2+2"}], "chosen": "4", "rejected": "5", "margin": 0.0,
                        "where": f"{where} 1"}]
    for row, needle in (({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"},
                         "bad.jsonl:1: column 'margin' must be a finite number, got str 'big'"),
                        ({"prompt": "1+1=", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
                         "bad.jsonl:1: column 'chosen' holds messages with roles ['user']"),
                        ({"prompt": "1+1=", "chosen": "2", "rejected": {"text": "3"}},
                         "bad.jsonl:1: column 'rejected' must be text or a number")):
        with pytest.raises(ValueError) as err:
            load_preference_records(write_jsonl(tmp_path / "bad.jsonl", [row]))
        assert needle in str(err.value)


def test_a_tokenizer_without_pad_or_eos_exits_2_naming_it(tmp_path):
    tokenizer = tiny_model(tmp_path / "init")
    assert padding_id(tokenizer, "x") == tokenizer.pad_token_id
    tokenizer.pad_token = None
    assert padding_id(tokenizer, "x") == tokenizer.eos_token_id  # the causal-LM fallback
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "bare")
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    cfg = {"run": {"device": "cpu", "output_dir": str(tmp_path / "runs")},
           "model": {"path": str(tmp_path / "init"), "tokenizer_path": str(tmp_path / "bare")},
           "rm": {"train_path": pairs, "batch_size": 1, "output_dir": str(tmp_path / "out")}}
    proc = run_python(["train_rm.py", "--config", write_config(tmp_path / "c.yaml", cfg)])
    assert proc.returncode == 2, explain(proc)
    assert f"the tokenizer at {tmp_path / 'bare'} has neither a pad token nor an eos token" in proc.stderr, \
        explain(proc)
    assert not (tmp_path / "out").exists()
