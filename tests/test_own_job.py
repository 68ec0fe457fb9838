"""Bringing one's own job to train_ppo.py, as real runs of the CLI: reward functions in the conventions users already
have, with the data's columns; mistakes that used to train on zeros without a word now stop, naming the culprit."""

from __future__ import annotations

import json

import yaml
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

from conftest import explain, run_python


def rows_of(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_verl_style_reward_reads_the_data_columns(assets, tmp_path):  # noqa: F811
    """compute_score(data_source, solution_str, ground_truth, extra_info) gets every record's own columns."""
    train = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
    data = rows_of(tmp_path / "train.jsonl",
                   [{**r, "data_source": "add", "extra_info": {"weight": 5.0}} for r in train])
    # a second eval file, with no data_source column: reported under its file's name
    second = rows_of(tmp_path / "second.jsonl", [{**r, "extra_info": {"weight": 2.0}} for r in train])
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       data={"train_path": data, "eval_path": [data, second], "eval_size": 4},
                       rollout={"eval_n": 2, "eval_temperature": 1.0},
                       reward={"functions": [{"spec": "tests.user_rewards:compute_score"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    start, step = read_metrics(tmp_path / "runs")[:2]
    # 5 from extra_info on every sample, plus 1 for an exact answer
    assert 5.0 <= step["reward/score/mean"] <= 6.0 and step["reward/score/min"] >= 5.0, step
    # eval per data source, and pass@2 over the 2 samples of each prompt (>= the per-sample accuracy)
    assert 5.0 <= start["eval/add/score/mean"] <= 6.0 and "eval/add/pass@2" in start, start
    assert 2.0 <= start["eval/second/score/mean"] <= 3.0 and "eval/second/pass@2" in start, start
    # data.eval_size=4 prompts from each file: equal counts, so the overall mean is the mean of the two
    both = (start["eval/add/score/mean"] + start["eval/second/score/mean"]) / 2
    assert abs(start["eval/score/mean"] - both) < 1e-9, start
    assert start["eval/pass@2"] >= start["eval/accuracy"], start


def test_a_reward_that_returns_text_stops_at_start_up(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs",
                       reward={"functions": [{"spec": "tests.user_rewards:text_score"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "tests.user_rewards:text_score" in proc.stderr and "not a number" in proc.stderr, explain(proc)
    assert not (tmp_path / "runs" / "t" / "metrics.jsonl").exists(), "nothing may start before the check"


def test_a_reward_of_no_known_signature_stops_at_start_up(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs",
                       reward={"functions": [{"spec": "tests.user_rewards:two_arguments"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2 and "none of the accepted conventions" in proc.stderr, explain(proc)


def test_a_reward_failing_on_most_samples_stops_before_the_update(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 3},
                       reward={"functions": [{"spec": "tests.user_rewards:always_raises"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode != 0, explain(proc)
    assert "max_error_fraction=0.5" in proc.stderr and "deliberate failure" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0], "no step may train on the zeros"


def test_an_eval_set_without_ground_truth_is_refused_for_a_reward_that_needs_one(assets, tmp_path):  # noqa: F811
    prompts = [{"prompt": json.loads(line)["prompt"]} for line in (assets / "test.jsonl").read_text().splitlines()]
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs",
                       data={"eval_path": rows_of(tmp_path / "eval.jsonl", prompts)},
                       reward={"functions": [{"spec": "exact_match"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "the first eval record" in proc.stderr and "needs a ground truth" in proc.stderr, explain(proc)


def test_starting_a_finished_run_again_says_so_and_trains_nothing(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    # stdout is a pipe here, as in a Slurm log: the step lines carry the time left
    assert "step 1/2" in proc.stdout and "eta=0:00:" in proc.stdout, explain(proc)
    before = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text()
    written = yaml.safe_load((tmp_path / "runs" / "t" / "config.yaml").read_text())
    assert written["run"]["total_steps"] == 2 and written["actor"]["optim"]["lr"] == 0.003, "the resolved config"
    again = write_config(tmp_path / "c2.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                         actor={"optim": {"lr": 1e-4}})
    proc = run_python(["train_ppo.py", "--config", again], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "has already finished" in proc.stderr and "at step 2" in proc.stderr, explain(proc)
    assert "raise run.total_steps" in proc.stderr and "another run.name" in proc.stderr, explain(proc)
    assert (tmp_path / "runs" / "t" / "metrics.jsonl").read_text() == before, "the finished run's log is kept"
    # raising total_steps resumes, and the log names what changed
    more = write_config(tmp_path / "c3.yaml", assets, tmp_path / "runs", run={"total_steps": 3},
                        actor={"optim": {"lr": 1e-4}})
    proc = run_python(["train_ppo.py", "--config", more], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "changed config" in proc.stderr and "actor.optim.lr: 0.003 -> 0.0001" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2, 3]


def test_zero_steps_evaluates_the_start_model_and_says_no_step_trained(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 0})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    score = read_metrics(tmp_path / "runs")[0]["eval/score/mean"]
    assert f"eval/score/mean: {score:.3f} (no step trained)" in proc.stdout and "nan" not in proc.stdout, explain(proc)


def test_a_system_prompt_reaches_the_prompt_builder(assets, tmp_path):  # noqa: F811
    """data.system_prompt on text prompts that are not templated is refused (the char tokenizer has no template)."""
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", data={"system_prompt": "be brief"})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2 and "data.chat_template=true" in proc.stderr, explain(proc)
