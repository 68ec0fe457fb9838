"""Hostile inputs, third round (issue 42): a run never reaches into another, a refused start writes nothing, no input
trains silently on junk. Real runs of the entry points on the tiny test model, real files made here."""

from __future__ import annotations

import json
import os
import socket

import pytest
from test_faults import finished_run, snapshot
from test_ppo import assets, write_config  # noqa: F401  (assets is a fixture)

import config as C
from conftest import explain, run_python


def test_a_run_name_is_one_folder_name(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1})
    for name in ("../victim", "../../escaped", "/tmp/abs", "", ".", "..", "a/b", "x" * 256):
        with pytest.raises(C.ConfigError, match=r"run\.name="):
            C.load_config(cfg, [f"run.name={name}"])
    assert C.load_config(cfg, ["run.name=ok-name_1.v2"]).run.name == "ok-name_1.v2"
    # train_ppo.py and train_rm.py exit 2 at config time, before any folder exists
    for script in ("train_ppo.py", "train_rm.py"):
        proc = run_python([script, "--config", cfg, "run.name=../escaped"], timeout=120)
        assert proc.returncode == 2 and "config error: run.name='../escaped'" in proc.stderr, explain(proc)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_the_run_folder_must_be_usable_and_the_port_valid(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1})
    for port in (0, 70000, -1):
        with pytest.raises(C.ConfigError, match=r"run\.prometheus_port=.*\[1, 65535\]"):
            C.load_config(cfg, [f"run.prometheus_port={port}"])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(C.ConfigError, match=r"run\.output_dir=.*a_file is a file"):
        C.check_ppo(C.load_config(cfg, [f"run.output_dir={tmp_path / 'a_file'}"]), 1)
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "runs" / "t")
    with pytest.raises(C.ConfigError, match=r"symbolic link to .*nowhere.*does not exist"):
        C.check_ppo(C.load_config(cfg), 1)
    with pytest.raises(C.ConfigError, match=r"symbolic link"):
        C.check_rm(C.load_config(cfg, [f"rm.train_path={cfg}"]), 1)
    os.unlink(tmp_path / "runs" / "t")
    (tmp_path / "runs" / "t").write_text("x")
    with pytest.raises(C.ConfigError, match=r"is a file, not a run folder"):
        C.check_ppo(C.load_config(cfg), 1)
    (tmp_path / "runs" / "t").unlink()
    # read-only folders (os.access stands in for the permission bits: the tests may run as root, who writes anywhere)
    (tmp_path / "ro").mkdir()
    (tmp_path / "runs" / "t" / "checkpoints").mkdir(parents=True)
    writable = os.access
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "access", lambda path, mode: not str(path).endswith(("ro", "checkpoints")) and
                      writable(path, mode))
        with pytest.raises(C.ConfigError, match=r"run\.output_dir=.*ro is not writable"):
            C.check_ppo(C.load_config(cfg, [f"run.output_dir={tmp_path / 'ro'}"]), 1)
        with pytest.raises(C.ConfigError, match=r"checkpoints is not writable by this user, so the run could resume"):
            C.check_ppo(C.load_config(cfg), 1)
        patch.setattr(os, "access", lambda path, mode: not str(path).endswith("t") and writable(path, mode))
        with pytest.raises(C.ConfigError, match=r"run\.name='t': .*runs/t is not writable by this user \(metrics, "
                                                r"TensorBoard"):
            C.check_ppo(C.load_config(cfg), 1)
    C.check_ppo(C.load_config(cfg), 1)
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:  # else run.wandb=true is refused for that first
        (tmp_path / "runs" / "t" / "wandb").write_text("x")
        with pytest.raises(C.ConfigError, match=r"wandb \(where W&B writes\) is a file"):
            C.check_ppo(C.load_config(cfg, ["run.wandb=true"]), 1)
    proc = run_python(["train_ppo.py", "--config", cfg, f"run.output_dir={tmp_path / 'a_file'}"], timeout=120)
    assert proc.returncode == 2 and "config error: run.output_dir=" in proc.stderr, explain(proc)


