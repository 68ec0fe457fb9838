"""A new user's first runs (issue 40): Ctrl-C, the user's own modules in the reward workers, config-time checks,
the shipped GRPO example and TRL/verl key names. Real runs of train_ppo.py on the tiny test model, real signals."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

import config as C
from conftest import ROOT, explain, run_env, run_python


def ckpts(run_dir) -> list[str]:
    root = run_dir / "t" / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_ctrl_c_finishes_the_step_saves_and_exits_zero(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 200})
    metrics = tmp_path / "runs" / "t" / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "train_ppo.py", "--config", cfg], cwd=ROOT, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import time

    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    assert "Ctrl-C: finishing this step" in err and "KeyboardInterrupt" not in err, err[-4000:]
    last = read_metrics(tmp_path / "runs")[-1]["step"]
    assert 2 <= last < 200 and ckpts(tmp_path / "runs") == ["latest", f"step_{last:08d}"], ckpts(tmp_path / "runs")


def test_ctrl_c_under_torchrun_saves_though_the_agent_passes_it_on(assets, tmp_path):  # noqa: F811
    """A terminal's Ctrl-C reaches torchrun's agent and its workers; the agent sends the workers SIGINT again at once
    (and SIGKILL 30 s later): that second one is the same Ctrl-C, so the workers still finish the step and save."""
    import os
    import time

    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 300})
    metrics = tmp_path / "runs" / "t" / "metrics.jsonl"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "train_ppo.py", "--config", cfg], cwd=ROOT, env=run_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 200
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    os.killpg(agent.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground process group
    _, err = agent.communicate(timeout=120)
    last = read_metrics(tmp_path / "runs")[-1]["step"]
    assert ckpts(tmp_path / "runs") == ["latest", f"step_{last:08d}"], err[-4000:]
    assert err.count("Ctrl-C: finishing this step") == 1 and "interrupted: stopped at once" not in err, err[-4000:]
    assert err.count("stop signal received: saved step") == 1, err[-4000:]  # one line for the job, not per rank


# Ctrl-C twice while the second checkpoint is being written (DCP runs the write under `except BaseException` and
# passes the KeyboardInterrupt on inside a CheckpointException)
CTRL_C_IN_A_SAVE = """
import os, runpy, signal, sys, time
from torch.distributed.checkpoint.filesystem import FileSystemWriter
write = FileSystemWriter.write_data
def write_data(self, plan, planner):
    if "step_00000002" in str(self.path):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    return write(self, plan, planner)
FileSystemWriter.write_data = write_data
sys.argv = ["train_ppo.py", *sys.argv[1:]]
runpy.run_path("train_ppo.py", run_name="__main__")
"""


def test_ctrl_c_twice_during_a_save_stops_at_once_and_is_no_disk_failure(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 4},
                       checkpoint={"save_every": 1})
    proc = run_python(["-c", CTRL_C_IN_A_SAVE, "--config", cfg], timeout=300)
    assert proc.returncode == 130, explain(proc)
    assert "could not be written" not in proc.stderr and "Training goes on" not in proc.stderr, explain(proc)
    assert "interrupted: stopped at once" in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2]
    assert ckpts(tmp_path / "runs") == ["latest", "step_00000001", "step_00000002.tmp"]
    # the next start removes the partial save and resumes from step 1
    proc = run_python(["train_ppo.py", "--config", cfg, "run.total_steps=2"], timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, explain(proc)
    assert ckpts(tmp_path / "runs") == ["latest", "step_00000001", "step_00000002"]


def hub_cache(home, source) -> None:
    """A Hugging Face cache under `home` (HF_HOME) laid out as huggingface_hub writes it: the test model as the model
    repo Org/Tiny and the addition data as the dataset repo org/addition (train and test splits, parquet files as the
    hub's converted datasets have them)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    for kind, repo, files in (("models", "Org--Tiny", {f.name: f for f in (source / "model").iterdir()}),
                              ("datasets", "org--addition", {})):
        revision = "0123456789abcdef0123456789abcdef01234567"
        snapshot = home / "hub" / f"{kind}--{repo}" / "snapshots" / revision
        (snapshot / "data").mkdir(parents=True)
        for name, path in files.items():
            shutil.copy(path, snapshot / name)
        if kind == "datasets":
            for split in ("train", "test"):
                rows = [json.loads(line) for line in (source / f"{split}.jsonl").read_text().splitlines()]
                pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / f"{split}-00000-of-00001.parquet")
        (home / "hub" / f"{kind}--{repo}" / "refs").mkdir()
        (home / "hub" / f"{kind}--{repo}" / "refs" / "main").write_text(revision)


