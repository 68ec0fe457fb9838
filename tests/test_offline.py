"""Offline RLHF: an online run's logged rollouts (run.save_rollouts), read back with pandas and trained on with no
generation (data.rollouts_path); bad rollout files stop with the file and row."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

from conftest import explain, run_python
from tasks.char_tokenizer import build_char_tokenizer
from tasks.offline import load_offline_groups, rollout_files
from tests.user_rewards import ones_fraction

GRPO = {"adv_estimator": "grpo", "kl": {"in_reward": False}}


def test_logged_rollouts_read_back_and_train_offline(assets, tmp_path):  # noqa: F811
    online = write_config(tmp_path / "online.yaml", assets, tmp_path / "runs", algorithm=GRPO,
                          run={"total_steps": 6, "save_rollouts": True, "name": "online"})
    proc = run_python(["train_ppo.py", "--config", online], timeout=300)
    assert proc.returncode == 0, explain(proc)
    logged = tmp_path / "runs" / "online" / "rollouts"
    files = rollout_files([str(logged)])
    assert [f.rsplit("/", 1)[1] for f in files] == [f"step_{k}.parquet" for k in range(1, 7)], "in step order"
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "online" / "metrics.jsonl").read_text().splitlines()]
    tokenizer = build_char_tokenizer("0123456789+=")
    for k, path in enumerate(files, start=1):
        frame = pd.read_parquet(path)
        assert len(frame) == 8 * 4 and (frame["step"] == k).all() and frame["group"].nunique() == 8
        # the file's scores are the step's: the same mean as the metric, each the reward of its response
        assert frame["score"].mean() == pytest.approx(metrics[k]["reward/score/mean"], abs=1e-6)
        for _, row in frame.iterrows():
            assert row["score"] == pytest.approx(ones_fraction(row["response"], None, ""))
            assert tokenizer.decode(list(row["response_ids"]), skip_special_tokens=True) == row["response"]
            assert len(row["logprobs"]) == len(row["response_ids"]) and max(row["logprobs"]) <= 0

    # the same start model, trained on the logged groups only (two passes), against the behaviour log-probs
    offline = write_config(tmp_path / "offline.yaml", assets, tmp_path / "runs", algorithm=GRPO,
                           run={"name": "offline", "epochs": 2, "total_steps": 0, "save_rollouts": True},
                           data={"train_path": "", "rollouts_path": str(logged)})
    proc = run_python(["train_ppo.py", "--config", offline], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "offline training on 48 logged prompts x 4 responses from 6 file(s)" in proc.stderr, explain(proc)
    assert "behaviour log-probs" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "offline" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(13)), "2 epochs of 48 groups, 8 per step"
    assert "timing_s/reward" not in rows[1], "no reward calls in offline steps (only in eval)"
    assert "rollout/logprob_diff_max" not in rows[1], "no engine in the offline steps: nothing to compare"
    # the offline steps train on the logged samples with their own scores: what they saved again pairs each
    # response with its reward, and the step's mean score is its samples'
    for k, path in enumerate(rollout_files([str(tmp_path / "runs" / "offline" / "rollouts")]), start=1):
        frame = pd.read_parquet(path)
        assert len(frame) == 32 and frame["score"].mean() == pytest.approx(rows[k]["reward/score/mean"], abs=1e-6)
        for _, row in frame.iterrows():
            assert row["score"] == pytest.approx(ones_fraction(row["response"], None, "")), row
    # learning from the logged samples raises the held-out score of the start model (eval is online, greedy)
    before, after = rows[0]["eval/score/mean"], rows[-1]["eval/score/mean"]
    assert after > before + 0.1, (before, after)


def rows_to(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_rollouts_without_logprobs_train_against_the_current_policy(assets, tmp_path):  # noqa: F811
    rows = [{"prompt": f"{a}+{b}=", "response": r, "score": ones_fraction(r, None, "")}
            for a in range(4) for b in range(2) for r in ("1", "11", "2", "12")]
    data = rows_to(tmp_path / "logged.jsonl", rows)
    # no eval set: nothing to score, so no reward is needed
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", algorithm=GRPO, run={"total_steps": 2},
                       data={"train_path": "", "rollouts_path": data, "eval_path": None}, reward={"functions": []})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "the current policy's log-probs before each update (the files have no logprobs)" in proc.stderr
    step = read_metrics(tmp_path / "runs")[1]
    # 8 groups per step: every group has the same 4 scores, so the batch mean is theirs
    assert step["reward/score/mean"] == pytest.approx(sum(ones_fraction(r, None, "") for r in
                                                          ("1", "11", "2", "12")) / 4)

    # more logged groups than the checkpoint's sampler saw: the resume says so and trains nothing
    rows_to(tmp_path / "logged.jsonl", rows + [{**r, "prompt": "9+9="} for r in rows[:4]])
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", algorithm=GRPO, run={"total_steps": 3},
                       data={"train_path": "", "rollouts_path": data})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2 and "the training data is not what the checkpoint saw" in proc.stderr, explain(proc)
    assert "data.rollouts_path now holds 9 prompts" in proc.stderr, explain(proc)

    # a bad file stops before anything trains, naming the file and line
    bad = rows_to(tmp_path / "bad.jsonl", [*rows[:3], {"prompt": "1+1=", "response": "2"}])
    cfg = write_config(tmp_path / "c2.yaml", assets, tmp_path / "runs2", algorithm=GRPO,
                       data={"train_path": "", "rollouts_path": bad})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2 and f"{bad}:4: no score column" in proc.stderr, explain(proc)
    assert not (tmp_path / "runs2" / "t" / "metrics.jsonl").exists()


def test_rollout_file_errors_name_the_file_and_row(tmp_path):
    tokenizer = build_char_tokenizer("0123456789+=")
    vocab = len(tokenizer)

    def load(rows, **kw):
        path = rows_to(tmp_path / "r.jsonl", rows)
        return load_offline_groups([path], tokenizer, **{"group_size": 2, "vocab_size": vocab, "max_prompt_len": 16,
                                                         "max_response_len": 8, **kw}), path

    good = [{"prompt": "1+1=", "response": "2", "score": 1.0}, {"prompt": "1+1=", "response": "3", "score": 0.0}]
    groups, _ = load(good)
    assert len(groups) == 1 and groups.items[0]["scores"] == [1.0, 0.0] and not groups.has_logprobs
    eos = tokenizer.eos_token_id
    assert groups.items[0]["responses"] == [tokenizer("2", add_special_tokens=False)["input_ids"] + [eos],
                                            tokenizer("3", add_special_tokens=False)["input_ids"] + [eos]]
    cases = [
        ([good[0], {**good[1], "response_ids": [1, vocab + 5]}], f"r.jsonl:2: response_ids has token id {vocab + 5}, "
                                                                 f"beyond the model's vocabulary of {vocab}"),
        ([good[0], {**good[1], "score": "high"}], "r.jsonl:2: score must be a finite number"),
        ([good[0], {**good[1], "score": float("nan")}], "r.jsonl:2: score must be a finite number"),
        ([good[0]], "r.jsonl:1: the group of this prompt has 1 responses but rollout.n=2; set rollout.n=1"),
        ([{**good[0], "response_ids": [1, 2], "logprobs": [-1.0, -2.0]}, good[1]],
         "r.jsonl:2: no logprobs, but 1 other rows have them"),
        ([{**good[0], "response_ids": [1, 2], "logprobs": [-1.0]}, good[1]], "r.jsonl:1: logprobs must hold one"),
        ([{**good[0], "response_ids": [1, 2], "logprobs": [-1.0, None]}, {**good[1], "response_ids": [1],
                                                                         "logprobs": [-1.0]}], "r.jsonl:1: logprobs"),
        ([{**good[0], "response_ids": [1], "logprobs": [0.5]}, good[1]], "r.jsonl:1: logprobs must hold one finite"),
        ([{**good[0], "response_ids": [1], "logprobs": [-0.5], "temperature": 0.7},
          {**good[1], "response_ids": [2], "logprobs": [-0.5], "temperature": 0.7}],
         "r.jsonl:1: its logprobs were taken at temperature 0.7, this run samples at rollout.temperature=1.0"),
        ([{**good[0], "response": "1" * 9}, good[1]], "r.jsonl:1: the response has 10 tokens, more than "
                                                       "rollout.max_new_tokens=8"),
        ([{"response": "2", "score": 1.0}], "r.jsonl:1: no prompt (or prompt_ids) column 'prompt'"),
        ([{**good[0], "response_ids": [1, 2, 3], "response_mask": [1, 0, 1]}, good[1]],
         "r.jsonl:1: its response_mask has zeros (a multi-turn episode's"),
    ]
    for rows, needle in cases:
        with pytest.raises(ValueError) as err:
            load(rows)
        assert needle in str(err.value), (needle, str(err.value))
    # group ids split one prompt's rows, and never join two prompts' (two runs' files may share ids)
    split = [{**r, "group": g} for g in ("a", "b") for r in good]
    assert len(load(split)[0]) == 2
    two_prompts = [{**r, "group": "a"} for r in good] + [{**r, "group": "a", "prompt": "2+2="} for r in good]
    groups, _ = load(two_prompts)
    assert len(groups) == 2 and {g["prompt_text"] for g in groups.items} == {"1+1=", "2+2="}
    # prompts too long are dropped, as online
    long = [{**r, "prompt": "1+1+1+1+1+1+1+1+1=", "group": "c"} for r in good]
    groups, _ = load(split + long)
    assert len(groups) == 2 and groups.n_dropped_too_long == 1