def test_a_refused_start_leaves_the_run_config_as_it_was(assets, tmp_path):  # noqa: F811
    run, before = finished_run(assets, tmp_path, steps=1)
    written = (run / "config.yaml").read_bytes()
    # a protected key changed; the run already finished; the Prometheus port taken
    everything = {k: v for k, v in snapshot(run).items() if k.name != "run.lock"}
    # (with TensorBoard on: its event file must not appear either)
    changed = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 2, "tensorboard": True},
                           data={"batch_size": 4}, actor={"optim": {"lr": 1e-2}})
    finished = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 1, "tensorboard": True},
                            actor={"optim": {"lr": 1e-2}})
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = ((changed, [], "would change what its run means"), (finished, [], "has already finished"),
                 (changed, [f"run.prometheus_port={port}", "checkpoint.allow_config_change=[data.batch_size]"],
                  f"run.prometheus_port={port}: cannot serve metrics"))
        for path, extra, message in cases:
            proc = run_python(["train_ppo.py", "--config", path, *extra], timeout=300)
            assert proc.returncode == 2 and message in proc.stderr, explain(proc)
            assert "Traceback" not in proc.stderr, explain(proc)
            assert (run / "config.yaml").read_bytes() == written, f"{message}: config.yaml was rewritten"
            assert (snapshot(run / "checkpoints"), (run / "metrics.jsonl").read_text()) == before
            assert {k: v for k, v in snapshot(run).items() if k.name != "run.lock"} == everything, message


def test_a_key_given_twice_is_refused_in_data_and_on_the_command_line(assets, tmp_path):  # noqa: F811
    from tasks.data import load_preference_records, load_prompt_records

    data = tmp_path / "train.jsonl"
    lines = (assets / "train.jsonl").read_text().splitlines()
    lines[2] = '{"prompt": "1+1=", "ground_truth": "2", "prompt": "9+9="}'
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:3: the key 'prompt' appears twice"):
        load_prompt_records(data)
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"prompt": "1=", "chosen": "1", "rejected": "2", "extra": {"a": 1, "a": 2}}\n')
    with pytest.raises(ValueError, match=r"nested\.jsonl:1: the key 'a' appears twice"):
        load_preference_records(nested)
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       data={"train_path": str(data)})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2 and f"{data}:3: the key 'prompt' appears twice" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    # the command line: the same key twice, or a section and a key in it
    for twice in (["actor.optim.lr=1e-3", "actor.optim.lr=1e-4"], ["actor.optim={lr: 1}", "actor.optim.lr=2"]):
        with pytest.raises(C.ConfigError, match=r"both set actor\.optim"):
            C.check_given_once(twice)
    C.check_given_once(["actor.optim.lr=1e-3", "critic.optim.lr=1e-4", "actor.optim.lr_warmup=1"])
    proc = run_python(["train_ppo.py", "--config", cfg, "run.seed=1", "run.seed=2"], timeout=120)
    assert proc.returncode == 2 and "'run.seed=1' and 'run.seed=2' both set run.seed" in proc.stderr, explain(proc)


def test_errors_name_the_file_and_row(tmp_path):
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.data import PromptDataset, load_prompt_records
    from tasks.offline import load_offline_groups

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: byte 0xe9 at column 16 is not UTF-8"):
        load_prompt_records(latin1)
    tokenizer = build_char_tokenizer("0123456789+=")
    hot = tmp_path / "hot.jsonl"
    hot.write_text('{"prompt": "1=", "response": "1", "score": 1, "logprobs": [-0.1, -0.1], "temperature": 1}\n'
                   '{"prompt": "1=", "response": "2", "score": 0, "logprobs": [-0.1, -0.1], "temperature": "hot"}\n')
    with pytest.raises(ValueError, match=r"hot\.jsonl:2: temperature must be a finite number, got str 'hot'"):
        load_offline_groups([str(hot)], tokenizer, group_size=2, vocab_size=len(tokenizer), max_prompt_len=8,
                            max_response_len=4)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                               "{{ raise_exception('Conversation roles must be system/user/assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": [{"role": "user", "content": "1+1="}]}\n'
                    '{"prompt": [{"role": "hacker", "content": "1+1="}]}\n')
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: the tokenizer's chat template refused this prompt \(roles "
                                         r"\['hacker'\]\): Conversation roles must be"):
        PromptDataset(load_prompt_records(chat), tokenizer, 16)