def test_the_reward_workers_import_the_users_modules_on_a_model_and_data_from_the_hub_cache(assets, tmp_path):  # noqa: F811
    """A user's reward folder with its own `config.py` and `tasks/` package, as meshrl has: the workers import the
    user's (meshrl's folder is on the trainer's path only because train_ppo.py runs from it). The run takes its model
    and data by hub ids, offline, from a cache laid out as the hub's; its console line shows run.console_keys."""
    user = tmp_path / "job"
    (user / "tasks").mkdir(parents=True)
    (user / "config.py").write_text("WEIGHT = 0.25\n")
    (user / "tasks" / "__init__.py").write_text("")
    (user / "tasks" / "scoring.py").write_text("def weighted(x):\n    return x\n")
    (user / "my_reward.py").write_text("import config\nfrom tasks.scoring import weighted\n\n\n"
                                       "def score(response, ground_truth, prompt):\n"
                                       "    return weighted(config.WEIGHT)\n")
    hub_cache(tmp_path / "hf", assets)
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       model={"path": "Org/Tiny"},
                       data={"train_path": "org/addition", "eval_path": "org/addition:test"},
                       reward={"functions": [{"spec": "my_reward:score"}]})
    proc = run_python(["train_ppo.py", "--config", cfg, "run.console_keys=[reward/score/mean,actor/entropy]"],
                      timeout=300, PYTHONPATH=str(user), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE=1)
    assert proc.returncode == 0, explain(proc)
    assert read_metrics(tmp_path / "runs")[0]["eval/score/mean"] == 0.25
    assert re.search(r"^step 1/1 reward/score/mean=0.25 actor/entropy=\S+ eta=", proc.stdout, re.M), proc.stdout


def test_a_missing_path_says_it_was_tried_as_a_hub_id_and_that_offline_mode_is_on(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text('{"prompt": "1", "response": "2"}\n')
    for overrides, message in (
            ([f"sft.train_path={tmp_path / 'd.jsonl'}", "model.path=Org/Absent"],
             "model.path='Org/Absent': not a local path; tried as a Hugging Face hub model id 'Org/Absent': not in the "
             f"hub cache {tmp_path}, and HF_HUB_OFFLINE=1 is set"),
            (["sft.train_path=org/absent", f"model.path={tmp_path / 'm'}"],
             "sft.train_path='org/absent': not a local path; tried as a Hugging Face hub dataset id 'org/absent': not "
             f"in the hub cache {tmp_path}, and HF_HUB_OFFLINE=1 is set"),
            ([f"sft.train_path={tmp_path / 'absent.jsonl'}", f"model.path={tmp_path / 'm'}"],
             f"sft.train_path={str(tmp_path / 'absent.jsonl')!r}: not found")):
        cfg = C.load_config(None, ["run.device=cpu", *overrides])
        with pytest.raises(C.ConfigError) as error:
            C.check_sft(cfg, 1)
        assert str(error.value).startswith(message), error.value


def config_error(argv: list[str], capsys) -> list[str]:
    """The stderr lines of the check every entry point runs first (config.parse_or_exit, rank 0 of a world of one),
    which must exit 2."""
    with pytest.raises(SystemExit) as exit_:
        C.parse_or_exit(argv, 1, 0)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_lengths_beyond_the_models_positions_and_a_malformed_override_exit_2_in_one_line(assets, tmp_path,  # noqa: F811
                                                                                         capsys):
    # the test model has 64 positions; its prompts are short, so the run would go until a long prompt came
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", data={"max_prompt_len": 60},
                       rollout={"max_new_tokens": 8})
    assert config_error(["--config", cfg], capsys) == [
        "config error: data.max_prompt_len=60 + rollout.max_new_tokens=8 = 68 tokens: more than the model's "
        f"max_position_embeddings=64 (model.path={str(assets / 'model')!r}); lower them to add up to at most 64"]
    assert not (tmp_path / "runs").exists()
    [line] = config_error(["--config", cfg, "data.max_prompt_len=56", "reward.functions=[{spec:"], capsys)
    assert line.startswith("config error: override 'reward.functions=[{spec:': the value is not valid YAML")


