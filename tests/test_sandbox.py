"""tasks/sandbox.py: hostile programs are contained (each ends within its limits, leaves nothing outside its folder,
and says why); tasks/humaneval_reward.py scores HumanEval-style problems by their tests in it, and a PPO run whose
samples run hostile programs goes on, with the failures counted."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

from conftest import ROOT, explain
from conftest import run_python as run_process
from tasks.humaneval_reward import compute_score, program
from tasks.sandbox import python, run_python


def test_a_plain_program_runs_and_may_write_in_its_own_folder():
    before = set(Path(tempfile.gettempdir()).glob("meshrl_sandbox_*"))
    r = run_python("open('note.txt', 'w').write('hi')\nprint(open('note.txt').read(), sum(range(10)))")
    assert r.ok and r.reason == "ok" and r.stdout == "hi 45\n", r
    assert set(Path(tempfile.gettempdir()).glob("meshrl_sandbox_*")) <= before, "its folder is removed"


@pytest.mark.parametrize("name, code, reason, says", [
    ("infinite loop", "while True:\n    pass", "timeout", ""),
    ("sleep", "import time\ntime.sleep(60)", "timeout", ""),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "exit 1", "os.fork is not allowed"),
    ("subprocess", "import subprocess\nsubprocess.run(['true'])", "exit 1", "subprocess.Popen is not allowed"),
    ("10 GB allocation", "x = bytearray(10 * 1024 ** 3)", "exit 1", "MemoryError"),
    ("a socket", "import socket\nsocket.create_connection(('127.0.0.1', 9))", "exit 1", "is not allowed"),
    ("huge output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "exit 1", "File too large"),
    ("syntax error", "def f(:\n    pass", "exit 1", "SyntaxError"),
    ("native code", "import ctypes\nctypes.CDLL(None)", "exit 1", "ctypes.dlopen is not allowed"),
])
def test_hostile_programs_are_contained(name, code, reason, says):
    began = time.perf_counter()
    r = run_python(code, timeout_s=2.0)
    assert not r.ok and r.reason == reason and says in r.stderr, (name, r)
    assert time.perf_counter() - began < 6, name
    assert len(r.stdout) <= 10_000 + len("\n[... output cut]"), name


def test_nothing_outside_its_folder_is_written_or_removed(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    for code in (f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
                 f"import os\nos.open({str(tmp_path / 'new.txt')!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os\nos.remove({str(keep)!r})", f"import os\nos.rename({str(keep)!r}, 'stolen.txt')",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})", "open('../escape.txt', 'w').write('x')"):
        r = run_python(code)
        assert not r.ok and "outside the sandbox's folder is not allowed" in r.stderr, (code, r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and keep.read_text() == "mine"


def test_the_python_tool_reports_output_and_failures():
    assert python("print(6 * 7)") == "42\n"
    assert python("raise ValueError('no')").endswith("ValueError: no\n[exit 1]")


PROBLEM = {"prompt": "def add(a, b):\n    \"\"\"The sum of a and b.\"\"\"\n",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
           "entry_point": "add"}


@pytest.mark.parametrize("response, score, timeout, error", [
    ("    return a + b\n", 1.0, 0.0, 0.0),
    ("    return a - b\n", 0.0, 0.0, 1.0),
    ("Sure:\n```python\ndef add(a, b):\n    return b + a\n```", 1.0, 0.0, 0.0),  # a chat model's whole function
    ("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```\n\n", 1.0, 0.0, 0.0),  # bare, a stray fence after it
    ("    while True:\n        pass\n", 0.0, 1.0, 0.0),
    ("    import os\n    os.fork()\n", 0.0, 0.0, 1.0),
    ("1 + 2 = 3", 0.0, 0.0, 1.0),
])
def test_humaneval_reward_runs_the_tests(response, score, timeout, error):
    got = compute_score("humaneval", response, None, PROBLEM, timeout_s=2.0)
    assert got == {"score": score, "timeout": timeout, "error": error}, program(
        PROBLEM["prompt"], response, PROBLEM["test"], PROBLEM["entry_point"])


HUMANEVAL = ROOT / "runs" / "real_assets" / "humaneval.jsonl"


@pytest.mark.skipif(not HUMANEVAL.is_file(), reason="HumanEval is not built here: `make real-assets` writes it")
def test_humaneval_canonical_solutions_pass_and_empty_ones_fail():
    rows = [json.loads(line) for line in HUMANEVAL.read_text().splitlines()]
    assert len(rows) == 164
    for row in rows[::8]:  # every 8th problem: 21 of them
        assert compute_score("humaneval", row["ground_truth"], None, row["extra_info"])["score"] == 1.0, row["task_id"]
        assert compute_score("humaneval", "    pass\n", None, row["extra_info"])["score"] == 0.0, row["task_id"]


def test_a_run_whose_samples_run_hostile_programs_goes_on(assets, tmp_path):  # noqa: F811
    """The tiny model's responses (digits) run after a prompt and before tests that loop forever or fork: every
    sample scores 0, the timeouts and errors are counted as metrics, and the run ends normally."""
    hostile = {"prompt": "def f():\n    return 0\n# ", "entry_point": "f"}  # the response lands in a comment
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": "0",
             "extra_info": {**hostile, "test": ["def check(c):\n    while True:\n        pass\n",
                                                "def check(c):\n    import os\n    os.fork()\n"][(a + b) % 4 > 0]}}
            for a in range(4) for b in range(4)]
    data = tmp_path / "hostile.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       data={"train_path": str(data), "eval_path": None, "batch_size": 2},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}},
                       reward={"functions": [{"spec": "tasks.humaneval_reward:compute_score"}], "num_workers": 2,
                               "timeout_s": 30.0})
    proc = run_process(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    steps = read_metrics(tmp_path / "runs")[1:]
    assert len(steps) == 2 and all(s["reward/score/mean"] == 0 for s in steps), steps
    fn = "reward/fn/tasks.humaneval_reward:compute_score"
    for kind in ("timeout", "error"):
        assert sum(s[f"{fn}/{kind}/mean"] for s in steps) > 0, [{k: v for k, v in s.items() if fn in k} for s in steps]