def test_a_rollout_file_changed_before_a_resume_is_refused(assets, tmp_path):  # noqa: F811
    from tests.user_rewards import ones_fraction

    rows = [{"prompt": f"{a}+{b}=", "response": r, "score": ones_fraction(r, None, "")}
            for a in range(4) for b in range(2) for r in ("1", "11", "2", "12")]
    data = tmp_path / "logged.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    offline = {"algorithm": {"adv_estimator": "grpo", "kl": {"in_reward": False}}, "reward": {"functions": []},
               "data": {"train_path": "", "rollouts_path": str(data), "eval_path": None}}
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1}, **offline)
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    run = tmp_path / "runs" / "t"
    before = snapshot(run)
    # the same prompts and count, other scores: the sampler cannot tell
    data.write_text("".join(json.dumps({**r, "score": -r["score"]}) + "\n" for r in rows))
    more = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 2}, **offline)
    proc = run_python(["train_ppo.py", "--config", more], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert f"the rollout files are not the ones it trained on: {data} changed" in proc.stderr, explain(proc)
    assert "Nothing was trained or written" in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    assert {k: v for k, v in snapshot(run).items() if k.name != "run.lock"} == \
        {k: v for k, v in before.items() if k.name != "run.lock"}, "a refused resume writes nothing"
    proc = run_python(["train_ppo.py", "--config", more, "checkpoint.allow_config_change=[data.rollouts_path]"],
                      timeout=300)
    assert proc.returncode == 0 and "with changed rollout files (allowed)" in proc.stderr, explain(proc)


def test_reward_model_pairs_with_no_signal_are_dropped_or_refused(tmp_path):
    from test_train_rm import addition_pairs, tiny_model, write_jsonl
    from test_train_rm import write_config as write_rm_config

    from roles.rm import encode_preferences

    tokenizer = tiny_model(tmp_path / "init")
    blank = [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}, {"prompt": "1+2=", "chosen": "", "rejected": "3"},
             {"prompt": "2+2=", "chosen": "4", "rejected": ""}, {"prompt": "3+3=", "chosen": "6a", "rejected": "6b"}]
    huge = {"prompt": "1+" * 1_000_000 + "1=", "chosen": "2", "rejected": "3"}  # 2M characters: never tokenised
    rows = addition_pairs(8, 1, digits=(1, 1), seed=0)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows[:4] + blank + [huge] + rows[4:])
    cfg = {"run": {"device": "cpu", "output_dir": str(tmp_path / "runs"), "tensorboard": False},
           "model": {"path": str(tmp_path / "init")},
           "rm": {"train_path": data, "eval_fraction": 0, "steps": 1, "batch_size": 4, "max_len": 32,
                  "output_dir": str(tmp_path / "out"), "fsdp": {"param_dtype": "float32"}}}
    proc = run_python(["train_rm.py", "--config", write_rm_config(tmp_path / "c.yaml", cfg)], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert (f"{data}: dropped 4 preference pair(s) with no signal: {data}:5 (chosen and rejected are the same); "
            f"{data}:6 (the chosen response has no tokens); {data}:7 (the rejected response has no tokens); "
            f"{data}:8 (chosen and rejected tokenise alike)") in proc.stderr, explain(proc)
    assert "rm: 8 training pairs, 0 held out, 1 dropped as longer than rm.max_len=32" in proc.stdout, explain(proc)
    # a file of nothing but such pairs is refused
    none_left = write_jsonl(tmp_path / "blank.jsonl", blank)
    proc = run_python(["train_rm.py", "--config", write_rm_config(tmp_path / "c.yaml", cfg),
                       f"rm.train_path={none_left}"], timeout=300)
    assert proc.returncode == 2 and "0 training pairs (after dropping 0 with a side longer than rm.max_len=32 " \
        "tokens and 4 with no signal)" in proc.stderr, explain(proc)
    # the work per record is bounded: a side of far more characters than max_len allows is dropped untokenised
    import time

    began = time.perf_counter()
    pairs, too_long, _ = encode_preferences([huge] * 20, tokenizer, max_len=32)
    assert (pairs, too_long) == ([], 20) and time.perf_counter() - began < 1.0


def test_a_huge_prompt_is_dropped_before_it_is_tokenised(tmp_path):
    import time

    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.data import PromptDataset
    from tasks.offline import load_offline_groups

    tokenizer = build_char_tokenizer("0123456789+=")
    huge = "1+" * 2_500_000 + "1="  # 5 MB
    records = [{"prompt": "1+1="}, {"prompt": huge}, {"prompt": [{"role": "user", "content": huge}]}]
    began = time.perf_counter()
    dataset = PromptDataset(records * 10, tokenizer, max_prompt_len=8)
    assert len(dataset) == 10 and dataset.n_dropped_too_long == 20
    with pytest.raises(ValueError, match="all 1 prompts are longer than max_prompt_len=8 tokens \\(the shortest has "
                                         "over 512 characters\\)"):
        PromptDataset([{"prompt": huge}], tokenizer, max_prompt_len=8)
    logged = tmp_path / "logged.jsonl"
    logged.write_text("".join(json.dumps({"prompt": p, "response": "1", "score": 1.0}) + "\n"
                              for p in ("1+1=", "1+1=", huge, huge)))
    kept = load_offline_groups([str(logged)], tokenizer, group_size=2, vocab_size=len(tokenizer), max_prompt_len=8,
                               max_response_len=4)
    assert len(kept) == 1 and kept.n_dropped_too_long == 1
    logged.write_text(json.dumps({"prompt": "1=", "response": huge, "score": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"logged\.jsonl:1: the response has 5000002 characters, far more than "
                                         r"rollout\.max_new_tokens=4"):
        load_offline_groups([str(logged)], tokenizer, group_size=1, vocab_size=len(tokenizer), max_prompt_len=8,
                            max_response_len=4)
    assert time.perf_counter() - began < 10


SPAWNER = '''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.environ["SPAWNED_PIDS"], "a") as f:
    f.write(f"{child.pid}\\n")
if os.environ.get("SLOW_IMPORT"):
    time.sleep(120)


def score(response, ground_truth, prompt):
    return response.count("1") / len(response) if response else 0.0
'''


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def all_gone(pids: list[int], within_s: float) -> bool:
    import time

    deadline = time.time() + within_s
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    return not any(alive(p) for p in pids)


def test_what_a_reward_module_spawns_ends_with_the_run_and_loading_stops_on_sigterm(assets, tmp_path):  # noqa: F811
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, run_env

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hostile_spawner.py").write_text(SPAWNER)
    pids = tmp_path / "pids.txt"
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'mods'}", "SPAWNED_PIDS": str(pids)}
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       reward={"functions": [{"spec": "hostile_spawner:score"}], "num_workers": 1})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300, **env)
    assert proc.returncode == 0, explain(proc)
    spawned = [int(p) for p in pids.read_text().split()]
    assert spawned and all_gone(spawned, within_s=5), f"still running after the run: {spawned}"

    # SIGTERM while the trainer loads (here: waits for a reward module's import) stops it at once; the worker and
    # what it spawned go with it
    pids.unlink()
    started = subprocess.Popen([sys.executable, "train_ppo.py", "--config", cfg, "run.name=slow"], cwd=ROOT,
                               env=run_env(**env, SLOW_IMPORT=1), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not pids.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert pids.exists(), "the reward module was never imported"
    started.send_signal(signal.SIGTERM)
    try:
        started.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        started.kill()
        started.communicate()
        pytest.fail("SIGTERM did not stop a trainer that was still loading")
    assert started.returncode == -signal.SIGTERM
    spawned = [int(p) for p in pids.read_text().split()]
    assert all_gone(spawned, within_s=10), f"still running after the trainer died: {spawned}"