@pytest.mark.parametrize("override,hint", [
    ("num_generations=8", "TRL's num_generations is rollout.n here"),
    ("rollout.max_completion_length=64", "TRL's max_completion_length is rollout.max_new_tokens here"),
    ("beta=0.04", "TRL's beta is algorithm.kl.coef"),
    ("learning_rate=1e-6", "TRL's learning_rate is actor.optim.lr here"),
    ("data.train_files=x.parquet", "verl's data.train_files is data.train_path here"),
    ("actor_rollout_ref.rollout.n=8", "verl's actor_rollout_ref.rollout.n is rollout.n here"),
])
def test_trl_and_verl_key_names_are_translated_in_the_unknown_key_error(override, hint):
    with pytest.raises(C.ConfigError, match=re.escape(hint)):
        C.load_config(str(ROOT / "configs" / "grpo_example.yaml"), [override])


def test_the_readme_shows_the_whole_name_table():
    readme = (ROOT / "docs" / "configuration.md").read_text()
    for name, ours in C.FOREIGN_NAMES.items():
        assert f"| `{name}` | {ours} |" in readme, name


def test_the_grpo_example_runs_on_the_quickstart_assets(tmp_path):
    """configs/grpo_example.yaml as shipped, on assets built as the quickstart's but smaller (the same settings
    otherwise: it shares the quickstart's folder), with nothing on PYTHONPATH: its reward, meshrl's own
    tasks.synthetic, is found by the workers all the same."""
    example = yaml.safe_load((ROOT / "configs" / "grpo_example.yaml").read_text())
    assert example["quickstart"] == yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["quickstart"]
    work = tmp_path / "assets"
    proc = run_python(["train_ppo.py", "--config", "configs/grpo_example.yaml", "run.total_steps=2", "run.device=cpu",
                       f"run.output_dir={tmp_path / 'runs'}", f"quickstart.workdir={work}", "quickstart.n_train=64",
                       "quickstart.n_test=8", "quickstart.hidden_size=32", "quickstart.num_layers=1",
                       "quickstart.sft_steps=2", f"model.path={work / 'sft'}",
                       f"data.train_path={work / 'train.jsonl'}", f"data.eval_path={work / 'test.jsonl'}"],
                      timeout=300, PYTHONPATH="")
    assert proc.returncode == 0, explain(proc)
    metrics = tmp_path / "runs" / "grpo_example" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "actor/kl_loss" in rows[1], rows[1].keys()
    # GRPO's console line: the reward function's mean, entropy, gradient norm and KL loss (not PPO's policy loss)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("step 2/2 "))
    keys = [part.split("=")[0] for part in line.split()[2:]]
    assert keys[:2] == ["reward/score/mean", "reward/fn/tasks.synthetic:addition_reward/mean"], line
    assert {"actor/entropy", "actor/grad_norm", "actor/kl_loss"} <= set(keys) and "actor/pg_loss" not in keys, line


def test_offline_with_train_path_null_and_saved_rollouts_keep_the_records_columns(assets, tmp_path,  # noqa: F811
                                                                                  capsys):
    records = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({**r, "source_id": f"s{i}", "extra_info": {"index": i}}) + "\n"
                             for i, r in enumerate(records)))
    grpo = {"adv_estimator": "grpo", "kl": {"in_reward": False}}
    online = write_config(tmp_path / "online.yaml", assets, tmp_path / "runs", algorithm=grpo,
                          run={"total_steps": 1, "save_rollouts": True, "name": "online"},
                          data={"train_path": str(train)})
    proc = run_python(["train_ppo.py", "--config", online], timeout=300)
    assert proc.returncode == 0, explain(proc)
    logged = tmp_path / "runs" / "online" / "rollouts"
    frame = pd.read_parquet(logged / "step_1.parquet")
    by_id = {f"s{i}": r for i, r in enumerate(records)}
    for _, row in frame.iterrows():  # each sample with its record's own columns, as a reward reads them
        assert by_id[row["source_id"]]["prompt"] == row["prompt"] and row["extra_info"]["index"] == \
            int(row["source_id"][1:]), row
    # offline on them with no prompt file: data.train_path=null; a train_path beside rollouts_path is not read, and
    # the log says so
    offline = write_config(tmp_path / "offline.yaml", assets, tmp_path / "runs", algorithm=grpo,
                           run={"name": "offline", "total_steps": 1}, data={"rollouts_path": str(logged)})
    proc = run_python(["train_ppo.py", "--config", offline, "data.train_path=null"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "is not read" not in proc.stderr and "offline training on 8 logged prompts" in proc.stderr, explain(proc)
    proc = run_python(["train_ppo.py", "--config", offline, "run.name=both"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert f"data.train_path={str(assets / 'train.jsonl')!r} is not read: offline training takes its prompts from " \
           "data.rollouts_path" in proc.stderr, explain(proc)
    # online, a train_path of null is named as missing, in one line
    [line] = config_error(["--config", online, "data.train_path=null"], capsys)
    assert line.startswith("config error: data.train_path is not set"), line


def make(folder, *args) -> subprocess.CompletedProcess:
    """`make ARGS` on a copy of the Makefile in `folder`, the environment taken as built and python as `echo`."""
    (folder / "stamp").touch()
    proc = subprocess.run(["make", "-s", "-C", str(folder), *args, f"STAMP={folder / 'stamp'}", "PY=echo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, explain(proc)
    return proc


def test_make_quickstart_runs_again_in_a_fresh_folder_and_make_clean_keeps_the_environment(tmp_path):
    for name in ("Makefile", "requirements.txt"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    assert make(tmp_path, "quickstart").stdout.split()[-1] == "run.name=quickstart"
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)  # a finished run: starting it again would exit 2
    (tmp_path / "runs" / "quickstart_2").mkdir()
    assert make(tmp_path, "quickstart").stdout.split()[-1] == "run.name=quickstart_3"
    (tmp_path / ".venv").mkdir()
    make(tmp_path, "clean")
    assert (tmp_path / ".venv").is_dir() and not (tmp_path / "runs").exists()
    make(tmp_path, "distclean")
    assert not (tmp_path / ".venv").exists()


def test_a_reward_given_as_a_file_path_imports_the_modules_beside_it(tmp_path):
    """verl's custom_reward_function.path: 'path/to/file.py:function', its folder's own config.py imported."""
    from tasks.rewards import RewardFunctionRunner

    job = tmp_path / "job"
    job.mkdir()
    (job / "config.py").write_text("WEIGHT = 0.5\n")
    (job / "my_score.py").write_text("import config\n\n\ndef compute_score(data_source, solution_str, ground_truth, "
                                     "extra_info=None):\n    return config.WEIGHT * len(solution_str)\n")
    with RewardFunctionRunner(f"{job / 'my_score.py'}:compute_score", num_workers=1) as runner:
        assert runner(["ab", "abcd"], ["x", "y"], ["p", "q"]) == ([1.0, 2.0], {"reward_fn/errors": 0,
                                                                              "reward_fn/timeouts": 0})
        assert runner.convention == "verl"
    with pytest.raises(ValueError, match=re.escape(f"no file {job / 'absent.py'}")):
        RewardFunctionRunner(f"{job / 'absent.py'}:compute_score")


def test_a_reward_module_not_on_the_path_says_how_to_put_it_there():
    from tasks.rewards import RewardFunctionRunner

    with RewardFunctionRunner("no_such_reward_module:score", num_workers=1) as runner:
        with pytest.raises(ValueError) as error:
            runner(["a"], [None], [""])
    assert "PYTHONPATH=that/folder" in str(error.value), error.value
    assert "'path/to/no_such_reward_module.py:score'" in str(error.value), error.value


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def test_a_chat_template_given_as_text_or_a_file_and_trl_rewards_on_conversational_data(assets, tmp_path):  # noqa: F811
    """data.chat_template as Jinja text or a file (TRL's chat_template_path), for a tokenizer without one; without
    it, the error names the key. A real run on chat-message prompts with the file, scored by a TRL-style function
    for conversational data."""
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.data import render_prompts

    tokenizer = build_char_tokenizer("0123456789+=")
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    records = [{"prompt": [{"role": "user", "content": "1+2"}]}, {"prompt": "3+4"}]
    for given in (TEMPLATE, str(tmp_path / "template.jinja")):
        texts, ids = render_prompts(records, tokenizer, given)
        assert texts == ["1+2=", "3+4="] and ids[0] == tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no chat template; give one with data.chat_template"):
        render_prompts(records[:1], tokenizer)
    with pytest.raises(ValueError, match="not a template"):
        render_prompts(records, tokenizer, str(tmp_path / "absent.jinja"))

    chat = {}
    for split in ("train", "test"):
        chat[split] = tmp_path / f"chat_{split}.jsonl"
        chat[split].write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"][:-1]}],
                                                   "ground_truth": r["ground_truth"]}) + "\n"
                                       for r in map(json.loads, (assets / f"{split}.jsonl").read_text().splitlines())))
    # scored by a TRL-style function written for conversational data (as TRL calls it: c[0]["content"], the prompts
    # as messages, completion_ids), which finds one prompt in ten not its business (None)
    (tmp_path / "conv_reward.py").write_text(CONVERSATIONAL_REWARD)
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       data={"train_path": str(chat["train"]), "eval_path": str(chat["test"]),
                             "chat_template": str(tmp_path / "template.jinja")},
                       reward={"functions": [{"spec": "conv_reward:score"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300, PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert all(r.get("reward_fn/errors", 0) == 0 for r in rows) and 0 < rows[1]["reward/score/mean"] < 1, rows[1]


CONVERSATIONAL_REWARD = """
def score(completions, prompts, completion_ids, ground_truth, trainer_state, **columns):
    assert 0 <= trainer_state.global_step <= trainer_state.max_steps or trainer_state.max_steps == 0
    out = []
    for c, p, ids, truth in zip(completions, prompts, completion_ids, ground_truth):
        assert c[0]["role"] == "assistant" and p[0]["role"] == "user" and all(isinstance(t, int) for t in ids)
        text = c[0]["content"]
        out.append(None if p[0]["content"].startswith("9") else text.count("1") / max(len(text), 1))
    return out
"""


def test_a_trl_function_gets_conversational_completions_and_its_none_is_no_error(tmp_path):
    from tasks.rewards import RewardFunctionRunner

    (tmp_path / "conv_reward.py").write_text(CONVERSATIONAL_REWARD)
    sys.path.insert(0, str(tmp_path))
    try:
        with RewardFunctionRunner("conv_reward:score", num_workers=1) as runner:
            extras = [{"messages": [{"role": "user", "content": p}], "completion_ids": [1, 1]} for p in ("1+2", "9+9")]
            scores, stats = runner(["11", "12"], ["3", "18"], ["1+2=", "9+9="], [{}, {}], extras,
                                   {"global_step": 3, "max_steps": 10})
    finally:
        sys.path.remove(str(tmp_path))
    assert scores[0] == 1.0 and math.isnan(scores[1]) and stats["reward_fn/errors"] == 0 and not runner.last_failed


BATCHED_REWARD = """
def score(completions, source=None, **columns):
    # the chunk's size, and each row's own column (None where a row has none)
    return [len(completions) + (0.5 if s is None else 0.0) for s in source]
"""


def test_a_trl_function_is_called_once_per_worker_with_its_share_of_the_batch(tmp_path):
    from tasks.rewards import RewardFunctionRunner

    (tmp_path / "batched_reward.py").write_text(BATCHED_REWARD)
    sys.path.insert(0, str(tmp_path))
    try:
        with RewardFunctionRunner("batched_reward:score", num_workers=2) as runner:
            columns = [{"source": "a"}, {}, {"source": "b"}, {"source": "c"}, {"source": "d"}, {"source": "e"}]
            scores, stats = runner(["x"] * 6, [None] * 6, ["p"] * 6, columns)
            assert runner.convention == "trl"
    finally:
        sys.path.remove(str(tmp_path))
    assert scores == [3.0, 3.5, 3.0, 3.0, 3.0, 3.0] and stats["reward_fn/errors"] == 0


VERL_SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.strip() == ground_truth
    return {"score": float(right) + solution_str.count("1") / 10, "acc": right, "ones": solution_str.count("1"),
            "pred": solution_str}
"""


def test_a_verl_dicts_other_numbers_are_metrics_in_training_and_eval(assets, tmp_path):  # noqa: F811
    (tmp_path / "verl_score.py").write_text(VERL_SCORE)
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       reward={"functions": [{"spec": f"{tmp_path / 'verl_score.py'}:compute_score"}]})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    fn = "reward/fn/verl_score.py:compute_score"
    for row, prefix in ((rows[0], "eval/"), (rows[1], "")):
        acc, ones, score = (row[f"{prefix}{fn}/{key}"] for key in ("acc/mean", "ones/mean", "mean"))
        assert 0 <= acc <= 1 and score == pytest.approx(acc + ones / 10), row
        assert f"{prefix}{fn}/pred/mean" not in row
    # and each eval sample keeps its dict's numbers and texts (verl's reward_extra_info in its validation generations)
    evals = [json.loads(line) for line in (tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()]
    for sample in (s for e in evals for s in e["samples"]):
        assert sample["acc"] in (0.0, 1.0) and sample["ones"] == sample["response"].count("1") and \
            sample["score"] == pytest.approx(sample["acc"] + sample["ones"] / 10) and \
            sample["pred"] == sample["response"], sample


def test_log_records_go_through_the_progress_bar_and_the_console_line_takes_its_keys(tmp_path, monkeypatch, capsys,
                                                                                    caplog):
    """On a terminal, a log record while the bar is shown is written above it (not onto the bar's line), and the
    console handlers are the user's again once the bar closes. The console line shows run.console_keys (a name no
    step logs is named once, with the close ones), else the estimator's own."""
    import io
    import logging

    from monitor import MetricsLogger, console_defaults

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)  # logging.basicConfig's, on the terminal
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logger = MetricsLogger(str(tmp_path), tensorboard=False, console_keys=["actor/entropy", "actor/entropi"])
        bar = logger.progress(0, 10)
        bar.update(1)
        logging.getLogger("meshrl").warning("a record")
        bar.update(1)
        bar.close()
        assert handler in root.handlers
        metrics = {"reward/score/mean": 0.5, "reward/fn/f/mean": 0.5, "reward/fn/f/acc/mean": 1.0,
                   "actor/entropy": 1.25, "actor/grad_norm": 2.0, "actor/pg_loss": 0.1, "timing_s/step": 3.0}
        logger.console(0, 10, {"eval/score/mean": 0.5})
        logger.console(1, 10, metrics)
        logger.console(2, 10, metrics)
        logger.close()
    finally:
        root.removeHandler(handler)
    text = terminal.getvalue()
    at = text.index("a record")
    assert text[at - 1] in "\r\n", repr(text[max(0, at - 80) : at + 10])
    assert capsys.readouterr().out.splitlines()[1:] == ["step 1/10 actor/entropy=1.25", "step 2/10 actor/entropy=1.25"]
    warned = [r.getMessage() for r in caplog.records if "run.console_keys" in r.getMessage()]
    assert len(warned) == 1 and "actor/entropi: did you mean actor/entropy?" in warned[0], warned
    assert console_defaults(metrics)[:2] == ["reward/score/mean", "reward/fn/f/mean"]
    assert {"actor/entropy", "actor/grad_norm"} <= set(console_defaults(metrics))
    assert "actor/pg_loss" not in console_defaults(metrics)
    gae = console_defaults({**metrics, "critic/vf_loss": 0.3})
    assert "critic/vf_loss" in gae and "actor/pg_loss" in gae and "reward/fn/f/mean" not in gae
    with pytest.raises(C.ConfigError, match="run.console_keys"):
        C.load_config(None, ["run.console_keys=[actor/entropy,actor/entropy]"])
